"""JSON numbers within decimal bounds (``minimum``/``maximum``/``exclusive*`` of any decimal value,
e.g. ``0.25``) and ``multipleOf`` where it is regular and cheap, as grammar AST.

A bounded number is written without an exponent (a sound narrowing: every accepted text is in
range). Its magnitude ``I.F`` is split on the integer part: between the bounds' integer parts any
fraction is allowed; at a bound's integer part the fraction digits are compared with the bound's,
digit by digit, as zero-padded decimal fractions (the digit-by-digit construction of numeric range
regexes, e.g. in outlines' and llguidance's JSON compilers, extended to fractions).
"""
from __future__ import annotations

import math
from decimal import Decimal

from sglite.errors import GrammarError

from . import ast as A

_D = A.cset([(48, 57)])
_ANY = A.star(_D)


def _frac_digits(x: Decimal) -> str:
    """Fraction digits of ``x >= 0`` without trailing zeros ("" when integral)."""
    t = format(x - math.floor(x), "f")
    return t.split(".")[1].rstrip("0") if "." in t else ""


def _digits(lo, lo_ex, hi, hi_ex, nonempty: bool):
    """Digit strings ``s`` (empty allowed unless ``nonempty``) with lo <(=) 0.s <(=) hi, where lo/hi
    are fraction digit strings or None (no bound)."""
    if lo == "" and not lo_ex:
        lo = None
    if hi is not None and hi == "" and hi_ex:
        return A.NOTHING
    if lo is None and hi is None:
        return A.rep(_D, 1, -1) if nonempty else _ANY
    if hi == "":  # 0.s <= 0: zeros only
        return A.NOTHING if lo is not None else A.rep(A.lit("0"), 1 if nonempty else 0, -1)
    if lo == "" and hi is None:  # 0.s > 0: some non-zero digit
        return A.seq(A.star(A.lit("0")), A.cset([(49, 57)]), _ANY)
    alts = []
    if not nonempty and lo is None:  # s = "" is 0.0, below any non-zero upper bound
        alts.append(A.EMPTY)
    l0 = int(lo[0]) if lo else 0
    h0 = int(hi[0]) if hi else 9
    groups: dict = {}
    for c in range(10):
        if lo is not None and c < l0 or hi is not None and c > h0:
            continue
        low = (lo[1:], lo_ex) if lo is not None and c == l0 else (None, False)
        up = (hi[1:], hi_ex) if hi is not None and c == h0 else (None, False)
        groups.setdefault((low, up), []).append(c)
    for (low, up), cs in groups.items():
        rest = _digits(low[0], low[1], up[0], up[1], False)
        if rest != A.NOTHING:
            alts.append(A.seq(A.cset([(48 + c, 48 + c) for c in cs]), rest))
    return A.alt(*alts) if alts else A.NOTHING


def _fraction(lo, lo_ex, hi, hi_ex):
    """Optional ``.digits`` whose value 0.digits is within the fraction bounds."""
    alts = []
    zero_ok = (lo is None or (set(lo) <= {"0"} and not lo_ex)) and (hi is None or not (hi_ex and set(hi) <= {"0"}))
    if zero_ok:
        alts.append(A.EMPTY)
    body = _digits(lo, lo_ex, hi, hi_ex, True)
    if body != A.NOTHING:
        alts.append(A.seq(A.lit("."), body))
    return A.alt(*alts) if alts else A.NOTHING


def magnitude_range(lo: Decimal, lo_ex: bool, hi, hi_ex: bool):
    """Non-negative decimals ``I(.F)?`` (no exponent) with ``lo <(=) m <(=) hi`` (``hi`` None: none)."""
    from .json_terms import uint_range

    li, lf = math.floor(lo), _frac_digits(lo)
    if hi is not None and hi < lo:
        return A.NOTHING
    alts = []
    if hi is None:
        alts.append(A.seq(A.lit(str(li)), _fraction(lf, lo_ex, None, False)))
        alts.append(A.seq(uint_range(li + 1, None), _ANY_FRACTION))
    else:
        hi_i, hf = math.floor(hi), _frac_digits(hi)
        if li == hi_i:
            alts.append(A.seq(A.lit(str(li)), _fraction(lf, lo_ex, hf, hi_ex)))
        else:
            alts.append(A.seq(A.lit(str(li)), _fraction(lf, lo_ex, None, False)))
            if li + 1 <= hi_i - 1:
                alts.append(A.seq(uint_range(li + 1, hi_i - 1), _ANY_FRACTION))
            alts.append(A.seq(A.lit(str(hi_i)), _fraction(None, False, hf, hi_ex)))
    alts = [a for a in alts if a != A.NOTHING and A.NOTHING not in (a[1] if a[0] == "seq" else ())]
    return A.alt(*alts) if alts else A.NOTHING


_ANY_FRACTION = A.opt(A.seq(A.lit("."), A.rep(_D, 1, -1)))


def decimal_range(lo, lo_ex: bool, hi, hi_ex: bool):
    """JSON numbers (no exponent) in the range; ``lo``/``hi`` are numbers or None."""
    lo = None if lo is None else Decimal(str(lo))
    hi = None if hi is None else Decimal(str(hi))
    alts = []
    if hi is None or hi >= 0:
        plo, plo_ex = (Decimal(0), False) if lo is None or lo < 0 else (lo, lo_ex)
        alts.append(magnitude_range(plo, plo_ex, hi, hi_ex))
    if lo is None or lo < 0:  # "-m" with m > 0
        nlo, nlo_ex = (Decimal(0), True) if hi is None or hi >= 0 else (-hi, hi_ex)
        alts.append(A.seq(A.lit("-"), magnitude_range(nlo, nlo_ex, None if lo is None else -lo, lo_ex)))
    alts = [a for a in alts if a != A.NOTHING]
    return A.alt(*alts) if alts else A.NOTHING


def multiple_of(mult, integer: bool, lo, lo_ex: bool, hi, hi_ex: bool, where: str):
    """Numbers that are multiples of ``mult`` (within the bounds), where regular and small:
    an integer multiple with finite bounds (at most 4096 values, enumerated), or ``10**-k`` without
    bounds. Raises GrammarError otherwise."""
    from .json_terms import INTEGER, value_node

    if isinstance(mult, bool) or not isinstance(mult, (int, float)) or mult <= 0:
        raise GrammarError(f"{where}/multipleOf: must be a positive number")
    m = Decimal(str(mult))
    if m == m.to_integral_value() and lo is not None and hi is not None:
        k = int(m)
        first = math.ceil(Decimal(str(lo)) / k) * k
        last = math.floor(Decimal(str(hi)) / k) * k
        if lo_ex and first == Decimal(str(lo)):
            first += k
        if hi_ex and last == Decimal(str(hi)):
            last -= k
        if (last - first) // k > 4096:
            raise GrammarError(f"{where}/multipleOf: more than 4096 multiples within the bounds is not supported")
        vals = range(int(first), int(last) + 1, k)
        return A.alt(*[value_node(v) for v in vals]) if len(vals) else A.NOTHING
    digits = -m.normalize().as_tuple().exponent
    if lo is None and hi is None and m.normalize() == Decimal(1).scaleb(-digits) and digits > 0 and not integer:
        return A.seq(INTEGER, A.opt(A.seq(A.lit("."), A.rep(_D, 1, digits), A.star(A.lit("0")))))
    raise GrammarError(f"{where}/multipleOf: multipleOf {mult} is only supported as an integer with both "
                       "bounds, or as 10^-k on an unbounded number")
