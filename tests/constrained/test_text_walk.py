"""Walking text through a matcher (``accept_string``): the one-class step of unexpanded DFA rows and
the count-shifted step of counted regions give the same verdicts as Python's ``re``, and a long
bounded string is walked without one subset construction per character."""
from __future__ import annotations

import random
import re

import pytest

from sglite.constrained import GrammarBackend, TokenizerInfo

BYTES = TokenizerInfo([bytes([i]) for i in range(256)], {0}, 256)

PATTERNS = [
    r"[a-z]{5,60}x",
    r"(ab|c){3,40}",
    r"(a{2,5}b){3,30}",
    r"[a-c]{0,50}(d[a-c]{10,20})?",
    r"(x[a-b]{1,12}){2,15}y?",
    r"[a-z ]{1,300}",
    r"(a?){5,60}c",
    r"((ab){3,10}c){2,20}",
    r"(c[ab]{3,9}){2,40}",
]


def _random_text(rng, pattern):
    alphabet = "abcdxy " if "x" in pattern or "y" in pattern or "d" in pattern else "abc "
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 90)))


def _mutated_match(rng, pattern):
    """A string that matches ``pattern`` (built by rejection-free construction for these shapes)."""
    for _ in range(2000):
        s = _random_text(rng, pattern)
        if re.fullmatch(pattern, s):
            return s
    return None


@pytest.mark.parametrize("pattern", PATTERNS)
def test_accept_string_agrees_with_re(pattern):
    rng = random.Random(hash(pattern) & 0xFFFF)
    texts = [_random_text(rng, pattern) for _ in range(150)]
    # near-misses around the bounds: long runs of one repeated unit
    for unit in ("a", "ab", "c", "aab", "xab", "abc"):
        for n in (1, 2, 3, 5, 19, 20, 21, 29, 30, 31, 39, 40, 41, 59, 60, 61, 299, 300, 301):
            texts.append(unit * n)
            texts.append(unit * n + "x")
    compiled = GrammarBackend(BYTES).compile("regex", pattern)
    bytewise = GrammarBackend(BYTES).compile("regex", pattern)  # its own DFA: another cache history
    for text in texts:
        want = re.fullmatch(pattern, text) is not None
        m = compiled.matcher()
        got = m.accept_string(text) and m.is_accepting()
        assert got == want, (pattern, text)
        m2 = bytewise.matcher()  # byte by byte agrees too
        assert (all(m2.accept_string(ch) for ch in text) and m2.is_accepting()) == want, (pattern, text)


def test_long_bounded_string_reuses_shifted_steps():
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5000}},
              "required": ["s"], "additionalProperties": False}
    compiled = GrammarBackend(BYTES).compile("json_schema", schema)
    body = ("hello wörld \\\" " * 400)[:4990]
    m = compiled.matcher()
    assert m.accept_string('{"s":"' + body)
    dfa = compiled.root
    # one real construction per (shape, byte class), not per character
    assert len(dfa._shape_steps) < 100 < len(body)
    assert m.accept_string('"}') and m.is_accepting()
    over = compiled.matcher()
    assert not over.accept_string('{"s":"' + "a" * 5001)
    exact = compiled.matcher()
    assert exact.accept_string('{"s":"' + "a" * 5000 + '"}') and exact.is_accepting()
