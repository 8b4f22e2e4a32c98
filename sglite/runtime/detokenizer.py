"""Incremental, UTF-8-safe detokenization with stop strings and stop regexes.

Decoding follows the prefix/read-offset scheme of vLLM's ``detokenize_incrementally`` and
SGLang's detokenizer manager: each step decodes only a short window of recent tokens
(``ids[prefix_offset:]``) and releases the part past the already-read text, unless that part
ends in U+FFFD (a byte-level token that stops mid-character), which is held back until the
character completes. Stop strings may span tokens, so a tail that could still become a stop
string (or a stop-regex match) is held back and released once it no longer can.

Stop regexes are searched with the ``regex`` module, which takes a timeout and releases the GIL
while it matches (``concurrent=True``): Python's ``re`` backtracks in C holding the GIL, so one
stop regex froze the engine and the event loop for minutes (``(?:.*?,){11}P`` takes ``re`` 15.9 s
on 60 characters). A request's stop-regex work (searches and hold-back walks) shares one budget,
``stop_regex_timeout`` seconds over its life; past it the request ends with ``finish_reason``
abort naming the budget (:attr:`IncrementalDetokenizer.error`).
"""
from __future__ import annotations

import math
import time
from typing import Sequence

import regex

from ..constrained.regex_prefix import RegexPrefix
from ..errors import GrammarError, InvalidRequestError

_REPLACEMENT = "\ufffd"
#: default seconds of stop-regex work one request may spend (EngineConfig.stop_regex_timeout)
STOP_REGEX_TIMEOUT_S = 1.0


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into released text deltas.

    Args:
        tokenizer: a :class:`sglite.runtime.tokenizer.Tokenizer` (needs ``decode``).
        skip_special_tokens / spaces_between_special_tokens: passed to ``tokenizer.decode``.
        stop: stop strings (a str or a sequence); empty strings are ignored.
        stop_regex: Python regexes; a match anywhere in the output stops it. Hold-back uses a lazy
            byte DFA with a state budget (:class:`~sglite.constrained.regex_prefix.RegexPrefix`);
            regexes it cannot parse (lookarounds, anchors) are matched only
            within the not-yet-released tail.
        no_stop_trim: keep the matched stop text in the output.
        stop_regex_timeout: seconds of stop-regex work (searches and hold-back) the request may
            spend in all (``EngineConfig.stop_regex_timeout``).

    Attributes:
        text: all text released so far (the concatenation of every delta; see :meth:`take`).
        finished: a stop matched or :meth:`flush` ran; later pushes are ignored.
        matched_stop: the stop string (or the regex's matched text) that ended output, else None.
        error: why the stop regexes were given up (their time budget spent; the request should end
            with finish_reason abort and this message), else None.

    Raises:
        InvalidRequestError: a ``stop_regex`` does not compile or matches the empty string
            (field ``stop_regex``).
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: str | Sequence[str] = (),
                 stop_regex: str | Sequence[str] = (), no_stop_trim: bool = False,
                 stop_regex_timeout: float = STOP_REGEX_TIMEOUT_S):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = tuple(s for s in ([stop] if isinstance(stop, str) else stop or ()) if s)
        patterns = [stop_regex] if isinstance(stop_regex, str) else list(stop_regex or ())
        self.stop_regex = []
        for pattern in patterns:
            try:
                self.stop_regex.append(regex.compile(pattern))
            except (regex.error, RecursionError, OverflowError) as exc:
                raise InvalidRequestError(f"stop_regex: cannot compile {pattern!r}: {exc}",
                                          field="stop_regex") from exc
            if self.stop_regex[-1].fullmatch("", timeout=stop_regex_timeout) is not None:
                raise InvalidRequestError(f"stop_regex: {pattern!r} matches the empty string",
                                          field="stop_regex")
        self._regex_prefix = []
        for pattern in patterns:
            try:
                self._regex_prefix.append(RegexPrefix(pattern))
            except GrammarError as exc:
                raise InvalidRequestError(f"stop_regex: {pattern!r}: {exc}", field="stop_regex") from None
        self.no_stop_trim = no_stop_trim
        self.stop_regex_timeout = stop_regex_timeout
        self._regex_left = stop_regex_timeout  # seconds of stop-regex work left to this request
        self.error: str | None = None
        self.token_ids: list[int] = []
        self.text = ""
        self.finished = False
        self.matched_stop: str | None = None
        self._prefix_offset = 0  # window start: text before it is final
        self._read_offset = 0  # tokens up to here are released (or pending)
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset]), cached
        self._pending = ""  # decoded but held back (could start a stop)
        self._taken = 0  # length of text already handed out by take()

    # ------------------------------------------------------------------------------- public

    def push(self, token_ids: Sequence[int]) -> tuple[str, str | None]:
        """Append output tokens; return ``(text released now, matched stop or None)``.

        Mutates the detokenizer. Costs two short decodes of the recent window, not the whole
        output. Ignored (returns ``("", None)``) once :attr:`finished`.
        """
        if self.finished:
            return "", None
        self.token_ids.extend(int(t) for t in token_ids)
        return self._release(self._decode_window(final=False), final=False)

    def flush(self) -> str:
        """Release everything held back (incomplete characters as U+FFFD, stop-string
        prefixes) and finish. Returns the released delta; a stop matched here sets
        :attr:`matched_stop`."""
        if self.finished:
            return ""
        delta, _ = self._release(self._decode_window(final=True), final=True)
        self.finished = True
        return delta

    def take(self) -> str:
        """The text released since the previous call (the next piece of a stream event)."""
        delta, self._taken = self.text[self._taken:], len(self.text)
        return delta

    # ------------------------------------------------------------------------------- internals

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def _decode_window(self, final: bool) -> str:
        """New complete text of the window, advancing the offsets when there is some."""
        new_text = self._decode(self.token_ids[self._prefix_offset:])
        if len(new_text) <= len(self._prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT) and not final:
            return ""  # a character is still incomplete: wait for its remaining bytes
        chunk = new_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        return chunk

    def _release(self, chunk: str, final: bool) -> tuple[str, str | None]:
        pending = self._pending + chunk
        # the stop regexes' work this call runs against one deadline (no clock read without them)
        deadline = time.perf_counter() + self._regex_left if self.stop_regex else math.inf
        try:
            found = self._find_stop(pending, deadline)
            hold = 0 if final or found is not None else self._holdback(pending, deadline)
        except _BudgetSpent:
            self.error = (f"stop_regex: matching took longer than stop_regex_timeout={self.stop_regex_timeout:g} s "
                          "(--stop-regex-timeout); a pattern that backtracks catastrophically ends its request")
            found, hold = None, 0
            self.finished = True
        finally:
            if self.stop_regex:
                self._regex_left = deadline - time.perf_counter()
        if found is not None:
            start, end, matched = found
            delta = pending[: end if self.no_stop_trim else start]
            self._pending = ""
            self.text += delta
            self.finished = True
            self.matched_stop = matched
            return delta, matched
        delta, self._pending = pending[: len(pending) - hold], pending[len(pending) - hold:]
        self.text += delta
        return delta, None

    def _find_stop(self, text: str, deadline: float) -> tuple[int, int, str] | None:
        """Earliest (start, end, matched text) of any stop string or regex match in ``text``;
        raises _BudgetSpent when a regex search runs past ``deadline`` (``time.perf_counter``)."""
        best = None
        for s in self.stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, i + len(s), s)
        for rx in self.stop_regex:
            try:  # the GIL released while it matches
                m = rx.search(text, concurrent=True, timeout=max(deadline - time.perf_counter(), 1e-6))
            except TimeoutError:
                raise _BudgetSpent from None
            if m is not None and (best is None or m.start() < best[0]):
                best = (m.start(), m.end(), m.group(0))
        return best

    def _holdback(self, text: str, deadline: float) -> int:
        """Length of the longest suffix of ``text`` that could still start a stop; raises
        _BudgetSpent when the stop regexes' DFA walks run past ``deadline``."""
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        for checker in self._regex_prefix:
            if not checker.supported:
                continue
            for start in range(0, len(text) - hold):  # each walk stops at the DFA's dead state
                if time.perf_counter() > deadline:
                    raise _BudgetSpent
                if checker.could_start(text[start:]):
                    hold = len(text) - start
                    break
        return hold


class _BudgetSpent(Exception):
    """The request's stop-regex time budget is spent."""
