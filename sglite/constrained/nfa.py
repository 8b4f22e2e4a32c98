"""Grammar AST → byte-level NFA (Thompson construction in continuation-passing style).

``build(node, nxt)`` returns a state from which matching ``node`` leads to ``nxt``; it is memoized
on ``(id(node), nxt)``, so a sub-tree shared by several alternatives with the same continuation is
built once (object suffixes of JSON schemas stay linear). Code point sets are compiled to UTF-8
byte-range sequences (Unicode Standard §3.9 Table 3-7; the split is the one used by RE2 and
Rust's ``regex-syntax`` ``Utf8Sequences``), so a multi-byte character may be split across tokens.
``("ref", name)`` nodes become *call edges* (``calls[state] = [(rule, resume_state)]``), used by the
pushdown matcher for recursive rules.

Counted repetitions with a large bound (``body{lo,hi}`` with ``max(lo, hi) > UNROLL_LIMIT``) are not
unrolled: the body is built once as a loop through a *hub* state, and a :class:`Counter` records the
bounds. The stored graph is then the over-approximation ``body*`` (what reachability analyses see);
the lazy DFA (:mod:`.dfa`) enforces the bounds by carrying a count next to the states of the loop's
*region*. This is the counter automaton of Turoňová, Holík, Lengál et al., "Regex matching with
counting-set automata" (OOPSLA 2020), in its simplest (one count per configuration) form, and the
way RE2/regex-automata keep ``{n,m}`` from multiplying NFA states; memory does not grow with the bound.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sglite.errors import GrammarError

from .ast import intersect

UNROLL_LIMIT = 64  # counted repetitions up to this bound are unrolled (one body copy per repetition)

_UTF8_LENGTHS = ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, 0x10FFFF))
_NO_SURROGATES = ((0, 0xD7FF), (0xE000, 0x10FFFF))


def _encode(cp: int) -> bytes:
    return chr(cp).encode("utf-8")


def _split(a: int, b: int, out: list):
    n = len(_encode(a))
    if n == 1:
        out.append(((a, b),))
        return
    for i in range(1, n):
        m = (1 << (6 * i)) - 1
        if (a & ~m) != (b & ~m):
            if a & m:
                _split(a, a | m, out)
                _split((a | m) + 1, b, out)
                return
            if (b & m) != m:
                _split(a, (b & ~m) - 1, out)
                _split(b & ~m, b, out)
                return
    out.append(tuple(zip(_encode(a), _encode(b))))


def utf8_sequences(intervals) -> list:
    """Byte-range sequences (tuples of ``(lo, hi)``) whose union encodes exactly the code points."""
    out: list = []
    for lo, hi in intersect(intervals, _NO_SURROGATES):
        for a, b in _UTF8_LENGTHS:
            x, y = max(lo, a), min(hi, b)
            if x <= y:
                _split(x, y, out)
    return out


@dataclass
class Counter:
    """Bounds of one counted region of an :class:`NFA` (see the module docstring).

    The region is the state range ``[start, stop)``; it is entered only at ``entry`` (a count of 0
    is pushed there) and left only by edges to states outside the range, allowed when the count is
    ``>= lo``. Every edge of an ``inc`` state that stays in the region adds 1 to the count, refused
    above ``hi`` (``hi = -1``: unbounded, counts saturate at ``lo``). ``viable(local_state, count)``,
    when set, says whether an accepting exit is still reachable (for regions whose body is not a
    hub loop, see :mod:`.counted`); ``local_state = state - start``.
    """

    lo: int
    hi: int
    entry: int
    start: int
    stop: int
    viable: object = field(default=None, repr=False)


def nullable(node, memo: dict | None = None) -> bool:
    """Whether ``node`` matches the empty string without a call (a ``ref`` counts as non-empty)."""
    memo = {} if memo is None else memo
    hit = memo.get(id(node))
    if hit is not None and hit[0] is node:
        return hit[1]
    kind = node[0]
    if kind == "lit":
        out = not node[1]
    elif kind in ("cset", "bset", "ref"):
        out = False
    elif kind == "seq":
        out = all(nullable(c, memo) for c in node[1])
    elif kind == "alt":
        out = any(nullable(c, memo) for c in node[1])
    elif kind == "rep":
        out = node[2] == 0 or nullable(node[1], memo)
    elif kind == "dfa":
        out = node[1].nullable
    else:
        raise AssertionError(f"unknown AST node {kind!r}")
    memo[id(node)] = (node, out)
    return out


class NFA:
    """Byte NFA with epsilon, byte-range and call edges. States are ints; mutated only while building.

    ``counters`` lists the counted regions (:class:`Counter`); ``owner[state]`` is the index of the
    innermost counter whose region holds the state (-1: none), ``inc`` the states whose in-region
    edges increment it, ``entries`` maps a region's entry state to its counter index.
    Raises GrammarError when it would exceed ``max_states`` states.
    """

    def __init__(self, max_states: int = 250_000, unroll_limit: int = UNROLL_LIMIT):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []
        self.calls: list[list[tuple[str, int]]] = []
        self.owner: list[int] = []
        self.counters: list[Counter] = []
        self.inc: set[int] = set()
        self.entries: dict[int, int] = {}
        self.max_states = max_states
        self.unroll_limit = unroll_limit
        self._memo: dict = {}
        self._nullable: dict = {}

    def new(self) -> int:
        if len(self.eps) >= self.max_states:
            raise GrammarError(f"grammar too large: more than {self.max_states} automaton states")
        self.eps.append([])
        self.edges.append([])
        self.calls.append([])
        self.owner.append(-1)
        return len(self.eps) - 1

    def add_counter(self, counter: Counter, inc_states) -> int:
        """Register a counted region whose states ``[counter.start, counter.stop)`` are built."""
        cid = len(self.counters)
        self.counters.append(counter)
        owner = self.owner
        for s in range(counter.start, counter.stop):
            if owner[s] == -1:  # inner regions were registered first and keep their states
                owner[s] = cid
        self.inc.update(inc_states)
        self.entries[counter.entry] = cid
        return cid

    def build(self, node, nxt: int) -> int:
        """State from which ``node`` then ``nxt`` is matched (mutates the NFA)."""
        key = (id(node), nxt)
        hit = self._memo.get(key)
        if hit is not None and hit[1] is node:
            return hit[0]
        s = self._build(node, nxt)
        self._memo[key] = (s, node)
        return s

    def _build(self, node, nxt: int) -> int:
        kind = node[0]
        if kind == "lit":
            s = nxt
            for b in reversed(node[1]):
                t = self.new()
                self.edges[t].append((b, b, s))
                s = t
            return s
        if kind == "bset":
            s = self.new()
            self.edges[s].extend((lo, hi, nxt) for lo, hi in node[1])
            return s
        if kind == "cset":
            s = self.new()
            for rngs in utf8_sequences(node[1]):
                t = nxt
                for lo, hi in reversed(rngs[1:]):
                    u = self.new()
                    self.edges[u].append((lo, hi, t))
                    t = u
                self.edges[s].append((rngs[0][0], rngs[0][1], t))
            return s
        if kind == "seq":
            s = nxt
            for child in reversed(node[1]):
                s = self.build(child, s)
            return s
        if kind == "alt":
            s = self.new()
            self.eps[s].extend(self.build(child, nxt) for child in node[1])
            return s
        if kind == "rep":
            return self._rep(node[1], node[2], node[3], nxt)
        if kind == "ref":
            s = self.new()
            self.calls[s].append((node[1], nxt))
            return s
        if kind == "dfa":
            from .fsm_ops import nfa_states

            return nfa_states(node, self, nxt)
        raise AssertionError(f"unknown AST node {kind!r}")

    def _rep(self, body, lo: int, hi: int, nxt: int) -> int:
        if hi != -1 and hi < lo:
            raise GrammarError(f"repetition {{{lo},{hi}}} has max < min")
        if max(lo, hi) > self.unroll_limit:
            return self._counted(body, lo, hi, nxt)
        if hi == -1:
            loop = self.new()
            self.eps[loop].append(nxt)
            self.eps[loop].append(self.build(body, loop))
            s = loop
        else:
            s = nxt
            for _ in range(hi - lo):
                t = self.new()
                self.eps[t].append(nxt)
                self.eps[t].append(self._build(body, s))
                s = t
        for _ in range(lo):
            s = self._build(body, s)
        return s

    def _counted(self, body, lo: int, hi: int, nxt: int) -> int:
        """``body{lo,hi}`` as a hub loop plus a :class:`Counter` (O(body) states for any bound)."""
        if nullable(body, self._nullable):
            lo = 0  # the required repetitions may all be empty; also keeps closures short
        hub = self.new()
        saved, self._memo = self._memo, {}  # no memo entry may lead into the region from outside
        try:
            entry = self.build(body, hub)
        finally:
            self._memo = saved
        if entry == hub:  # the body is the empty string
            return nxt
        if not self._reaches(entry, hub):  # the body matches nothing
            return nxt if lo == 0 else self.new()
        self.eps[hub].extend((entry, nxt))
        self.add_counter(Counter(lo, hi, hub, hub, len(self.eps)), (hub,))
        return hub

    def _reaches(self, src: int, dst: int) -> bool:
        seen, stack = {src}, [src]
        while stack:
            s = stack.pop()
            if s == dst:
                return True
            for t in [*self.eps[s], *(t for _, _, t in self.edges[s]), *(t for _, t in self.calls[s])]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return False
