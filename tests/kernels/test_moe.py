"""The mixture-of-experts ops against naive per-token references on random shapes: routing
(``moe_topk``: softmax, top-k, optional renormalisation, ties as ``torch.topk``) and the grouped
experts (``moe_experts``) on float weights, on LinearWeights of every CPU implementation and on
quantized (GGUF Q8_0 / Q4_0) experts."""
import pytest
import torch
import torch.nn.functional as F

from sglite import kernels
from sglite.kernels import reference


def naive_experts(x, ids, weights, gate_up, down):
    """One token at a time, one expert at a time (the definition)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = F.linear(x[t:t + 1], gate_up[e]).chunk(2, dim=-1)
            out[t] += (F.linear(F.silu(g) * u, down[e]) * weights[t, j])[0]
    return out


def naive_topk(logits, k, renorm):
    out_w, out_i = [], []
    for row in logits:
        p = torch.softmax(row.double(), -1)
        idx = sorted(range(len(p)), key=lambda e: (-float(p[e]), e))[:k]  # ties: lower expert id first
        w = p[idx]
        out_w.append((w / w.sum()) if renorm else w)
        out_i.append(idx)
    return torch.stack(out_w).float(), torch.tensor(out_i)


@pytest.mark.parametrize("n,h,i,e,k,seed", [(1, 16, 8, 4, 2, 0), (7, 32, 24, 8, 2, 1), (33, 64, 40, 6, 3, 2),
                                            (5, 16, 16, 3, 3, 3), (0, 16, 8, 4, 1, 4)])
def test_grouped_experts_match_per_token(n, h, i, e, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    gate_up = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    down = torch.randn(e, h, i, generator=g) / i ** 0.5
    logits = torch.randn(n, e, generator=g)
    w, ids = kernels.moe_topk(logits, k, renormalize=bool(seed % 2))
    want = naive_experts(x, ids, w, gate_up, down)
    got_ref = reference.moe_experts(x, ids, w, gate_up, down)
    lws_gu = [kernels.LinearWeight(gate_up[j].contiguous()) for j in range(e)]
    lws_d = [kernels.LinearWeight(down[j].contiguous()) for j in range(e)]
    for impl in ("torch", "cpp", "invariant"):
        for lw in lws_gu + lws_d:
            lw.use(impl)
        got = kernels.moe_experts(x, ids, w, lws_gu, lws_d, batch_invariant=impl == "invariant")
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), impl
    assert torch.allclose(got_ref, want, atol=1e-5, rtol=1e-5)


def test_batch_invariant_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, 32, generator=g)
    gu = [kernels.LinearWeight(torch.randn(32, 32, generator=g)).use("invariant") for _ in range(4)]
    dn = [kernels.LinearWeight(torch.randn(32, 16, generator=g)).use("invariant") for _ in range(4)]
    w, ids = kernels.moe_topk(torch.randn(12, 4, generator=g), 2, True)
    full = kernels.moe_experts(x, ids, w, gu, dn, batch_invariant=True)
    for r in (0, 5, 11):
        one = kernels.moe_experts(x[r:r + 1], ids[r:r + 1], w[r:r + 1], gu, dn, batch_invariant=True)
        assert torch.equal(one[0], full[r])


@pytest.mark.parametrize("renorm", [False, True])
def test_topk_routing_and_ties(renorm):
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(40, 8, generator=g)
    logits[:10, 3] = logits[:10, 5]  # exact ties between experts 3 and 5
    logits[10:20] = 0.0  # every expert tied
    w, ids = kernels.moe_topk(logits, 3, renorm)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    want_w, want_i = naive_topk(logits, 3, renorm)
    assert torch.allclose(w, want_w, atol=1e-6)
    # the chosen set is the top-k set; tie order is torch.topk's, as in transformers' routers
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    assert torch.equal(ids, torch.topk(probs, 3, dim=-1).indices)
    assert all(set(a.tolist()) == set(b.tolist()) for a, b in zip(ids[20:], want_i[20:]))
    if renorm:
        assert torch.allclose(w.sum(-1), torch.ones(40))


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_quantized_experts_match_their_dequantized_weights(fmt):
    from sglite.runtime.gguf_native import blocks_to_weight
    from sglite.testing import random_gguf_blocks

    e, h, i = 4, 64, 32
    gu = [blocks_to_weight(fmt, random_gguf_blocks(fmt, 2 * i, h, seed=j), h) for j in range(e)]
    dn = [blocks_to_weight(fmt, random_gguf_blocks(fmt, h, i, seed=10 + j), i) for j in range(e)]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, h, generator=g)
    w, ids = kernels.moe_topk(torch.randn(9, e, generator=g), 2, False)
    got = kernels.moe_experts(x, ids, w, gu, dn)
    want = naive_experts(x, ids, w, [q.dequantize(torch.float32) for q in gu], [q.dequantize(torch.float32) for q in dn])
    assert torch.allclose(got, want, atol=1e-3 * want.abs().max(), rtol=1e-3)
