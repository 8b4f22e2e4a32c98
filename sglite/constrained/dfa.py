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

    Attributes (numpy, grown on demand): ``trans`` int32 [rows, 256] (rows cover every expanded state;
    read a state's row only after :meth:`expand`); ``expanded``/``acc``/``has_call``
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
        self._edge_states = frozenset(i for i, es in enumerate(nfa.edges) if es)
        self._call_states = frozenset(i for i, cs in enumerate(nfa.calls) if cs)
        self._fresh = False  # set when a step enters a counted region (a count starts at 0)
        self._partial: dict[tuple, int] = {}  # (state, byte class) -> state, rows not yet expanded
        self._shapes: dict[int, object] = {}  # state -> (relative members, base) or None
        self._shape_steps: dict[tuple, tuple] = {}  # (relative members, class) -> (relative result,) / ()
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
                    self._fresh = True
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
                            self._fresh = True
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
        bases = {m if type(m) is int else m[0] for m in members} if self.counted else members
        self.has_edges[sid] = not self._edge_states.isdisjoint(bases)
        if self.any_call:
            self.has_call[sid] = not self._call_states.isdisjoint(bases)
        return sid

    def _grow(self):
        cap = len(self.expanded) * 2
        for name in ("expanded", "acc", "has_call", "has_edges"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=bool)
            new[: len(old)] = old
            setattr(self, name, new)

    def _targets(self, sid: int) -> list:
        """Per byte class, the NFA configurations reached from state ``sid``."""
        targets: list[list] = [[] for _ in range(self.n_classes)]
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
        return targets

    def _byte_targets(self, sid: int, byte: int) -> list:
        """The NFA configurations reached from state ``sid`` by ``byte`` (one class of ``_targets``)."""
        out: list = []
        nfa = self.nfa
        if self.counted:
            entries = nfa.entries
            for cfg in self.sets[sid]:
                if type(cfg) is int:
                    for lo, hi, t in nfa.edges[cfg]:
                        if lo <= byte <= hi:
                            if t in entries:
                                self._fresh = True
                            out.append((t, (0,)) if t in entries else t)
                    continue
                s, ks = cfg
                ts = [t for lo, hi, t in nfa.edges[s] if lo <= byte <= hi]
                if ts:
                    out.extend(n for n in self._moves(s, ks, ts) if n is not None)
        else:
            for s in self.sets[sid]:
                for lo, hi, t in nfa.edges[s]:
                    if lo <= byte <= hi:
                        out.append(t)
        return out

    def expand(self, sid: int) -> None:
        """Fill row ``sid`` of ``trans`` (may create and append new states)."""
        if self.expanded[sid]:
            return
        row = np.zeros(self.n_classes, dtype=np.int32)
        for c, ts in enumerate(self._targets(sid)):
            if ts:
                hit = self._partial.get((sid, c))
                row[c] = hit if hit is not None else self._state(self.closure(ts))
        if sid >= len(self.trans):  # rows exist up to the largest expanded state only: states a
            trans = np.zeros((max(2 * len(self.trans), sid + 1), 256), dtype=np.int32)  # text walk
            trans[: len(self.trans)] = self.trans  # passes through cost no row
            self.trans = trans
        self.trans[sid] = row[self.byte_class]
        self.expanded[sid] = True

    # -- queries --------------------------------------------------------------------------------
    def step(self, sid: int, byte: int) -> int:
        """Next state after ``byte`` (DEAD if none)."""
        if self.expanded[sid]:
            return int(self.trans[sid, byte])
        # one class only: walking text through fresh states (e.g. a long counted string) must not
        # pay for every byte class of every state it passes
        c = int(self.byte_class[byte])
        key = (sid, c)
        t = self._partial.get(key)
        if t is None:
            shape = self._shape(sid) if self.counted else None
            if shape is not None:
                t = self._shifted_step(shape, c, byte)
            else:
                ts = self._byte_targets(sid, byte)
                t = self._state(self.closure(ts)) if ts else DEAD
            self._partial[key] = t
        return t

    def _shape(self, sid: int):
        """``(members with counts relative to their minimum, minimum)`` when state ``sid``'s step
        is translation-invariant in its counts, else None.

        That holds when every counted configuration sits in one region (no nesting) whose counter
        has no ``viable`` test, has reached ``lo`` and is at least 2 below ``hi``, and the step
        enters no region afresh (checked when the step is first built): then counts only meet
        ``+1`` and comparisons with each other, so states differing only by a common shift of
        their counts step to states differing by the same shift (one subset construction per
        shape, not one per count of a long bounded string).
        """
        hit = self._shapes.get(sid, False)
        if hit is False:
            hit = self._shapes[sid] = self._make_shape(self.sets[sid])
        return hit

    def _make_shape(self, members):
        nfa, base = self.nfa, None
        for cfg in members:
            if type(cfg) is int:
                continue
            s, ks = cfg
            c = nfa.counters[nfa.owner[s]]
            k = ks[0]
            if len(ks) != 1 or c.viable is not None or c.hi < 0 or k < c.lo or k < 2 or k + 2 > c.hi:
                return None
            base = k if base is None or k < base else base
        if base is None:
            return None
        return frozenset(m if type(m) is int else (m[0], (m[1][0] - base,)) for m in members), base

    def _shifted_step(self, shape, c: int, byte: int) -> int:
        rel, base = shape
        key = (rel, c)
        hit = self._shape_steps.get(key)
        if hit is None:  # first state of this shape: the real construction, kept relative if it can be
            self._fresh = False
            ts = self._byte_targets(self.index_of(rel, base), byte)
            members = self.closure(ts) if ts else None
            if members is None:
                hit = ()
            elif self._fresh:  # a count started at 0 does not shift with the others
                return self._state(members)
            else:
                nxt = self._make_shape(members)
                hit = ((frozenset(m if type(m) is int else (m[0], (m[1][0] - base,)) for m in members),)
                       + ((nxt[0], nxt[1] - base) if nxt is not None else (None, 0)))
            self._shape_steps[key] = hit
        if not hit:
            return DEAD
        t = self.index_of(hit[0], base)
        if hit[1] is not None and t not in self._shapes:  # the next step's shape, known already
            b = base + hit[2]
            self._shapes[t] = self._valid_shift(hit[1], b)
        return t

    def _valid_shift(self, rel: frozenset, base: int):
        """``(rel, base)`` if shifting ``rel`` by ``base`` keeps every count in the invariant range."""
        nfa = self.nfa
        for m in rel:
            if type(m) is not int:
                c, k = nfa.counters[nfa.owner[m[0]]], m[1][0] + base
                if k < c.lo or k < 2 or k + 2 > c.hi:
                    return None
        return rel, base

    def index_of(self, rel: frozenset, base: int) -> int:
        """State id of relative members ``rel`` shifted by ``base`` (created if new)."""
        return self._state(frozenset(m if type(m) is int else (m[0], (m[1][0] + base,)) for m in rel))

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
