"""GBNF-style EBNF (llama.cpp ``grammars/README.md`` syntax, as SGLang users write it) → rules.

``name ::= alternatives`` (a rule ends where the next ``name ::=`` starts); terms: ``"literal"``
(escapes ``\\n \\t \\r \\\\ \\" \\xHH \\uHHHH \\UHHHHHHHH``), ``[a-z\\n]`` / ``[^...]`` classes,
``.`` (any character), rule names, ``( ... )``; postfix ``* + ? {m} {m,} {m,n}``; ``#`` comments.
The start rule is ``root`` (else the first rule).
"""
from __future__ import annotations

import re

from sglite.errors import GrammarError

from . import ast as A

_TOKEN = re.compile(r"""
    (?P<ws>\s+|\#[^\n]*) | (?P<define>::=) | (?P<name>[A-Za-z_][A-Za-z0-9_.-]*)
  | (?P<string>"(?:[^"\\]|\\.)*") | (?P<cls>\[(?:[^\]\\]|\\.)*\]) | (?P<rep>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<op>[|()*+?.])
""", re.X | re.S)
_ESC = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "^": "^",
        "/": "/", "f": "\f", "b": "\b", "0": "\0"}


def _tokens(text: str) -> list:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise GrammarError(f"ebnf: unexpected character {text[pos]!r} at offset {pos}")
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def _unescape(body: str) -> list[int]:
    """Code points of a literal/class body, with escapes resolved."""
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(ord(c))
            i += 1
            continue
        e = body[i + 1] if i + 1 < len(body) else ""
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        if width:
            out.append(int(body[i + 2:i + 2 + width], 16))
            i += 2 + width
        elif e in _ESC:
            out.append(ord(_ESC[e]))
            i += 2
        else:
            raise GrammarError(f"ebnf: unknown escape \\{e}")
    return out


def _char_class(text: str):
    body = text[1:-1]
    negate = body.startswith("^")
    cps, ivs, i = _unescape_marked(body[1:] if negate else body), [], 0
    while i < len(cps):
        if i + 2 < len(cps) and cps[i + 1] == "-":
            ivs.append((cps[i], cps[i + 2]))
            i += 3
        else:
            ivs.append((cps[i], cps[i]) if cps[i] != "-" else (45, 45))
            i += 1
    return A.cset(A.complement(ivs) if negate else ivs)


def _unescape_marked(body: str) -> list:
    """Like _unescape, but an unescaped '-' stays the marker string '-' (a range operator)."""
    parts, out = re.split(r"((?<!\\)-)", body), []
    for p in parts:
        out.extend(["-"] if p == "-" else _unescape(p))
    return out


class _Parser:
    def __init__(self, toks):
        self.toks, self.i = toks, 0

    def peek(self, k=0):
        return self.toks[self.i + k] if self.i + k < len(self.toks) else (None, None)

    def at_rule_start(self):
        return self.peek()[0] == "name" and self.peek(1)[0] == "define"

    def rules(self) -> tuple[dict, str]:
        rules, first = {}, None
        while self.i < len(self.toks):
            kind, name = self.peek()
            if not self.at_rule_start():
                raise GrammarError(f"ebnf: expected 'name ::=' at token {name!r}")
            self.i += 2
            if name in rules:
                raise GrammarError(f"ebnf: rule {name!r} defined twice")
            rules[name] = self.alternatives()
            first = first or name
        if not rules:
            raise GrammarError("ebnf: empty grammar")
        return rules, "root" if "root" in rules else first

    def alternatives(self):
        alts = [self.sequence()]
        while self.peek() == ("op", "|"):
            self.i += 1
            alts.append(self.sequence())
        return A.alt(*alts)

    def sequence(self):
        items = []
        while True:
            kind, val = self.peek()
            if kind is None or self.at_rule_start() or (kind == "op" and val in "|)"):
                return A.seq(*items) if items else A.EMPTY
            items.append(self.postfix(self.atom()))

    def atom(self):
        kind, val = self.peek()
        self.i += 1
        if kind == "string":
            return A.lit("".join(chr(c) for c in _unescape(val[1:-1])))
        if kind == "cls":
            return _char_class(val)
        if kind == "name":
            return A.ref(val)
        if (kind, val) == ("op", "."):
            return A.cset([(0, A.MAX_CODEPOINT)])
        if (kind, val) == ("op", "("):
            node = self.alternatives()
            if self.peek() != ("op", ")"):
                raise GrammarError("ebnf: missing ')'")
            self.i += 1
            return node
        raise GrammarError(f"ebnf: unexpected token {val!r}")

    def postfix(self, node):
        while True:
            kind, val = self.peek()
            if kind == "op" and val in "*+?":
                self.i += 1
                node = A.rep(node, 1 if val == "+" else 0, 1 if val == "?" else -1)
            elif kind == "rep":
                self.i += 1
                lo, _, hi = val[1:-1].replace(" ", "").partition(",")
                node = A.rep(node, int(lo), int(lo) if not _ else (int(hi) if hi else -1))
            else:
                return node


def ebnf_to_rules(text: str) -> tuple[dict, str]:
    """Parse GBNF text → (rules, start rule). Raises GrammarError (syntax, undefined rules)."""
    if not isinstance(text, str):
        raise GrammarError("ebnf grammar must be a str")
    rules, root = _Parser(_tokens(text)).rules()
    for name, body in rules.items():
        for ref in _refs(body):
            if ref not in rules:
                raise GrammarError(f"ebnf: rule {name!r} references undefined rule {ref!r}")
    return rules, root


def _refs(node):
    if node[0] == "ref":
        yield node[1]
    elif node[0] in ("seq", "alt"):
        for c in node[1]:
            yield from _refs(c)
    elif node[0] == "rep":
        yield from _refs(node[1])
