"""Boolean operations on regular sub-languages: AST → explicit byte DFA, intersection, difference,
and back into the grammar as a ``("dfa", TableDFA)`` AST node (built into the NFA state by state).

Used where a JSON Schema combines two regular constraints on one string (``pattern`` with
``minLength``/``maxLength``, ``pattern`` with ``format``) and for ``patternProperties`` keys ("matches
these patterns and not those, and is none of the declared names"). The product construction is the
textbook one (Rabin & Scott 1959; Hopcroft & Ullman, *Introduction to Automata Theory*, §3.2);
difference runs the second automaton as a complement, its dead state meaning "accept from here on".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglite.errors import GrammarError

MAX_STATES = 200_000


@dataclass(eq=False)
class TableDFA:
    """Explicit byte DFA. ``trans`` int32 [n, 256] (state 0 = dead), ``acc`` bool [n], ``start``.

    Every live state can reach an accepting state (trimmed)."""

    trans: np.ndarray
    acc: np.ndarray
    start: int

    @property
    def n(self) -> int:
        return len(self.acc)

    @property
    def nullable(self) -> bool:
        """Whether the empty string is in the language."""
        return bool(self.acc[self.start])

    def accepts(self, data: bytes) -> bool:
        s = self.start
        for b in data:
            s = int(self.trans[s, b])
            if s == 0:
                return False
        return bool(self.acc[s])


def from_node(node, what: str, max_states: int = MAX_STATES) -> TableDFA:
    """Explicit DFA of a rule-free AST node. Raises GrammarError above ``max_states`` states."""
    from .dfa import LazyDFA
    from .grammar import coreachable
    from .nfa import NFA

    nfa = NFA(max_states * 4)
    final = nfa.new()
    start = nfa.build(node, final)
    if any(nfa.calls):
        raise GrammarError(f"{what}: a rule reference cannot be intersected")
    dfa = LazyDFA(nfa, start, final, coreachable(nfa, final))
    seen, todo = {dfa.start}, [dfa.start]
    while todo:
        s = todo.pop()
        dfa.expand(s)
        if len(dfa.sets) > max_states:
            raise GrammarError(f"{what}: more than {max_states} automaton states")
        for t in np.unique(dfa.trans[s]).tolist():
            if t and t not in seen:
                seen.add(t)
                todo.append(t)
    n = len(dfa.sets)
    return _trim(dfa.trans[:n].copy(), dfa.acc[:n].copy(), dfa.start)


def explore_pairs(start: tuple, rows, nb: int, what: str, max_states: int):
    """Subset-free product exploration: states are pairs reachable from ``start``.

    ``rows(x, y)`` gives the successor arrays ``(tx, ty)`` ([256] int each) and a [256] bool
    ``live`` mask for pair (x, y); pair ids are 1-based (0 = dead), second components < ``nb``.
    Returns (trans int32 [n, 256], pairs list of (x, y), index 0 = the dead pair).
    Raises GrammarError past ``max_states`` pairs.
    """
    index = {start: 1}
    pairs = [(0, 0), start]
    todo = [1]
    out_rows: dict = {}
    while todo:
        k = todo.pop()
        tx, ty, live = rows(*pairs[k])
        row = np.zeros(256, dtype=np.int32)
        if live.any():
            keys = tx[live].astype(np.int64) * nb + ty[live]
            uniq, inv = np.unique(keys, return_inverse=True)
            ids = np.empty(len(uniq), dtype=np.int32)
            for i, key in enumerate(uniq.tolist()):
                p = (key // nb, key % nb)
                j = index.get(p)
                if j is None:
                    j = len(pairs)
                    if j > max_states:
                        raise GrammarError(f"{what}: more than {max_states} automaton states")
                    index[p] = j
                    pairs.append(p)
                    todo.append(j)
                ids[i] = j
            row[live] = ids[inv]
        out_rows[k] = row
    trans = np.zeros((len(pairs), 256), dtype=np.int32)
    for k, row in out_rows.items():
        trans[k] = row
    return trans, pairs


def product(a: TableDFA, b: TableDFA, negate_b: bool, what: str, max_states: int = MAX_STATES):
    """L(a) ∩ L(b), or L(a) \\ L(b) when ``negate_b``; None when empty."""
    zero = np.zeros(256, dtype=np.int32)

    def rows(sa, sb):
        ta = a.trans[sa]
        tb = b.trans[sb] if sb else zero
        return ta, tb, (ta != 0 if negate_b else (ta != 0) & (tb != 0))

    trans, pairs = explore_pairs((a.start, b.start), rows, b.n + 1, what, max_states)
    n = len(pairs)
    pa = np.array([p[0] for p in pairs])
    pb = np.array([p[1] for p in pairs])
    b_acc = np.concatenate([[False], b.acc[1:]])[pb] if b.n else np.zeros(n, dtype=bool)
    acc = a.acc[pa] & (~b_acc if negate_b else b_acc)
    acc[0] = False
    return _trim(trans, acc, 1)


def _trim(trans: np.ndarray, acc: np.ndarray, start: int):
    """Drop states that cannot reach acceptance (transitions into them become dead)."""
    n = len(acc)
    rev: list[list[int]] = [[] for _ in range(n)]
    src, byte = np.nonzero(trans)
    for s, t in set(zip(src.tolist(), trans[src, byte].tolist())):
        rev[t].append(s)
    good = np.zeros(n, dtype=bool)
    stack = np.nonzero(acc)[0].tolist()
    good[stack] = True
    while stack:
        for s in rev[stack.pop()]:
            if not good[s]:
                good[s] = True
                stack.append(s)
    good[0] = False
    if not good[start]:
        return None
    trans = np.where(good[trans], trans, 0).astype(np.int32)
    return TableDFA(trans, acc & good, start)


def intersect_nodes(a, b, what: str):
    """AST node for L(a) ∩ L(b) (``NOTHING`` when empty).

    When ``b`` is a repetition whose bound exceeds the NFA's unroll limit (a large ``maxLength``),
    the result is a counted product (:mod:`.counted`) whose size does not grow with the bound."""
    from . import ast as A
    from .nfa import UNROLL_LIMIT

    if b[0] == "rep" and max(b[2], b[3]) > UNROLL_LIMIT:
        from .counted import count_intersect

        try:
            return count_intersect(a, b[1], b[2], b[3], what)
        except GrammarError:
            pass  # body not a prefix code or irregular counts: the explicit product may still fit
    out = product(from_node(a, what), from_node(b, what), False, what)
    return A.NOTHING if out is None else ("dfa", out)


def nfa_states(node, nfa, nxt: int) -> int:
    """Build a ``("dfa", TableDFA)`` node into ``nfa`` (one NFA state per DFA state) → entry state.
    A ``CountedDFA`` payload (:mod:`.counted`) becomes a counted region."""
    t = node[1]
    if not isinstance(t, TableDFA):
        from .counted import build_into

        return build_into(node, nfa, nxt)
    return table_into_nfa(t, nfa, nxt)[t.start]


def table_into_nfa(t: TableDFA, nfa, nxt: int) -> list:
    """Add one NFA state per state of ``t`` (byte-range edges; accepting states step to ``nxt``).
    Returns the new NFA state ids, indexed by ``t``'s state."""
    ids = [nfa.new() for _ in range(t.n)]
    for s in range(1, t.n):
        row = t.trans[s]
        cuts = np.flatnonzero(np.diff(row)) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts - 1, [255]])
        for lo, hi in zip(starts.tolist(), ends.tolist()):
            tgt = int(row[lo])
            if tgt:
                nfa.edges[ids[s]].append((lo, hi, ids[tgt]))
        if t.acc[s]:
            nfa.eps[ids[s]].append(nxt)
    return ids
