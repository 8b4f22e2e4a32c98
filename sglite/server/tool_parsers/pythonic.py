"""Pythonic tool calls (``--tool-call-parser pythonic``; Llama 3.2 / 4): the model writes a Python
list of calls with keyword arguments of literal values, ``[get_weather(city="Paris"), get_time()]``.

The list starts at the first ``[`` followed by ``name(``; the text before it is the content. The
list is read with :mod:`ast` (never evaluated): every element must be a call of one of the tools,
with keyword arguments whose values are literals (strings, numbers, ``True``/``False``/``None``,
lists, dicts). Anything else (an unclosed list, positional arguments, an unknown function, an
expression) means no calls: the output comes back whole as content.

Streaming: content is sent up to a possible list start; the list is held until its closing
``]`` and then sent as calls (each: id and name, then its arguments JSON), so a list that turns out
malformed is sent as content, as the non-streamed parse returns it.
Source: SGLang ``function_call/pythonic_detector.py`` (format); Llama 3.2's chat template.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Optional

from .json_calls import new_call_id

_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_MAYBE_START = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?$")  # a tail that may still become _START


class _ListScanner:
    """Finds the ``]`` closing a list (Python strings skipped), fed a growing text: each call
    continues where the last stopped, so streaming a long list costs O(1) per character."""

    def __init__(self, start: int):
        self.pos, self.depth, self.quote, self.esc = start, 0, None, False

    def end(self, text: str) -> Optional[int]:
        """Index after the closing ``]``, or None while the list is still open."""
        for i in range(self.pos, len(text)):
            ch = text[i]
            if self.quote:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == self.quote:
                    self.quote = None
            elif ch in "\"'":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None


def _list_end(text: str, start: int) -> Optional[int]:
    """Index after the ``]`` closing the list opened at ``start``, or None."""
    return _ListScanner(start).end(text)


def _calls_of(src: str, names: list[str]) -> list[dict]:
    try:
        tree = ast.parse(src.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return []
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    calls = []
    for el in tree.elts:
        if not (isinstance(el, ast.Call) and isinstance(el.func, ast.Name) and el.func.id in names and not el.args):
            return []
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in el.keywords if kw.arg is not None}
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return []
        if len(args) != len(el.keywords):
            return []  # **kwargs
        try:
            text = json.dumps(args, ensure_ascii=False)
        except (TypeError, ValueError):
            return []  # sets, tuples as keys, bytes ...
        calls.append({"id": new_call_id(), "type": "function", "function": {"name": el.func.id, "arguments": text}})
    return calls


def parse_pythonic_calls(text: str, names: list[str]) -> tuple[Optional[str], list[dict]]:
    """Split ``text`` into ``(content, calls)``; no exception on any input."""
    m = _START.search(text)
    if m is None:
        return text, []
    end = _list_end(text, m.start())
    calls = _calls_of(text[m.start():end], names) if end is not None else []
    if not calls:
        return text, []
    return text[:m.start()].strip() or None, calls


class PythonicStreamer:
    """``feed(cumulative_text)`` / ``finish(text)`` -> ``(content_delta, tool_call_deltas)``."""

    def __init__(self, names: list[str], parallel: bool = True):
        self.names, self.parallel = names, parallel
        self.sent = 0
        self.state = "content"   # content -> list -> done | plain
        self.list_from = 0
        self.scanner: Optional[_ListScanner] = None
        self.n_calls = 0
        self.incomplete = False

    def _hold_from(self, text: str) -> int:
        """Content may be sent up to here (a possible list start is held)."""
        j = text.rfind("[", self.sent)
        while j >= 0:
            if _MAYBE_START.match(text, j):
                return j
            j = text.rfind("[", self.sent, j)
        return len(text)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        content, deltas = "", []
        if self.state == "content":
            m = _START.search(text, self.sent)
            if m is None:
                cut = max(self._hold_from(text), self.sent)
                content, self.sent = text[self.sent:cut], cut
                return content, deltas
            content, self.sent = text[self.sent:m.start()], m.start()
            self.state, self.list_from, self.scanner = "list", m.start(), _ListScanner(m.start())
        if self.state == "list":
            end = self.scanner.end(text)
            if end is None:
                return content, deltas
            calls = _calls_of(text[self.list_from:end], self.names)
            if not calls:
                self.state = "plain"
            else:
                self.state, self.sent = "done", end
                deltas = self._entries(calls if self.parallel else calls[:1])
        if self.state == "plain":
            content, self.sent = content + text[self.sent:], len(text)
        return content, deltas

    def _entries(self, calls: list[dict]) -> list[dict]:
        out = []
        for c in calls:
            fn = c["function"]
            out.append({"index": self.n_calls, "id": c["id"], "type": "function",
                        "function": {"name": fn["name"], "arguments": ""}})
            out.append({"index": self.n_calls, "function": {"arguments": fn["arguments"]}})
            self.n_calls += 1
        return out

    def finish(self, text: str) -> tuple[str, list[dict]]:
        content, deltas = self.feed(text)
        if self.state in ("content", "list"):  # an unclosed list (or a held `[`) is content
            self.state = "plain"
            content, self.sent = content + text[self.sent:], len(text)
        return content, deltas
