"""The DSL's builders: ``gen``, ``gen_int``, ``gen_string``, ``select``, roles, and the backend helpers.

Arguments and defaults follow SGLang's ``sglang/lang/api.py``: every ``gen`` argument defaults
to None, meaning "inherit the run's default". Bad input raises when the expression is built
(before any request): an invalid regex or JSON schema raises GrammarError, other bad values
InvalidRequestError — both ValueErrors naming the field.
"""
from __future__ import annotations

import json
import re
import warnings
from typing import Optional

from sglite.errors import GrammarError, InvalidRequestError
from sglite.sampling_params import SamplingParams

from .backend import Backend, as_backend
from .choices import resolve_choices_method
from .global_config import global_config
from .ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, ExprList, Gen, RoleBegin, RoleEnd, Select

_DTYPES = {int: (REGEX_INT, [" ", "\n"]), "int": (REGEX_INT, [" ", "\n"]),
           float: (REGEX_FLOAT, [" ", "\n"]), "float": (REGEX_FLOAT, [" ", "\n"]),
           bool: (REGEX_BOOL, []), "bool": (REGEX_BOOL, []), str: (REGEX_STR, []), "str": (REGEX_STR, [])}


def _check_regex(regex) -> str:
    if not isinstance(regex, str):
        raise GrammarError(f"gen.regex: must be a string, got {type(regex).__name__}")
    try:
        re.compile(regex)
    except re.error as e:
        raise GrammarError(f"gen.regex: invalid regex {regex!r}: {e}") from e
    return regex


def _check_json_schema(schema) -> str:
    """The schema as JSON text, after checking it parses and is a valid JSON Schema."""
    if isinstance(schema, str):
        try:
            obj = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"gen.json_schema: not valid JSON: {e}") from e
    elif isinstance(schema, (dict, bool)):
        obj = schema
    else:
        raise GrammarError(f"gen.json_schema: must be a dict or JSON text, got {type(schema).__name__}")
    import jsonschema  # light; only needed when a schema is given
    try:
        jsonschema.validators.validator_for(obj).check_schema(obj)
    except jsonschema.SchemaError as e:
        path = "/".join(str(p) for p in e.path) or "<root>"
        raise GrammarError(f"gen.json_schema: invalid schema at {path}: {e.message}") from e
    return schema if isinstance(schema, str) else json.dumps(obj)


def gen(name: Optional[str] = None, max_tokens: Optional[int] = None, min_tokens: Optional[int] = None,
        n: Optional[int] = None, stop=None, stop_token_ids=None, stop_regex=None,
        temperature: Optional[float] = None, top_p: Optional[float] = None, top_k: Optional[int] = None,
        min_p: Optional[float] = None, frequency_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None, ignore_eos: Optional[bool] = None,
        return_logprob: Optional[bool] = None, logprob_start_len: Optional[int] = None,
        top_logprobs_num: Optional[int] = None, return_text_in_logprobs: Optional[bool] = None,
        dtype=None, choices: Optional[list] = None, choices_method=None, regex: Optional[str] = None,
        json_schema=None, lora_path: Optional[str] = None):
    """Generate text into variable ``name`` (SGLang's ``sgl.gen``).

    ``max_tokens``/``min_tokens`` are in tokens. ``dtype`` ∈ {int, float, bool, str} (or their
    names) constrains the output with SGLang's regexes (int/float also stop at space/newline);
    it wins over ``regex``. ``choices`` turns the call into :func:`select` (a ``regex``,
    ``json_schema`` or ``dtype`` beside it is ignored, with a warning). ``regex`` and
    ``json_schema`` (dict or JSON text) constrain decoding. ``lora_path`` names the LoRA adapter
    this call runs with (SGLang's name; docs/lora.md). Unset arguments inherit ``run()``'s.

    Raises:
        GrammarError: invalid regex or JSON schema. InvalidRequestError: other bad values.
    """
    if name is not None and not isinstance(name, str):
        raise InvalidRequestError(f"gen.name: must be a string, got {name!r}", field="name")
    if choices is not None:
        ignored = [k for k, v in (("regex", regex), ("json_schema", json_schema), ("dtype", dtype)) if v is not None]
        if ignored:  # SGLang drops them silently; say so
            warnings.warn(f"gen: choices selects among fixed strings; {', '.join(ignored)} is ignored", stacklevel=2)
        return select(name, choices, 0.0 if temperature is None else temperature, choices_method, lora_path)
    if dtype is not None:
        if dtype not in _DTYPES:
            raise InvalidRequestError(f"gen.dtype: must be int, float, bool or str, got {dtype!r}", field="dtype")
        if regex is not None:
            warnings.warn(f"gen: both dtype and regex are set; dtype {dtype!r} wins", stacklevel=2)
        regex, extra_stop = _DTYPES[dtype]
        stop = ([stop] if isinstance(stop, str) else list(stop or [])) + [s for s in extra_stop if s != stop]
    if regex is not None:
        _check_regex(regex)
    if json_schema is not None:
        json_schema = _check_json_schema(json_schema)
    if isinstance(stop, str):
        stop = [stop]
    params = {"max_new_tokens": max_tokens, "min_new_tokens": min_tokens, "n": n, "stop": stop,
              "stop_token_ids": stop_token_ids, "stop_regex": stop_regex, "temperature": temperature,
              "top_p": top_p, "top_k": top_k, "min_p": min_p, "frequency_penalty": frequency_penalty,
              "presence_penalty": presence_penalty, "ignore_eos": ignore_eos, "regex": regex,
              "json_schema": json_schema}
    params = {k: v for k, v in params.items() if v is not None}
    check = dict(params)
    if "min_new_tokens" in check and "max_new_tokens" not in check:
        check["max_new_tokens"] = max(check["min_new_tokens"], 128) if isinstance(check["min_new_tokens"], int) else 128
    try:
        SamplingParams(**check).validate()
    except InvalidRequestError as e:
        raise InvalidRequestError(f"gen: {e}", field=e.field) from e
    logprob = {"return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
               "top_logprobs_num": top_logprobs_num, "return_text_in_logprobs": return_text_in_logprobs,
               "lora_path": lora_path}
    return Gen(name, params, {k: v for k, v in logprob.items() if v is not None}, dtype)


def gen_int(name: Optional[str] = None, **kwargs):
    """``gen(name, dtype=int, ...)``: an integer (SGLang's REGEX_INT; stops at space/newline)."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: Optional[str] = None, **kwargs):
    """``gen(name, dtype=str, ...)``: a double-quoted string of word characters and spaces."""
    return gen(name, dtype=str, **kwargs)


def select(name: Optional[str] = None, choices: Optional[list] = None, temperature: float = 0.0,
           choices_method=None, lora_path: Optional[str] = None):
    """Choose one of ``choices`` by scoring each after the prefix (not constrained decoding).

    ``choices_method``: ``token_length_normalized`` (default), ``greedy_token_selection``,
    ``unconditional_likelihood_normalized`` (an object from :mod:`.choices` or its name).
    Selection is argmax, so ``temperature`` must be 0. ``lora_path``: the LoRA adapter the
    choices are scored with (None: ``run()``'s, else the base model; docs/lora.md).

    Raises:
        InvalidRequestError: no choices, a non-string choice, or temperature > 0.
        ValueError: unknown choices_method.
    """
    if not choices or not isinstance(choices, (list, tuple)):
        raise InvalidRequestError(f"select.choices: must be a non-empty list, got {choices!r}", field="choices")
    for c in choices:
        if not isinstance(c, str) and not hasattr(c, "sources"):
            raise InvalidRequestError(f"select.choices: entries must be strings, got {c!r}", field="choices")
    if temperature is None or temperature > 1e-5:
        raise InvalidRequestError(f"select.temperature: selection is argmax, must be 0, got {temperature!r}",
                                  field="temperature")
    if lora_path is not None and not isinstance(lora_path, str):
        raise InvalidRequestError(f"select.lora_path: must be an adapter's name, got {lora_path!r}",
                                  field="lora_path")
    return Select(name, list(choices), resolve_choices_method(choices_method), 0.0, lora_path)


def _role(role: str, expr=None):
    return ExprList.of(RoleBegin(role), *([expr] if expr is not None else []), RoleEnd(role))


def system(expr=None):
    """A whole system turn around ``expr``."""
    return _role("system", expr)


def user(expr=None):
    """A whole user turn around ``expr``."""
    return _role("user", expr)


def assistant(expr=None):
    """A whole assistant turn around ``expr``."""
    return _role("assistant", expr)


def system_begin():
    """Open a system turn."""
    return RoleBegin("system")


def system_end():
    """Close a system turn."""
    return RoleEnd("system")


def user_begin():
    """Open a user turn."""
    return RoleBegin("user")


def user_end():
    """Close a user turn."""
    return RoleEnd("user")


def assistant_begin():
    """Open an assistant turn."""
    return RoleBegin("assistant")


def assistant_end():
    """Close an assistant turn."""
    return RoleEnd("assistant")


def set_default_backend(backend) -> None:
    """Use ``backend`` (a Backend, an ``sglite.Engine``, a ``Runtime`` or a server URL) when ``run``
    gets none; the same as ``global_config.default_backend = backend``."""
    global_config.default_backend = backend


def resolve_backend(backend=None) -> Backend:
    """``backend`` as a Backend, or the default one.

    Raises:
        InvalidRequestError: neither is set.
    """
    if backend is not None:
        return as_backend(backend)
    b = global_config.default_backend
    if b is None:
        raise InvalidRequestError("no backend: pass backend= or call set_default_backend(...) first",
                                  field="backend")
    return b


def flush_cache(backend=None) -> bool:
    """Flush the backend's prefix cache; False when refused (requests running)."""
    return resolve_backend(backend).flush_cache()


def get_server_info(backend=None) -> dict:
    """The backend's server info (config and counters)."""
    return resolve_backend(backend).get_server_info()
