"""JSON Schema objects → AST: declared properties in schema order (required ones mandatory), then
additional / pattern properties. Suffixes are shared nodes so the NFA stays linear in the number
of properties (a skipped optional property does not copy the rest of the object)."""
from __future__ import annotations

from sglite.errors import GrammarError

from . import ast as A
from . import json_terms as J


def _member(conv, key_node, value_node):
    return A.seq(key_node, conv.colon, value_node)


MATCH_ALL = ("", ".*", "^.*")  # ECMA-262 patterns (search semantics) every key matches


def _match_all(s: dict) -> list:
    """Schemas of ``patternProperties`` whose pattern every key matches, if all of them do."""
    pats = s.get("patternProperties") or {}
    return list(pats.values()) if pats and all(p in MATCH_ALL for p in pats) else []


def pattern_dfas(s: dict, path: str) -> list:
    """``[(TableDFA of the pattern's canonical key bodies, value schema)]`` for ``patternProperties``."""
    from .fsm_ops import from_node

    pats = s.get("patternProperties") or {}
    if len(pats) > 4:
        raise GrammarError(f"{path}/patternProperties: more than 4 patterns are not supported")
    return [(from_node(J.pattern_body(p, f"{path}/patternProperties"), f"{path}/patternProperties"), sub)
            for p, sub in pats.items()]


def _canonical(name: str) -> bytes:
    return "".join(J.encode_char(ord(c)) for c in name).encode()


def _pattern_members(conv, dfas: list, addl, names: list, path: str):
    """Members for keys that are not declared names: one alternative per set of matched patterns
    (the key language is "matches these patterns, not the others, and is no declared name",
    canonical escapes only), valued by all the matched patterns' schemas (none: ``addl``)."""
    from .fsm_ops import from_node, product

    where = f"{path}/patternProperties"
    universe = from_node(A.star(J.to_json_body(("cset", ((0, A.MAX_CODEPOINT),)))), where)
    taken = from_node(A.alt(*[A.lit(_canonical(n)) for n in names]), where) if names else None
    out = []
    for subset in range(1 << len(dfas)):
        keys = universe
        for i, (d, _) in enumerate(dfas):
            keys = product(keys, d, not (subset >> i) & 1, where)
            if keys is None:
                break
        if keys is not None and taken is not None:
            keys = product(keys, taken, True, where)
        if keys is None:
            continue
        subs = [sub for i, (_, sub) in enumerate(dfas) if (subset >> i) & 1]
        if subs:
            value = conv.node({"allOf": subs} if len(subs) > 1 else subs[0], where)
        elif addl is False:
            continue
        else:
            value = conv.node(addl, f"{path}/additionalProperties")
        if value != A.NOTHING:
            out.append(_member(conv, A.seq(A.lit('"'), ("dfa", keys), A.lit('"')), value))
    return A.alt(*out) if out else None


def additional(conv, s: dict):
    """The schema of keys ``s`` does not name: ``additionalProperties``, else closed (False) when
    the converter is strict and ``s`` names properties, else True (the specification's default)."""
    if "additionalProperties" in s:
        return s["additionalProperties"]
    if conv.strict and any(k in s for k in ("properties", "patternProperties", "required")):
        return False
    return True


def _extra(conv, s: dict, names: list, path: str):
    addl = additional(conv, s)
    pats = s.get("patternProperties") or {}
    every = _match_all(s)
    if every:  # additionalProperties never applies; every value satisfies all the pattern schemas
        value = conv.node({"allOf": every}, f"{path}/patternProperties")
        return None if value == A.NOTHING else _member(conv, J.key_not_in(names), value)
    if pats:
        return _pattern_members(conv, pattern_dfas(s, path), addl, names, path)
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
    if min_props > max(len(set(required)), 1):
        raise GrammarError(f"{path}/minProperties: keyword 'minProperties' beyond the required count is not supported")
    addl = additional(conv, s)
    every = _match_all(s)
    dfas = pattern_dfas(s, path) if s.get("patternProperties") and not every else []

    def matched(name):  # schemas of the patterns ``name`` matches
        return every or [sub for d, sub in dfas if d.accepts(_canonical(name))]

    decl = []  # (name, value node, required)
    for name, sub in props.items():
        m = matched(name)
        value = conv.node({"allOf": [sub, *m]} if m else sub, f"{path}/properties/{name}")
        decl.append((name, value, name in required))
    for name in required:
        if name not in props:
            m = matched(name)
            if m:
                value = conv.node({"allOf": m} if len(m) > 1 else m[0], f"{path}/patternProperties")
            else:  # the schema names this key, so strictness does not close it
                value = conv.node(s.get("additionalProperties", True), f"{path}/additionalProperties")
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
        if min_props < 1:
            firsts.append(A.EMPTY)
    return A.seq(A.lit("{"), conv.ws, A.alt(*firsts), conv.ws, A.lit("}"))
