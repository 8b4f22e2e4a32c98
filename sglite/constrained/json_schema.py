"""JSON Schema → grammar rules (AST). Recursion via ``$ref`` becomes rule calls, not unrolling.

Supported: ``type`` (incl. lists), ``enum``/``const`` (values filtered by their sibling keywords),
``properties``, ``required``, ``additionalProperties``, ``patternProperties`` (keys partitioned by the
patterns they match, via DFA products in :mod:`.fsm_ops`), ``minProperties`` up to 1 beyond the
required count, ``items``, ``prefixItems``, ``minItems``, ``maxItems``, ``minLength``, ``maxLength``,
``pattern``, ``format`` (length, pattern and format intersected), ``minimum``/``maximum``/``exclusive*``
(any decimal value, :mod:`.json_numbers`), ``multipleOf`` (integer with both bounds, or ``10^-k``),
``anyOf``, ``oneOf`` (when its branches are provably exclusive), ``allOf`` (merged), local ``$ref`` /
``$defs`` / ``definitions``, ``nullable``, boolean schemas. Anything else that constrains instances
raises :class:`GrammarError` naming the keyword and its JSON path. Properties are emitted in schema order,
then additional properties. Whitespace between tokens follows ``whitespace_pattern`` (default
:data:`DEFAULT_WS`, empty: compact JSON as ``json.dumps(separators=(",", ":"))`` writes it, so no
runaway whitespace and every separator and key is forced, which jump-forward appends without a
decode step; :data:`FLEXIBLE_WS` allows one space or one newline plus up to 16 spaces/tabs).
"""
from __future__ import annotations

from urllib.parse import unquote

from sglite.errors import GrammarError

from . import ast as A
from . import json_terms as J
from .json_merge import ANNOTATIONS, merge_schemas, provably_disjoint
from .regex_parse import parse_regex

DEFAULT_WS = ""
FLEXIBLE_WS = r"[ ]?|\n[ \t]{0,16}"
UNSUPPORTED = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
               "dependentSchemas", "dependencies", "propertyNames", "unevaluatedProperties",
               "unevaluatedItems", "$dynamicRef", "$recursiveRef", "maxProperties")
TYPES = ("null", "boolean", "object", "array", "number", "string")


def _type_ok(value, types) -> bool:
    types = [types] if isinstance(types, str) else list(types)
    if value is None:
        return "null" in types
    if isinstance(value, bool):
        return "boolean" in types
    if isinstance(value, (int, float)):
        whole = isinstance(value, int) or float(value).is_integer()
        return "number" in types or ("integer" in types and whole)
    kind = {str: "string", list: "array", dict: "object"}.get(type(value))
    return kind in types


def schema_to_rules(schema, *, whitespace_pattern: str | None = None, strict: bool = True) -> dict:
    """Rules for ``schema`` with start rule ``"root"``. Raises GrammarError (message has the JSON path).

    ``strict`` (XGrammar's default ``strict_mode``, llguidance's strict reading): an object schema
    that names properties (``properties``, ``patternProperties`` or ``required``) but does not say
    ``additionalProperties`` admits no other key, and an array with ``prefixItems`` (or draft-4
    tuple ``items``) but no ``items`` / ``additionalItems`` admits no further item. A bare
    ``{"type": "object"}`` / ``{"type": "array"}`` stays any object / array, as in XGrammar.
    ``strict=False`` is the specification's reading (unnamed members allowed).
    """
    ws = parse_regex(DEFAULT_WS if whitespace_pattern is None else whitespace_pattern)
    return _Converter(schema, ws, strict).run()


class _Converter:
    def __init__(self, root, ws, strict: bool = True):
        if not isinstance(root, (dict, bool)):
            raise GrammarError(f"json_schema must be an object or a boolean, got {type(root).__name__}")
        self.root, self.ws, self.strict = root, ws, strict
        self.rules: dict = {}
        self.sep = A.seq(ws, A.lit(","), ws)
        self.colon = A.seq(ws, A.lit(":"), ws)

    def run(self) -> dict:
        self.rules["root"] = self.node(self.root, "#")
        self._any_rules()
        return self.rules

    def _any_rules(self):
        if "any" in self.rules:
            return
        self.rules["any"] = A.NOTHING
        member = A.seq(J.STRING, self.colon, A.ref("any"))
        obj = A.seq(A.lit("{"), self.ws, A.opt(A.seq(member, A.star(A.seq(self.sep, member)))), self.ws, A.lit("}"))
        arr = A.seq(A.lit("["), self.ws, A.opt(A.seq(A.ref("any"), A.star(A.seq(self.sep, A.ref("any"))))),
                    self.ws, A.lit("]"))
        self.rules["any"] = A.alt(obj, arr, J.STRING, J.NUMBER, A.lit("true"), A.lit("false"), A.lit("null"))

    # -- references -----------------------------------------------------------------------------
    def resolve(self, ref: str, path: str):
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise GrammarError(f"{path}/$ref: only local references ('#...') are supported, got {ref!r}")
        node = self.root
        for part in [p for p in ref[1:].split("/") if p != ""]:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            try:
                node = node[int(part)] if isinstance(node, list) else node[part]
            except (KeyError, IndexError, ValueError, TypeError):
                raise GrammarError(f"{path}/$ref: {ref!r} does not resolve") from None
        return node

    def ref_rule(self, ref: str, path: str):
        name = "$ref " + ref
        if name not in self.rules:
            target = self.resolve(ref, path)
            self.rules[name] = A.NOTHING  # placeholder while converting (recursion)
            self.rules[name] = self.node(target, ref)
        return A.ref(name)

    def deref(self, schema, path):
        """Schema with a top-level $ref replaced by its target merged with the siblings."""
        seen = 0
        while isinstance(schema, dict) and "$ref" in schema:
            seen += 1
            if seen > 50:
                raise GrammarError(f"{path}/$ref: reference chain too long (cycle?)")
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = merge_schemas(self.resolve(schema["$ref"], path), rest, path)
        return schema

    # -- dispatch -----------------------------------------------------------------------------------
    def node(self, schema, path: str):
        if schema is True:
            self._any_rules()
            return A.ref("any")
        if schema is False:
            return A.NOTHING
        if not isinstance(schema, dict):
            raise GrammarError(f"{path}: a schema must be an object or a boolean")
        for kw in UNSUPPORTED:
            if kw in schema:
                raise GrammarError(f"{path}/{kw}: keyword {kw!r} is not supported")
        if "$ref" in schema:
            if all(k in ANNOTATIONS or k in ("$defs", "definitions") for k in schema if k != "$ref"):
                return self.ref_rule(schema["$ref"], path)
            return self.node(self.deref(schema, path), path)
        if "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for i, sub in enumerate(schema["allOf"]):
                merged = merge_schemas(merged, self.deref(sub, f"{path}/allOf/{i}"), f"{path}/allOf/{i}")
            return self.node(merged, path)
        for kw in ("anyOf", "oneOf"):
            if kw in schema:
                rest = {k: v for k, v in schema.items() if k != kw}
                branches = schema[kw]
                if not isinstance(branches, list) or not branches:
                    raise GrammarError(f"{path}/{kw}: must be a non-empty array")
                if kw == "oneOf":
                    self.check_one_of([merge_schemas(rest, self.deref(b, f"{path}/oneOf/{i}"), path) if rest else b
                                       for i, b in enumerate(branches)], path)
                return A.alt(*[self.node(merge_schemas(rest, self.deref(b, f"{path}/{kw}/{i}"), path)
                                         if rest else b, f"{path}/{kw}/{i}") for i, b in enumerate(branches)])
        if schema.get("nullable") is True:
            rest = {k: v for k, v in schema.items() if k != "nullable"}
            return A.alt(A.lit("null"), self.node(rest, path))
        if "const" in schema or "enum" in schema:
            if "const" in schema:
                values, rest = [schema["const"]], {k: v for k, v in schema.items() if k != "const"}
            else:
                values, rest = schema["enum"], {k: v for k, v in schema.items() if k != "enum"}
                if not isinstance(values, list):
                    raise GrammarError(f"{path}/enum: must be an array")
            values = [v for v in values if self.admits(rest, v, path)]
            return A.alt(*[J.value_node(v) for v in values]) if values else A.NOTHING
        types = schema.get("type", list(TYPES))
        types = [types] if isinstance(types, str) else types
        for t in types:
            if t not in TYPES + ("integer",):
                raise GrammarError(f"{path}/type: unknown type {t!r}")
        if "number" in types:
            types = [t for t in types if t != "integer"]
        return A.alt(*[self.typed(t, schema, path) for t in types]) if types else A.NOTHING

    def admits(self, rest: dict, value, path: str) -> bool:
        """Whether ``value`` (of an enum/const) satisfies the sibling keywords ``rest``.

        ``type`` is checked directly; other constraints by running the value's compact JSON through
        the grammar of ``rest`` (object keys must then be in ``rest``'s declared order).
        """
        if "type" in rest and not _type_ok(value, rest["type"]):
            return False
        if not set(rest) - ANNOTATIONS - {"type", "$defs", "definitions", "nullable"}:
            return True
        from .compiled import CompiledGrammar
        from .grammar import Automaton
        from .tokenizer_info import TokenizerInfo

        conv = _Converter(self.root, A.EMPTY, self.strict)
        conv.rules["root"] = conv.node(rest, path)
        conv._any_rules()
        g = CompiledGrammar(Automaton(conv.rules, "root"), TokenizerInfo([b"x"], set()))
        state = g.step_bytes(g.initial_state, J.json_text(value))
        return state is not None and g.accepting(state)

    def check_one_of(self, branches, path):
        subs = [self.deref(b, f"{path}/oneOf/{i}") for i, b in enumerate(branches)]
        for i in range(len(subs)):
            for j in range(i + 1, len(subs)):
                if not provably_disjoint(subs[i], subs[j]):
                    raise GrammarError(f"{path}/oneOf: branches {i} and {j} are not provably exclusive "
                                       "(exactly-one cannot be enforced)")

    def typed(self, t: str, s: dict, path: str):
        if t == "null":
            return A.lit("null")
        if t == "boolean":
            return A.alt(A.lit("true"), A.lit("false"))
        if t in ("integer", "number"):
            return self.number(t == "integer", s, path)
        if t == "string":
            return self.string(s, path)
        if t == "array":
            from .json_arrays import array_node
            return array_node(self, s, path)
        from .json_objects import object_node
        return object_node(self, s, path)

    def number(self, integer: bool, s: dict, path: str):
        mult = s.get("multipleOf")
        if mult is not None and integer and not isinstance(mult, bool) and mult == 1:
            mult = None
        lo, hi, lo_ex, hi_ex = s.get("minimum"), s.get("maximum"), False, False
        emin, emax = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
        if emin is True or emax is True:  # draft 4 booleans
            lo_ex, hi_ex = emin is True, emax is True
        if isinstance(emin, (int, float)) and not isinstance(emin, bool) and (lo is None or emin >= lo):
            lo, lo_ex = emin, True
        if isinstance(emax, (int, float)) and not isinstance(emax, bool) and (hi is None or emax <= hi):
            hi, hi_ex = emax, True
        if mult is not None:
            from .json_numbers import multiple_of

            return multiple_of(mult, integer, lo, lo_ex, hi, hi_ex, path)
        return J.number_range(lo, lo_ex, hi, hi_ex, integer, path)

    def string(self, s: dict, path: str):
        lo, hi = J.count_keyword(s, "minLength", path) or 0, J.count_keyword(s, "maxLength", path)
        hi = -1 if hi is None else hi
        if hi >= 0 and hi < lo:
            return A.NOTHING
        parts = []  # regular constraints on the string body, intersected when there are several
        if "pattern" in s:
            parts.append(J.pattern_body(s["pattern"], f"{path}/pattern"))
        if "format" in s:
            parts.append(J.format_body(s["format"], f"{path}/format"))
        if not parts or lo > 0 or hi >= 0:
            parts.append(A.rep(J.CHAR, lo, hi))
        body = parts[0]
        if len(parts) > 1:
            from .fsm_ops import intersect_nodes

            for other in parts[1:]:
                body = intersect_nodes(body, other, f"{path}/maxLength" if "maxLength" in s else f"{path}/format")
        return A.seq(A.lit('"'), body, A.lit('"'))
