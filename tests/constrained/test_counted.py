"""Counted repetitions with large bounds: a counter over one copy of the body instead of one NFA copy
per repetition (sglite.constrained.nfa / dfa / counted), checked against unrolled automata, Python's
``re`` and brute-force length counting, on a byte vocabulary (fast, no model files)."""
import json
import random
import re

import numpy as np
import pytest

from sglite.bench.grammar_coverage import accepts, byte_backend
from sglite.constrained import ast as A
from sglite.constrained import json_terms as J
from sglite.constrained.counted import CountedDFA
from sglite.constrained.dfa import DEAD, LazyDFA
from sglite.constrained.fsm_ops import from_node, intersect_nodes, product
from sglite.constrained.grammar import coreachable
from sglite.constrained.nfa import NFA, UNROLL_LIMIT
from sglite.constrained.regex_parse import parse_regex


@pytest.fixture(scope="module")
def backend():
    return byte_backend()


def lazy(node, unroll_limit=UNROLL_LIMIT):
    nfa = NFA(unroll_limit=unroll_limit)
    final = nfa.new()
    start = nfa.build(node, final)
    return nfa, LazyDFA(nfa, start, final, coreachable(nfa, final))


def run(dfa, data: bytes) -> bool:
    s = dfa.start
    for b in data:
        s = dfa.step(s, b)
        if s == DEAD:
            return False
    return bool(dfa.acc[s])


def feed_bytes(compiled, data: bytes):
    """State after feeding ``data`` one byte at a time (None once refused)."""
    s = compiled.initial_state
    for b in data:
        s = compiled.step_bytes(s, bytes([b]))
        if s is None:
            return None
    return s


def explore(dfa):
    """All reachable DFA states, and those that cannot reach acceptance (dead ends)."""
    seen, todo = {dfa.start}, [dfa.start]
    while todo:
        x = todo.pop()
        dfa.expand(x)
        for y in np.unique(dfa.trans[x]).tolist():
            if y and y not in seen:
                seen.add(y)
                todo.append(y)
    n = len(dfa.sets)
    good = dfa.acc[:n].copy()
    while True:
        more = good | good[dfa.trans[:n]].any(axis=1)
        more[DEAD] = False
        if (more == good).all():
            break
        good = more
    return seen, [x for x in seen if not good[x]]


@pytest.mark.parametrize("pattern,lo,hi", [("a{0,3000}", 0, 3000), ("[a-z]{5,2500}", 5, 2500),
                                           ("(ab){70,900}", 140, 1800)])
def test_regex_boundary_lengths_byte_by_byte(backend, pattern, lo, hi):
    g = backend.compile("regex", pattern)
    assert len(g.automaton.dfas[g.automaton.root].nfa.eps) < 20  # one body copy, not hi
    unit = "ab" if "ab" in pattern else "a"
    for n in sorted({max(lo - 1, 0), lo, lo + 1, hi - 1, hi, hi + 1}):
        text = (unit * n)[:n]
        want = re.fullmatch(pattern, text) is not None
        s = feed_bytes(g, text.encode())
        assert (s is not None and g.accepting(s)) == want, (pattern, n)


@pytest.mark.parametrize("pattern,n_ok,n_bad", [("a{0,100000}", [0, 1, 700], []),
                                                ("[a-z]{5,70000}", [5, 6, 300], [0, 4]),
                                                ("(x[0-9]{2,8000}y){2}", [], [0, 3])])
def test_huge_bounds_compile_small(backend, pattern, n_ok, n_bad):
    g = backend.compile("regex", pattern)
    nfa = g.automaton.dfas[g.automaton.root].nfa
    assert len(nfa.eps) < 40 and nfa.counters
    for n in n_ok:
        assert accepts(g, b"a" * n)
    for n in n_bad:
        assert not accepts(g, b"a" * n)
    if pattern.startswith("(x"):
        assert accepts(g, b"x12yx" + b"5" * 8000 + b"y")
        assert not accepts(g, b"x12yx" + b"5" * 8001 + b"y")


PATTERNS = [r"a{0,100}", r"[a-z]{5,70}", r"(ab|a){3,90}", r"(a?){70,80}", r"(a{2,70}b){65,67}c",
            r"(x|y{0,100}){100,}", r"é{66,67}", r"(ab){0,65}a", r"a{100,}", r"(a|aa){65,70}",
            r"((ab){70}|c){66}", r"(a|b?){66,70}c", r"(x(yz){0,66}){66,70}"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_counted_equals_unrolled(pattern):
    """Same language and the same number of DFA states as the unrolled NFA (nullable, ambiguous,
    nested and unbounded bodies); no dead end among the reachable states."""
    node = parse_regex(pattern)
    n1, counted = lazy(node)
    n2, unrolled = lazy(node, unroll_limit=10**9)
    assert n1.counters and len(n1.eps) < 20 < len(n2.eps)
    alpha = sorted({c for c in pattern if c.isalpha() or c == "é"})
    rng = random.Random(pattern)
    for _ in range(150):
        n = rng.choice([rng.randint(0, 300), rng.randint(60, 150)])
        pool = alpha if rng.random() < 0.5 else alpha[:2]
        text = "".join(rng.choice(pool) for _ in range(n))
        if rng.random() < 0.3:
            text = alpha[0] * n + text[:3]
        data = text.encode()
        assert run(counted, data) == run(unrolled, data), (pattern, text)
    if len(n2.eps) < 2000:  # every reachable state (the nested ones have thousands)
        seen_c, bad_c = explore(counted)
        seen_u, bad_u = explore(unrolled)
        assert bad_c == [] and len(seen_c) <= len(seen_u)


def test_counter_refs_inside_body(backend):
    """A recursive rule called from inside a counted body (array of trees, maxItems above the limit)."""
    tree = {"$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}, "maxItems": 2}},
            "type": "array", "items": {"$ref": "#/$defs/t"}, "minItems": 70, "maxItems": 100}
    g = backend.compile("json_schema", tree)
    assert g.pushdown
    for n, want in [(69, False), (70, True), (100, True), (101, False)]:
        items = [[[], [[]]] if i % 7 == 0 else [] for i in range(n)]
        assert accepts(g, json.dumps(items, separators=(",", ":")).encode()) == want, n


@pytest.mark.parametrize("n,want", [(299, True), (300, True), (301, False)])
def test_json_max_length_counts_characters_not_bytes(backend, n, want):
    """A multi-byte character, a raw 4-byte emoji, a short escape and a \\u escape each count as one."""
    g = backend.compile("json_schema", {"type": "string", "minLength": 299, "maxLength": 300})
    pieces = ["é", "😀", "\\n", "\\u00e9", 'x', '\\"']
    body = "".join(pieces[i % len(pieces)] for i in range(n))
    assert len(json.loads(f'"{body}"')) == n
    assert accepts(g, f'"{body}"'.encode()) == want


def test_json_max_length_131072(backend):
    g = backend.compile("json_schema", {"type": "object", "required": ["body"], "additionalProperties": False,
                                        "properties": {"body": {"type": "string", "maxLength": 131072,
                                                                "minLength": 1}}})
    nfa = g.automaton.dfas[g.automaton.root].nfa
    assert len(nfa.eps) < 200 and len(nfa.counters) == 1
    assert accepts(g, '{"body":"é😀\\n\\u00e9 x"}'.encode())
    assert not accepts(g, b'{"body":""}')
    assert not accepts(g, b'{"body":"\\x"}')
    c = nfa.counters[0]
    assert (c.lo, c.hi) == (1, 131072)


@pytest.mark.parametrize("fmt,lo,hi", [("email", 60, 66), ("hostname", 3, 80), ("date-time", 20, 70),
                                       ("uuid", 0, 100), ("uuid", 37, 100)])
def test_counted_intersection_matches_explicit_product(fmt, lo, hi):
    """Format ∩ length as a counted product: same language as the explicit product, no dead ends."""
    body = J.format_body(fmt, "t")
    counted = intersect_nodes(body, A.rep(J.CHAR, lo, hi), "t")
    explicit = product(from_node(body, "t"), from_node(A.rep(J.CHAR, lo, hi), "t"), False, "t")
    if explicit is None:
        assert counted == A.NOTHING
        return
    assert isinstance(counted[1], CountedDFA) and counted[1].dfa.n <= explicit.n
    _, dfa = lazy(counted)
    _, bad = explore(dfa)
    assert bad == []
    rng = random.Random(fmt)
    rx = re.compile(J.FORMATS[fmt])
    samples = {"email": "a.b@c.de", "hostname": "ab.cd", "date-time": "2020-01-01T00:00:00Z",
               "uuid": "0" * 8 + "-0000-0000-0000-" + "0" * 12}
    for _ in range(120):
        text = samples[fmt]
        n = rng.randint(max(lo - 3, 0), hi + 3)
        if fmt == "email":
            text = "é" * rng.randint(0, 1) + "a" * max(n - len(text), 0) + text
        elif fmt == "hostname":
            text = ".".join(["ab"] * max(1, n // 3))
        elif fmt == "date-time":
            text = text[:-1] + "." + "1" * max(n - len(text), 1) + "Z"
        data = text.encode()
        want = rx.fullmatch(text) is not None and lo <= len(text) <= hi
        assert explicit.accepts(data) == want
        assert run(dfa, data) == want == counted[1].accepts(data), text


def test_email_with_max_length_1024(backend):
    """maskbench: ``format: email`` with ``maxLength: 1024`` (explicit product was over 200k states)."""
    schema = {"type": "string", "format": "email", "maxLength": 1024}
    g = backend.compile("json_schema", schema)
    assert len(g.automaton.dfas[g.automaton.root].nfa.eps) < 1000
    local = "a" * (1024 - len("@example.com"))
    assert accepts(g, f'"{local}@example.com"'.encode())
    assert not accepts(g, f'"{local}a@example.com"'.encode())
    assert not accepts(g, b'"no-at-sign"')
    s = feed_bytes(g, f'"{local}@example.co'.encode())  # 1023 characters: one more letter, or the end
    assert s is not None and ord("m") in g.live_bytes(s) and ord('"') in g.live_bytes(s)
    assert g.live_bytes(g.step_bytes(s, b"m")) == {ord('"')}  # a "." would need 2 more characters
