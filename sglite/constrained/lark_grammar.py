"""Lark grammars → rules. Lark itself parses the grammar text (EBNF operators, templates, imports,
aliases); its BNF rules and terminal regexes become our AST, matched scannerless by our automata.

``%ignore`` terminals are allowed between any two symbols (one occurrence per gap, so ``%ignore WS``
still allows any amount of white space there). lark's ``common.ESCAPED_STRING`` uses a lookbehind,
which a finite automaton cannot run; it is replaced by the equivalent ``"([^"\\\\]|\\\\.)*"``.
Start rule: ``start`` if defined, else the first rule.
"""
from __future__ import annotations

from sglite.errors import GrammarError

from . import ast as A
from .regex_parse import parse_regex

_STRING = r'"(?:[^"\\]|\\.)*"'


def _terminal_node(term):
    pat = term.pattern
    flags = "".join(sorted(f for f in pat.flags if f in "imsx"))
    if type(pat).__name__ == "PatternStr":
        if "i" not in flags:
            return A.lit(pat.value)
        import re

        return parse_regex(f"(?i){re.escape(pat.value)}")
    value = pat.value
    if "(?<!\\\\)" in value and value.startswith('".*?'):
        value = _STRING
    try:
        return parse_regex(f"(?{flags}){value}" if flags else value)
    except GrammarError as e:
        raise GrammarError(f"lark terminal {term.name}: {e}") from None


def lark_to_rules(text: str) -> tuple[dict, str]:
    """Parse lark grammar text → (rules, start rule). Raises GrammarError on any grammar error."""
    if not isinstance(text, str):
        raise GrammarError("lark grammar must be a str")
    try:
        from lark.exceptions import LarkError
        from lark.load_grammar import load_grammar
    except ImportError as e:  # pragma: no cover - lark is a dependency
        raise GrammarError(f"lark is not installed: {e}") from None
    try:
        grammar, _ = load_grammar(text, "<grammar>", [], False)
        names = [d[0] if isinstance(d, tuple) else d.name for d in grammar.rule_defs]
        start = "start" if "start" in names else (names[0] if names else None)
        if start is None:
            raise GrammarError("lark grammar defines no rules")
        terms, rules, ignore = grammar.compile([start], set())
    except LarkError as e:
        raise GrammarError(f"lark grammar: {e}") from None
    out: dict = {f"t:{t.name}": _terminal_node(t) for t in terms}
    ign = A.opt(A.alt(*[A.ref(f"t:{n}") for n in ignore])) if ignore else None
    groups: dict = {}
    for r in rules:
        syms = [A.ref(("t:" if s.is_term else "r:") + s.name) for s in r.expansion]
        if ign is not None and syms:
            syms = [x for s in syms for x in (s, ign)][:-1]
        groups.setdefault(f"r:{r.origin.name}", []).append(A.seq(*syms) if syms else A.EMPTY)
    for name, alts in groups.items():
        out[name] = A.alt(*alts)
    if f"r:{start}" not in out:
        raise GrammarError(f"lark grammar: start rule {start!r} has no expansion")
    out["__root"] = A.seq(ign, A.ref(f"r:{start}"), ign) if ign is not None else A.ref(f"r:{start}")
    return out, "__root"
