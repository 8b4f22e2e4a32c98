"""Function calling for ``/v1/chat/completions``: planning, prompting, constraining, parsing.

* ``tool_choice`` ``"none"``: tools are not shown; plain chat.
* ``"auto"`` (the default with tools): the tools go to the chat template (or, when the template
  ignores them, into a system message asking for Hermes-style ``<tool_call>{json}</tool_call>``);
  the output is parsed for such blocks, or for a bare ``{"name", "arguments"}`` JSON answer.
* ``"required"`` or a named function: the output is *forced* by constrained decoding against
  ``{"name": <one of the tools>, "arguments": <that tool's parameters schema>}`` (an ``anyOf``
  over the tools for ``required``), so the arguments always parse and validate.

Sources: OpenAI's function-calling API; the Hermes / Qwen2.5 ``<tool_call>`` format that SGLang's
``function_call/qwen25_detector.py`` parses; SGLang forces calls with a JSON schema the same way.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

from .errors import ApiError

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN_TAG) + r"(.*?)(?:" + re.escape(CLOSE_TAG) + r"|$)", re.S)


@dataclass
class ToolPlan:
    """What to do with ``tools``: ``mode`` is ``none`` | ``auto`` | ``forced``."""

    mode: str = "none"
    tools: list[dict] = field(default_factory=list)  # OpenAI tool dicts ({"type", "function"})
    schema: Optional[dict] = None                    # forced mode: the JSON schema of the call
    parallel: bool = True                            # parallel_tool_calls: False keeps the first call only

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


def plan_tools(tools: Optional[list], tool_choice, parallel: bool = True) -> ToolPlan:
    """Decide the tool mode of a chat request (pydantic ``Tool`` / ``NamedToolChoice`` objects);
    ``parallel`` is ``parallel_tool_calls`` (False: at most one call is returned).

    Raises:
        ApiError: 400 when ``tool_choice`` needs tools that are not there.
    """
    tool_dicts = [t.model_dump(by_alias=True, exclude_none=True) for t in (tools or [])]
    names = [t["function"]["name"] for t in tool_dicts]
    if len(set(names)) != len(names):
        raise ApiError("tools: function names must be unique", param="tools")
    choice = tool_choice if tool_choice is not None else ("auto" if tool_dicts else "none")
    if choice == "none":
        return ToolPlan("none")
    if not tool_dicts:
        raise ApiError(f"tool_choice: {choice if isinstance(choice, str) else 'a named function'} "
                       "requires a non-empty tools list", param="tool_choice")
    if choice == "auto":
        return ToolPlan("auto", tool_dicts, parallel=parallel)
    if choice == "required":
        return ToolPlan("forced", tool_dicts, calls_schema([t["function"] for t in tool_dicts]))
    name = choice.function.name
    if name not in names:
        raise ApiError(f"tool_choice.function.name: {name!r} is not one of the tools {names}",
                       param="tool_choice.function.name")
    tool = tool_dicts[names.index(name)]
    return ToolPlan("forced", [tool], calls_schema([tool["function"]]))


def tools_system_prompt(tools: list[dict]) -> str:
    """A system-prompt section describing ``tools`` and the ``<tool_call>`` answer format."""
    lines = ["# Tools", "", "You may call one or more functions to assist with the user query.",
             "Function signatures, one per line:", "<tools>"]
    lines += [json.dumps(t["function"], ensure_ascii=False) for t in tools]
    lines += ["</tools>", "", "To call a function, reply with a JSON object with its name and arguments "
              f"inside {OPEN_TAG}{CLOSE_TAG} tags:",
              f'{OPEN_TAG}{{"name": <function-name>, "arguments": <args-json-object>}}{CLOSE_TAG}']
    return "\n".join(lines)


def render_prompt(engine, messages: list[dict], plan: ToolPlan, add_generation_prompt: bool = True) -> str:
    """The chat prompt; with tools, make sure the model sees them (template or system message)."""
    if plan.mode == "none":
        return engine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    text = engine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=plan.tools)
    if all(n in text for n in plan.names):
        return text
    section = tools_system_prompt(plan.tools)
    msgs = [dict(m) for m in messages]
    if msgs and msgs[0]["role"] == "system":
        msgs[0]["content"] = f"{msgs[0].get('content') or ''}\n\n{section}".strip()
    else:
        msgs.insert(0, {"role": "system", "content": section})
    return engine.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)


def _make_call(obj, names: list[str]) -> Optional[dict]:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _calls_from_json(text: str, names: list[str]) -> list[dict]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return []
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_make_call(o, names) for o in objs]
    return calls if calls and all(calls) else []


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[Optional[str], list[dict]]:
    """Split model output into ``(content, tool_calls)``.

    Forced mode: the whole text is the call's JSON. Auto mode: ``<tool_call>`` blocks, or the
    whole text as a bare call. Content is the text before the first call (None if empty).
    Unparsable output is returned as content with no calls.
    """
    if plan.mode == "none":
        return text, []
    stripped = text.strip()
    if plan.mode == "forced" or stripped.startswith(("{", "[")):
        calls = _calls_from_json(stripped, plan.names)
        if calls:
            return None, calls if plan.parallel else calls[:1]
        if plan.mode == "forced":
            return text, []
    blocks = list(_BLOCK.finditer(text))
    calls = [c for m in blocks for c in _calls_from_json(m.group(1).strip(), plan.names)]
    if not calls:
        return text, []
    content = text[:blocks[0].start()].strip()
    return content or None, calls if plan.parallel else calls[:1]

