"""Mistral's newer tool-call form: ``[TOOL_CALLS]name[ARGS]{...}`` (tokenizer v11 and later:
Mistral Small 3.1+, Magistral, Devstral), parsed whole and streamed.

Each call is ``[TOOL_CALLS]`` + the function name + ``[ARGS]`` + its arguments JSON; parallel
calls repeat the whole group (``[TOOL_CALLS]a[ARGS]{...}[TOOL_CALLS]b[ARGS]{...}``). Some
versions put ``[CALL_ID]<id>`` between the name and ``[ARGS]``; that id becomes the call's id.
The older form, ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``, is the JSON-list
parser's (:mod:`sglite.server.tool_parsers.json_calls`); :func:`args_form` tells them apart from
the first character after ``[TOOL_CALLS]`` (``[`` or ``{``: the list form; else a name).
``[TOOL_CALLS]``, ``[CALL_ID]`` and ``[ARGS]`` are special tokens, so the server keeps special
tokens in the text of a mistral-format request with tools (as vLLM's mistral parser does).

Sources: Mistral's tokenizer docs (``mistral-common``, tool calls of the v11 tokenizer) and the
chat templates of the models above. Nothing raises: output that does not parse is content.
"""
from __future__ import annotations

import json
import re
from typing import Optional

from .json_calls import ValueScanner, new_call_id, skip_ws

OPENER = "[TOOL_CALLS]"
_HEAD = re.compile(r'\[TOOL_CALLS\]\s*([^\s\[\]{}"]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9_\-]+)\s*)?\[ARGS\]\s*')
_DECODER = json.JSONDecoder()


def args_form(text: str) -> Optional[bool]:
    """Whether ``text``'s first ``[TOOL_CALLS]`` opens the ``name[ARGS]`` form: True, False (the
    JSON-list form, or no opener), None (undecided: nothing after the opener yet)."""
    i = text.find(OPENER)
    if i < 0:
        return False
    p = skip_ws(text, i + len(OPENER))
    if p == len(text):
        return None
    return text[p] not in "[{"


def _call(name: str, call_id: Optional[str], args) -> dict:
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_args_calls(text: str, names: list[str], parallel: bool = True) -> tuple[Optional[str], list[dict]]:
    """``(content, calls)`` of an output in the ``name[ARGS]`` form: content is the text before
    the first ``[TOOL_CALLS]`` (None when blank); a group whose name is not a tool or whose
    arguments are not a JSON object ends the calls (none parsed: the whole text is content)."""
    start = text.find(OPENER)
    if start < 0:
        return text, []
    calls, pos = [], start
    while True:
        m = _HEAD.match(text, pos)
        if m is None or m.group(1) not in names:
            break
        try:
            args, end = _DECODER.raw_decode(text, m.end())
        except json.JSONDecodeError:
            break
        if not isinstance(args, dict):
            break
        calls.append(_call(m.group(1), m.group(2), args))
        pos = skip_ws(text, end)
    if not calls:
        return text, []
    return text[:start].strip() or None, calls if parallel else calls[:1]


class ArgsStreamer:
    """Streams the ``name[ARGS]`` form as OpenAI tool-call deltas (the same contract as
    :class:`sglite.server.tool_stream.ToolCallStreamer`): content up to ``[TOOL_CALLS]``, then
    per call its id and name once ``[ARGS]`` is seen, then its arguments text as generated.
    A group that does not stream (a name that is not a tool) is held and parsed whole at the end.

    Args:
        names: the tool names.
        parallel: stream every call (False: the first only).
        sent: content characters already sent by the streamer this one takes over from.
    """

    def __init__(self, names: list[str], parallel: bool = True, sent: int = 0):
        self.names, self.parallel = names, parallel
        self.sent, self.pos, self.state = sent, sent, "content"
        self.n_calls, self.incomplete = 0, False
        self.scanner: Optional[ValueScanner] = None
        self.args_sent = 0
        self.call_from = 0

    @property
    def called(self) -> bool:
        return self.n_calls > 0

    def _content(self, text: str) -> int:
        i = text.find(OPENER, self.sent)
        if i >= 0:
            self.state, self.pos, self.call_from = "head", i, i
            return i
        for k in range(min(len(OPENER) - 1, len(text) - self.sent), 0, -1):
            if OPENER.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def _head(self, text: str) -> Optional[dict]:
        m = _HEAD.match(text, self.pos)
        if m is None:
            rest = text[self.pos:]
            if "[ARGS]" in rest or "{" in rest or len(rest) > 256:
                self.state = "held"  # not a group this streamer reads: parsed whole at the end
            return None
        if m.end() == len(text):
            return None  # the arguments' first character decides
        if m.group(1) not in self.names or text[m.end()] != "{":
            self.state = "held"
            return None
        self.n_calls += 1
        self.state, self.scanner, self.pos = "args", ValueScanner(), m.end()
        self.args_sent = self.pos
        return {"index": self.n_calls - 1, "id": m.group(2) or new_call_id(), "type": "function",
                "function": {"name": m.group(1), "arguments": ""}}

    def feed(self, text: str) -> tuple[str, list[dict]]:
        content, deltas = "", []
        while True:
            if self.state == "content":
                cut = max(self._content(text), self.sent)
                content, self.sent = content + text[self.sent:cut], cut
                if self.state == "head":
                    continue
            elif self.state == "head":
                d = self._head(text)
                if d is not None:
                    deltas.append(d)
                    continue
            elif self.state == "args":
                self.pos = self.scanner.scan(text, self.pos)
                if self.pos > self.args_sent:
                    deltas.append({"index": self.n_calls - 1, "function": {"arguments": text[self.args_sent:self.pos]}})
                    self.args_sent = self.pos
                if self.scanner.done:
                    self.state = "between" if self.parallel else "done"
                    continue
            elif self.state == "between":
                p = skip_ws(text, self.pos)
                if text.startswith(OPENER, p):
                    self.state, self.pos, self.call_from = "head", p, p
                    continue
                if p < len(text) and not OPENER.startswith(text[p:]):
                    self.state = "done"
            return content, deltas

    def finish(self, text: str, finish_reason: Optional[str] = None) -> tuple[str, list[dict]]:
        content, deltas = self.feed(text)
        if self.state == "args" and not self.scanner.done:
            self.incomplete = True
        elif self.state in ("head", "held"):
            rest = text[self.call_from:] if self.parallel or not self.called else ""
            _, calls = parse_args_calls(rest, self.names, self.parallel) if rest else (None, [])
            if calls:
                for c in calls:
                    fn = c["function"]
                    deltas += [{"index": self.n_calls, "id": c["id"], "type": "function",
                                "function": {"name": fn["name"], "arguments": ""}},
                               {"index": self.n_calls, "function": {"arguments": fn["arguments"]}}]
                    self.n_calls += 1
            elif not self.called:
                content, self.sent = content + text[self.sent:], len(text)
        return content, deltas
