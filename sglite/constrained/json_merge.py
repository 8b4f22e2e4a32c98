"""``allOf`` support: merge two JSON schemas into one that accepts their intersection, where the
intersection is expressible keyword by keyword; otherwise raise GrammarError naming the keyword."""
from __future__ import annotations

import json

from sglite.errors import GrammarError

ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "example", "$schema", "$id", "id", "$comment",
    "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "$anchor",
    "discriminator", "format_hint", "xml", "externalDocs", "$vocabulary", "$dynamicAnchor",
})
_MAX_KW = ("minimum", "minLength", "minItems", "exclusiveMinimum", "minProperties")
_MIN_KW = ("maximum", "maxLength", "maxItems", "exclusiveMaximum")


def _types(t):
    return {t} if isinstance(t, str) else set(t)


def _merge_type(a, b):
    ta, tb = _types(a), _types(b)
    out = ta & tb
    if "number" in ta and "integer" in tb or "integer" in ta and "number" in tb:
        out.add("integer")
    return sorted(out)


def merge_schemas(a, b, path: str):
    """Schema accepting exactly the instances both ``a`` and ``b`` accept. Does not mutate inputs."""
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return False
    if not isinstance(a, dict) or not isinstance(b, dict):
        raise GrammarError(f"{path}: a schema must be an object or a boolean")
    for x, y in ((a, b), (b, a)):
        extra = set(y.get("properties") or {}) - set(x.get("properties") or {})
        if x.get("additionalProperties", True) is not True and extra:
            raise GrammarError(f"{path}/allOf: additionalProperties next to properties of another subschema")
        if "items" in x and "prefixItems" in y and "prefixItems" not in x:
            raise GrammarError(f"{path}/allOf: items next to prefixItems of another subschema")
    out = dict(a)
    for k, v in b.items():
        if k not in out or k in ANNOTATIONS or k in ("$defs", "definitions"):
            out.setdefault(k, v)
            continue
        w = out[k]
        if json.dumps(w, sort_keys=True) == json.dumps(v, sort_keys=True):
            continue
        if k == "type":
            out[k] = _merge_type(w, v)
        elif k in _MAX_KW:
            out[k] = max(w, v)
        elif k in _MIN_KW:
            out[k] = min(w, v)
        elif k == "required":
            out[k] = list(dict.fromkeys(list(w) + list(v)))
        elif k == "properties":
            props = dict(w)
            for name, sub in v.items():
                props[name] = {"allOf": [props[name], sub]} if name in props else sub
            out[k] = props
        elif k in ("items", "additionalProperties"):
            out[k] = {"allOf": [w, v]}
        elif k == "enum":
            keys = {json.dumps(x, sort_keys=True) for x in v}
            out[k] = [x for x in w if json.dumps(x, sort_keys=True) in keys]
        elif k == "const":
            out["enum"] = []
        elif k in ("anyOf", "oneOf"):
            out[k] = [{"allOf": [x, y]} for x in w for y in v]
        elif k == "allOf":
            out[k] = list(w) + list(v)
        else:
            raise GrammarError(f"{path}/allOf: cannot merge two different {k!r} constraints")
    return out


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(v)]


def _kinds(s):
    if s is False:
        return set()
    if not isinstance(s, dict):
        return None
    if "const" in s:
        return {_json_type(s["const"])}
    if isinstance(s.get("enum"), list):
        return {_json_type(v) for v in s["enum"]}
    if "type" not in s:
        return None
    ts = _types(s["type"])
    return (ts - {"integer"}) | {"number"} if "integer" in ts else ts


def _values(s):
    if not isinstance(s, dict):
        return None
    if "const" in s:
        return {json.dumps(s["const"], sort_keys=True)}
    if isinstance(s.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in s["enum"]}
    return None


def provably_disjoint(a, b, depth: int = 0) -> bool:
    """True if no instance satisfies both schemas (by type, const/enum, or a required
    discriminator property); False when unknown. Used to accept ``oneOf`` as ``anyOf``."""
    ka, kb = _kinds(a), _kinds(b)
    if ka is not None and kb is not None and not ka & kb:
        return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not va & vb:
        return True
    if depth > 3 or not isinstance(a, dict) or not isinstance(b, dict):
        return False
    pa, pb = a.get("properties") or {}, b.get("properties") or {}
    for name in set(a.get("required") or []) & set(b.get("required") or []):
        if name in pa and name in pb and provably_disjoint(pa[name], pb[name], depth + 1):
            return True
    if {"object"} not in (ka, kb):  # below, common instances must be objects
        return False
    for x, y, py in ((a, b, pb), (b, a, pa)):  # x requires a property y forbids
        for name in x.get("required") or []:
            if py.get(name) is False or (name not in py and y.get("additionalProperties", True) is False
                                         and not y.get("patternProperties")):
                return True
    return False
