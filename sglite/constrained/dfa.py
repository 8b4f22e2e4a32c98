"""Lazy subset construction: a byte DFA over one rule's NFA, materialized state by state.

A DFA state is the epsilon-closure of a set of NFA states, kept to its "important" members (states
with byte or call edges, and the final state). Rows of the transition table ``trans[state, byte]``
(``int32 [capacity, 256]``, state 0 = dead, a sink) are filled on first use (``expand``), so a
counted repetition like ``.{0,2000}`` costs only the states a generation actually reaches (the lazy
DFA of RE2 / regex-automata; Russ Cox, "Regular Expression Matching in the Wild", 2010).
Bytes are grouped into equivalence classes from the NFA's edge boundaries so a row costs
O(classes), not O(256).

When the NFA has counted regions (:class:`~.nfa.Counter`), a member of a DFA state is a
*configuration*: a plain NFA state outside every region, else ``(state, counts)`` with one count per
enclosing region, outermost first. Counts are pushed on entering a region, checked and popped on
leaving it, incremented on the region's ``inc`` edges; among configurations that differ only in the
innermost count, those with a count ``>= lo`` keep only the smallest (its language contains the
others'), so an ambiguous or nullable body does not multiply configurations.
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
        self.counted = bool(nfa.counters)
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
        seed = (start, (0,)) if start in nfa.entries else start
        self.start = self._state(self.closure((seed,)))

    # -- counted configurations -----------------------------------------------------------------
    def _moves(self, s: int, ks: tuple, ts) -> list:
        """Configurations reached from the in-region configuration ``(s, ks)`` by edges to the NFA
        states ``ts`` (None where a counter refuses the edge)."""
        nfa = self.nfa
        c = nfa.counters[nfa.owner[s]]
        k, head = ks[-1], ks[:-1]
        ks_in = ks
        if s in nfa.inc:
            k1 = k + 1
            if c.hi >= 0:
                ks_in = None if k1 > c.hi else head + (k1,)
            else:
                ks_in = head + (min(k1, c.lo),)
        ks_out = head if k >= c.lo else None  # leaving the region needs at least lo iterations
        entries, counters, lo_r, hi_r = nfa.entries, nfa.counters, c.start, c.stop
        out = []
        for t in ts:
            base = ks_in if lo_r <= t < hi_r else ks_out
            if base is not None:
                e = entries.get(t)
                if e is not None and not counters[e].start <= s < counters[e].stop:
                    base = base + (0,)  # entering an inner (or next) region
                out.append((t, base) if base else t)
            else:
                out.append(None)
        return out

    def _counted_closure(self, key: frozenset) -> frozenset:
        nfa, alive, final = self.nfa, self.alive, self.final
        owner, counters = nfa.owner, nfa.counters
        seen, keep, best, entries = set(key), [], {}, nfa.entries
        plain = list(key)
        stack = [c for c in plain if type(c) is not int]
        if stack:
            plain = [c for c in plain if type(c) is int]
        while stack or plain:
            while plain:  # outside every counted region: the plain subset construction
                s = plain.pop()
                if (nfa.edges[s] or nfa.calls[s] or s == final) and (alive is None or s in alive):
                    keep.append(s)
                for t in nfa.eps[s]:
                    if t not in seen:
                        seen.add(t)  # an entry state never occurs as a plain configuration
                        if t in entries:
                            t = (t, (0,))
                            if t not in seen:
                                seen.add(t)
                                stack.append(t)
                        else:
                            plain.append(t)
            if not stack:
                break
            cfg = stack.pop()
            s, ks = cfg
            o = owner[s]
            c = counters[o] if o >= 0 else None
            if c is not None and ks[-1] >= c.lo:
                bkey = (s, ks[:-1])
                b = best.get(bkey)
                if b is not None and b < ks[-1]:
                    continue  # subsumed by the same state with a smaller count
                best[bkey] = ks[-1]
            if ((nfa.edges[s] or nfa.calls[s] or s == final) and (alive is None or s in alive)
                    and (c is None or c.viable is None or c.viable(s - c.start, ks[-1]))):
                keep.append(cfg)
            for n in self._moves(s, ks, nfa.eps[s]):
                if n is not None and n not in seen:
                    seen.add(n)
                    (plain if type(n) is int else stack).append(n)
        out = []
        for cfg in keep:
            if type(cfg) is not int:
                s, ks = cfg
                c = counters[owner[s]]
                if ks[-1] >= c.lo and best[(s, ks[:-1])] < ks[-1]:
                    continue
            out.append(cfg)
        return frozenset(out)

    # -- construction -------------------------------------------------------------------------
    def closure(self, seeds) -> frozenset:
        key = frozenset(seeds)
        hit = self._closure_memo.get(key)
        if hit is not None:
            return hit
        if self.counted:
            out = self._counted_closure(key)
            self._closure_memo[key] = out
            return out
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
        bases = (m if type(m) is int else m[0] for m in members) if self.counted else members
        self.has_edges[sid] = any(self.nfa.edges[s] for s in bases)
        if self.any_call:
            bases = (m if type(m) is int else m[0] for m in members) if self.counted else members
            self.has_call[sid] = any(self.nfa.calls[s] for s in bases)
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
        if self.counted:
            entries = self.nfa.entries
            for cfg in self.sets[sid]:
                if type(cfg) is int:  # outside every counted region
                    for lo, hi, t in self.nfa.edges[cfg]:
                        n = (t, (0,)) if t in entries else t
                        for c in range(cls[lo], cls[hi] + 1):
                            targets[c].append(n)
                    continue
                s, ks = cfg
                edges = self.nfa.edges[s]
                for (lo, hi, _), n in zip(edges, self._moves(s, ks, [t for _, _, t in edges])):
                    if n is not None:
                        for c in range(cls[lo], cls[hi] + 1):
                            targets[c].append(n)
        else:
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
            out = []
            for cfg in self.sets[sid]:
                s, ks = (cfg, ()) if type(cfg) is int else cfg
                for rule, t in self.nfa.calls[s]:
                    if self.alive is None or t in self.alive:
                        if ks:
                            n = self._moves(s, ks, (t,))[0]
                        else:
                            n = (t, (0,)) if t in self.nfa.entries else t
                        if n is not None:
                            out.append((rule, self._state(self.closure((n,)))))
            self._calls[sid] = out
        return out

    def live_bytes(self, sid: int) -> np.ndarray:
        """Bytes (int array) with a non-dead transition from ``sid``."""
        if not self.expanded[sid]:
            self.expand(sid)
        return np.nonzero(self.trans[sid])[0]
