"""JSON Schema arrays → AST: ``prefixItems`` (or draft-4 ``items: [...]``), ``items`` /
``additionalItems``, ``minItems``/``maxItems``. ``uniqueItems: true`` cannot be enforced by a
context-free grammar and raises GrammarError."""
from __future__ import annotations

from sglite.errors import GrammarError

from . import ast as A
from . import json_terms as J


def array_node(conv, s: dict, path: str):
    """AST for an array schema ``s`` (``conv`` is the json_schema converter)."""
    if s.get("uniqueItems") is True:
        raise GrammarError(f"{path}/uniqueItems: keyword 'uniqueItems' is not supported")
    prefix = s.get("prefixItems")
    items = s.get("items", not (conv.strict and prefix is not None))  # strict: no items past prefixItems
    if isinstance(items, list):  # draft 4-2019 tuple form
        prefix, items = items, s.get("additionalItems", not conv.strict)
    prefix = list(prefix or [])
    lo, hi = J.count_keyword(s, "minItems", path) or 0, J.count_keyword(s, "maxItems", path)
    hi = -1 if hi is None else hi
    elems = [conv.node(p, f"{path}/prefixItems/{i}") for i, p in enumerate(prefix)]
    item = conv.node(items, f"{path}/items")
    if item == A.NOTHING:
        hi = len(elems) if hi < 0 else min(hi, len(elems))
    if hi >= 0 and hi < lo:
        return A.NOTHING
    # cut prefix where an element is impossible
    for i, e in enumerate(elems):
        if e == A.NOTHING:
            elems, hi = elems[:i], i if hi < 0 else min(hi, i)
            if hi < lo:
                return A.NOTHING
            break
    k = len(elems)

    def tail_from(i):  # elements i.. (i >= k): repeated ``item``
        need = max(lo - i, 0)
        more = -1 if hi < 0 else hi - i
        if more == 0:
            return A.EMPTY
        if i == 0:
            rest = A.rep(A.seq(conv.sep, item), max(need - 1, 0), -1 if more < 0 else more - 1)
            body = A.seq(item, rest)
            return body if need > 0 else A.opt(body)
        return A.rep(A.seq(conv.sep, item), need, more)

    node = tail_from(k)
    for i in reversed(range(k)):
        if hi >= 0 and i >= hi:
            node = A.EMPTY
            continue
        step = A.seq(conv.sep, elems[i], node) if i > 0 else A.seq(elems[i], node)
        node = step if i < lo else A.opt(step)
    return A.seq(A.lit("["), conv.ws, node, conv.ws, A.lit("]"))
