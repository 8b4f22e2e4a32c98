"""Token masks of single pushdown stacks, cached on the part of the stack that decides them.

A stack is a tuple of ``(rule, dfa_state)`` frames, bottom first (see :mod:`.compiled`). Its mask is

* the tokens the top frame's DFA consumes entirely (the per-``(rule, state)`` vocabulary walk of
  :mod:`.token_walk`, DESIGN §5 lead 4: decided without the parser), plus
* the *boundary* tokens that pass a rule boundary mid-token (a call, or a point where the top rule
  may return), which are run through the pushdown step here, vectorized: all of them walk the top
  DFA together as rows of the length-sorted byte matrix (each row at its own byte offset), and at
  every boundary state the rows there fork into a recursive walk of the callee (push) or the parent
  frame (pop). Rows that reach their last byte on some branch are allowed.

The walk records the deepest original frame it read. The mask only depends on that suffix of the
stack (plus, if it tried to pop the bottom frame, on the stack being exactly that), so it is cached
under that suffix (DESIGN §5 lead 3): a JSON value nested 20 deep is decided by the same two or
three top frames as one nested twice, and costs a lookup. This is the context-dependent /
context-independent token split of XGrammar (Dong et al., "XGrammar: Flexible and Efficient
Structured Generation Engine for Large Language Models", 2024, §3.1), with a suffix-keyed cache
in place of XGrammar's persistent stack.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .dfa import DEAD
from .token_walk import pack_ids


class StackMasker:
    """Per-stack packed masks for one compiled pushdown grammar (not thread-safe: caller locks).

    Args:
        dfas: rule name → :class:`~sglite.constrained.dfa.LazyDFA`.
        vocab: the tokenizer's :class:`~sglite.constrained.tokenizer_info.SortedVocab`.
        walk: ``walk(rule, state, may_return) -> WalkResult`` (cached by the caller).
        words: int32 words per mask row, ``ceil(V / 32)``.
        max_depth: pushes beyond this stack depth are refused (as the matcher's closure does).
        max_cache: cached stack masks (least recently used dropped first).
    """

    def __init__(self, dfas: dict, vocab, walk, words: int, max_depth: int, max_cache: int = 16384):
        self.dfas, self.vocab, self.walk, self.words = dfas, vocab, walk, words
        self.max_depth, self.max_cache = max_depth, max_cache
        self._alive: dict = {}
        self._cache: OrderedDict = OrderedDict()

    # -- public -----------------------------------------------------------------------------------
    def mask(self, stack: tuple) -> np.ndarray:
        """Packed int32 [words] mask of the tokens ``stack`` accepts (EOS not included).

        The result is cached and shared: do not modify it.
        """
        hit = self._lookup(stack)
        if hit is not None:
            return hit
        rule, d = stack[-1]
        key = (rule, d, len(stack) > 1)
        w = self.walk(*key)
        out = self._alive.get(key)
        if out is None:
            out = pack_ids(w.alive_ids, self.words)
            self._alive[key] = out
        touched = [len(stack) - 1 if len(stack) > 1 else -1]  # a bottom frame may not return
        if len(w.uncertain_rows):
            rows = w.uncertain_rows
            ok = self._resolve(stack, len(stack), rows, np.zeros(len(rows), dtype=np.int64), False,
                               touched, frozenset())
            if ok.any():
                out = out | pack_ids(self.vocab.ids[rows[ok]], self.words)
        m = touched[0]
        self._store((True, stack) if m < 0 else (False, stack[m:]), out)
        return out

    # -- cache ------------------------------------------------------------------------------------
    def _lookup(self, stack):
        cache, n = self._cache, len(stack)
        for k in range(1, n + 1):
            hit = cache.get((False, stack[n - k:]))
            if hit is not None:
                return hit
        return cache.get((True, stack))

    def _store(self, key, value):
        self._cache[key] = value
        if len(self._cache) > self.max_cache:
            self._cache.popitem(last=False)

    # -- the vectorized pushdown walk -------------------------------------------------------------
    def _resolve(self, stack, orig, rows, offs, branch0, touched, chain) -> np.ndarray:
        """Which rows (vocab matrix rows, bytes from ``offs`` on) ``stack`` can consume entirely.

        Args:
            stack: frames, bottom first; the top is the frame that consumes the next byte.
            orig: how many bottom frames are the caller's original, unmodified frames (reads of
                them are recorded in ``touched[0]``, the lowest original index read; -1 = "nothing
                below the bottom" was read).
            rows / offs: int64 [n] matrix rows and their current byte offsets.
            branch0: also take boundary moves before the first byte (false for the caller's stack,
                whose closure already holds those moves as separate stacks).
            chain: stacks reached without consuming a byte since the last byte (cycle guard).
        Returns:
            bool [n]: row accepted on some branch.
        """
        vocab, dfas = self.vocab, self.dfas
        rule, d = stack[-1]
        dfa = dfas[rule]
        n = len(rows)
        ok = np.zeros(n, dtype=bool)
        pos = np.arange(n)
        cur = np.full(n, d, dtype=np.int32)
        lens = vocab.lengths[rows]
        j = 0
        while len(pos):
            o = offs[pos] + j
            done = o >= lens[pos]
            if done.any():
                ok[pos[done]] = True
                keep = ~done
                pos, cur, o = pos[keep], cur[keep], o[keep]
                if not len(pos):
                    break
            need = ~dfa.expanded[cur]
            if need.any():
                for s in np.unique(cur[need]):
                    dfa.expand(int(s))
            if j > 0 or branch0:
                bnd = dfa.acc[cur] | dfa.has_call[cur]
                if bnd.any():
                    sub_chain = (chain if j == 0 else frozenset())
                    for s in np.unique(cur[bnd]).tolist():
                        sel = pos[cur == s]
                        got = self._boundary(stack, orig, dfa, rule, s, rows[sel], offs[sel] + j,
                                             touched, sub_chain)
                        if got.any():
                            ok[sel[got]] = True
                    left = ~ok[pos]
                    pos, cur, o = pos[left], cur[left], o[left]
                    if not len(pos):
                        break
            cur = dfa.trans[cur, vocab.matrix[rows[pos], o]]
            alive = cur != DEAD
            pos, cur = pos[alive], cur[alive]
            j += 1
        return ok

    def _boundary(self, stack, orig, dfa, rule, s, rows, offs, touched, chain) -> np.ndarray:
        """Rows at boundary state ``s`` of the top rule: try returning and calling."""
        got = np.zeros(len(rows), dtype=bool)
        depth = len(stack)
        if dfa.acc[s]:
            below = depth - 2
            if below < orig and below < touched[0]:
                touched[0] = below
            if depth > 1:
                parent = stack[:-1]
                if parent not in chain:
                    got |= self._resolve(parent, min(orig, depth - 1), rows, offs, True, touched,
                                         chain | {parent})
        if dfa.has_call[s] and depth < self.max_depth:
            base = stack[:-1]
            for callee, resume in dfa.calls(s):
                todo = ~got
                if not todo.any():
                    break
                pushed = base + ((rule, resume), (callee, self.dfas[callee].start))
                if pushed in chain:
                    continue
                got[todo] |= self._resolve(pushed, min(orig, depth - 1), rows[todo], offs[todo], True,
                                           touched, chain | {pushed})
        return got
