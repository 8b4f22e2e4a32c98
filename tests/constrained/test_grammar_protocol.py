"""One contract suite for every grammar backend behind sglite.constrained.protocols.

Runs on a tiny byte-level BPE tokenizer built here (273 tokens, no model files): sglite's backend
always, llguidance and xgrammar when installed (skipped with the reason otherwise). The same
specs must accept the same strings, masks must allow exactly the tokens that keep a valid prefix
(checked against an enumerated finite language), forks are independent, rollback restores the
mask, and EOS terminates.
"""
import importlib.util
import inspect
import pathlib
import re
from concurrent.futures import Future

import pytest
import torch

from sglite.constrained import (CompiledGrammarProtocol, GrammarBackend, GrammarBackendProtocol,
                                GrammarMatcherProtocol, TokenizerInfo)
from sglite.constrained.protocols import protocol_members
from sglite.constrained.tokenizer_info import bytes_to_unicode
from sglite.errors import GrammarError

EOS = 0
MERGED = ["ab", "bc", "abc", "ca", "at", "cat", "do", "dog", "og", "12", '{"', '":', '"}', " a", " d", " c"]


B2U = bytes_to_unicode()  # GPT-2 byte table


def tiny_hf_tokenizer():
    """A byte-level BPE tokenizer: ``<eos>`` (id 0), the 256 bytes (ids 1..256), then MERGED."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = {"<eos>": EOS}, []
    for b in range(256):
        vocab[B2U[b]] = len(vocab)
    for m in MERGED:
        u = "".join(B2U[b] for b in m.encode())
        k = next(k for k in range(len(u) - 1, 0, -1) if u[:k] in vocab and u[k:] in vocab)
        merges.append((u[:k], u[k:]))
        vocab[u] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


def _backend_param(name):
    if name == "sglite" or importlib.util.find_spec(name) is not None:
        return name
    return pytest.param(name, marks=pytest.mark.skip(reason=f"{name} is not installed (pip install {name})"))


BACKENDS = [_backend_param(n) for n in ("sglite", "llguidance", "xgrammar")]


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_tokenizer()


@pytest.fixture(scope="module")
def token_bytes(hf):
    return TokenizerInfo.from_hf(hf, len(hf), {EOS}).token_bytes


_BACKENDS: dict = {}


@pytest.fixture(params=BACKENDS)
def backend(request, hf):
    name = request.param
    if name not in _BACKENDS:
        if name == "sglite":
            _BACKENDS[name] = GrammarBackend(TokenizerInfo.from_hf(hf, len(hf), {EOS}))
        else:
            from sglite.constrained.external import make_backend
            _BACKENDS[name] = make_backend(name, hf, len(hf), [EOS])
    return _BACKENDS[name]


def byte_id(b: int) -> int:
    return 1 + b


def allowed(m, vocab_size: int) -> set:
    bm = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    m.fill_next_token_bitmask(bm, 0)
    words = bm[0].tolist()
    return {t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1}


def accepts(backend, hf, kind, spec, text: str) -> bool:
    m = backend.compile(kind, spec).matcher()
    ids = hf.encode(text, add_special_tokens=False)
    return all(m.accept_token(t) for t in ids) and m.accept_token(EOS) and m.is_terminated()


# ------------------------------------------------------------------ the declarations
def _same_signature(impl, proto, name):
    got = inspect.signature(getattr(impl, name))
    want = inspect.signature(getattr(proto, name))
    as_tuple = [(p.name, p.kind, p.default) for p in want.parameters.values()]
    assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == as_tuple, (impl, name, got, want)


def test_backends_declare_the_protocols(backend):
    g = backend.compile("regex", "(cat|dog)s?")
    m = g.matcher()
    for obj, proto in ((backend, GrammarBackendProtocol), (g, CompiledGrammarProtocol), (m, GrammarMatcherProtocol)):
        assert isinstance(obj, proto)
        assert proto in type(obj).__mro__, f"{type(obj).__name__} should subclass {proto.__name__}"
        for name in protocol_members(proto):
            assert getattr(type(obj), name) is not getattr(proto, name), f"{type(obj).__name__}.{name} not implemented"
            _same_signature(type(obj), proto, name)


def test_protocol_check_rejects_incomplete_objects():
    class NoRollback:
        def fill_next_token_bitmask(self, bitmask, row=0): ...
        def accept_token(self, token_id): ...
    assert not isinstance(NoRollback(), GrammarMatcherProtocol)
    assert not isinstance(object(), GrammarBackendProtocol)
    assert protocol_members(GrammarMatcherProtocol) == [
        "fill_next_token_bitmask", "accept_token", "is_terminated", "find_jump_forward_string",
        "forces_token_text", "mask_is_cached", "rollback", "fork"]


def test_runtime_calls_only_protocol_members():
    """Every ``<...>grammar.<method>(`` call in sglite/runtime names a GrammarMatcherProtocol
    member (or ``matcher()`` of the compiled grammar / ``compile`` of the backend)."""
    root = pathlib.Path(__file__).resolve().parents[2] / "sglite" / "runtime"
    allowed_names = (set(protocol_members(GrammarMatcherProtocol)) | set(protocol_members(CompiledGrammarProtocol))
                     | set(protocol_members(GrammarBackendProtocol)))
    called = set()
    for path in root.rglob("*.py"):
        called |= set(re.findall(r"grammar(?:_backend)?\.(\w+)\(", path.read_text()))
    assert called, "the pattern found no grammar call in sglite/runtime"
    assert called <= allowed_names, sorted(called - allowed_names)


# ------------------------------------------------------------------ same spec, same language
CASES = [
    ("regex", r"(cat|dog)s? [0-9]{2}", ["cat 12", "dogs 07"], ["cat12", "cow 12", "cats 1", "cat 123"]),
    ("regex", r"abc[de]f{2}", ["abcdff", "abceff"], ["abcff", "abcdf", "abcdfff"]),
    ("regex", r"[a-c]+\.?", ["a", "abcab.", "ca"], ["", "d", "a..", ".a"]),
    ("choices", ["cat", "cats", "dog"], ["cat", "cats", "dog"], ["do", "dogs", "catdog"]),
    ("ebnf", 'root ::= "a" ("b" | "cd")* "."', ["a.", "abcdb."], ["a", "ac.", "b."]),
    ("json_schema", {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                     "properties": {"a": {"type": "integer"}, "b": {"enum": ["cat", "dog"]}}},
     ['{"a":12,"b":"cat"}', '{"a":-3,"b":"dog"}'],
     ['{"a":"x","b":"cat"}', '{"b":"cat"}', '{"a":1,"b":"cow"}', '{"a":1,"b":"cat","c":1}']),
]


@pytest.mark.parametrize("kind,spec,good,bad", CASES, ids=[c[0] + str(i) for i, c in enumerate(CASES)])
def test_same_spec_accepts_the_same_strings(backend, hf, kind, spec, good, bad):
    for s in good:
        assert accepts(backend, hf, kind, spec, s), (kind, spec, s)
    for s in bad:
        assert not accepts(backend, hf, kind, spec, s), (kind, spec, s)


# ------------------------------------------------------------------ exact masks
FINITE = [
    ("regex", "(cat|dog)s?", [b"cat", b"cats", b"dog", b"dogs"]),
    ("regex", "(ab|abc)[12]", [b"ab1", b"ab2", b"abc1", b"abc2"]),
    ("choices", ["cat", "cats", "ca"], [b"cat", b"cats", b"ca"]),
]


#: backends whose masks are exactly the valid-prefix tokens; llguidance also prunes from its masks
#: some token sequences that are not the tokenizer's canonical tokenization (checked below to be
#: only those), while its accept_token still takes them
EXACT_MASKS = {"sglite", "xgrammar"}


@pytest.mark.parametrize("kind,spec,language", FINITE, ids=[c[0] + str(i) for i, c in enumerate(FINITE)])
def test_mask_allows_exactly_the_valid_prefix_tokens(backend, hf, token_bytes, kind, spec, language):
    V = len(hf)
    g = backend.compile(kind, spec)
    prefixes = sorted({s[:k] for s in language for k in range(len(s) + 1)})
    for p in prefixes:
        m = g.matcher()
        path = [byte_id(b) for b in p]
        assert all(m.accept_token(t) for t in path), p
        want = {t for t, tb in enumerate(token_bytes)
                if tb and any(s.startswith(p + tb) for s in language)}
        if p in language:
            want.add(EOS)
        got = allowed(m, V)
        assert got <= want, (p, sorted(got - want))          # sound: never a dead end
        assert (EOS in got) == (p in language), p              # EOS exactly when complete
        if getattr(backend, "name", "sglite") in EXACT_MASKS:
            assert got == want, (p, sorted(want - got))
        else:
            for t in want - got:                                # pruned: non-canonical only
                assert hf.encode((p + token_bytes[t]).decode(), add_special_tokens=False) != path + [t], (p, t)
        # accept_token takes every allowed token and nothing outside the language (for an exact
        # backend: exactly the allowed ones; llguidance accepts the tokens it prunes from masks)
        for t in range(V):
            ok = m.fork().accept_token(t)
            assert (t in got) <= ok and ok <= (t in want), (p, t)
            if getattr(backend, "name", "sglite") in EXACT_MASKS:
                assert ok == (t in got), (p, t)
    for s in language:  # complete along each sentence's canonical tokenization
        m = g.matcher()
        for t in hf.encode(s.decode(), add_special_tokens=False) + [EOS]:
            assert t in allowed(m, V) and m.accept_token(t), (s, t)


# ------------------------------------------------------------------ fork, rollback, termination
def test_fork_is_independent(backend, hf):
    V = len(hf)
    m = backend.compile("regex", "(cat|dog)s?").matcher()
    assert m.accept_token(byte_id(ord("c")))
    before = allowed(m, V)
    f = m.fork()
    assert f.accept_token(hf.convert_tokens_to_ids("at"))
    assert allowed(m, V) == before and allowed(f, V) == {byte_id(ord("s")), EOS}
    assert m.accept_token(byte_id(ord("a"))) and allowed(f, V) == {byte_id(ord("s")), EOS}
    assert f.accept_token(EOS) and f.is_terminated() and not m.is_terminated()
    assert allowed(m, V) == {byte_id(ord("t"))}


def test_rollback_restores_the_mask(backend, hf):
    V = len(hf)
    m = backend.compile("regex", r"(cat|dog)s? [0-9]{2}").matcher()
    ids = hf.encode("dogs 12", add_special_tokens=False)
    masks = [allowed(m, V)]
    for t in ids:
        assert m.accept_token(t)
        masks.append(allowed(m, V))
    m.rollback(0)
    assert allowed(m, V) == masks[-1]
    m.rollback(2)
    assert allowed(m, V) == masks[-3]
    assert m.accept_token(ids[-2]) and allowed(m, V) == masks[-2]
    m.rollback(len(ids) - 1)
    assert allowed(m, V) == masks[0]
    with pytest.raises(ValueError, match="num_tokens"):
        m.rollback(1)
    with pytest.raises(ValueError, match="num_tokens"):
        m.rollback(-1)
    assert all(m.accept_token(t) for t in ids) and m.accept_token(EOS)
    m.rollback(1)  # EOS is a token too: back before it, where only EOS may follow
    assert allowed(m, V) == masks[-1] == {EOS} and m.accept_token(EOS)


def test_refused_token_changes_nothing(backend, hf):
    V = len(hf)
    m = backend.compile("regex", "abc[de]").matcher()
    before = allowed(m, V)
    assert not m.accept_token(byte_id(ord("b"))) and not m.accept_token(EOS)
    assert allowed(m, V) == before
    assert m.accept_token(hf.convert_tokens_to_ids("abc"))


def test_eos_terminates(backend, hf):
    m = backend.compile("regex", "(ab)+").matcher()
    assert m.accept_token(hf.convert_tokens_to_ids("ab")) and not m.is_terminated()
    assert m.accept_token(EOS) and m.is_terminated()
    assert not m.accept_token(hf.convert_tokens_to_ids("ab")) and not m.accept_token(EOS)


def test_jump_forward_string(backend, hf):
    m = backend.compile("regex", r"abc[de]f{2}").matcher()
    assert m.find_jump_forward_string() == "abc"
    assert m.find_jump_forward_string() == "abc"  # no mutation
    assert m.accept_token(hf.convert_tokens_to_ids("abc")) and m.find_jump_forward_string() == ""
    assert m.accept_token(byte_id(ord("d"))) and m.find_jump_forward_string() == "ff"


def test_optional_queries_are_safe_booleans(backend, hf):
    m = backend.compile("regex", "abc").matcher()
    for t in (hf.convert_tokens_to_ids("abc"), byte_id(ord("x"))):
        assert m.forces_token_text(t) in (True, False)
    assert m.mask_is_cached() in (True, False)
    assert not m.forces_token_text(byte_id(ord("x")))  # not allowed, never forced


def test_sglite_forces_token_text_and_rolls_back_forced_strings(hf):
    g = GrammarBackend(TokenizerInfo.from_hf(hf, len(hf), {EOS})).compile("regex", "abcd")
    m = g.matcher()
    assert m.forces_token_text(hf.convert_tokens_to_ids("abc"))       # a, ab, abc: all prefixes
    assert not m.forces_token_text(hf.convert_tokens_to_ids("ab"))    # abc reaches past it
    assert m.accept_string("abc") and m.num_accepted == 1
    m.rollback(1)
    assert m.num_accepted == 0 and m.find_jump_forward_string() == "abcd"


def test_compile_errors_cache_and_async(backend):
    with pytest.raises(GrammarError):
        backend.compile("regex", "(unclosed")
    with pytest.raises(GrammarError):
        backend.compile("no-such-kind", "x")
    g = backend.compile("regex", "[0-9]+")
    assert backend.compile("regex", "[0-9]+") is g
    fut = backend.compile_async("regex", "[0-9]+")
    assert isinstance(fut, Future) and fut.result(timeout=30) is g
    bad = backend.compile_async("regex", "(unclosed")
    with pytest.raises(GrammarError):
        bad.result(timeout=30)
