"""Text-level prompt lookup: drafts that survive a change of tokenization.

Token n-grams (:mod:`.ngram`) only match when the output spells a span with the same tokens as
the prompt. Copying into a structured output often does not: a JSON value follows ``"`` where the
prompt had a space (``' Seville'`` in the prompt, ``'S' 'ev' 'ille'`` after ``"city":"``), so no
token n-gram of the output ever occurs in the prompt. Here the match is done on *characters*:
the longest suffix of the decoded tail of the sequence (the grammar's forced text included) that
occurs in the decoded prompt; the text after that occurrence is re-encoded and becomes the draft
(the model's own tokenization is what verification checks; a re-sync happens at every step, so
a draft cut by a tokenization difference costs one step, not the rest of the copy).

Occurrences are ranked word-aligned first (the match starts after a non-alphanumeric character
in both the tail and the prompt: ``"S`` / `` S`` — the start of a copied value), then latest.
This is Prompt Lookup Decoding (Saxena 2023) on text instead of token ids.

The lookup runs on every decode step of every drafting request, so it is kept cheap
(:class:`TokenText`): the tail's text is joined from a per-token byte cache instead of a tokenizer
decode, matches too short to be trusted end the search before their occurrences are listed
(``min_chars``), and the continuation is re-encoded with the tokenizer's Rust backend only when the
draft policy says the match could pay for its rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

MAX_MATCH_CHARS = 48  # longest suffix tried
CONT_CHARS_PER_TOKEN = 6  # prompt characters re-encoded per wanted draft token


@dataclass
class TextMatch:
    """One occurrence of the tail's suffix in the source: the text after it and the match quality.

    Attributes:
        cont: source text following the occurrence (to be re-encoded as the draft).
        chars: matched characters (the suffix length).
        aligned: the match starts at a word boundary in both the tail and the source.
    """

    cont: str
    chars: int
    aligned: bool


class TextLookup:
    """Character-level lookup of a tail in a fixed source text (a request's decoded prompt).

    Args:
        source: the text drafts are copied from.
    """

    __slots__ = ("source",)

    def __init__(self, source: str):
        self.source = source

    def longest_suffix(self, tail: str) -> int:
        """Length in characters of the longest suffix of ``tail`` (at most ``MAX_MATCH_CHARS``)
        that occurs in the source; 0 when not even its last character does. (A suffix occurs
        only if every shorter one does, so the lengths are tried upward.)"""
        n = 0
        for m in range(1, min(len(tail), MAX_MATCH_CHARS) + 1):
            if tail[-m:] not in self.source:
                break
            n = m
        return n

    def find(self, tail: str, want_chars: int, candidates: int = 1, min_chars: int = 0) -> list[TextMatch]:
        """Up to ``candidates`` occurrences of the longest suffix of ``tail`` with distinct
        continuations (their first 4 characters), word-aligned ones first, latest first within
        each group; ``want_chars`` characters of continuation each. Empty when nothing matches,
        and (``min_chars``) when the match is shorter than that and cannot be word-aligned (the
        tail's match does not start at a word boundary): such a match is no draft."""
        n = self.longest_suffix(tail)
        if n == 0 or want_chars < 1:
            return []
        key, src = tail[-n:], self.source
        tail_aligned = n == len(tail) or not tail[-n - 1].isalnum()
        if n < min_chars and not tail_aligned:
            return []
        found = []
        pos = src.rfind(key)
        while pos >= 0:
            end = pos + n
            if end < len(src):
                aligned = tail_aligned and (pos == 0 or not src[pos - 1].isalnum())
                found.append(TextMatch(src[end:end + want_chars], n, aligned))
            pos = src.rfind(key, 0, pos + n - 1) if pos > 0 else -1
        found.sort(key=lambda m: not m.aligned)  # stable: latest first within each group
        out, seen = [], set()
        for m in found:
            head = m.cont[:4]
            if head in seen:
                continue
            seen.add(head)
            out.append(m)
            if len(out) >= candidates:
                break
        return out


class TokenText:
    """Text of token ids for the per-step lookups, without a tokenizer decode per step.

    The text of a run of ids is the UTF-8 decoding of their joined raw bytes
    (``tokenizer.id_to_bytes``, cached per id; byte-level BPE and byte-fallback pieces are exact,
    a partial UTF-8 character shows as U+FFFD as in a decode). Whether that equals the
    tokenizer's own decode is checked on the first prompt (:meth:`check`); where it does not
    (or the tokenizer has no ``id_to_bytes``), :meth:`text` falls back to ``decode``. Only
    drafts depend on this text (verification checks every draft token), so a mismatch costs
    speed, never correctness.

    Args:
        tokenizer: the runtime's :class:`~sglite.runtime.tokenizer.Tokenizer` (``decode``,
            ``encode``; ``id_to_bytes`` and ``hf.backend_tokenizer`` used when present).
    """

    __slots__ = ("tok", "_bytes", "_exact", "_backend", "_space")

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._bytes: dict[int, bytes] = {}
        self._space: dict[int, bool] = {}
        self._exact: Optional[bool] = None if hasattr(tokenizer, "id_to_bytes") else False
        self._backend = getattr(getattr(tokenizer, "hf", None), "backend_tokenizer", None)

    def piece(self, t: int) -> bytes:
        """Raw bytes of token ``t`` (cached)."""
        b = self._bytes.get(t)
        if b is None:
            b = self._bytes[t] = self.tok.id_to_bytes(t)
        return b

    def check(self, ids: Sequence[int], decoded: str) -> None:
        """Once: whether joined bytes reproduce ``decoded`` (the tokenizer's text of ``ids``)."""
        if self._exact is None:
            try:
                self._exact = self._join(ids) == decoded
            except Exception:  # noqa: BLE001 - an odd tokenizer: use its decode
                self._exact = False

    def _join(self, ids: Sequence[int]) -> str:
        piece = self.piece
        return b"".join([piece(t) for t in ids]).decode("utf-8", "replace")

    def text(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens as their text)."""
        if self._exact:
            return self._join(ids)
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def starts_word(self, t: int) -> bool:
        """Token ``t``'s text starts with whitespace (cached)."""
        ws = self._space.get(t)
        if ws is None:
            piece = self.piece(t) if self._exact else self.tok.decode([t], skip_special_tokens=False).encode()
            ws = self._space[t] = bool(piece) and piece[:1].isspace()
        return ws

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added): the Rust backend's encode when the
        tokenizer has one (the same ids, ~2x faster than the Python wrapper), else ``encode``."""
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return self.tok.encode(text)
