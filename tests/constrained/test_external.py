"""Optional llguidance / xgrammar backends behind sglite's matcher interface (skipped when absent)."""
import importlib.util
import json
import re

import pytest
import torch

from sglite.constrained.external import EXTERNAL, make_backend
from sglite.errors import GrammarError

INSTALLED = [n for n in EXTERNAL if importlib.util.find_spec(n) is not None]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}}}


def test_unknown_or_missing_backend_raises(monkeypatch):
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        make_backend("nope", None, 10, [0])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match="pip install llguidance"):
        make_backend("llguidance", None, 10, [0])


@pytest.fixture(scope="module")
def hf_tok(real_tokenizer):
    return real_tokenizer.hf


@pytest.mark.parametrize("name", INSTALLED)
def test_matcher_interface(hf_tok, name):
    be = make_backend(name, hf_tok, 49152, [2])
    with pytest.raises(GrammarError):
        be.compile("regex", "(unclosed")
    g = be.compile("json_schema", SCHEMA)
    assert be.compile("json_schema", SCHEMA) is g  # cached
    m = g.matcher()
    jf = m.find_jump_forward_string()
    assert jf.startswith("{")
    ids = hf_tok.encode('{"name": "Al", "n": 12}', add_special_tokens=False)
    bm = torch.zeros(1, (49152 + 31) // 32, dtype=torch.int32)
    bad = hf_tok.encode("[", add_special_tokens=False)[0]
    assert not m.accept_token(bad)  # refused, state unchanged
    for i, t in enumerate(ids):
        m.fill_next_token_bitmask(bm, 0)
        assert (int(bm[0, t // 32]) >> (t % 32)) & 1, (name, i)
        if i == 3:
            f = m.fork()
        assert m.accept_token(t)
    assert m.accept_token(2) and m.is_terminated()
    for t in ids[3:]:
        assert f.accept_token(t)
    f.rollback(1)
    assert not f.accept_token(2) and f.accept_token(ids[-1]) and f.accept_token(2)


@pytest.mark.parametrize("name", INSTALLED)
def test_engine_with_external_backend(tiny_model_dir, name):
    from sglite import Engine

    e = Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=4096, grammar_backend=name)
    try:
        outs = e.generate(["a", "b"], [{"max_new_tokens": 24, "temperature": 0, "regex": r"(cat|dog)s? [0-9]{2}"},
                                       {"max_new_tokens": 48, "temperature": 0, "json_schema": SCHEMA}])
        assert re.fullmatch(r"(cat|dog)s? [0-9]{2}", outs[0]["text"]), outs[0]["text"]
        assert outs[0]["meta_info"]["finish_reason"]["type"] == "stop"
        if outs[1]["meta_info"]["finish_reason"]["type"] == "stop":
            assert set(json.loads(outs[1]["text"])) == {"name", "n"}
    finally:
        e.shutdown()
