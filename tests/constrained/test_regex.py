"""Regex path of sglite.constrained on a small synthetic byte vocabulary (fast, no model files)."""
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglite.constrained import GrammarBackend, TokenizerInfo
from sglite.errors import GrammarError

EOS = 256
MULTI = ["ab", "ba", "abc", "é", "éa", "a.", ".a", "Mr", "Mrs", "rs", "\n", "aaaa", "cé"]
VOCAB = [bytes([b]) for b in range(256)] + [None] + [s.encode() for s in MULTI]


@pytest.fixture(scope="module")
def backend():
    return GrammarBackend(TokenizerInfo(list(VOCAB), {EOS}))


def tid(s: str) -> int:
    return VOCAB.index(s.encode())


def allowed(m, vocab_size=len(VOCAB)):
    bm = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    m.fill_next_token_bitmask(bm, 0)
    words = bm[0].tolist()
    return {t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1}


def feed(m, data: bytes) -> bool:
    return all(m.accept_token(b) for b in data)


def test_full_language_not_leftmost_first(backend):
    m = backend.compile("regex", "(Mr|Mrs)").matcher()
    assert {tid("M"), tid("Mr"), tid("Mrs")} <= allowed(m)
    assert m.accept_token(tid("Mrs")) and m.is_terminated()
    m = backend.compile("regex", "(Mr|Mrs)").matcher()
    assert m.accept_token(tid("Mr"))
    assert EOS in allowed(m) and tid("s") in allowed(m) and not m.is_terminated()
    m = backend.compile("regex", r"a(\.a)*").matcher()
    assert m.accept_token(tid("a"))
    assert {tid("."), tid(".a"), EOS} <= allowed(m)


def test_eos_only_in_accepting_states(backend):
    m = backend.compile("regex", "ab+").matcher()
    assert EOS not in allowed(m) and not m.accept_token(EOS)
    assert m.accept_token(tid("ab"))
    assert EOS in allowed(m)
    assert m.accept_token(EOS) and m.is_terminated()
    assert allowed(m) == set() and not m.accept_token(tid("b"))


def test_multibyte_utf8_split_across_tokens(backend):
    m = backend.compile("regex", "[é]+x").matcher()
    assert m.accept_token(0xC3) and allowed(m) == {0xA9}
    assert m.accept_token(0xA9) and m.accept_token(tid("é")) and m.accept_token(tid("x"))
    m = backend.compile("regex", "[^a]").matcher()
    assert 0xC3 in allowed(m) and tid("é") in allowed(m) and tid("a") not in allowed(m)


def test_refused_token_leaves_state_unchanged(backend):
    m = backend.compile("regex", "abc").matcher()
    assert not m.accept_token(tid("b"))
    assert m.accept_token(tid("abc")) and m.is_terminated()


def test_jump_forward_rollback_fork(backend):
    m = backend.compile("regex", r"abc[de]f{2}").matcher()
    assert m.find_jump_forward_string() == "abc"
    assert m.accept_string("abc")
    assert m.find_jump_forward_string() == ""
    f = m.fork()
    assert f.accept_token(tid("d")) and f.find_jump_forward_string() == "ff"
    assert m.find_jump_forward_string() == "" and tid("e") in allowed(m)
    f.rollback(1)
    assert f.accept_token(tid("e")) and feed(f, b"ff") and f.is_terminated()
    m2 = backend.compile("regex", "[é]").matcher()
    assert m2.find_jump_forward_string() == "é"


@pytest.mark.parametrize("pattern,construct", [
    (r"(a)\1", "backreference"), (r"(?<=a)b", "lookbehind"), (r"(?=a)a", "lookahead"),
    (r"\bx", "word boundary"), ("((", "invalid regex"), ("a(?>b)", "atomic"),
])
def test_unsupported_constructs_raise(backend, pattern, construct):
    with pytest.raises(GrammarError, match=re.escape(construct)):
        backend.compile("regex", pattern)


def test_compile_is_cached_and_async(backend):
    a = backend.compile("regex", "x+y")
    assert backend.compile("regex", "x+y") is a
    assert backend.compile_async("regex", "x+y").result(timeout=30) is a
    fut = backend.compile_async("regex", "(")
    with pytest.raises(GrammarError):
        fut.result(timeout=30)
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        backend.compile("nope", "x")


def test_choices(backend):
    m = backend.compile("choices", ["yes", "no", "maybe"]).matcher()
    assert feed(m, b"no") and m.is_terminated()
    m = backend.compile("choices", ["yes", "no", "maybe"]).matcher()
    assert not m.accept_token(tid("x"))


def test_vocab_larger_than_tokenizer_and_padding_ids():
    info = TokenizerInfo(list(VOCAB) + [None] * 30, {EOS}, vocab_size=len(VOCAB) + 30)
    m = GrammarBackend(info).compile("regex", "a").matcher()
    got = allowed(m, info.vocab_size)
    assert got == {tid("a")} and not m.accept_token(len(VOCAB) + 3)


# ---- property tests ------------------------------------------------------------------------

_atoms = st.sampled_from(["a", "b", "c", "é", ".", "[ab]", "[^a]", "[a-cé]", r"\d", "x", r"\.", "[^é\n]"])


def _regex(depth=3):
    if depth == 0:
        return _atoms
    sub = _regex(depth - 1)
    return st.one_of(
        _atoms,
        st.tuples(sub, sub).map("".join),
        st.tuples(sub, sub).map(lambda p: f"(?:{p[0]}|{p[1]})"),
        st.tuples(sub, st.sampled_from(["?", "*", "+", "{2}", "{1,3}", "{0,2}"])).map(lambda p: f"(?:{p[0]}){p[1]}"),
    )


_text = st.text(alphabet="abcé.x1\n", max_size=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pattern=_regex(), text=_text)
def test_property_fullmatch_agrees(backend, pattern, text):
    m = backend.compile("regex", pattern).matcher()
    ours = feed(m, text.encode()) and m.is_accepting()
    assert ours == bool(re.fullmatch(pattern, text, re.ASCII)), (pattern, text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pattern=_regex(), text=_text)
def test_property_mask_matches_accept_token(backend, pattern, text):
    m = backend.compile("regex", pattern).matcher()
    for b in text.encode():
        mask = allowed(m)
        for t in range(len(VOCAB)):
            f = m.fork()
            ok = f.accept_token(t)
            assert ok == (t in mask), (pattern, text, t)
            if ok and t != EOS:  # an allowed token keeps the matcher alive
                assert f.is_accepting() or allowed(f), (pattern, t)
        if not m.accept_token(b):
            break
