"""EBNF (GBNF) and lark grammars, builtin grammars, pushdown matcher behaviour."""
import pytest
import torch

from sglite import grammars
from sglite.bench.grammar_coverage import accepts, byte_backend
from sglite.errors import GrammarError

ARITH = r'''
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*   # comment
factor ::= [0-9]+ | "(" expr ")"
'''


@pytest.fixture(scope="module")
def backend():
    return byte_backend()


@pytest.mark.parametrize("text,valid", [
    ("1+2*3", True), ("(1+2)*3", True), ("((4))", True), ("1+", False), ("(1", False), ("", False),
])
def test_ebnf_recursive(backend, text, valid):
    assert accepts(backend.compile("ebnf", ARITH), text.encode()) == valid


def test_ebnf_classes_escapes_repeats(backend):
    g = backend.compile("ebnf", r'root ::= "yes" | "no" [\n]? [^a-c\]]{2,3} | "\u00e9" x' + "\nx ::= [a-z]?")
    for text, valid in [("yes", True), ("no\nxy", True), ("noab", False), ("no]]", False), ("é", True), ("éq", True)]:
        assert accepts(g, text.encode()) == valid, text


def test_ebnf_left_recursion_rewritten(backend):
    g = backend.compile("ebnf", 'root ::= root "a" | "b"')
    assert accepts(g, b"baaa") and not accepts(g, b"ab")


@pytest.mark.parametrize("kind,text,needle", [
    ("ebnf", "root ::= foo", "undefined rule 'foo'"), ("ebnf", "root ::= (", "missing ')'"),
    ("ebnf", "root ::= a\na ::= b\nb ::= a", "derives no finite string"),
    ("ebnf", 'root ::= a\na ::= b "x" | "y"\nb ::= a "z"', "left recursion"),
    ("lark", "start: foo", "foo"), ("lark", "start: /a(?<=a)/", "lookbehind"),
])
def test_bad_grammars_raise(backend, kind, text, needle):
    with pytest.raises(GrammarError) as e:
        backend.compile(kind, text)
    assert needle in str(e.value)


def test_builtin_grammars_listed():
    assert {"json", "sql"} <= set(grammars.available())
    assert "%ignore" in grammars.read("json")
    with pytest.raises(ValueError, match="available"):
        grammars.read("nope")


@pytest.mark.parametrize("text,valid", [
    ('{"a": [1, 2.5e3, {"b": null}], "c": "x\\n"}', True), ("[1,]", False), ("  true ", True),
    ('{"a" 1}', False), ('["\\q"]', False),
])
def test_lark_json(backend, text, valid):
    assert accepts(backend.compile("lark", grammars.read("json")), text.encode()) == valid


@pytest.mark.parametrize("text,valid", [
    ("SELECT name, count(*) FROM users u WHERE age >= 18 AND city = 'Paris' GROUP BY name "
     "ORDER BY name DESC LIMIT 10;", True),
    ("select * from t", True), ("SELECT a FROM t WHERE a IS NOT NULL", True),
    ("SELECT FROM t", False), ("SELECT a FROM", False), ("SELECT a FROM t LIMIT x", False),
])
def test_lark_sql(backend, text, valid):
    assert accepts(backend.compile("lark", grammars.read("sql")), text.encode()) == valid


def test_pushdown_mask_agrees_with_accept_token(backend):
    g = backend.compile("ebnf", ARITH)
    m = g.matcher()
    bm = torch.zeros(1, 9, dtype=torch.int32)
    for ch in b"(12+(3)":
        m.fill_next_token_bitmask(bm, 0)
        words = bm[0].tolist()
        for t in range(257):
            allowed = bool((words[t // 32] >> (t % 32)) & 1)
            assert m.fork().accept_token(t) == allowed, (chr(ch), t)
        assert m.accept_token(ch)
    m.rollback(2)  # back to "(12+("
    assert not m.accept_token(ord(")")) and m.accept_token(ord("7"))
    assert m.accept_token(ord(")")) and m.accept_token(ord(")")) and m.accept_token(256) and m.is_terminated()
