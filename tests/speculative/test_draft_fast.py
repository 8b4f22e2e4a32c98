"""The bf16 GEMV draft (sglite/runtime/speculative/draft_fast.py) against its float32 reference,
:class:`EagleHead` itself: same outputs within bf16 rounding, with and without past K/V and a tree
mask; the draft LM head's log-probabilities likewise. Random weights and shapes (seeded)."""
import pytest
import torch

from sglite.runtime.speculative.draft_fast import FastEagle, FastLMHead, FastMedusa
from sglite.runtime.speculative.heads import EagleHead, MedusaHeads


def _head(seed, hidden, nh, nkv, inter, **extra):
    torch.manual_seed(seed)
    m = EagleHead(dict(hidden_size=hidden, intermediate_size=inter, num_attention_heads=nh, num_key_value_heads=nkv,
                       vocab_size=100, rms_norm_eps=1e-6, rope_theta=10000.0, **extra))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.08) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return m.eval()


def _close(a, b, tol=0.05):
    err = (a - b).abs().max() / b.abs().max()
    assert err < tol, float(err)


@pytest.mark.parametrize("seed,hidden,nh,nkv,inter,extra", [
    (0, 64, 4, 2, 96, {}), (1, 96, 6, 6, 160, {"input_norm": True}), (2, 48, 4, 1, 64, {"fc_bias": False})])
def test_fast_eagle_matches_the_float32_head(seed, hidden, nh, nkv, inter, extra):
    m = _head(seed, hidden, nh, nkv, inter, **extra)
    fast = FastEagle(m)
    g = torch.Generator().manual_seed(seed)
    P, T = int(torch.randint(1, 12, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
    emb, feat = torch.randn(1, P, hidden, generator=g), torch.randn(1, P, hidden, generator=g)
    pos = torch.arange(P)[None]
    with torch.no_grad():
        ref, (rk, rv) = m(emb, feat, pos)
        got, (k, v) = fast(emb, feat, pos)
        _close(got, ref), _close(k, rk), _close(v, rv)
        # tree rows: T queries over the past plus a random ancestry mask (each row sees itself)
        mask = torch.rand(T, P + T, generator=g) < 0.5
        mask[:, :P] = True
        mask[:, P:] |= torch.eye(T, dtype=torch.bool)
        e2, f2 = torch.randn(1, T, hidden, generator=g), torch.randn(1, T, hidden, generator=g)
        pos2 = torch.randint(P, P + 3, (1, T), generator=g)
        ref2, _ = m(e2, f2, pos2, (rk, rv), mask)
        got2, _ = fast(e2, f2, pos2, (k, v), mask)
        _close(got2, ref2)
        c = P // 2  # the same past as two chunks, read in place
        got3, _ = fast(e2, f2, pos2, ([k[:, :c], k[:, c:]], [v[:, :c], v[:, c:]]), mask)
        assert torch.allclose(got3, got2, atol=1e-5)
    assert got.dtype == torch.float32 and k.dtype == torch.float32 and got2.shape == (1, T, hidden)


def test_fast_lm_head_log_probs_match():
    torch.manual_seed(3)
    w, feat = torch.randn(300, 64) * 0.1, torch.randn(2, 5, 64)
    ref = torch.log_softmax(feat @ w.T, -1)
    got = FastLMHead(w)(feat)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.05
    assert torch.allclose(got.exp().sum(-1), torch.ones(2, 5), atol=1e-4)


def test_fast_medusa_matches_the_float32_heads():
    torch.manual_seed(4)
    m = MedusaHeads(dict(hidden_size=64, vocab_size=50, medusa_num_heads=3))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    h = torch.randn(2, 64)
    with torch.no_grad():
        ref = m(h)
    got = FastMedusa(m)(h)
    assert got.shape == ref.shape == (2, 3, 64) and got.dtype == torch.float32
    _close(got, ref, 0.02)
