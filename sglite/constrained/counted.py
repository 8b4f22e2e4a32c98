"""A regular language intersected with a large repetition count, without one product state per count.

``L(pattern) ∩ body{lo,hi}`` (a JSON string ``pattern``/``format`` with ``minLength``/``maxLength``:
``body`` is one JSON character) is built as the product of the pattern's DFA with the body's DFA,
where finishing one body iteration returns the body part to its start (a *boundary*), plus a
:class:`~.nfa.Counter` over that product: every byte leaving a boundary state starts an iteration and
increments the count. The product has ``|pattern| x |body|`` states whatever the bounds; the lazy DFA
carries the count (:mod:`.dfa`). It needs ``body`` to be a prefix code (no word of it is a proper
prefix of another, so iterations split uniquely): true of a JSON character, checked here.

A counted state must not be a dead end (a mask must never allow a token after which nothing can be
completed), so :meth:`CountedDFA.viable` answers "can this state still reach acceptance with a total
count in ``[lo, hi]``". The sets ``A_r`` of states that reach acceptance with exactly ``r`` more
iterations satisfy ``A_{r+1} = pre(A_r)``; as sets of a finite automaton they are eventually periodic
(the unary-language case of Chrobak, "Finite automata and unary languages", TCS 1986), so ``A_r`` is
computed until it repeats and every query is a prefix-sum lookup.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sglite.errors import GrammarError

from .fsm_ops import MAX_STATES, TableDFA, _trim, explore_pairs, from_node, table_into_nfa
from .nfa import Counter

MAX_PERIOD_STEPS = 1 << 15  # iterations of A_r searched for a repeat before giving up


@dataclass(eq=False)
class CountedDFA:
    """Product automaton plus count bounds; used as the payload of a ``("dfa", ...)`` AST node.

    Attributes:
        dfa: trimmed product :class:`~.fsm_ops.TableDFA` (bounds ignored), state 0 dead.
        boundary: bool [n], states where the next byte starts a counted iteration.
        lo, hi: bounds on the number of iterations (``hi = -1``: unbounded).
        cum: int32 [n, L + 1], prefix sums over ``r < L`` of ``state in A_r``.
        r0, period: ``A_r = A_{r0 + (r - r0) % period}`` for ``r >= r0`` (period 0: only ``r < L``
            can matter, because ``L > hi``).
    """

    dfa: TableDFA = field(repr=False)
    boundary: np.ndarray = field(repr=False)
    lo: int
    hi: int
    cum: np.ndarray = field(repr=False)
    r0: int
    period: int

    @property
    def nullable(self) -> bool:
        return self.lo == 0 and bool(self.dfa.acc[self.dfa.start])

    def _any(self, s: int, x: int, y: int | None) -> bool:
        """Whether ``s in A_r`` for some ``x <= r <= y`` (``y=None``: unbounded)."""
        cum, L, r0, p = self.cum[s], self.cum.shape[1] - 1, self.r0, self.period
        if y is not None and y < x:
            return False
        if x < L:
            top = L - 1 if y is None else min(y, L - 1)
            if cum[top + 1] > cum[x]:
                return True
            if p == 0 or (y is not None and y < L):
                return False
            x = L
        if p == 0:
            return False
        if y is None or y - x + 1 >= p:
            return bool(cum[L] > cum[r0])
        a, b = r0 + (x - r0) % p, r0 + (y - r0) % p
        if a <= b:
            return bool(cum[b + 1] > cum[a])
        return bool(cum[L] > cum[a] or cum[b + 1] > cum[r0])

    def viable(self, s: int, k: int) -> bool:
        """Whether product state ``s`` with ``k`` iterations started can still be accepted."""
        return self._any(s, max(self.lo - k, 0), None if self.hi < 0 else self.hi - k)

    def accepts(self, data: bytes) -> bool:
        """Reference membership test (tests and debugging): run the product and count."""
        s, k = self.dfa.start, 0
        for b in data:
            k += bool(self.boundary[s])
            s = int(self.dfa.trans[s, b])
            if s == 0 or (self.hi >= 0 and k > self.hi):
                return False
        return bool(self.dfa.acc[s]) and k >= self.lo


def count_intersect(pattern, body, lo: int, hi: int, what: str, max_states: int = MAX_STATES):
    """AST node for ``L(pattern) ∩ body{lo,hi}`` (``NOTHING`` when empty).

    Raises GrammarError when ``body`` is not a non-empty prefix code, when an automaton exceeds
    ``max_states`` states, or when the count sets do not repeat within ``MAX_PERIOD_STEPS``.
    """
    from . import ast as A

    p = from_node(pattern, what, max_states)
    b = from_node(body, what, max_states)
    if p is None or b is None:
        return A.NOTHING
    if b.acc[b.start] or b.trans[b.acc].any():
        raise GrammarError(f"{what}: the counted body is not a prefix code")
    trans, acc, boundary = _product(p, b, what, max_states)
    t = _trim(trans, acc, 1)
    if t is None:
        return A.NOTHING
    cum, r0, period = _count_sets(t, boundary, hi, what)
    out = CountedDFA(t, boundary, lo, hi, cum, r0, period)
    if not out.viable(t.start, 0):
        return A.NOTHING
    return ("dfa", out)


def _product(p: TableDFA, b: TableDFA, what: str, max_states: int):
    """Pairs (pattern state, body state); a finished body returns to the body's start state."""
    back = np.where(b.acc, b.start, np.arange(b.n)).astype(np.int64)  # accepting body state → start
    back[0] = 0

    def rows(sp, sb):
        tp, tb = p.trans[sp], back[b.trans[sb]]
        return tp, tb, (tp != 0) & (tb != 0)

    trans, pairs = explore_pairs((p.start, b.start), rows, b.n + 1, what, max_states)
    pp = np.array([q[0] for q in pairs])
    pb = np.array([q[1] for q in pairs])
    boundary = pb == b.start
    boundary[0] = False
    acc = p.acc[pp] & boundary
    return trans, acc, boundary


def _count_sets(t: TableDFA, boundary: np.ndarray, hi: int, what: str):
    """Prefix sums of ``A_r`` membership, and where the sequence ``A_r`` becomes periodic."""
    src, byte = np.nonzero(t.trans)
    pairs = np.unique(src.astype(np.int64) * t.n + t.trans[src, byte], return_inverse=False)
    src, dst = pairs // t.n, pairs % t.n
    counting = boundary[src]
    cs, cd, ns, nd = src[counting], dst[counting], src[~counting], dst[~counting]

    def finish_char(x):  # states that reach ``x`` without starting another iteration
        while True:
            y = x.copy()
            y[ns[x[nd]]] = True
            if (y == x).all():
                return y
            x = y

    a = finish_char(t.acc.copy())
    seen: dict = {}
    rows = []
    while True:
        key = a.tobytes()
        if key in seen:
            r0 = seen[key]
            period = len(rows) - r0
            break
        if hi >= 0 and len(rows) > hi:
            r0, period = len(rows), 0
            break
        if len(rows) >= MAX_PERIOD_STEPS:
            raise GrammarError(f"{what}: count bounds too irregular to track (no period within "
                               f"{MAX_PERIOD_STEPS} steps)")
        seen[key] = len(rows)
        rows.append(a)
        z = np.zeros_like(a)
        z[cs[a[cd]]] = True
        a = finish_char(z)
    good = np.stack(rows, axis=1)
    cum = np.zeros((t.n, len(rows) + 1), dtype=np.int32)
    cum[:, 1:] = np.cumsum(good, axis=1, dtype=np.int32)
    return cum, r0, period


def build_into(node, nfa, nxt: int) -> int:
    """Build a ``("dfa", CountedDFA)`` node into ``nfa`` as one counted region → entry state."""
    cd: CountedDFA = node[1]
    t = cd.dfa
    base = len(nfa.eps)
    ids = table_into_nfa(t, nfa, nxt)  # consecutive ids base .. base + t.n - 1
    nfa.add_counter(Counter(cd.lo, cd.hi, ids[t.start], base, base + t.n, cd.viable),
                    [ids[s] for s in np.flatnonzero(cd.boundary).tolist()])
    return ids[t.start]
