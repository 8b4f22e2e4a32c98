"""ScriptedAgentEngine: a :class:`~sglite.server.testing.FakeEngine` that plays one agent turn the
way a tool-using model does, for tests of agent frameworks against the server without a model.

The script, per request (decided from the rendered prompt and the request's constraint; a
forced call follows its constraint: bare JSON for a ``json_schema``, the tag's own markup for a
tags-only structural tag):

1. no tool result in the prompt yet (``tool_result_marker`` absent): call the first tool whose
   name is not an output tool (``final_result*``, ``final_answer``, a LangGraph response-format
   tool) with :attr:`call_arguments`, in Hermes ``<tool_call>`` format;
2. a tool result is there: answer in the requested shape: an instance of the request's own JSON
   schema (``response_format`` / ``text.format``, also inside an "auto" union), else a call of
   the output tool with an instance of its parameters schema, else :attr:`final_text`.

Every reply is deterministic (no rotation when sampling). ``prompts`` records each rendered prompt.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from .testing import FakeEngine, example_instance

OUTPUT_TOOL_PREFIXES = ("final_result", "final_answer")


def _tags_and_schema(constraint) -> tuple[dict, Optional[Any]]:
    """``({tool name: parameters schema}, the non-tool JSON schema or None)`` of a constraint."""
    if constraint is None:
        return {}, None
    kind, spec = constraint
    if kind == "json_schema":
        return {}, json.loads(spec) if isinstance(spec, str) else spec
    if kind != "structural_tag":
        return {}, None
    tags: dict = {}
    other: list = []

    def walk(node, in_tag):
        if isinstance(node, dict):
            if node.get("type") == "tag" and "begin" in node:
                begin = node["begin"]
                name = begin.split('"name": "', 1)[1].split('"', 1)[0] if '"name": "' in begin else None
                content = node.get("content") or {}
                if name is not None:
                    tags[name] = content.get("json_schema", {})
                return
            if node.get("type") == "json_schema" and not in_tag:
                other.append(node.get("json_schema"))
                return
            for v in node.values():
                walk(v, in_tag)
        elif isinstance(node, list):
            for v in node:
                walk(v, in_tag)

    walk(json.loads(spec) if isinstance(spec, str) else spec, False)
    return tags, (other[0] if other else None)


def tags_only_instance(spec) -> Optional[str]:
    """A text valid for a structural tag whose format is tags and nothing else (a top-level
    ``tags_with_separator`` with ``at_least_one``, as forced tool calls are): the first tag's
    ``begin`` + an instance of its content + its ``end``. None when the format allows free text."""
    root = json.loads(spec) if isinstance(spec, str) else spec
    fmt = root.get("format") if isinstance(root, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") != "tags_with_separator" or not fmt.get("at_least_one"):
        return None
    return _tag_instance(fmt["tags"][0])


def _tag_instance(node: dict) -> str:
    kind = node.get("type", "tag")
    if kind == "tag":
        return node.get("begin", "") + _tag_instance(node.get("content") or {"type": "const_string", "value": ""}) \
            + node.get("end", "")
    if kind == "tags_with_separator":
        return _tag_instance(node["tags"][0])
    if kind == "json_schema":
        return json.dumps(example_instance(node.get("json_schema", {})))
    if kind == "const_string":
        return node.get("value", "")
    raise ValueError(f"tags_only_instance: no example for a {kind!r} part")


def _forced_tags(constraint) -> dict:
    """``{tool name: its tag}`` of a forced structural tag (tags and nothing else); else empty."""
    if constraint is None or constraint[0] != "structural_tag" or tags_only_instance(constraint[1]) is None:
        return {}
    spec = json.loads(constraint[1]) if isinstance(constraint[1], str) else constraint[1]
    out: dict = {}

    def walk(node):
        if isinstance(node, dict):
            begin = node.get("begin")
            if node.get("type") == "tag" and isinstance(begin, str) and '"name": "' in begin:
                out[begin.split('"name": "', 1)[1].split('"', 1)[0]] = node
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(spec)
    return out


def _call_branches(schema) -> dict:
    """``{tool name: arguments schema}`` of a forced-call schema (one call, an ``anyOf`` of calls, or
    an array of them); empty for any other schema."""
    out: dict = {}
    if not isinstance(schema, dict):
        return out
    for branch in [schema.get("items", schema)] + list(schema.get("items", schema).get("anyOf", [])):
        props = branch.get("properties", {}) if isinstance(branch, dict) else {}
        names = props.get("name", {}).get("enum", [])
        if len(names) == 1 and "arguments" in props:
            out[names[0]] = props["arguments"]
    return out


def hermes_call(name: str, arguments: dict) -> str:
    """One Hermes-format tool call, as Qwen 2.5 / SmolLM2 write it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class ScriptedAgentEngine(FakeEngine):
    """FakeEngine scripted as a one-tool agent (see the module docstring).

    Args:
        tool_names: the tools the prompt may offer (the fake template lists the offered ones).
        call_arguments: the arguments of the first call (default ``{"city": "Paris"}``).
        tool_result_marker: text that only a tool's result puts in the prompt.
        final_text: the plain final answer when no format is asked for.
        **kw: :class:`FakeEngine`'s options.
    """

    def __init__(self, tool_names=("get_weather",), call_arguments: Optional[dict] = None,
                 tool_result_marker: str = "sunny, 21", final_text: str = "Paris: sunny, 21 C.", **kw):
        kw.setdefault("context_length", 16384)
        kw.setdefault("max_total_tokens", 1 << 20)
        super().__init__(**kw)
        self.tool_names, self.call_arguments = tuple(tool_names), call_arguments or {"city": "Paris"}
        self.tool_result_marker, self.final_text = tool_result_marker, final_text
        self.prompts: list[str] = []
        self._prompt = ""

    def _plan(self, prompt, sampling_params, input_ids, rid, lp_kw):
        text = prompt
        if not isinstance(text, str) and input_ids and isinstance(input_ids[0], int):
            text = self.tokenizer.decode(input_ids)  # token-exact resends (turn_tokens) come as ids
        self._prompt = text if isinstance(text, str) else ""
        self.prompts.append(self._prompt)
        return super()._plan(prompt, sampling_params, input_ids, rid, lp_kw)

    def _target(self, sp, seed: int) -> str:
        tags, schema = _tags_and_schema(sp.constraint)
        done = self.tool_result_marker in self._prompt
        forced = _call_branches(schema) if sp.constraint is not None and sp.constraint[0] == "json_schema" else {}
        if forced:  # tool_choice "required" / named as bare JSON: the output is the call object itself
            name = next((n for n in forced if (n in self.tool_names) != done), next(iter(forced)))
            args = self.call_arguments if name in self.tool_names else example_instance(forced[name], schema)
            call = {"name": name, "arguments": args}
            return json.dumps([call] if schema.get("type") == "array" else call)
        marked = _forced_tags(sp.constraint)
        if marked:  # forced in the family's markup (a tags-only structural tag): one call, as tagged
            name = next((n for n in marked if (n in self.tool_names) != done), next(iter(marked)))
            tag = marked[name]
            args = self.call_arguments if name in self.tool_names else example_instance(tags[name])
            return tag["begin"] + json.dumps(args) + tag["end"]
        if not done:
            name = next((n for n in self.tool_names if n in self._prompt or n in tags), self.tool_names[0])
            return hermes_call(name, self.call_arguments)
        if sp.constraint is not None and sp.constraint[0] == "json_schema":
            return json.dumps(example_instance(schema))
        if schema is not None:
            return json.dumps(example_instance(schema))
        out_tool = next((n for n in tags if n not in self.tool_names), None)
        if out_tool is not None:
            return hermes_call(out_tool, example_instance(tags[out_tool]))
        return self.final_text

    def _free_reply(self, sp, seed: int) -> str:
        return self.reply
