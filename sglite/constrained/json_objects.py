"""JSON Schema objects → AST: declared properties in schema order (required ones mandatory), then
additional / pattern properties. Suffixes are shared nodes so the NFA stays linear in the number
of properties (a skipped optional property does not copy the rest of the object)."""
from __future__ import annotations

from sglite.errors import GrammarError

from . import ast as A
from . import json_terms as J


def _member(conv, key_node, value_node):
    return A.seq(key_node, conv.colon, value_node)


def _extra(conv, s: dict, names: list, path: str):
    addl = s.get("additionalProperties", True)
    pats = s.get("patternProperties") or {}
    if pats:
        if addl is not False:
            raise GrammarError(f"{path}/patternProperties: only supported with additionalProperties: false")
        alts = []
        for p, sub in pats.items():
            key = A.seq(A.lit('"'), J.pattern_body(p, f"{path}/patternProperties"), A.lit('"'))
            alts.append(_member(conv, key, conv.node(sub, f"{path}/patternProperties/{p}")))
        return A.alt(*alts)
    if addl is False:
        return None
    value = conv.node(addl, f"{path}/additionalProperties")
    if value == A.NOTHING:
        return None
    return _member(conv, J.key_not_in(names), value)


def object_node(conv, s: dict, path: str):
    """AST for an object schema ``s`` (``conv`` is the json_schema converter)."""
    props = s.get("properties") or {}
    required = list(s.get("required") or [])
    if not isinstance(props, dict):
        raise GrammarError(f"{path}/properties: must be an object")
    min_props = s.get("minProperties", 0)
    if min_props > len(set(required)):
        raise GrammarError(f"{path}/minProperties: keyword 'minProperties' beyond the required count is not supported")
    addl = s.get("additionalProperties", True)
    decl = []  # (name, value node, required)
    for name, sub in props.items():
        value = conv.node(sub, f"{path}/properties/{name}")
        decl.append((name, value, name in required))
    for name in required:
        if name not in props:
            value = conv.node(addl, f"{path}/additionalProperties") if not s.get("patternProperties") else A.NOTHING
            decl.append((name, value, True))
    for name, value, req in decl:
        if req and value == A.NOTHING:
            return A.NOTHING
    decl = [d for d in decl if d[1] != A.NOTHING]
    extra = _extra(conv, s, list(dict.fromkeys([d[0] for d in decl] + list(props))), path)
    extra_star = ("seq", (A.star(A.seq(conv.sep, extra)),)) if extra is not None else A.EMPTY
    members = [_member(conv, A.lit(J.json_text(name)), value) for name, value, _ in decl]
    tails, r = [None] * len(decl), extra_star
    for i in reversed(range(len(decl))):
        tails[i] = r  # continuation after member i, shared by every path reaching it
        item = ("seq", (conv.sep, members[i], r))
        r = item if decl[i][2] else ("alt", (item, r))
    firsts = []
    for i, (_, _, req) in enumerate(decl):
        firsts.append(("seq", (members[i], tails[i])))
        if req:
            break
    else:
        if extra is not None:
            firsts.append(("seq", (extra, extra_star)))
        firsts.append(A.EMPTY)
    return A.seq(A.lit("{"), conv.ws, A.alt(*firsts), conv.ws, A.lit("}"))
