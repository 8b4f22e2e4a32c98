"""OpenAI request -> engine requests: sampling params, prompts, chat messages, and the
OpenAI-only checks (model name, ``max_tokens > 0`` and within the context, non-empty
``messages``). Value ranges of sampling fields are checked by ``SamplingParams.from_dict``;
its errors are renamed to the OpenAI field (``max_new_tokens`` -> ``max_tokens``, ...).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from ..errors import context_length_message
from ..runtime.logprob_options import NO_LOGPROBS, LogprobOptions
from .engine_client import EngineClient, GenCall
from .errors import ApiError, from_value_error
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest



def renames(max_field: str = "max_tokens", schema_field: str = "response_format") -> dict:
    """Engine field -> OpenAI field, for error messages and ``param``."""
    return {"max_new_tokens": max_field, "sampling_seed": "seed", "min_new_tokens": "min_tokens",
            "json_schema": schema_field}


_PASS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
         "repetition_penalty", "stop_token_ids", "logit_bias", "regex", "ebnf")


def check_model(model: Optional[str], names: set[str], served: Optional[list[str]] = None) -> None:
    """404 ``model_not_found`` (OpenAI's status and code) unless ``model`` is None or one of
    ``names``; the message lists ``served`` (the public model ids, never a filesystem path)."""
    if model is not None and model not in names:
        shown = served if served is not None else sorted(n for n in names if "/" not in n)
        raise ApiError(f"model: the model {model!r} does not exist; served: {shown}",
                       status=404, param="model", code="model_not_found")



def model_adapter(ctx, model: Optional[str]) -> Optional[str]:
    """The LoRA adapter a request's ``model`` names (None: the base model, or ``model`` omitted);
    404 ``model_not_found`` as :func:`check_model` for a name that is neither."""
    adapters = ctx.lora_names()
    if model is not None and model not in ctx.names and model in adapters:
        return model
    check_model(model, ctx.names, [ctx.model_name, *adapters])
    return None


@dataclass
class Constraint:
    """The grammar constraint of a request: engine key (``json_schema`` | ``regex`` | ``ebnf``),
    its spec text, and the request field it came from (named in the engine's errors)."""

    kind: str
    spec: str
    field: str


# sampling_params(constraint=...) default: take the constraint from the request's own fields
FROM_REQUEST = Constraint("", "", "")


def response_format_schema(rf, field: str = "response_format") -> Optional[str]:
    """The JSON-schema text of an OpenAI ``response_format`` (None for none or ``text``).

    Raises:
        ApiError: 400 for ``json_schema`` without a schema.
    """
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return json.dumps({"type": "object"})
    schema = rf.json_schema.schema_ if rf.json_schema is not None else None
    if schema is None:
        schema = rf.schema_
    if schema is None:
        param = f"{field}.schema" if field != "response_format" else "response_format.json_schema.schema"
        raise ApiError(f"{param}: required for type json_schema", param=param)
    return json.dumps(schema)


def sampling_params(req, max_tokens: Optional[int], max_field: str, client: EngineClient,
                    prompt_tokens: Optional[int] = None, allow_zero: bool = False,
                    constraint: Optional[Constraint] = FROM_REQUEST, n: Optional[int] = None) -> tuple[dict, dict]:
    """Engine sampling params of an OpenAI request (validated; ``n`` is added by :func:`make_call`), and the
    engine-field -> request-field renames for later errors (see :func:`renames`). ``allow_zero``:
    ``max_tokens: 0`` is allowed (completions with ``echo``: the prompt's logprobs only).
    ``constraint``: the grammar constraint built by the caller (None: none beyond the request's
    ``regex`` / ``ebnf``); by default it comes from the request's ``response_format`` /
    ``json_schema``. Sampling fields the request does not have count as unset; ``n`` defaults to
    ``req.n``.

    Raises:
        ApiError: 400 naming the OpenAI field.
    """
    ctx = client.context_length
    if max_tokens is not None:
        if max_tokens < 0 or (max_tokens == 0 and not allow_zero):
            only = " (0 only with echo)" if max_field == "max_tokens" and hasattr(req, "echo") else ""
            raise ApiError(f"{max_field}: must be > 0{only}, got {max_tokens}", param=max_field)
        if ctx and (max_tokens > ctx or (prompt_tokens is not None and prompt_tokens + max_tokens > ctx)):
            raise ApiError(context_length_message(prompt_tokens or 0, ctx, max_tokens, max_field),
                           param=max_field, code="context_length_exceeded")
    elif ctx and prompt_tokens is not None:
        max_tokens = max(ctx - prompt_tokens, 1)
    sp = {k: getattr(req, k) for k in _PASS if getattr(req, k, None) is not None}
    if max_tokens is not None:
        sp["max_new_tokens"] = max_tokens
    stop = getattr(req, "stop", None)
    if stop is not None:
        sp["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if getattr(req, "seed", None) is not None:
        sp["sampling_seed"] = req.seed % (2 ** 63)
    if getattr(req, "min_tokens", None) is not None:
        sp["min_new_tokens"] = req.min_tokens
    for flag in ("ignore_eos", "no_stop_trim"):
        if getattr(req, flag, False):
            sp[flag] = True
    if not getattr(req, "skip_special_tokens", True):
        sp["skip_special_tokens"] = False
    rename = renames(max_field, "response_format")
    if constraint is FROM_REQUEST:
        schema = response_format_schema(getattr(req, "response_format", None))
        own = getattr(req, "json_schema", None)
        if own is not None:
            if schema is not None:
                raise ApiError("json_schema: only one constraint may be set, got json_schema and response_format",
                               param="json_schema")
            schema = own if isinstance(own, str) else json.dumps(own)
            rename["json_schema"] = "json_schema"
        constraint = Constraint("json_schema", schema, rename["json_schema"]) if schema is not None else None
    if constraint is not None:
        sp[constraint.kind] = constraint.spec
        rename[constraint.kind] = constraint.field
    for key in ("regex", "ebnf", "json_schema"):
        if key in sp:
            rename["grammar"] = rename.get(key, key)
    try:
        client.validate({**sp, "n": req.n if n is None else n})
    except ValueError as e:
        raise from_value_error(e, rename, top_level=True) from e
    return sp, rename


def make_call(prompts: list[dict], sp: dict, n: int, rid: str, logprobs: int,
              prompt_logprobs: bool = False) -> GenCall:
    """The engine call of an OpenAI request: ``len(prompts) * n`` choices, choice index
    ``p * n + j`` (the engine's output order); the engine derives the samples' seeds and rids.

    ``logprobs`` is the number of top logprobs per token, or -1 for no logprobs;
    ``prompt_logprobs`` adds the prompt tokens' (``logprob_start_len=0``) when logprobs are on.
    """
    lp = LogprobOptions(return_logprob=True, top_logprobs_num=logprobs,
                        logprob_start_len=0 if prompt_logprobs else -1) if logprobs >= 0 else NO_LOGPROBS
    sps = [dict(sp, n=n) if n > 1 else dict(sp) for _ in prompts]
    batch = len(prompts) > 1
    if "input_ids" in prompts[0]:
        return GenCall(input_ids=[p["input_ids"] for p in prompts], sampling_params=sps, rid=rid, logprobs=lp,
                       batch=batch)
    return GenCall(prompts=[p["prompt"] for p in prompts], sampling_params=sps, rid=rid, logprobs=lp, batch=batch)


def completion_prompts(req: CompletionRequest) -> list[dict]:
    """``[{"prompt": str} | {"input_ids": [...]}]`` of a completions request."""
    p = req.prompt
    if isinstance(p, str):
        return [{"prompt": p}]
    if not p:
        raise ApiError("prompt: must not be empty", param="prompt")
    if isinstance(p[0], str):
        return [{"prompt": x} for x in p]
    if isinstance(p[0], int):
        return [{"input_ids": list(p)}]
    if any(not x for x in p):
        raise ApiError("prompt: token-id prompts must not be empty", param="prompt")
    return [{"input_ids": list(x)} for x in p]


def _content_text(m: ChatMessage, i: int) -> Optional[str]:
    if m.content is None or isinstance(m.content, str):
        return m.content
    parts = []
    for j, part in enumerate(m.content):
        if part.type != "text":
            raise ApiError(f"messages[{i}].content: only text parts are supported, got {part.type!r}",
                           param=f"messages[{i}].content")
        if part.text is None:
            raise ApiError(f"messages[{i}].content[{j}].text: required for a part of type 'text'",
                           param=f"messages[{i}].content[{j}].text")
        parts.append(part.text)
    return "".join(parts)


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as plain dicts for the chat template (tool-call arguments as objects)."""
    if not req.messages:
        raise ApiError("messages: must contain at least one message", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        d = {"role": role, "content": _content_text(m, i) or ""}
        if m.name:
            d["name"] = m.name
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None and role == "assistant":
            d["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                args = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        raise ApiError(f"messages[{i}].tool_calls: arguments are not valid JSON",
                                       param=f"messages[{i}].tool_calls") from None
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args or {}}})
            d["tool_calls"] = calls
        out.append(d)
    return out
