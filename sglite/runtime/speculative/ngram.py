"""N-gram (prompt lookup) drafts: continue the sequence the way it continued before.

The last ``n`` tokens of a request (``n`` from ``max_n`` down to ``min_n``) are looked up among
the earlier positions of its own prompt and output; the tokens that followed the most recent
earlier occurrences are the draft (Saxena 2023, "Prompt Lookup Decoding"; SGLang's ``NGRAM``
algorithm). Copy-heavy requests (edit a paragraph, extract fields, quote code) repeat long spans
of the prompt, so such drafts are often accepted whole; with no match there is no draft and the
step is an ordinary decode.
"""
from __future__ import annotations

from typing import Sequence

MIN_N, MAX_N = 1, 4  # n-gram lengths tried, longest first
MAX_POSITIONS = 8  # end positions remembered per n-gram (most recent kept)


class NgramIndex:
    """Incremental index of one request's sequence: n-gram → the positions where it ended.

    ``extend(tokens)`` indexes newly known tokens (prompt, then outputs as they are committed);
    :meth:`propose` returns draft continuations of the current end. Memory is O(len x (MAX_N -
    MIN_N + 1)) small tuples; a lookup is O(MAX_N).
    """

    __slots__ = ("seq", "_index")

    def __init__(self, tokens: Sequence[int] = ()):
        self.seq: list[int] = []
        self._index: dict[tuple, list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the indexed sequence."""
        seq, index = self.seq, self._index
        for t in tokens:
            seq.append(int(t))
            end = len(seq) - 1
            for n in range(MIN_N, MAX_N + 1):
                if end + 1 < n:
                    break
                key = tuple(seq[end + 1 - n:])
                pos = index.get(key)
                if pos is None:
                    index[key] = [end]
                else:
                    pos.append(end)
                    if len(pos) > MAX_POSITIONS:
                        del pos[0]

    def sync(self, seq_len: int, tokens_from) -> None:
        """Index the tokens between what is indexed and ``seq_len`` (``tokens_from(a, b)`` gives
        ``seq[a:b]``)."""
        if seq_len > len(self.seq):
            self.extend(tokens_from(len(self.seq), seq_len))

    def propose(self, k: int, candidates: int = 1) -> list[list[int]]:
        """Up to ``candidates`` distinct draft continuations of at most ``k`` tokens each, longest
        matching n-gram first, most recent occurrence first within one n. Empty when nothing
        matches (or ``k`` < 1)."""
        return [c for c, _ in self.propose_with_match(k, candidates)]

    def propose_with_match(self, k: int, candidates: int = 1) -> list[tuple[list[int], int]]:
        """Like :meth:`propose`, each continuation with the length ``n`` of the n-gram it matched
        (a longer match is a better predictor)."""
        seq, out = self.seq, []
        L = len(seq)
        if k < 1 or L < MIN_N + 1:
            return out
        seen = set()
        for n in range(min(MAX_N, L - 1), MIN_N - 1, -1):
            ends = self._index.get(tuple(seq[L - n:]))
            if not ends:
                continue
            for end in reversed(ends):
                if end >= L - 1:  # the current end itself
                    continue
                cont = seq[end + 1:end + 1 + k]
                if not cont or cont[0] in seen:
                    continue
                seen.add(cont[0])
                out.append((cont, n))
                if len(out) >= candidates:
                    return out
        return out
