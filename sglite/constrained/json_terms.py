"""JSON lexical pieces as AST: strings (and regexes lifted into JSON string bodies), numbers with
exact integer-valued bounds, ``format`` regexes, keys that differ from a set of names."""
from __future__ import annotations

import json

from sglite.errors import GrammarError

from . import ast as A
from .regex_parse import parse_regex

_ESC = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
SPECIAL = ((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
_HEX = A.cset([(48, 57), (65, 70), (97, 102)])
ESCAPE = A.seq(A.lit("\\"), A.alt(A.chars('"\\/bfnrt'), A.seq(A.lit("u"), A.rep(_HEX, 4, 4))))
RAW_CHAR = A.cset(A.complement(SPECIAL))
CHAR = A.alt(RAW_CHAR, ESCAPE)
STRING = A.seq(A.lit('"'), A.star(CHAR), A.lit('"'))
_D = A.cset([(48, 57)])
_D19 = A.cset([(49, 57)])
UINT = A.alt(A.lit("0"), A.seq(_D19, A.star(_D)))
INTEGER = A.seq(A.opt(A.lit("-")), UINT)
_FRAC = A.seq(A.lit("."), A.rep(_D, 1, -1))
_EXP = A.seq(A.chars("eE"), A.opt(A.chars("+-")), A.rep(_D, 1, -1))
NUMBER = A.seq(INTEGER, A.opt(_FRAC), A.opt(_EXP))


def encode_char(cp: int) -> str:
    """Canonical JSON encoding of one code point (as ``json.dumps(ensure_ascii=False)`` writes it)."""
    return json.dumps(chr(cp), ensure_ascii=False)[1:-1]


def json_text(value) -> bytes:
    """Compact JSON serialization of a ``const``/``enum`` value."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def value_node(value):
    """Compact JSON of a ``const``/``enum`` value; integral numbers also as ``1.0`` (JSON equality)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, list, dict)):
        return A.lit(json_text(value))
    if isinstance(value, (int, float)):
        if value != value or value in (float("inf"), float("-inf")) or value != int(value):
            return A.lit(json_text(value))
        whole = str(int(value))
        return A.seq(A.lit(whole), A.opt(A.seq(A.lit("."), A.rep(A.lit("0"), 1, -1))))
    if isinstance(value, list):
        parts = [A.lit("[")]
        for i, v in enumerate(value):
            parts += [A.lit(",")] * (i > 0) + [value_node(v)]
        return A.seq(*parts, A.lit("]"))
    parts = [A.lit("{")]
    for i, (k, v) in enumerate(value.items()):
        parts += [A.lit(",")] * (i > 0) + [A.lit(json_text(k) + b":"), value_node(v)]
    return A.seq(*parts, A.lit("}"))


def to_json_body(node):
    """Lift a regex AST over decoded characters into one over JSON string-body bytes."""
    kind = node[0]
    if kind == "cset":
        plain = A.subtract(node[1], SPECIAL)
        parts = [A.cset(plain)] if plain else []
        for lo, hi in A.intersect(node[1], SPECIAL):
            parts.extend(A.lit(encode_char(cp)) for cp in range(lo, hi + 1))
        return A.alt(*parts) if parts else A.NOTHING
    if kind == "lit":
        return A.lit("".join(encode_char(ord(c)) for c in node[1].decode()))
    if kind in ("seq", "alt"):
        return (kind, tuple(to_json_body(c) for c in node[1]))
    if kind == "rep":
        return ("rep", to_json_body(node[1]), node[2], node[3])
    raise AssertionError(kind)


def pattern_body(pattern: str, where: str):
    """JSON string body for an ECMA-262 ``pattern`` (search semantics: unanchored unless ^/$)."""
    try:
        node = parse_regex(pattern, ecma=True)
    except GrammarError as e:
        raise GrammarError(f"{where}: {e}") from None
    body = to_json_body(node)
    anything = A.star(CHAR)
    head = A.EMPTY if pattern.startswith("^") else anything
    tail = A.EMPTY if pattern.endswith("$") and not pattern.endswith("\\$") else anything
    return A.seq(head, body, tail)


def key_not_in(names) -> object:
    """A JSON string (with quotes) whose decoded value is none of ``names`` (raw-char keys exact)."""
    trie: dict = {}
    for n in names:
        node = trie
        for ch in n:
            node = node.setdefault(ch, {})
        node[None] = {}
    anything = A.seq(A.star(CHAR), A.lit('"'))

    def build(node, is_root):
        alts = []
        if None not in node:
            alts.append(A.lit('"'))
        kids = [c for c in node if c is not None]
        other = A.subtract(A.complement(SPECIAL), [(ord(c), ord(c)) for c in kids])
        simple = "".join(e for e in '"\\/bfnrt' if json.loads(f'"\\{e}"') not in kids)
        esc = A.seq(A.lit("\\"), A.alt(A.chars(simple), A.seq(A.lit("u"), A.rep(_HEX, 4, 4))))
        alts.append(A.seq(A.alt(A.cset(other), esc), anything))
        for c in kids:
            alts.append(A.seq(A.lit(encode_char(ord(c))), build(node[c], False)))
        return A.alt(*alts)

    return A.seq(A.lit('"'), build(trie, True))


def _same_len(lo: str, hi: str):
    if not lo:
        return A.EMPTY
    if lo[0] == hi[0]:
        return A.seq(A.lit(lo[0]), _same_len(lo[1:], hi[1:]))
    n = len(lo) - 1
    if set(lo[1:]) <= {"0"} and set(hi[1:]) <= {"9"}:
        return A.seq(A.cset([(ord(lo[0]), ord(hi[0]))]), A.rep(_D, n, n))
    alts = [A.seq(A.lit(lo[0]), _same_len(lo[1:], "9" * n))]
    if ord(hi[0]) - ord(lo[0]) > 1:
        alts.append(A.seq(A.cset([(ord(lo[0]) + 1, ord(hi[0]) - 1)]), A.rep(_D, n, n)))
    alts.append(A.seq(A.lit(hi[0]), _same_len("0" * n, hi[1:])))
    return A.alt(*alts)


def uint_range(lo: int, hi: int | None):
    """Decimal naturals in ``[lo, hi]`` (``hi=None``: unbounded), no leading zeros."""
    alts = []
    top = len(str(hi)) if hi is not None else len(str(lo))
    for d in range(len(str(lo)), top + 1):
        a = max(lo, 10 ** (d - 1) if d > 1 else 0)
        b = min(hi, 10 ** d - 1) if hi is not None else 10 ** d - 1
        if a <= b:
            alts.append(_same_len(str(a), str(b)))
    if hi is None:
        alts.append(A.seq(_D19, A.rep(_D, top, -1)))
    return A.alt(*alts) if alts else A.NOTHING


def _mag_range(lo: int, lo_ex: bool, hi: int | None, hi_ex: bool, frac: bool):
    """Non-negative decimals ``m`` with ``lo <(=) m <(=) hi`` (integer bounds), no exponent."""
    any_f = A.opt(_FRAC) if frac else A.EMPTY
    alts = []
    ilo, ihi = lo + 1 if lo_ex else lo, None if hi is None else hi - 1
    if ihi is None or ilo <= ihi:
        alts.append(A.seq(uint_range(ilo, ihi), any_f))
    if frac and lo_ex and (hi is None or lo < hi):
        alts.append(A.seq(A.lit(str(lo)), A.lit("."), A.star(_D), _D19, A.star(_D)))
    if hi is not None and not hi_ex and (hi > lo or (hi == lo and not lo_ex)):
        zero_frac = A.opt(A.seq(A.lit("."), A.rep(A.lit("0"), 1, -1))) if frac else A.EMPTY
        alts.append(A.seq(A.lit(str(hi)), zero_frac))
    return A.alt(*alts) if alts else A.NOTHING


def number_range(lo, lo_ex: bool, hi, hi_ex: bool, integer: bool, where: str):
    """JSON numbers (integers if ``integer``) within the bounds (None = unbounded)."""
    if lo is None and hi is None:
        return INTEGER if integer else NUMBER
    for name, v in (("minimum", lo), ("maximum", hi)):
        if v is not None and (v != v or v in (float("inf"), float("-inf"))):
            raise GrammarError(f"{where}: {name} {v} is not a finite number")
    if not integer:
        from .json_numbers import decimal_range

        return decimal_range(lo, lo_ex, hi, hi_ex)
    if integer:
        import math
        lo = None if lo is None else (math.floor(lo) + 1 if lo_ex else math.ceil(lo))
        hi = None if hi is None else (math.ceil(hi) - 1 if hi_ex else math.floor(hi))
        lo_ex = hi_ex = False
    lo = None if lo is None else int(lo)
    hi = None if hi is None else int(hi)
    alts = []
    frac = not integer
    if hi is None or hi >= 0:
        plo, plo_ex = (0, False) if lo is None or lo < 0 else (lo, lo_ex)
        alts.append(_mag_range(plo, plo_ex, hi, hi_ex, frac))
    if lo is None or lo < 0:
        nlo, nlo_ex = (0, True) if hi is None or hi >= 0 else (-hi, hi_ex)
        alts.append(A.seq(A.lit("-"), _mag_range(nlo, nlo_ex, None if lo is None else -lo, lo_ex, frac)))
    return A.alt(*alts)


_DATE = r"\d{4}-(02-(0[1-9]|1\d|2\d)|(0[469]|11)-(0[1-9]|[12]\d|30)|(0[13578]|1[02])-(0[1-9]|[12]\d|3[01]))"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"
_LABEL = r"[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_H = r"[0-9a-fA-F]{1,4}"
_IPV6 = "|".join([
    rf"({_H}:){{7}}{_H}", rf"({_H}:){{1,7}}:", rf"({_H}:){{1,6}}:{_H}", rf"({_H}:){{1,5}}(:{_H}){{1,2}}",
    rf"({_H}:){{1,4}}(:{_H}){{1,3}}", rf"({_H}:){{1,3}}(:{_H}){{1,4}}", rf"({_H}:){{1,2}}(:{_H}){{1,5}}",
    rf"{_H}:(:{_H}){{1,6}}", rf":((:{_H}){{1,7}}|:)", rf"({_H}:){{6}}{_OCTET}(\.{_OCTET}){{3}}",
    rf"::(ffff(:0{{1,4}})?:)?{_OCTET}(\.{_OCTET}){{3}}", rf"({_H}:){{1,4}}:{_OCTET}(\.{_OCTET}){{3}}",
])
_DUR_DATE = r"\d+Y(\d+M(\d+D)?)?|\d+M(\d+D)?|\d+D"
_DUR_TIME = r"T(\d+H(\d+M(\d+S)?)?|\d+M(\d+S)?|\d+S)"
FORMATS = {
    "date": _DATE, "time": _TIME, "date-time": rf"{_DATE}[Tt]{_TIME}",
    "duration": rf"P(({_DUR_DATE})({_DUR_TIME})?|{_DUR_TIME}|\d+W)",
    "email": rf"[a-zA-Z0-9!#$%&'*+/=?^_`{{|}}~-]+(\.[a-zA-Z0-9!#$%&'*+/=?^_`{{|}}~-]+)*@{_LABEL}(\.{_LABEL})*",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "uri": r"[a-zA-Z][a-zA-Z0-9+.-]*:[^\s\"\\<>{}|^`]*",
    "ipv4": rf"{_OCTET}(\.{_OCTET}){{3}}", "ipv6": _IPV6, "hostname": rf"{_LABEL}(\.{_LABEL})*",
}


def format_body(fmt: str, where: str):
    """JSON string body for a ``format`` value. Raises GrammarError for unknown formats."""
    if fmt not in FORMATS:
        raise GrammarError(f"{where}: format {fmt!r} is not supported (known: {', '.join(FORMATS)})")
    return to_json_body(parse_regex(FORMATS[fmt]))


def count_keyword(schema: dict, key: str, path: str):
    """The non-negative integer value of a counting keyword (``minLength``, ``maxItems``, ...), or
    None when absent. Raises GrammarError naming the keyword and its JSON path otherwise."""
    v = schema.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 0:
        raise GrammarError(f"{path}/{key}: must be a non-negative integer, got {v!r}")
    return int(v)
