"""Lark grammars → rules. Lark itself parses the grammar text (EBNF operators, templates, imports,
aliases); its BNF rules and terminal regexes become our AST, matched scannerless by our automata.

``%ignore`` terminals are allowed between any two symbols (one occurrence per gap, so ``%ignore WS``
still allows any amount of white space there). lark's ``common.ESCAPED_STRING`` uses a lookbehind,
which a finite automaton cannot run; it is replaced by the equivalent ``"([^"\\\\]|\\\\.)*"``.
Start rule: ``start`` if defined, else the first rule.

Grammars come from the network, so ``%import`` is limited to lark's bundled ``common`` grammar
(``%import common.NUMBER``): a relative import (``%import .name.RULE``) would read ``*.lark`` files
from the server's working directory and generate their content. Every failure is a
:class:`GrammarError` (HTTP 400), never a file-system error carrying a path.
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


#: the only grammar a lark ``%import`` may name: lark's own bundled ``common.lark``
ALLOWED_IMPORTS = (("common",),)


def _load(text: str):
    """lark's ``load_grammar`` with imports restricted to :data:`ALLOWED_IMPORTS` from lark's own
    package. Raises GrammarError for any other import."""
    from lark.load_grammar import GrammarBuilder

    class SafeBuilder(GrammarBuilder):
        def do_import(self, dotted_path, base_path, aliases, base_mangle=None):
            if base_path is not None or tuple(dotted_path) not in ALLOWED_IMPORTS:
                shown = ("." if base_path is not None else "") + ".".join(dotted_path)
                raise GrammarError(f"lark grammar: %import {shown} is not allowed: only lark's bundled "
                                   f"'common' grammar can be imported (e.g. %import common.NUMBER)")
            super().do_import(dotted_path, base_path, aliases, base_mangle)

    builder = SafeBuilder(False, [])
    builder.load_grammar(text, "<grammar>")
    return builder.build()


def lark_to_rules(text: str) -> tuple[dict, str]:
    """Parse lark grammar text → (rules, start rule). Raises GrammarError on any grammar error."""
    if not isinstance(text, str):
        raise GrammarError("lark grammar must be a str")
    try:
        from lark.exceptions import LarkError
    except ImportError as e:  # pragma: no cover - lark is a dependency
        raise GrammarError(f"lark is not installed: {e}") from None
    try:
        grammar = _load(text)
        names = [d[0] if isinstance(d, tuple) else d.name for d in grammar.rule_defs]
        start = "start" if "start" in names else (names[0] if names else None)
        if start is None:
            raise GrammarError("lark grammar defines no rules")
        terms, rules, ignore = grammar.compile([start], set())
    except GrammarError:
        raise
    except LarkError as e:
        raise GrammarError(f"lark grammar: {e}") from None
    except (ValueError, AssertionError, KeyError, IndexError, TypeError, AttributeError, OSError,
            RecursionError) as e:  # lark's internals on malformed input
        raise GrammarError(f"lark grammar: malformed grammar ({type(e).__name__})") from None
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
