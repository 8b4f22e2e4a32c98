"""C++ CPU extend (prefill) attention (sglite/kernels/cpu_attention.py, csrc/cpu_extend_attention.cpp):
random ragged shapes against the torch reference and a float64 oracle, pool layouts, per-row
independence (batch, token block, prefix split, threads), input errors, dispatcher routing."""

import pytest
import torch

from tests.kernels.builds import built
from sglite import kernels
from sglite.kernels import cpu_attention, dispatch, reference


@pytest.fixture(scope="module")
def ops():
    """The compiled extension (built once per machine, loaded once per session)."""
    return built(cpu_attention.load_extend)


def make_case(lens, Hq, Hkv, D, dtype, head_major, seed=0, spare_rows=2):
    """Random pool with scattered slots; ``lens`` = [(prefix, extend)] per request; requests sit at
    shuffled rows of a wider slot table with garbage past each request's length."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    total = sum(p + e for p, e in lens)
    S = total + 31
    if head_major:  # the engine's storage: [Hkv, S, D] seen as [S, Hkv, D]
        k = torch.randn(Hkv, S, D, generator=g).to(dtype).transpose(0, 1)
        v = torch.randn(Hkv, S, D, generator=g).to(dtype).transpose(0, 1)
    else:
        k = torch.randn(S, Hkv, D, generator=g).to(dtype)
        v = torch.randn(S, Hkv, D, generator=g).to(dtype)
    Lmax = max(p + e for p, e in lens) + 5
    rt = torch.randint(0, S, (B + spare_rows, Lmax), generator=g, dtype=torch.int32)
    slots = (torch.randperm(S - 1, generator=g)[:total] + 1).to(torch.int32)
    rows = torch.randperm(B + spare_rows, generator=g)[:B]
    start = 0
    for b, (p, e) in enumerate(lens):
        rt[rows[b], :p + e] = slots[start:start + p + e]
        start += p + e
    N = sum(e for _, e in lens)
    q = torch.randn(N, Hq, D, generator=g).to(dtype)
    pre = torch.tensor([p for p, _ in lens], dtype=torch.int64)
    ext = torch.tensor([e for _, e in lens], dtype=torch.int64)
    return q, k, v, rt, rows, pre, ext, D ** -0.5


def oracle(q, k, v, rt, rows, pre, ext, scale):
    """Naive float64 causal attention per request (GQA: head i reads KV head i // G)."""
    N, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = torch.empty(N, Hq, D, dtype=torch.float64)
    start = 0
    for b in range(len(ext)):
        p, e = int(pre[b]), int(ext[b])
        slots = rt[rows[b], :p + e].long()
        for h in range(Hq):
            kk, vv = k[slots, h // G].double(), v[slots, h // G].double()  # [T, D]
            s = q[start:start + e, h].double() @ kk.T * scale  # [e, T]
            mask = torch.arange(p + e)[None, :] > (torch.arange(e)[:, None] + p)
            out[start:start + e, h] = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1) @ vv
        start += e
    return out


CASES = [  # ([(prefix, extend)], Hq, Hkv, D)
    ([(0, 1)], 4, 4, 64),
    ([(0, 5)], 3, 1, 64),
    ([(0, 130)], 9, 3, 64),  # SmolLM2's heads; several query blocks and key tiles
    ([(3, 70), (0, 1), (130, 17), (64, 64)], 9, 3, 64),  # ragged, prefixes on and off tile edges
    ([(200, 3), (1, 100)], 8, 2, 128),
    ([(17, 20), (0, 9)], 16, 2, 128),  # G = 8
    ([(40, 33)], 4, 1, 256),
    ([(5, 9), (0, 70)], 6, 2, 40),  # D padded inside the kernel
    ([(2, 11)], 14, 2, 96),  # G = 7
    ([(0, 3), (8, 2)], 80, 1, 8),  # G > 64 rows: one token per task
]


def rounds_weights(dtype, amx, dot, Hq, Hkv, D) -> bool:
    """Whether this call's path rounds the softmax weights to bf16: the AMX tiles, or the bf16
    dot-product tiles off them (bf16 pool, even D, a build with AVX512-BF16)."""
    if dtype != torch.bfloat16:
        return False
    on_amx = amx and cpu_attention.amx_ready() and Hq // Hkv <= 64
    return on_amx or (dot and D % 2 == 0 and cpu_attention.bf16_dot_built())


@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize("lens,Hq,Hkv,D", CASES)
def test_matches_reference_and_float64_oracle(ops, lens, Hq, Hkv, D, dtype, head_major, amx, dot):
    """``amx``: a bf16 pool may take the AMX tiles (where this CPU has them; float32 pools never do);
    ``dot``: off the tiles, the bf16 dot-product path where the build has it (else float32 tiles)."""
    case = make_case(lens, Hq, Hkv, D, dtype, head_major, seed=len(lens) * 7 + D + Hq)
    out = cpu_attention.extend_attention(*case, amx=amx, bf16_dot=dot)
    assert out.shape == case[0].shape and out.dtype == dtype
    want = oracle(*case)
    ref = reference.extend_attention(*case).double()
    err, ref_err = (out.double() - want).abs().mean(), (ref - want).abs().mean()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    elif rounds_weights(dtype, amx, dot, Hq, Hkv, D):
        # the tiles round the softmax weights (the AMX ones also the scaled query) to bf16 (float32
        # sums), as SDPA in bf16 rounds the scores and the weights: the same order of error
        torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(out.double(), ref, atol=4e-2, rtol=4e-2)
        assert err <= 2 * ref_err + 1e-4
    else:  # one bf16 rounding of the output here; the reference (SDPA in bf16) rounds more
        torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(out.double(), ref, atol=4e-2, rtol=4e-2)
        assert err <= ref_err + 1e-4


def test_random_shapes_against_reference(ops):
    """Random ragged batches, GQA ratios and head dims 64/128/256, both dtypes."""
    g = torch.Generator().manual_seed(33)
    for trial in range(12):
        B = int(torch.randint(1, 5, (1,), generator=g))
        lens = [(int(torch.randint(0, 150, (1,), generator=g)), int(torch.randint(1, 150, (1,), generator=g)))
                for _ in range(B)]
        Hkv = int(torch.randint(1, 4, (1,), generator=g))
        G = int(torch.randint(1, 9, (1,), generator=g))
        D = (64, 128, 256)[trial % 3]
        dtype = (torch.float32, torch.bfloat16)[trial % 2]
        case = make_case(lens, Hkv * G, Hkv, D, dtype, bool(trial % 4 < 2), seed=trial)
        out = cpu_attention.extend_attention(*case).double()
        tol = 2e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out, oracle(*case), atol=tol, rtol=tol)
        torch.testing.assert_close(out, reference.extend_attention(*case).double(), atol=4 * tol, rtol=4 * tol)


def test_rows_do_not_depend_on_batch_split_or_threads(ops):
    """A token's output bits depend only on its own query, position and keys: the same request alone or
    in a batch, prefilled in one go or after a cached prefix (chunked prefill), on 1 or 2 threads,
    with q as a strided view of the fused projection."""
    q, k, v, rt, rows, pre, ext, scale = make_case([(0, 150), (20, 40)], 9, 3, 64, torch.bfloat16, True, seed=4)
    full = cpu_attention.extend_attention(q, k, v, rt, rows, pre, ext, scale)
    alone = cpu_attention.extend_attention(q[:150], k, v, rt, rows[:1], pre[:1], ext[:1], scale)
    assert torch.equal(full[:150], alone)
    tail = cpu_attention.extend_attention(q[77:150], k, v, rt, rows[:1], torch.tensor([77]), torch.tensor([73]), scale)
    assert torch.equal(full[77:150], tail)  # the same tokens after a 77-token cached prefix
    wide = torch.randn(q.shape[0], 12, 64).to(torch.bfloat16)
    wide[:, :9] = q
    qv = wide[:, :9]
    assert not qv.is_contiguous()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.extend_attention(qv, k, v, rt, rows, pre, ext, scale)
        torch.set_num_threads(2)
        two = cpu_attention.extend_attention(qv, k, v, rt, rows, pre, ext, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(one, full)


def test_bad_inputs_raise_clear_errors(ops):
    q, k, v, rt, rows, pre, ext, scale = make_case([(2, 4), (0, 6)], 4, 2, 16, torch.float32, True, seed=3)
    bad_rt = rt.clone()
    bad_rt[rows[1], 2] = k.shape[0]  # one past the pool
    with pytest.raises(IndexError, match="slot outside the pool"):
        cpu_attention.extend_attention(q, k, v, bad_rt, rows, pre, ext, scale)
    with pytest.raises(ValueError, match=r"extend_lens\[1\]=0"):
        cpu_attention.extend_attention(q[:4], k, v, rt, rows, pre, torch.tensor([4, 0]), scale)
    with pytest.raises(ValueError, match=r"prefix_lens\[0\]"):
        cpu_attention.extend_attention(q, k, v, rt, rows, torch.tensor([rt.shape[1], 0]), ext, scale)
    with pytest.raises(ValueError, match="extend_lens sum to 10"):
        cpu_attention.extend_attention(q[:9], k, v, rt, rows, pre, ext, scale)
    with pytest.raises(IndexError, match="req_pool_indices"):
        cpu_attention.extend_attention(q, k, v, rt, torch.tensor([0, rt.shape[0]]), pre, ext, scale)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        cpu_attention.extend_attention(q[:, :3], k, v, rt, rows, pre, ext, scale)


def test_dispatcher_routes_extend_to_cpp(ops, monkeypatch):
    case = make_case([(3, 11), (0, 5)], 6, 2, 32, torch.bfloat16, True, seed=9)
    calls = []
    real = cpu_attention.extend_attention
    monkeypatch.setattr(cpu_attention, "extend_attention", lambda *a: calls.append(1) or real(*a))
    monkeypatch.delenv("SGLITE_KERNEL", raising=False)
    assert "extend_attention" in dispatch.CPP_OPS
    assert dispatch.resolve_impl(None, case[0], "extend_attention") == "cpp"
    assert torch.equal(kernels.extend_attention(*case), real(*case)) and len(calls) == 1
    assert torch.equal(kernels.extend_attention(*case, window=4), real(*case, 4, 0.0)) and len(calls) == 2
    monkeypatch.setenv("SGLITE_KERNEL", "torch")
    assert torch.equal(kernels.extend_attention(*case), reference.extend_attention(*case)) and len(calls) == 2
    half = tuple(x.half() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in case)
    torch.testing.assert_close(real(*half), reference.extend_attention(*half))  # fp16: the reference
