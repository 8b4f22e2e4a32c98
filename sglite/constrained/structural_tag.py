"""Structural tags: free text that switches into constrained parts at trigger strings, as one grammar.

The spec follows XGrammar's structural tag (``xgrammar.StructuralTag``, the ``"format"`` tree) and
accepts SGLang's older ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`` form,
which it reads as one ``triggered_tags``. Formats (``"type"``):

* ``const_string`` ``{"value"}``; ``json_schema`` ``{"json_schema"}``; ``regex`` ``{"pattern"}``;
  ``grammar`` ``{"grammar"}`` (GBNF text, as ``ebnf``);
* ``any_text``: any bytes up to whatever ends the enclosing part (a tag's ``end``, or the end
  of the output when it is last at the top level);
* ``sequence`` / ``or`` ``{"elements"}``;
* ``tag`` ``{"begin", "content", "end"}``;
* ``triggered_tags`` ``{"triggers", "tags", "at_least_one", "stop_after_first"}``: free text
  until a trigger, from which one of the tags whose ``begin`` starts with it must follow, then
  free text again (``stop_after_first``: the output ends after the first tag);
* ``tags_with_separator`` ``{"tags", "separator", "at_least_one", "stop_after_first"}``: tags
  one after another with ``separator`` between them and no free text.

Everything compiles to one grammar of the shared AST (:mod:`.ast`): free text is the
Aho-Corasick DFA of :mod:`.free_text`, each embedded JSON schema or GBNF grammar keeps its rules
under a unique prefix. So the matcher, the mask cache, jump-forward (after a trigger the
constant part of the tag is forced) and rollback for speculative decoding are the ordinary ones,
and a token straddling a trigger is handled by the automaton itself. The backend's cache keys on
the whole spec, so a tool set compiles once.

Uses in sglite: constrained "auto" tool calls (free text, then from the family's opener on
``{"name": <a tool>, "arguments": <its schema>}``), "auto" with ``response_format`` (an ``or``
of tool calls and the schema), and the reasoning gate (``any_text`` up to ``</think>``, then the
request's grammar): see :func:`reasoning_gated`.
"""
from __future__ import annotations

import importlib
import json

from sglite.errors import GrammarError

from . import ast as A
from .free_text import text_without
from .grammar_cache import GrammarCache

FORMAT_TYPES = ("const_string", "json_schema", "regex", "grammar", "any_text", "sequence", "or", "tag",
                "triggered_tags", "tags_with_separator")
ANY_BYTES = A.star(("bset", ((0, 255),)))
# between the end of reasoning and the answer, the whitespace models write ("</think>\n\n")
REASONING_GAP = r"[ \t\r\n]*"
_PIECES = GrammarCache(512)  # (kind, spec) -> (rules, root) of embedded schemas / regexes / grammars


def reasoning_gated(end: str, inner: dict) -> dict:
    """Structural tag: free text (the thinking) up to ``end`` (e.g. ``</think>``), optional
    whitespace, then ``inner`` (a format dict such as ``{"type": "json_schema", ...}``)."""
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": end},
        {"type": "regex", "pattern": REASONING_GAP}, inner]}}


def constraint_format(kind: str, spec) -> dict:
    """The format dict of an ordinary constraint (``regex``, ``json_schema``, ``json_object``,
    ``ebnf``, ``structural_tag``), to wrap in a larger structural tag.

    Raises:
        GrammarError: a kind that has no format (``lark``, ``choices``).
    """
    if kind == "regex":
        return {"type": "regex", "pattern": spec}
    if kind in ("json_schema", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else spec
        return {"type": "json_schema", "json_schema": json.loads(schema) if isinstance(schema, str) else schema}
    if kind == "ebnf":
        return {"type": "grammar", "grammar": spec}
    if kind == "structural_tag":
        d = json.loads(spec) if isinstance(spec, str) else spec
        return d["format"] if "format" in d else _legacy_format(d, "structural_tag")
    raise GrammarError(f"a {kind} constraint cannot be wrapped in a structural tag")


def structural_tag_rules(spec, whitespace_pattern: str | None = None, strict: bool = True) -> tuple[dict, str]:
    """Rules and root of a structural tag ``spec`` (dict or JSON text).

    Raises:
        GrammarError: invalid JSON, an unknown format type, a missing or mistyped field (the
            message names its path, e.g. ``structural_tag.format.elements[1].end``), a tag whose
            ``begin`` starts with none of the triggers.
    """
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise GrammarError(f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise GrammarError(f"structural_tag: must be an object, got {type(spec).__name__}")
    if "format" in spec:
        fmt = spec["format"]
        path = "structural_tag.format"
    else:
        fmt, path = _legacy_format(spec, "structural_tag"), "structural_tag"
    conv = _Converter(whitespace_pattern, strict)
    conv.rules["root"] = conv.node(fmt, path, stops=None)
    return conv.rules, "root"


def _legacy_format(spec: dict, path: str) -> dict:
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise GrammarError(f"{path}.structures: must be a non-empty list (or give a 'format')")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or "schema" not in s:
            raise GrammarError(f"{path}.structures[{i}]: must be an object with begin, schema and end")
        tags.append({"type": "tag", "begin": s.get("begin", ""), "end": s.get("end", ""),
                     "content": {"type": "json_schema", "json_schema": s["schema"]}})
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags}


def _rename(node, prefix: str, memo: dict):
    """``node`` with every rule reference prefixed (shared sub-nodes stay shared)."""
    out = memo.get(id(node))
    if out is not None and out[0] is node:
        return out[1]
    kind = node[0]
    if kind == "ref":
        new = ("ref", prefix + node[1])
    elif kind in ("seq", "alt"):
        kids = tuple(_rename(c, prefix, memo) for c in node[1])
        new = node if all(a is b for a, b in zip(kids, node[1])) else (kind, kids)
    elif kind == "rep":
        body = _rename(node[1], prefix, memo)
        new = node if body is node[1] else ("rep", body, node[2], node[3])
    else:
        new = node
    memo[id(node)] = (node, new)
    return new


class _Converter:
    def __init__(self, whitespace_pattern, strict):
        self.ws, self.strict = whitespace_pattern, strict
        self.rules: dict = {}
        self._embedded = 0

    def _embed(self, kind: str, spec, path: str):
        backend = importlib.import_module(".backend", __package__)
        try:  # a tool's schema converts once, whatever tag set, union or reasoning gate holds it
            rules, root = _PIECES.get_or_compile(f"{kind}|{self.ws}|{self.strict}", spec,
                                                 lambda: backend.build_rules(kind, spec, self.ws, self.strict))
        except GrammarError as e:
            raise GrammarError(f"{path}: {e}") from None
        prefix = f"st{self._embedded}."
        self._embedded += 1
        memo: dict = {}
        for name, body in rules.items():
            self.rules[prefix + name] = _rename(body, prefix, memo)
        return A.ref(prefix + root)

    def node(self, fmt, path: str, stops):
        """AST of format ``fmt``; ``stops``: strings that end the enclosing part (None: the end
        of the output), which ``any_text`` and free text must not contain."""
        if not isinstance(fmt, dict):
            raise GrammarError(f"{path}: must be an object with a 'type', got {type(fmt).__name__}")
        t = fmt.get("type")
        if t not in FORMAT_TYPES:
            raise GrammarError(f"{path}.type: unknown format {t!r}; known: {', '.join(FORMAT_TYPES)}")
        if t == "const_string":
            return A.lit(_string(fmt, "value", path))
        if t == "json_schema":
            if "json_schema" not in fmt:
                raise GrammarError(f"{path}.json_schema: required")
            schema = fmt["json_schema"]
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise GrammarError(f"{path}.json_schema: not valid JSON: {e}") from None
            return self._embed("json_schema", schema, f"{path}.json_schema")
        if t == "regex":
            return self._embed("regex", _string(fmt, "pattern", path), f"{path}.pattern")
        if t == "grammar":
            return self._embed("ebnf", _string(fmt, "grammar", path), f"{path}.grammar")
        if t == "any_text":
            return ANY_BYTES if stops is None else ("dfa", text_without(stops))
        if t in ("sequence", "or"):
            elems = fmt.get("elements")
            if not isinstance(elems, list) or not elems:
                raise GrammarError(f"{path}.elements: must be a non-empty list")
            if t == "or":
                return A.alt(*[self.node(e, f"{path}.elements[{i}]", stops) for i, e in enumerate(elems)])
            last = len(elems) - 1
            return A.seq(*[self.node(e, f"{path}.elements[{i}]", stops if i == last else ())
                           for i, e in enumerate(elems)])
        if t == "tag":
            return self._tag(fmt, path, stops)
        tags = fmt.get("tags")
        if not isinstance(tags, list) or not tags:
            raise GrammarError(f"{path}.tags: must be a non-empty list")
        at_least_one = _flag(fmt, "at_least_one", path)
        first_only = _flag(fmt, "stop_after_first", path)
        if t == "triggered_tags":
            return self._triggered(fmt, tags, path, stops, at_least_one, first_only)
        one = A.alt(*[self._tag(g, f"{path}.tags[{i}]", ()) for i, g in enumerate(tags)])
        sep = A.lit(_string(fmt, "separator", path, empty_ok=True))
        many = one if first_only else A.seq(one, A.star(A.seq(sep, one)))
        return many if at_least_one else A.opt(many)

    def _tag(self, fmt, path, stops):
        if not isinstance(fmt, dict) or fmt.get("type", "tag") != "tag":
            raise GrammarError(f"{path}: must be a tag (begin, content, end)")
        begin = _string(fmt, "begin", path, empty_ok=True)
        end = _string(fmt, "end", path, empty_ok=True)
        if "content" not in fmt:
            raise GrammarError(f"{path}.content: required")
        inner_stops = [end] if end else stops  # an empty end: the content runs to the outer end
        return A.seq(A.lit(begin), self.node(fmt["content"], f"{path}.content", inner_stops), A.lit(end))

    def _triggered(self, fmt, tags, path, stops, at_least_one, first_only):
        triggers = fmt.get("triggers")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(x, str) and x for x in triggers):
            raise GrammarError(f"{path}.triggers: must be a non-empty list of non-empty strings")
        for i, g in enumerate(tags):
            begin = g.get("begin") if isinstance(g, dict) else None
            if not isinstance(begin, str) or not any(begin.startswith(x) for x in triggers):
                raise GrammarError(f"{path}.tags[{i}].begin: must start with one of the triggers {triggers}")
        free = ("dfa", text_without(list(triggers) + list(stops or ())))
        one = A.alt(*[self._tag(g, f"{path}.tags[{i}]", ()) for i, g in enumerate(tags)])
        if first_only:
            return A.seq(free, one) if at_least_one else A.seq(free, A.opt(one))
        more = A.star(A.seq(one, free))
        return A.seq(free, one, free, more) if at_least_one else A.seq(free, more)


def _string(fmt: dict, key: str, path: str, empty_ok: bool = False) -> str:
    v = fmt.get(key)
    if not isinstance(v, str) or (not v and not empty_ok):
        raise GrammarError(f"{path}.{key}: must be a {'' if empty_ok else 'non-empty '}string, got {v!r}")
    return v


def _flag(fmt: dict, key: str, path: str) -> bool:
    v = fmt.get(key, False)
    if not isinstance(v, bool):
        raise GrammarError(f"{path}.{key}: must be true or false, got {v!r}")
    return v
