"""Python ``re`` syntax → grammar AST (:mod:`.ast`), with full-language (not leftmost-first) semantics.

The pattern is parsed with the standard library's own regex parser (``re._parser``), so the accepted
syntax is exactly Python's; constructs a finite automaton cannot express raise :class:`GrammarError`
naming them (backreferences, lookahead/lookbehind, word boundaries, atomic groups, possessive
repetition, conditional groups). ``^``/``$``/``\\A``/``\\Z`` are accepted at the edges (matching is
always a full match). ``\\d``, ``\\w`` and ``\\s`` use ASCII semantics (as JSON Schema and the other
engines do), ``.`` excludes ``\\n`` unless ``(?s)``; ``(?i)`` folds ASCII and simple Unicode case.
"""
from __future__ import annotations

import re

from sglite.errors import GrammarError

from . import ast as A

try:  # Python 3.11+
    import re._constants as C
    import re._parser as P
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as C  # type: ignore
    import sre_parse as P  # type: ignore

_DIGIT = ((48, 57),)
_WORD = ((48, 57), (65, 90), (95, 95), (97, 122))
_SPACE = ((9, 13), (32, 32))
_ECMA_SPACE = ((9, 13), (32, 32), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
               (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))
_CATEGORIES = {
    C.CATEGORY_DIGIT: (_DIGIT, False), C.CATEGORY_NOT_DIGIT: (_DIGIT, True),
    C.CATEGORY_WORD: (_WORD, False), C.CATEGORY_NOT_WORD: (_WORD, True),
    C.CATEGORY_SPACE: (_SPACE, False), C.CATEGORY_NOT_SPACE: (_SPACE, True),
}
_UNSUPPORTED = {
    C.GROUPREF: "backreference", C.GROUPREF_EXISTS: "conditional group (?(id)...)",
    C.ATOMIC_GROUP: "atomic group (?>...)", C.POSSESSIVE_REPEAT: "possessive repetition",
}


def parse_regex(pattern: str, *, dotall: bool = False, ecma: bool = False):
    """Parse a Python regex into an AST node matching exactly the strings ``re.fullmatch`` accepts.

    ``ecma=True`` gives ``\\s``/``\\S`` ECMA-262's Unicode white space (JSON Schema ``pattern``).

    Raises:
        GrammarError: invalid syntax, or a construct that is not regular (message names it).
    """
    if not isinstance(pattern, str):
        raise GrammarError(f"regex must be a str, got {type(pattern).__name__}")
    try:
        tree = P.parse(pattern, re.DOTALL if dotall else 0)
    except (re.error, OverflowError, RecursionError) as e:
        raise GrammarError(f"invalid regex {pattern!r}: {e}") from None
    flags = tree.state.flags
    return _Converter(pattern, ecma).seq(list(tree), flags, top=True)


class _Converter:
    def __init__(self, pattern: str, ecma: bool = False):
        self.pattern = pattern
        self.categories = dict(_CATEGORIES)
        if ecma:
            self.categories[C.CATEGORY_SPACE] = (_ECMA_SPACE, False)
            self.categories[C.CATEGORY_NOT_SPACE] = (_ECMA_SPACE, True)

    def fail(self, what: str):
        raise GrammarError(f"regex {self.pattern!r}: {what} is not supported (not a regular language)")

    def seq(self, items, flags, top=False):
        out = []
        for i, (op, av) in enumerate(items):
            if op == C.AT:
                if av in (C.AT_BEGINNING, C.AT_BEGINNING_STRING) and (i == 0 or not top):
                    continue
                if av in (C.AT_END, C.AT_END_STRING) and (i == len(items) - 1 or not top):
                    continue
                if av in (C.AT_BOUNDARY, C.AT_NON_BOUNDARY):
                    self.fail("word boundary \\b/\\B")
                self.fail("anchor ^/$ in the middle of a pattern")
            out.append(self.node(op, av, flags))
        return A.seq(*out) if out else A.EMPTY

    def node(self, op, av, flags):
        if op in _UNSUPPORTED:
            self.fail(_UNSUPPORTED[op])
        if op in (C.ASSERT, C.ASSERT_NOT):
            self.fail("lookbehind" if av[0] < 0 else "lookahead")
        if op == C.LITERAL:
            return self.charset([(av, av)], flags)
        if op == C.NOT_LITERAL:
            return A.cset(A.complement(self.fold([(av, av)], flags)))
        if op == C.ANY:
            return A.cset([(0, A.MAX_CODEPOINT)] if flags & re.DOTALL else A.complement([(10, 10)]))
        if op == C.IN:
            return self.in_set(av, flags)
        if op == C.BRANCH:
            return A.alt(*[self.seq(list(b), flags) for b in av[1]])
        if op == C.SUBPATTERN:
            _, add, sub, body = av
            return self.seq(list(body), (flags | add) & ~sub)
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):
            lo, hi, body = av
            hi = -1 if hi == C.MAXREPEAT else hi
            return A.rep(self.seq(list(body), flags), lo, hi)
        if op == C.AT:
            self.fail("anchor inside a group")
        self.fail(f"regex construct {op}")

    def fold(self, intervals, flags):
        if not flags & re.IGNORECASE:
            return intervals
        out = list(intervals)
        for lo, hi in intervals:
            for cp in range(lo, min(hi, lo + 2000) + 1):
                c = chr(cp)
                for d in {c.lower(), c.upper()}:
                    if len(d) == 1 and d != c:
                        out.append((ord(d), ord(d)))
        return out

    def charset(self, intervals, flags):
        return A.cset(self.fold(intervals, flags))

    def in_set(self, items, flags):
        negate, ivs = False, []
        for op, av in items:
            if op == C.NEGATE:
                negate = True
            elif op == C.LITERAL:
                ivs.append((av, av))
            elif op == C.RANGE:
                ivs.append(av)
            elif op == C.CATEGORY:
                base, neg = self.categories.get(av, (None, None))
                if base is None:
                    self.fail(f"character category {av}")
                ivs.extend(A.complement(base) if neg else base)
            else:
                self.fail(f"set item {op}")
        ivs = self.fold(ivs, flags)
        return A.cset(A.complement(ivs) if negate else ivs)
