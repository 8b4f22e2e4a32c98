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
"""
from __future__ import annotations

from dataclasses import dataclass

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

    def find(self, tail: str, want_chars: int, candidates: int = 1) -> list[TextMatch]:
        """Up to ``candidates`` occurrences of the longest suffix of ``tail`` with distinct
        continuations (their first 4 characters), word-aligned ones first, latest first within
        each group; ``want_chars`` characters of continuation each. Empty when nothing matches."""
        n = self.longest_suffix(tail)
        if n == 0 or want_chars < 1:
            return []
        key, src = tail[-n:], self.source
        tail_aligned = n == len(tail) or not tail[-n - 1].isalnum()
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
