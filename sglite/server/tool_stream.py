"""Streaming tool calls for ``/v1/chat/completions`` as OpenAI clients accumulate them.

A call is streamed as OpenAI streams it: a first ``delta.tool_calls`` entry
``{"index", "id", "type": "function", "function": {"name", "arguments": ""}}`` as soon as the
function name is complete, then entries ``{"index", "function": {"arguments": "<new text>"}}``
carrying the arguments JSON text as it is generated (the concatenation is the arguments text,
without the call wrapper ``{"name": ..., "arguments": ...}`` around it). A call cut by
``max_tokens`` has streamed its partial arguments (never as ``content``).

Where calls are parsed from (the plan's :class:`~sglite.server.tool_parsers.ToolCallFormat`):

* forced mode (``tool_choice`` ``"required"`` or a named function): the output is the calls in
  the family's markup, its opener a special token or text (read as in auto mode; the grammar
  allows nothing else), or, where the backend has no structural tags (or for pythonic), one bare
  call object ``{"name": ..., "arguments": ...}`` (the grammar puts ``name`` first, schema order);
* auto mode: text before the format's opener (``<tool_call>``, ``<|python_tag|>``,
  ``[TOOL_CALLS]``, ``<|tool_call|>``) is content; then call objects are streamed one by one
  (indices 0, 1, ...; only the first when ``parallel_tool_calls`` is false), stepping over what
  the format puts between them (a list's ``,`` and ``]``, llama3's ``;``, hermes' closer and next
  opener); an answer that starts with ``{`` or ``[`` is a bare call (or list of calls). Calls
  whose header does not parse incrementally (keys in another order, a name that is not a tool)
  are held and parsed whole at the end, as :func:`~sglite.server.tool_calls.parse_tool_calls`
  does. ``pythonic`` calls are streamed by :class:`~sglite.server.tool_parsers.pythonic.PythonicStreamer`.

Sources: OpenAI's chat-completions streaming format (``ChoiceDeltaToolCall``); SGLang's
``function_call`` detectors and vLLM's tool parsers stream argument deltas the same way.
"""
from __future__ import annotations

import json
import re
from typing import Optional

from .tool_calls import ToolPlan, parse_tool_calls
from .tool_parsers.json_calls import ValueScanner, new_call_id, skip_ws
from .tool_parsers.mistral_args import ArgsStreamer, args_form
from .tool_parsers.pythonic import PythonicStreamer

# a call object's opening up to its arguments value: `{"name": "<str>", "arguments": `
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_NAME_PREFIX = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)')


class ToolCallStreamer:
    """Per-choice state: ``feed(cumulative_text)`` -> ``(content_delta, tool_call_deltas)``;
    ``finish(text, finish_reason)`` -> ``(content_delta, tool_call_deltas)`` for the last chunk.

    ``called`` is True once any call was (or is being) returned; ``incomplete`` is True when the
    last call's arguments were cut before their JSON value ended (by ``max_tokens``).
    """

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.sent = 0          # content characters sent
        self.pos = 0           # parse position for calls
        self.call_from = 0     # where the call being parsed starts (its <tool_call> tag or `{`)
        # forced calls in the family's markup open with its opener, as in "auto" (the grammar
        # allows no text around them); bare-JSON forced calls (json_schema) start with `{`
        forced_markup = plan.mode == "forced" and plan.fmt.shape != "pythonic" and bool(plan.fmt.opener)
        self.state = "content" if plan.mode == "auto" or forced_markup else {"none": "plain"}.get(plan.mode, "call")
        self.n_calls = 0
        self.args_sent = 0     # end of the current call's arguments text already sent
        self.scanner: Optional[ValueScanner] = None
        self.incomplete = False
        self.in_list = False   # inside a JSON list of calls (mistral, granite, a bare `[`)
        self.obj_open = False  # the current call object's `}` is still to come
        self._nonblank, self._blank_to = False, 0  # whether text[:_blank_to] (sent content) has text
        self.fmt = plan.fmt
        self.py = PythonicStreamer(plan.names, plan.parallel) if plan.mode == "auto" and plan.fmt.shape == "pythonic" \
            else None

        # mistral's `[TOOL_CALLS]name[ARGS]{...}` form: its own streamer, chosen at the opener
        self.mistral: Optional[ArgsStreamer] = None
        self._final = False  # finish(): an undecided opener is read by the JSON-list path

    @property
    def called(self) -> bool:
        return self.n_calls > 0 or (self.py is not None and self.py.n_calls > 0) or \
            (self.mistral is not None and self.mistral.called)

    def _mistral_args(self, text: str) -> Optional[bool]:
        """Auto mode, mistral format, before any call: whether the `name[ARGS]` form took over
        (True), or the text is undecided so far (None: hold it)."""
        if self.mistral is None and self.fmt.name == "mistral" and self.plan.mode == "auto" and self.state == "content":
            form = args_form(text[self.sent:])
            if form is None:
                return False if self._final else None
            if form:
                self.mistral = ArgsStreamer(self.plan.names, self.plan.parallel, sent=self.sent)
        return self.mistral is not None

    def _content(self, text: str) -> int:
        """Auto mode, before any call: how far content may be sent; switches state on a call start."""
        op = self.fmt.opener
        i = text.find(op, self.sent) if op else -1
        if i >= 0:
            self.call_from, self.pos, self.state = i, i + len(op), "call"
            return i
        if not self._nonblank and text[self._blank_to:self.sent].strip():
            self._nonblank = True  # content already sent has text: a later `{` is no bare call
        self._blank_to = self.sent
        if not self._nonblank:
            head = skip_ws(text, self.sent)
            if head == len(text) or (op and op.startswith(text[head:])):
                return self.sent  # blank or a partial opener so far: held (a bare call may follow)
            if self.fmt.bare_json and text.startswith(("{", "["), head):
                self.call_from, self.pos, self.state = self.sent, self.sent, "call"
                return self.sent  # a bare call: nothing of it is content
        for k in range(min(len(op) - 1, len(text) - self.sent), 0, -1):
            if op.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def _between(self, text: str) -> bool:
        """After a call: step over the format's separators; True when the next call starts."""
        p = skip_ws(text, self.pos)
        if p == len(text):
            return False
        if self.obj_open:  # the call object's own `}` after its arguments
            if text[p] != "}":
                self.state = "done"
                return False
            self.obj_open, self.pos = False, p + 1
            return self._between(text)
        if self.in_list:
            if text[p] == ",":
                self.call_from = self.pos = p + 1
                self.state = "call"
                return True
            if text[p] != "]":
                self.state = "done"
                return False
            self.in_list, self.pos = False, p + 1
            return self._between(text)
        op = self.fmt.opener
        if self.fmt.per_call:
            i = text.find(op, self.pos)
            if i >= 0:
                self.call_from, self.pos, self.state = i, i + len(op), "call"
            return i >= 0
        if self.fmt.shape != "json_object":
            self.state = "done"
            return False
        while True:  # llama3: `; ` and a repeated opener between calls
            if text.startswith(";", p):
                p = skip_ws(text, p + 1)
            elif op and text.startswith(op, p):
                p = skip_ws(text, p + len(op))
            else:
                break
        if p == len(text) or (op and op.startswith(text[p:])):
            return False  # wait for more text
        if text[p] == "{":
            self.call_from, self.pos, self.state = p, p, "call"
            return True
        self.state = "done"
        return False

    def _header(self, text: str) -> Optional[dict]:
        p = skip_ws(text, self.pos)
        if not self.in_list and text.startswith("[", p):
            q = skip_ws(text, p + 1)
            if q == len(text):
                return None
            if text[q] == "{":
                self.in_list, self.pos, self.call_from = True, q, q
        m = _HEADER.match(text, self.pos)
        if m is None:
            return None
        try:
            name = json.loads(m.group(1))
        except json.JSONDecodeError:
            name = None
        if name not in self.plan.names:
            self.state = "held"
            return None
        self.pos = m.end()
        while self.pos < len(text) and text[self.pos].isspace():
            self.pos += 1
        self.state, self.scanner, self.args_sent = "args", ValueScanner(), self.pos
        self.obj_open = True
        self.n_calls += 1
        return {"index": self.n_calls - 1, "id": new_call_id(), "type": "function",
                "function": {"name": name, "arguments": ""}}

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.py is not None:
            return self.py.feed(text)
        form = self._mistral_args(text)
        if form is None:
            return "", []
        if form:
            return self.mistral.feed(text)
        content, deltas = "", []
        while True:
            if self.state == "plain":
                content, self.sent = content + text[self.sent:], len(text)
            elif self.state == "content":
                cut = max(self._content(text), self.sent)
                content, self.sent = content + text[self.sent:cut], cut
                if self.state == "call":
                    continue
            elif self.state == "call":
                head = self._header(text)
                if head is not None:
                    deltas.append(head)
                    continue
            elif self.state == "args":
                if self.args_sent == self.pos and self.pos < len(text) and self.scanner.kind is None:
                    while self.pos < len(text) and text[self.pos].isspace():
                        self.pos += 1
                    self.args_sent = self.pos
                self.pos = self.scanner.scan(text, self.pos)
                if self.pos > self.args_sent:
                    deltas.append({"index": self.n_calls - 1,
                                   "function": {"arguments": text[self.args_sent:self.pos]}})
                    self.args_sent = self.pos
                if self.scanner.done:
                    more = self.plan.mode != "none" and self.plan.parallel
                    self.state = "between" if more else "done"
                    continue
            elif self.state == "between":
                if self._between(text):
                    continue
            return content, deltas

    def finish(self, text: str, finish_reason: Optional[str]) -> tuple[str, list[dict]]:
        if self.py is not None:
            return self.py.finish(text)
        self._final = True
        if self._mistral_args(text):
            out = self.mistral.finish(text, finish_reason)
            self.incomplete = self.mistral.incomplete
            return out
        content, deltas = self.feed(text)
        if self.state == "args" and not self.scanner.done:
            self.incomplete = True
            return content, deltas
        if self.plan.mode == "none" or self.state in ("done", "between", "plain"):
            return content, deltas
        # a call that did not stream (held header, bare list, or no call at all)
        if self.called:
            rest = text[self.call_from:] if self.plan.parallel else ""
            if rest and self.in_list:
                rest = "[" + rest  # the held call is inside a list: parse the rest of it as one
            _, calls = parse_tool_calls(rest, self.plan) if rest else (None, [])
            return content, deltas + self._whole(calls)
        _, calls = parse_tool_calls(text, self.plan)
        if calls:
            return content, self._whole(calls)
        if self.plan.mode == "forced" and finish_reason == "length":
            name = self._guess_name(text)
            if name is not None:  # cut before the arguments began: the call with empty arguments
                self.incomplete = True
                return "", self._whole([{"id": new_call_id(), "type": "function",
                                         "function": {"name": name, "arguments": ""}}])
        content, self.sent = content + text[self.sent:], len(text)
        return content, deltas

    def _whole(self, calls: list[dict]) -> list[dict]:
        """Entries of calls parsed whole: each call's id and name first (arguments ``""``), then
        its arguments text in one piece, as streamed calls arrive."""
        out = []
        for c in calls:
            fn = c["function"]
            out.append({"index": self.n_calls, "id": c["id"], "type": "function",
                        "function": {"name": fn["name"], "arguments": ""}})
            if fn["arguments"]:
                out.append({"index": self.n_calls, "function": {"arguments": fn["arguments"]}})
            self.n_calls += 1
        return out

    def _guess_name(self, text: str) -> Optional[str]:
        """The function a truncated forced call is calling: the only tool, or the only tool whose
        name starts with the name text generated so far."""
        if len(self.plan.names) == 1:
            return self.plan.names[0]
        op = self.fmt.opener
        head = skip_ws(text, 0)
        m = _NAME_PREFIX.match(text, head + len(op) if op and text.startswith(op, head) else 0)
        if m is None:
            return None
        hits = [n for n in self.plan.names if n.startswith(m.group(1))]
        return hits[0] if len(hits) == 1 else None


def chunk_entries(deltas: list[dict]) -> list[dict]:
    """The entries to send, one per chunk: each call's first entry (id, name, ``arguments: ""``)
    alone, then its arguments pieces joined. Clients read only ``delta.tool_calls[0]`` of a chunk
    (instructor's TOOLS streaming does), as OpenAI sends one entry per chunk."""
    out: list[dict] = []
    for d in deltas:
        prev = out[-1] if out else None
        if ("id" not in d and prev is not None and "id" not in prev and prev["index"] == d["index"]):
            out[-1] = {"index": d["index"],
                       "function": {"arguments": prev["function"]["arguments"] + d["function"]["arguments"]}}
        else:
            out.append(d)
    return out


def merge_tool_call_deltas(deltas: list[dict]) -> list[dict]:
    """Accumulate ``delta.tool_calls`` entries into whole calls (as OpenAI clients do)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
        c["id"] = d.get("id") or c["id"]
        fn = d.get("function") or {}
        c["function"]["name"] = fn.get("name") or c["function"]["name"]
        c["function"]["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def truncated_tool_calls(text: str, plan: ToolPlan) -> tuple[Optional[str], list[dict]]:
    """Non-streamed output cut by ``max_tokens``: ``(content, calls)`` with the partial call's
    arguments text as generated (OpenAI and vLLM return the truncated call with finish_reason
    ``length``). Empty ``calls`` when no call had started (then ``content`` is the text)."""
    s = ToolCallStreamer(plan)
    content, deltas = s.finish(text, "length")
    if not deltas:
        return text, []
    return content.strip() or None, merge_tool_call_deltas(deltas)
