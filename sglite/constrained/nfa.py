"""Grammar AST → byte-level NFA (Thompson construction in continuation-passing style).

``build(node, nxt)`` returns a state from which matching ``node`` leads to ``nxt``; it is memoized
on ``(id(node), nxt)``, so a sub-tree shared by several alternatives with the same continuation is
built once (object suffixes of JSON schemas stay linear). Code point sets are compiled to UTF-8
byte-range sequences (Unicode Standard §3.9 Table 3-7; the split is the one used by RE2 and
Rust's ``regex-syntax`` ``Utf8Sequences``), so a multi-byte character may be split across tokens.
``("ref", name)`` nodes become *call edges* (``calls[state] = [(rule, resume_state)]``), used by the
pushdown matcher for recursive rules.
"""
from __future__ import annotations

from sglite.errors import GrammarError

from .ast import intersect

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


class NFA:
    """Byte NFA with epsilon, byte-range and call edges. States are ints; mutated only while building.

    Raises GrammarError when it would exceed ``max_states`` (a guard against huge counted repetitions).
    """

    def __init__(self, max_states: int = 250_000):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []
        self.calls: list[list[tuple[str, int]]] = []
        self.max_states = max_states
        self._memo: dict = {}

    def new(self) -> int:
        if len(self.eps) >= self.max_states:
            raise GrammarError(f"grammar too large: more than {self.max_states} automaton states")
        self.eps.append([])
        self.edges.append([])
        self.calls.append([])
        return len(self.eps) - 1

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
        if hi == -1:
            loop = self.new()
            self.eps[loop].append(nxt)
            self.eps[loop].append(self.build(body, loop))
            s = loop
        else:
            if hi < lo:
                raise GrammarError(f"repetition {{{lo},{hi}}} has max < min")
            s = nxt
            for _ in range(hi - lo):
                t = self.new()
                self.eps[t].append(nxt)
                self.eps[t].append(self._build(body, s))
                s = t
        for _ in range(lo):
            s = self._build(body, s)
        return s
