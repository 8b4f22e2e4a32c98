"""Function calling for ``/v1/chat/completions``: planning, prompting, constraining, parsing.

* ``tool_choice`` ``"none"``: tools are not shown; plain chat.
* ``"auto"`` (the default with tools): the tools go to the chat template (or, when the template
  ignores them, into a system message asking for calls in the plan's format, e.g. Hermes-style
  ``<tool_call>{json}</tool_call>``); the output is parsed by the format's parser
  (:mod:`sglite.server.tool_parsers`: ``qwen25``/hermes, ``llama3``, ``mistral``, ``pythonic``,
  ``granite``; ``--tool-call-parser``), which also reads a bare ``{"name", "arguments"}`` answer.
* ``"required"`` or a named function: the output is *forced* by constrained decoding to calls
  ``{"name": <one of the tools>, "arguments": <that tool's parameters schema>}``, in the family's
  own markup (``<tool_call>...</tool_call>``, or a special-token opener such as
  ``<|python_tag|>`` generated as its token id; what the model writes natively and the chat
  template renders on the next turn), else (pythonic, external grammar backends) as bare JSON
  (an ``anyOf`` over the tools for ``required``), so the arguments always parse and validate.

Sources: OpenAI's function-calling API; the Hermes / Qwen2.5 ``<tool_call>`` format that SGLang's
``function_call/qwen25_detector.py`` parses; SGLang forces calls with a JSON schema the same way.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Optional

from .errors import ApiError
from .template_facts import TemplateFacts, name_count
from .tool_parsers.formats import HERMES, ToolCallFormat, get_format
from .tool_parsers.json_calls import make_call, parse_json_calls
from .tool_parsers.mistral_args import args_form, parse_args_calls
from .tool_parsers.pythonic import parse_pythonic_calls

OPEN_TAG, CLOSE_TAG = HERMES.opener, HERMES.closer


@dataclass
class ToolPlan:
    """What to do with ``tools``: ``mode`` is ``none`` | ``auto`` | ``forced``."""

    mode: str = "none"
    tools: list[dict] = field(default_factory=list)  # OpenAI tool dicts ({"type", "function"})
    schema: Optional[dict] = None                    # forced mode: the JSON schema of the call
    parallel: bool = True                            # parallel_tool_calls: False keeps the first call only
    fmt: ToolCallFormat = HERMES                     # how the model writes calls (--tool-call-parser)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


_DATA_KEYWORDS = ("enum", "const", "default", "examples")  # values, not schemas: never rewritten


def _rebase_refs(node, prefix: str):
    """``node`` with every local ``$ref`` (``#...``) moved under the JSON pointer ``prefix``."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                out[k] = prefix + v[1:]
            else:
                out[k] = v if k in _DATA_KEYWORDS else _rebase_refs(v, prefix)
        return out
    if isinstance(node, list):
        return [_rebase_refs(x, prefix) for x in node]
    return node


def _has_ref(node) -> bool:
    if isinstance(node, dict):
        return any((k == "$ref" and isinstance(v, str)) or (k not in _DATA_KEYWORDS and _has_ref(v))
                   for k, v in node.items())
    return isinstance(node, list) and any(_has_ref(x) for x in node)


def call_schema(fn: dict, defs: Optional[dict] = None, key: str = "tool0") -> dict:
    """JSON schema of one call of ``fn``: ``{"name": fn.name, "arguments": fn.parameters}``.

    Parameters with local references (pydantic's ``$defs`` / ``definitions`` + ``$ref`` for
    nested models) must resolve against the parameters' own root, not the call schema's: such
    parameters go to ``defs[key]`` (the caller puts ``defs`` at the root as ``$defs``) with every
    ``#...`` reference rebased to ``#/$defs/<key>...``, and ``arguments`` refers to them.
    """
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if _has_ref(params):
        defs = {} if defs is None else defs
        defs[key] = _rebase_refs(params, f"#/$defs/{key}")
        params = {"$ref": f"#/$defs/{key}"}
    return {"type": "object",
            "properties": {"name": {"type": "string", "enum": [fn["name"]]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def calls_schema(fns: list[dict]) -> dict:
    """JSON schema of one call of any of ``fns`` (``anyOf`` when several), shared ``$defs`` at the root."""
    defs: dict = {}
    schemas = [call_schema(fn, defs, f"tool{i}") for i, fn in enumerate(fns)]
    out = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {**out, "$defs": defs} if defs else out


#: the longest tool name (OpenAI's limit)
MAX_TOOL_NAME = 64


def _schema_depth(node) -> int:
    """Nesting depth of a JSON value (dicts and lists), walked without recursion."""
    depth, stack = 0, [(node, 1)]
    while stack:
        n, d = stack.pop()
        if isinstance(n, (dict, list)):
            depth = max(depth, d)
            stack.extend((v, d + 1) for v in (n.values() if isinstance(n, dict) else n))
    return depth


def check_tools(tool_dicts: list[dict], field_of=lambda i, key: f"tools[{i}].function.{key}") -> None:
    """400 for a tool the server cannot show or constrain: a name that is empty, longer than
    :data:`MAX_TOOL_NAME` characters or holds whitespace, control characters, quotes or
    backslashes; parameters nested deeper than the schema compiler recurses (a quarter of the
    interpreter's recursion limit: 250 levels by default). ``field_of(i, key)`` names the field.

    Raises:
        ApiError: naming the field and the limit.
    """
    limit = sys.getrecursionlimit() // 4
    for i, t in enumerate(tool_dicts):
        name = t["function"]["name"]
        if not name or len(name) > MAX_TOOL_NAME or any(c.isspace() or not c.isprintable() or c in "\"\\" for c in name):
            raise ApiError(f"{field_of(i, 'name')}: must be 1-{MAX_TOOL_NAME} characters without whitespace, "
                           f"control characters, quotes or backslashes, got {name[:80]!r}", param=field_of(i, "name"))
        if _schema_depth(t["function"].get("parameters")) > limit:
            raise ApiError(f"{field_of(i, 'parameters')}: nested too deeply (at most {limit} levels)",
                           param=field_of(i, "parameters"))


def plan_tools(tools: Optional[list], tool_choice, parallel: bool = True, parser: Optional[str] = None,
               field_of=lambda i, key: f"tools[{i}].function.{key}") -> ToolPlan:
    """Decide the tool mode of a chat request (pydantic ``Tool`` / ``NamedToolChoice`` objects);
    ``parallel`` is ``parallel_tool_calls`` (False: at most one call is returned; a named
    ``tool_choice`` returns one call, as OpenAI's does); ``parser`` is the ``--tool-call-parser``
    name (None: ``qwen25``); ``field_of(i, key)`` names tool ``i``'s ``key`` in 400 messages.

    Raises:
        ApiError: 400 when ``tool_choice`` needs tools that are not there, and for the tools
        :func:`check_tools` refuses.
    """
    tool_dicts = [t.model_dump(by_alias=True, exclude_none=True) for t in (tools or [])]
    names = [t["function"]["name"] for t in tool_dicts]
    if len(set(names)) != len(names):
        raise ApiError("tools: function names must be unique", param="tools")
    check_tools(tool_dicts, field_of)
    choice = tool_choice if tool_choice is not None else ("auto" if tool_dicts else "none")
    fmt = get_format(parser)
    if choice == "none":
        return ToolPlan("none", fmt=fmt)
    if not tool_dicts:
        raise ApiError(f"tool_choice: {choice if isinstance(choice, str) else 'a named function'} "
                       "requires a non-empty tools list", param="tool_choice")
    if choice == "auto":
        return ToolPlan("auto", tool_dicts, parallel=parallel, fmt=fmt)
    if choice == "required":
        return ToolPlan("forced", tool_dicts, calls_schema([t["function"] for t in tool_dicts]), parallel, fmt)
    name = choice.function.name
    if name not in names:
        raise ApiError(f"tool_choice.function.name: {name!r} is not one of the tools {names}",
                       param="tool_choice.function.name")
    tool = tool_dicts[names.index(name)]
    return ToolPlan("forced", [tool], calls_schema([tool["function"]]), False, fmt)


def tools_system_prompt(tools: list[dict], fmt: ToolCallFormat = HERMES) -> str:
    """A system-prompt section describing ``tools`` and ``fmt``'s answer format."""
    lines = ["# Tools", "", "You may call one or more functions to assist with the user query.",
             "Function signatures, one per line:", "<tools>"]
    lines += [json.dumps(t["function"], ensure_ascii=False) for t in tools]
    if fmt is HERMES:  # Qwen2.5's own wording
        lines += ["</tools>", "", "To call a function, reply with a JSON object with its name and arguments "
                  f"inside {OPEN_TAG}{CLOSE_TAG} tags:",
                  f'{OPEN_TAG}{{"name": <function-name>, "arguments": <args-json-object>}}{CLOSE_TAG}']
    else:
        lines += ["</tools>", "", "To call a function, reply in exactly this format (several calls are allowed):",
                  fmt.render_calls([("<function-name>", {"<arg-name>": "<value>"})])]
    return "\n".join(lines)


# apply_chat_template's own parameters: a request may not set them through chat_template_kwargs
# (``chat_template`` would run the client's Jinja on the server; the others change what is rendered)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "kwargs"})


def check_template_kwargs(kwargs: Optional[dict]) -> None:
    """400 naming ``chat_template_kwargs.<key>`` for a key the template call owns (see
    :data:`RESERVED_TEMPLATE_KWARGS`) or that is not an identifier (a Jinja variable name)."""
    for key in kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise ApiError(f"chat_template_kwargs.{key}: not allowed (template variables only; reserved: "
                           f"{sorted(RESERVED_TEMPLATE_KWARGS)})", param=f"chat_template_kwargs.{key}")


def render_prompt(engine, messages: list[dict], plan: ToolPlan, add_generation_prompt: bool = True,
                  template_kwargs: Optional[dict] = None, facts: Optional[TemplateFacts] = None) -> str:
    """The chat prompt; with tools, make sure the model sees them (template or system message);
    past assistant calls the template would drop are kept as text (:func:`calls_as_content`).
    ``template_kwargs``: the request's ``chat_template_kwargs`` (extra template variables).
    ``facts``: the server's :class:`~sglite.server.template_facts.TemplateFacts` (what the template
    does with tools, judged once on probe messages); None judges afresh (no cache)."""
    check_template_kwargs(template_kwargs)
    facts = facts if facts is not None else TemplateFacts(max_entries=4)
    kw = {"chat_template_kwargs": template_kwargs} if template_kwargs else {}

    def render(msgs_, tools=None, add_generation_prompt=add_generation_prompt):
        return engine.apply_chat_template(msgs_, add_generation_prompt=add_generation_prompt, tools=tools, **kw)
    msgs = calls_as_content(engine, messages, plan.fmt, facts)
    if plan.mode == "none":
        return render(msgs)
    # whether the template shows the tools is the template's property: judged on probe messages of
    # the request's shape (its own messages may name the tools themselves, e.g. instructions saying
    # "call get_weather", or calls kept as text) and cached per tool list and shape
    shown = facts.shows_tools(render, plan.tools, messages, template_kwargs)
    if shown is None:  # the probe was rejected: compare the messages as given with and without tools
        text, plain = render(messages, tools=plan.tools), render(messages)
        shown = all(name_count(text, n) > name_count(plain, n) for n in plan.names)
    if shown:
        return render(msgs, tools=plan.tools)
    section = tools_system_prompt(plan.tools, plan.fmt)
    if msgs and msgs[0]["role"] == "system":
        msgs[0]["content"] = f"{msgs[0].get('content') or ''}\n\n{section}".strip()
    else:
        msgs.insert(0, {"role": "system", "content": section})
    return render(msgs)


def calls_as_content(engine, messages: list[dict], fmt: ToolCallFormat,
                     facts: Optional[TemplateFacts] = None) -> list[dict]:
    """Copies of ``messages``; where the chat template drops assistant ``tool_calls`` (SmolLM2's
    ChatML renders only ``content``), each such message's calls are appended to its content as
    the model generated them (:meth:`ToolCallFormat.render_generated`), so the next turn's prompt
    extends this turn's prompt and output token for token (the radix cache hits them). A template
    that renders calls itself is left to do so (``facts`` caches that verdict)."""
    msgs = [dict(m) for m in messages]
    if fmt.shape == "pythonic" or not any(m.get("tool_calls") for m in msgs):
        return msgs
    facts = facts if facts is not None else TemplateFacts(max_entries=4)
    if facts.renders_calls(engine.apply_chat_template):
        return msgs
    for m in msgs:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.pop("tool_calls")]
            m["content"] = (m.get("content") or "") + fmt.render_generated(calls)
    return msgs


def _calls_from_json(text: str, names: list[str]) -> list[dict]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return []
    objs = obj if isinstance(obj, list) else [obj]
    calls = [make_call(o, names) for o in objs]
    return calls if calls and all(calls) else []


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[Optional[str], list[dict]]:
    """Split model output into ``(content, tool_calls)``; never raises.

    Forced mode: the whole text is the call's JSON, or the calls in the format's markup. Auto mode: the plan's format parser (see
    :mod:`sglite.server.tool_parsers`). Content is the text before the first call (None if
    empty). Unparsable output is returned as content with no calls.
    """
    if plan.mode == "none":
        return text, []
    stripped = text.strip()
    if plan.mode == "forced":  # bare JSON (json_schema) or the family's markup (a structural tag)
        calls = _calls_from_json(stripped, plan.names)
        if not calls and plan.fmt.shape != "pythonic":
            _, calls = parse_json_calls(text, plan.fmt, plan.names)
        if not calls:
            return text, []
        return None, calls if plan.parallel else calls[:1]
    if plan.fmt.shape == "pythonic":
        content, calls = parse_pythonic_calls(text, plan.names)
    elif plan.fmt.name == "mistral" and args_form(text):
        content, calls = parse_args_calls(text, plan.names)
    else:
        content, calls = parse_json_calls(text, plan.fmt, plan.names)
    return content, calls if plan.parallel else calls[:1]
