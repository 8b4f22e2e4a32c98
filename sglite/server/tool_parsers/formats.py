"""Tool-call output formats of the model families, as data (``--tool-call-parser`` names are SGLang's).

Each :class:`ToolCallFormat` says how a family's chat template asks the model to write calls:
the *opener* that starts the tool-call section, the *closer* that ends it (``""``: none), the
*shape* of what lies between (one JSON object per opener, a JSON list of objects, or a Python
list of calls), the key holding the arguments, and how parallel calls are separated. The parsers
(:mod:`sglite.server.tool_parsers.json_calls`, :mod:`~sglite.server.tool_parsers.pythonic`) and
the grammar of constrained "auto" tool calls read the same data, so a format is defined once.

Sources (the templates' own instructions and examples):

* ``qwen25`` / ``hermes``: Qwen2.5's and NousResearch Hermes 2 Pro's templates,
  ``<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>``,
  one block per call (SGLang ``function_call/qwen25_detector.py``).
* ``llama3``: Llama 3.1/3.2 JSON tool calling, ``{"name": ..., "parameters": {...}}``, optionally
  after ``<|python_tag|>``; several calls separated by ``;`` (SGLang ``llama32_detector.py``).
* ``mistral``: Mistral v0.3 instruct, ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.
* ``pythonic``: Llama 3.2 / 4 "pythonic" calls, ``[get_weather(city="Paris"), get_time()]``.
* ``granite``: IBM Granite 3.x, ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``.

Special-token openers (``<|python_tag|>``, ``[TOOL_CALLS]``, ``<|tool_call|>``) vanish from the
text when the server skips special tokens, so every JSON format also accepts its calls as bare
JSON at the start of the output (``bare_json``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, Optional

Shape = Literal["json_object", "json_list", "pythonic"]


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family writes tool calls.

    Attributes:
        name: the ``--tool-call-parser`` name (SGLang's).
        opener: text that starts the tool-call section (``per_call``: each call).
        closer: text that ends it; ``""`` when the section runs to the end of the output.
        shape: ``json_object`` (one ``{"name", <args_key>}`` object per opener, or several
            separated by ``separator``), ``json_list`` (a JSON list of such objects after the
            opener), ``pythonic`` (a Python list of calls ``[f(a=1), g()]``, keyword arguments
            with literal values).
        per_call: the opener/closer wrap each call (hermes) rather than all the calls.
        args_key: the key of the arguments object (``arguments`` or ``parameters``); the parsers
            accept either.
        separator: what the format puts between two parallel calls (for rendering).
        aliases: other names of the same parser.
        template_markers: substrings of a chat template that identify the family (any one).
        bare_json: calls may also appear as bare JSON at the start of the output (opener absent,
            e.g. a special token skipped by the detokenizer).
        pad: whitespace the family writes inside the opener and before the closer (rendering
            only; parsers skip any whitespace there).
    """

    name: str
    opener: str
    closer: str
    shape: Shape
    per_call: bool = False
    args_key: str = "arguments"
    separator: str = ""
    aliases: tuple[str, ...] = ()
    template_markers: tuple[str, ...] = ()
    bare_json: bool = True
    pad: str = ""

    def render_call(self, name: str, arguments: dict) -> str:
        """One call's text *inside* the opener/closer, as the family writes it."""
        if self.shape == "pythonic":
            args = ", ".join(f"{k}={_py_literal(v)}" for k, v in arguments.items())
            return f"{name}({args})"
        return json.dumps({"name": name, self.args_key: arguments}, ensure_ascii=False)

    def render_generated(self, calls: list[tuple[str, dict]]) -> str:
        """The tool-call section of ``calls`` as the grammar of a constrained call generates it
        (:mod:`sglite.server.tool_constraint`): the tag's literal head ``{"name": "<name>",
        "<args_key>": `` then the arguments as compact JSON (the JSON-schema grammar's default
        whitespace: none), keys in the given order. Not for ``pythonic``."""
        bodies = ['{"name": ' + json.dumps(n, ensure_ascii=False) + ', "' + self.args_key + '": '
                  + json.dumps(a, ensure_ascii=False, separators=(",", ":")) + "}" for n, a in calls]
        if self.per_call:
            return self.separator.join(f"{self.opener}{self.pad}{b}{self.pad}{self.closer}" for b in bodies)
        if self.shape == "json_object":
            return self.opener + self.separator.join(bodies) + self.closer
        return self.opener + "[" + ", ".join(bodies) + "]" + self.closer

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        """The whole tool-call section of ``calls`` (``[(name, arguments), ...]``), opener and
        closer included: what a model of this family writes (and what the parsers read back)."""
        bodies = [self.render_call(n, a) for n, a in calls]
        if self.per_call:
            return self.separator.join(f"{self.opener}{self.pad}{b}{self.pad}{self.closer}" for b in bodies)
        if self.shape == "json_object":
            return self.opener + self.separator.join(bodies) + self.closer
        return self.opener + "[" + ", ".join(bodies) + "]" + self.closer


def _py_literal(v) -> str:
    """A JSON value as a Python literal (``True``/``False``/``None``, quoted strings)."""
    if isinstance(v, bool) or v is None:
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_py_literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_py_literal(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)


HERMES = ToolCallFormat("qwen25", "<tool_call>", "</tool_call>", "json_object", per_call=True,
                        separator="\n", pad="\n", aliases=("hermes", "qwen"),
                        template_markers=("<tool_call>",))
LLAMA3 = ToolCallFormat("llama3", "<|python_tag|>", "", "json_object", args_key="parameters",
                        separator="; ", aliases=("llama31", "llama32"),
                        template_markers=("<|python_tag|>", '"parameters": dictionary of argument name'))
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS] ", "", "json_list", template_markers=("[TOOL_CALLS]",))
PYTHONIC = ToolCallFormat("pythonic", "", "", "pythonic", bare_json=False, aliases=("llama4",),
                          template_markers=("[func_name1(params_name1=params_value1",
                                            "[func_name1(param1=value1"))
GRANITE = ToolCallFormat("granite", "<|tool_call|>", "", "json_list", template_markers=("<|tool_call|>",))

FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, PYTHONIC, GRANITE)}
DEFAULT_FORMAT = "qwen25"


def tool_call_parser_names() -> list[str]:
    """Every accepted ``--tool-call-parser`` value (names and aliases)."""
    return sorted([*FORMATS, *(a for f in FORMATS.values() for a in f.aliases)])


def get_format(name: Optional[str]) -> ToolCallFormat:
    """The format of a ``--tool-call-parser`` name or alias (None: the default, ``qwen25``).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name is None:
        return FORMATS[DEFAULT_FORMAT]
    for f in FORMATS.values():
        if name == f.name or name in f.aliases:
            return f
    raise ValueError(f"tool_call_parser: unknown parser {name!r}; known: {tool_call_parser_names()}")


# most specific first: granite's and mistral's markers are unique; llama3's python_tag is also in
# some hermes-style templates, so hermes' <tool_call> is looked for before it
_DETECT_ORDER = ("granite", "mistral", "pythonic", "qwen25", "llama3")


def detect_format(chat_template: Optional[str], model_type: Optional[str] = None) -> tuple[ToolCallFormat, str]:
    """Choose the format from a chat template's text (its markers) or, where the model type names
    a single format (``granite``, ``llama4``), the model family; else ``qwen25`` (hermes), the
    format the server's fallback tool prompt teaches.

    Returns:
        ``(format, reason)``; the reason is for the start-up log line.
    """
    text = chat_template or ""
    for name in _DETECT_ORDER:
        f = FORMATS[name]
        for m in f.template_markers:
            if m in text:
                return f, f"chat template contains {m!r}"
    # the family only where the model type names one tool format: "llama" and "mistral" are
    # architectures shared by models with other templates (SmolLM2 is "llama" and writes ChatML)
    by_family = {"granite": "granite", "llama4": "pythonic"}
    family = (model_type or "").lower()
    if family in by_family:
        return FORMATS[by_family[family]], f"model type {model_type!r}"
    return FORMATS[DEFAULT_FORMAT], "no family marker in the chat template (default)"
