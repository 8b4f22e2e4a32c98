"""Edge shapes of the bf16 dot-product attention tiles (AVX512-BF16 without AMX: csrc/extend_dot.h,
csrc/decode_dot_cascade.h) the other tests leave out: 1-3 and odd key counts, one query row and
more than 128 (several tasks), head dims 32 / 80 / 96, GQA 1 / 3 / 4 / 8, no cached prefix,
prefixes past 4,096 keys, float32 queries on the bf16 pool, windows and softcap together; cascade
groups sharing 1-3 keys (negative cascade_min), a 4,097-key prefix under 130 one-key rows. Each
against a float64 oracle with the bf16 tolerances of test_cpu_extend_attention / test_cpu_decode_cascade,
no worse on average than the torch reference (extend) or the per-row path (cascade), and bit for
bit the same at 1 and 2 threads."""
import pytest
import torch

from sglite.kernels import cpu_attention, reference
from tests.kernels.builds import built
from tests.kernels.test_cpu_decode_cascade import make_batch
from tests.kernels.test_cpu_extend_attention import make_case


@pytest.fixture(scope="module")
def dot_ops():
    built(cpu_attention.load_extend)
    if not cpu_attention.bf16_dot_built() or not cpu_attention.dot_cascade_built():
        pytest.skip("this build has no AVX512-BF16 dot-product tiles")


def oracle(q, k, v, rt, rows, pre, ext, scale, window=0, softcap=0.0):
    """Float64 causal attention (GQA, window, softcap) per request; decode = extend of one token."""
    N, Hq, D = q.shape
    G = Hq // k.shape[1]
    out, start = torch.empty(N, Hq, D, dtype=torch.float64), 0
    for b in range(len(ext)):
        p, e = int(pre[b]), int(ext[b])
        slots = rt[rows[b], :p + e].long()
        kk, vv = k[slots].double().repeat_interleave(G, 1), v[slots].double().repeat_interleave(G, 1)
        s = torch.einsum("ehd,thd->het", q[start:start + e].double(), kk) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        pos, key = torch.arange(e)[:, None] + p, torch.arange(p + e)[None, :]
        mask = (key > pos) | ((key <= pos - window) if window > 0 else False)
        out[start:start + e] = torch.einsum("het,thd->ehd", torch.softmax(s.masked_fill(mask[None], float("-inf")), -1), vv)
        start += e
    return out


def at_threads(fn):
    prev, outs = torch.get_num_threads(), []
    try:
        for th in (1, 2):
            torch.set_num_threads(th)
            outs.append(fn())
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(outs[0], outs[1])
    return outs[0]


EXTEND = [  # ([(prefix, extend)], G, Hkv, D, window, softcap, query dtype)
    ([(0, 1)], 1, 1, 64, 0, 0.0, torch.bfloat16),  # one key, one row
    ([(1, 1), (0, 2), (2, 1)], 3, 2, 80, 0, 0.0, torch.bfloat16),  # 2-3 keys
    ([(0, 17), (14, 17), (0, 31)], 8, 1, 96, 0, 0.0, torch.bfloat16),
    ([(2, 33), (0, 129)], 4, 2, 32, 0, 0.0, torch.bfloat16),
    ([(0, 300)], 1, 2, 128, 0, 0.0, torch.bfloat16),  # >128 query rows, no prefix
    ([(4100, 129), (0, 1)], 4, 1, 64, 0, 0.0, torch.bfloat16),  # long prefix, many rows
    ([(4097, 3)], 8, 1, 256, 1000, 30.0, torch.bfloat16),
    ([(31, 33), (129, 2)], 3, 1, 80, 7, 5.0, torch.float32),  # float32 q: rounded to bf16 once
]


@pytest.mark.parametrize("lens,G,Hkv,D,window,softcap,qdt", EXTEND)
def test_extend_dot_edges(dot_ops, lens, G, Hkv, D, window, softcap, qdt):
    q, *rest = make_case(lens, G * Hkv, Hkv, D, torch.bfloat16, True, seed=D + G + len(lens))
    case = (q.to(qdt), *rest)
    out = at_threads(lambda: cpu_attention.extend_attention(*case, window, softcap, amx=False, bf16_dot=True))
    assert out.dtype == qdt and out.shape == q.shape
    want = oracle(*case, window, softcap)
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)
    ref = reference.extend_attention(*case, window, softcap).double()
    assert (out.double() - want).abs().mean() <= 2 * (ref - want).abs().mean() + 1e-4


CASCADE = [  # ([(prefix, [own lens])], singles, G, Hkv, D, cascade_min, query dtype)
    ([(1, [1, 2, 1]), (2, [3, 1])], [1, 2], 4, 2, 64, -1, torch.bfloat16),  # 1-2 shared keys
    ([(3, [1] * 5), (17, [31, 1])], [33], 3, 1, 80, -3, torch.bfloat16),
    ([(33, [2, 129, 1]), (31, [1, 17])], [], 8, 1, 96, -17, torch.bfloat16),
    ([(129, [1, 3, 1])], [129, 1], 1, 4, 32, -64, torch.bfloat16),  # G = 1
    ([(4097, [1] * 130)], [2], 1, 1, 64, -64, torch.bfloat16),  # one group, 130 rows
    ([(65, [1, 2, 40])], [3], 4, 2, 128, -2, torch.float32),
]


@pytest.mark.parametrize("groups,singles,G,Hkv,D,cmin,qdt", CASCADE)
def test_cascade_dot_edges(dot_ops, groups, singles, G, Hkv, D, cmin, qdt):
    q, k, v, rt, rows, lens, scale = make_batch(groups, singles, G * Hkv, Hkv, D, seed=D + G)
    found = cpu_attention.shared_prefix_groups(rt, rows, lens, min_shared=-cmin)
    assert sorted(P for P, _ in found) == sorted(P for P, _ in groups if P >= -cmin)
    q = q.to(qdt)
    out = at_threads(lambda: cpu_attention.decode_attention(q, k, v, rt, rows, lens, scale, cascade_min=cmin))
    assert out.dtype == qdt
    want = oracle(q, k, v, rt, rows, lens - 1, torch.ones_like(lens), scale)
    torch.testing.assert_close(out.double(), want, atol=1.5e-2, rtol=1.5e-2)
    if qdt == torch.bfloat16:  # float32 queries: the per-row path keeps them float32, the tiles round them
        rowwise = cpu_attention.decode_attention(q, k, v, rt, rows, lens, scale, cascade_min=0).double()
        assert (out.double() - want).abs().mean() <= 2 * (rowwise - want).abs().mean() + 1e-4
