"""Grammar AST shared by every front end (regex, JSON Schema, EBNF, lark).

Nodes are plain tuples (cheap, immutable):

* ``("lit", bytes)``            a literal byte string
* ``("cset", ((lo, hi), ...))`` one Unicode code point in the inclusive intervals, UTF-8 encoded
* ``("bset", ((lo, hi), ...))`` one raw byte in the inclusive intervals
* ``("seq", (node, ...))``      concatenation (``("seq", ())`` is the empty string)
* ``("alt", (node, ...))``      alternation (``("alt", ())`` matches nothing)
* ``("rep", node, lo, hi)``     ``lo`` to ``hi`` repetitions, ``hi = -1`` for unbounded
* ``("ref", name)``             a reference to a rule of the grammar (resolved by :mod:`.grammar`)
* ``("dfa", TableDFA)``         an explicit byte DFA (from :mod:`.fsm_ops`: intersections, differences;
                                a ``CountedDFA`` from :mod:`.counted` for a large length bound)

A grammar is ``(rules: dict[str, node], root: str)``. The same node object may occur several times;
the NFA builder shares it when it is followed by the same continuation (used for JSON object suffixes).
"""
from __future__ import annotations

MAX_CODEPOINT = 0x10FFFF
EMPTY = ("seq", ())
NOTHING = ("alt", ())


def lit(s: str | bytes):
    """Literal node for ``s`` (str is UTF-8 encoded)."""
    return ("lit", s.encode("utf-8") if isinstance(s, str) else bytes(s))


def seq(*nodes):
    """Concatenation, flattening nested sequences and dropping empty ones."""
    out = []
    for n in nodes:
        if n[0] == "seq":
            out.extend(n[1])
        else:
            out.append(n)
    return out[0] if len(out) == 1 else ("seq", tuple(out))


def alt(*nodes):
    """Alternation of ``nodes`` (a single node is returned as is)."""
    return nodes[0] if len(nodes) == 1 else ("alt", tuple(nodes))


def opt(node):
    """``node?``."""
    return ("rep", node, 0, 1)


def star(node):
    """``node*``."""
    return ("rep", node, 0, -1)


def rep(node, lo: int, hi: int):
    """``node{lo,hi}`` (``hi=-1`` unbounded)."""
    return ("rep", node, lo, hi)


def ref(name: str):
    """Reference to grammar rule ``name``."""
    return ("ref", name)


def normalize_intervals(intervals) -> tuple:
    """Sort and merge inclusive ``(lo, hi)`` intervals; returns a tuple."""
    out = []
    for lo, hi in sorted(intervals):
        if lo > hi:
            continue
        if out and lo <= out[-1][1] + 1:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def complement(intervals, top: int = MAX_CODEPOINT) -> tuple:
    """Complement of the intervals within ``[0, top]``."""
    out, prev = [], 0
    for lo, hi in normalize_intervals(intervals):
        if lo > prev:
            out.append((prev, lo - 1))
        prev = hi + 1
    if prev <= top:
        out.append((prev, top))
    return tuple(out)


def subtract(a, b) -> tuple:
    """Intervals of ``a`` minus intervals of ``b``."""
    return intersect(a, complement(b))


def intersect(a, b) -> tuple:
    """Intersection of two interval lists."""
    a, b = normalize_intervals(a), normalize_intervals(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def cset(intervals):
    """Code point set node (empty set → :data:`NOTHING`)."""
    iv = normalize_intervals(intervals)
    return ("cset", iv) if iv else NOTHING


def chars(s: str):
    """Node matching one of the characters of ``s``."""
    return cset([(ord(c), ord(c)) for c in s])
