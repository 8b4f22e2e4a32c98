"""Lazy subset construction: a byte DFA over one rule's NFA, materialized state by state.

A DFA state is the epsilon-closure of a set of NFA states, kept to its "important" members (states
with byte or call edges, and the final state). Rows of the transition table ``trans[state, byte]``
(``int32 [capacity, 256]``, state 0 = dead, a sink) are filled on first use (``expand``), so a
counted repetition like ``.{0,2000}`` costs only the states a generation actually reaches (the lazy
DFA of RE2 / regex-automata; Russ Cox, "Regular Expression Matching in the Wild", 2010).
Bytes are grouped into equivalence classes from the NFA's edge boundaries so a row costs
O(classes), not O(256).
"""
from __future__ import annotations

import numpy as np

from .nfa import NFA

DEAD = 0


class LazyDFA:
    """Deterministic view of ``nfa`` from ``start`` with accepting NFA state ``final``.

    Attributes (numpy, grown on demand): ``trans`` int32 [cap, 256]; ``expanded``/``acc``/``has_call``
    bool [cap]; ``has_edges`` bool [cap]. Not thread-safe: expand from one thread at a time (the matcher's thread).
    """

    def __init__(self, nfa: NFA, start: int, final: int, alive: set | None = None):
        self.nfa, self.final = nfa, final
        self.alive = alive
        self.any_call = any(nfa.calls)
        bounds = {0, 256}
        for es in nfa.edges:
            for lo, hi, _ in es:
                bounds.add(lo)
                bounds.add(hi + 1)
        self.bounds = np.array(sorted(bounds), dtype=np.int64)
        self.byte_class = (np.searchsorted(self.bounds, np.arange(256), side="right") - 1).astype(np.int64)
        self.n_classes = len(self.bounds) - 1
        self._closure_memo: dict = {}
        self.sets: list[frozenset] = []
        self.index: dict[frozenset, int] = {}
        cap = 64
        self.trans = np.zeros((cap, 256), dtype=np.int32)
        self.expanded = np.zeros(cap, dtype=bool)
        self.acc = np.zeros(cap, dtype=bool)
        self.has_call = np.zeros(cap, dtype=bool)
        self.has_edges = np.zeros(cap, dtype=bool)
        self._calls: dict[int, list] = {}
        self._state(frozenset())
        self.expanded[DEAD] = True
        self.start = self._state(self.closure((start,)))

    # -- construction -------------------------------------------------------------------------
    def closure(self, seeds) -> frozenset:
        key = frozenset(seeds)
        hit = self._closure_memo.get(key)
        if hit is not None:
            return hit
        nfa, alive, seen, stack, keep = self.nfa, self.alive, set(key), list(key), []
        while stack:
            s = stack.pop()
            if (nfa.edges[s] or nfa.calls[s] or s == self.final) and (alive is None or s in alive):
                keep.append(s)
            for t in nfa.eps[s]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        out = frozenset(keep)
        self._closure_memo[key] = out
        return out

    def _state(self, members: frozenset) -> int:
        sid = self.index.get(members)
        if sid is not None:
            return sid
        sid = len(self.sets)
        if sid >= len(self.expanded):
            self._grow()
        self.sets.append(members)
        self.index[members] = sid
        self.acc[sid] = self.final in members
        self.has_call[sid] = any(self.nfa.calls[s] for s in members)
        self.has_edges[sid] = any(self.nfa.edges[s] for s in members)
        return sid

    def _grow(self):
        cap = len(self.expanded) * 2
        trans = np.zeros((cap, 256), dtype=np.int32)
        trans[: len(self.trans)] = self.trans
        self.trans = trans
        for name in ("expanded", "acc", "has_call", "has_edges"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=bool)
            new[: len(old)] = old
            setattr(self, name, new)

    def expand(self, sid: int) -> None:
        """Fill row ``sid`` of ``trans`` (may create and append new states)."""
        if self.expanded[sid]:
            return
        targets: list[list[int]] = [[] for _ in range(self.n_classes)]
        cls = self.byte_class
        for s in self.sets[sid]:
            for lo, hi, t in self.nfa.edges[s]:
                for c in range(cls[lo], cls[hi] + 1):
                    targets[c].append(t)
        row = np.zeros(self.n_classes, dtype=np.int32)
        for c, ts in enumerate(targets):
            if ts:
                row[c] = self._state(self.closure(ts))
        self.trans[sid] = row[cls]
        self.expanded[sid] = True

    # -- queries --------------------------------------------------------------------------------
    def step(self, sid: int, byte: int) -> int:
        """Next state after ``byte`` (DEAD if none)."""
        if not self.expanded[sid]:
            self.expand(sid)
        return int(self.trans[sid, byte])

    def calls(self, sid: int) -> list:
        """``[(rule_name, resume_state)]`` call edges leaving state ``sid``."""
        out = self._calls.get(sid)
        if out is None:
            out = [(rule, self._state(self.closure((t,))))
                   for s in self.sets[sid] for rule, t in self.nfa.calls[s]
                   if self.alive is None or t in self.alive]
            self._calls[sid] = out
        return out

    def live_bytes(self, sid: int) -> np.ndarray:
        """Bytes (int array) with a non-dead transition from ``sid``."""
        if not self.expanded[sid]:
            self.expand(sid)
        return np.nonzero(self.trans[sid])[0]
