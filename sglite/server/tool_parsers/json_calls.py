"""Non-streamed parsing of JSON-shaped tool calls (``qwen25``/hermes, ``llama3``, ``mistral``,
``granite``): output text -> ``(content, calls)``.

The tool-call section starts at the format's opener, or (``bare_json``) at a ``{`` / ``[`` that
begins the output. From there the parser reads call objects ``{"name": <a tool>, "arguments" |
"parameters": <JSON>}`` with :meth:`json.JSONDecoder.raw_decode`, stepping over what the format puts
between calls: a list's ``[`` ``,`` ``]``, llama3's ``;`` and repeated opener, hermes' closer
and next ``<tool_call>`` (a hermes block that does not parse is skipped; the next one is read).
Text before the section is the content (None when blank); text after the last call is dropped.
Nothing raises: output with no parsable call comes back whole as content with no calls.
The streamed counterpart (:class:`sglite.server.tool_stream.ToolCallStreamer`) walks the same
grammar incrementally, so both agree for every chunking of a well-formed output.
"""
from __future__ import annotations

import json
import uuid
from typing import Optional

from .formats import ToolCallFormat

_DECODER = json.JSONDecoder()
_LITERAL_END = set(",}] \t\r\n")


def new_call_id() -> str:
    """An OpenAI-style tool-call id: ``call_`` + 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(obj, names: list[str]) -> Optional[dict]:
    """An OpenAI ``tool_calls`` entry of a decoded call object, or None when it is not a call of
    one of ``names`` (not an object, unknown name, arguments a string that is not JSON)."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def skip_ws(text: str, pos: int) -> int:
    """The index of the first non-whitespace character of ``text`` at or after ``pos`` (``len(text)``
    when none)."""
    n = len(text)
    while pos < n and text[pos].isspace():
        pos += 1
    return pos


def section_start(text: str, fmt: ToolCallFormat) -> Optional[tuple[int, int]]:
    """``(content_end, parse_from)`` of the tool-call section, or None when there is none."""
    head = skip_ws(text, 0)
    if fmt.opener and text.startswith(fmt.opener, head):
        return head, head + len(fmt.opener)
    if fmt.bare_json and text.startswith(("{", "["), head):
        return 0, head
    if fmt.opener:
        i = text.find(fmt.opener)
        if i >= 0:
            return i, i + len(fmt.opener)
    return None


def next_call(text: str, pos: int, fmt: ToolCallFormat, in_list: bool) -> tuple[Optional[int], bool]:
    """After a call ended at ``pos``: where the next call object starts (None: no more), and
    whether it is inside a JSON list."""
    p = skip_ws(text, pos)
    if in_list:
        if text.startswith(",", p):
            return skip_ws(text, p + 1), True
        if not text.startswith("]", p):
            return None, False
        p, in_list = skip_ws(text, p + 1), False
    if fmt.per_call:
        i = text.find(fmt.opener, p)
        return (None, False) if i < 0 else (i + len(fmt.opener), False)
    if fmt.shape != "json_object":
        return None, False
    while True:  # llama3: `; ` and a repeated opener between calls
        if text.startswith(";", p):
            p = skip_ws(text, p + 1)
        elif fmt.opener and text.startswith(fmt.opener, p):
            p = skip_ws(text, p + len(fmt.opener))
        else:
            break
    return (p, False) if text.startswith("{", p) else (None, False)


def _decode_at(text: str, pos: int, names: list[str], in_list: bool) -> tuple[list[dict], int, bool]:
    """Calls decoded at ``pos`` (one object, or a whole list), the end, whether a list is open."""
    p = skip_ws(text, pos)
    if not in_list and text.startswith("[", p):
        q = skip_ws(text, p + 1)
        if text.startswith("{", q):  # a list of calls: read its objects one by one
            return _decode_at(text, q, names, True)
    try:
        obj, end = _DECODER.raw_decode(text, p)
    except json.JSONDecodeError:
        return [], p, in_list
    objs = obj if isinstance(obj, list) else [obj]
    calls = [make_call(o, names) for o in objs]
    if not calls or not all(calls):
        return [], p, in_list
    return calls, end, in_list


class ValueScanner:
    """Finds where one JSON value ends, fed the text incrementally (O(1) per character)."""

    def __init__(self):
        self.depth, self.in_str, self.esc, self.kind, self.done = 0, False, False, None, False

    def scan(self, text: str, pos: int) -> int:
        """Consume ``text[pos:]`` up to the value's end; return the index reached."""
        n = len(text)
        while pos < n and not self.done:
            ch = text[pos]
            if self.kind is None:
                self.kind = "container" if ch in "{[" else "string" if ch == '"' else "literal"
                self.depth = 1 if ch in "{[" else 0
                self.in_str = ch == '"'
            elif self.kind == "literal":
                if ch in _LITERAL_END:
                    self.done = True
                    break
            elif self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    self.done = self.kind == "string"
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.done = self.depth == 0
            pos += 1
        return pos


def parse_json_calls(text: str, fmt: ToolCallFormat, names: list[str]) -> tuple[Optional[str], list[dict]]:
    """Split ``text`` into ``(content, calls)`` (see the module docstring)."""
    start = section_start(text, fmt)
    if start is None:
        return text, []
    content_end, pos = start
    calls: list[dict] = []
    in_list = False
    while pos is not None:
        got, end, in_list = _decode_at(text, pos, names, in_list)
        if not got:
            if not fmt.per_call or in_list:
                break
            i = text.find(fmt.opener, end)  # hermes: a bad block is skipped
            pos = None if i < 0 else i + len(fmt.opener)
            continue
        calls += got
        pos, in_list = next_call(text, end, fmt, in_list)
    if not calls:
        return text, []
    return text[:content_end].strip() or None, calls
