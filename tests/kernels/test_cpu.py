"""C++ CPU decode attention (sglite/kernels/cpu_attention.py): numerics against the torch reference and a
float64 oracle, pool layouts, input errors, dispatcher default and overrides, build-failure fallback."""
import logging

import pytest
import torch

from tests.kernels.builds import built
from sglite import kernels
from sglite.kernels import cpu_attention, dispatch, reference


@pytest.fixture(scope="module")
def ops():
    """The compiled extension (built once per machine, loaded once per session)."""
    return built(cpu_attention.load)


def make_case(lens, Hq, Hkv, D, dtype, head_major, seed=0, spare_rows=2, extra_slots=23):
    """Random pool with scattered slots; requests sit at shuffled rows of a wider slot table."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    S = sum(lens) + extra_slots + 1
    if head_major:  # the engine's storage: [Hkv, S, D] seen as [S, Hkv, D]
        k = torch.randn(Hkv, S, D, generator=g).to(dtype).transpose(0, 1)
        v = torch.randn(Hkv, S, D, generator=g).to(dtype).transpose(0, 1)
    else:
        k = torch.randn(S, Hkv, D, generator=g).to(dtype)
        v = torch.randn(S, Hkv, D, generator=g).to(dtype)
    Lmax = max(lens) + 5
    rt = torch.randint(0, S, (B + spare_rows, Lmax), generator=g, dtype=torch.int32)  # garbage past len
    slots = (torch.randperm(S - 1, generator=g)[: sum(lens)] + 1).to(torch.int32)  # scattered, no reuse
    rows = torch.randperm(B + spare_rows, generator=g)[:B]
    start = 0
    for b, n in enumerate(lens):
        rt[rows[b], :n] = slots[start:start + n]
        start += n
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    return q, k, v, rt, rows, torch.tensor(lens, dtype=torch.int64), D ** -0.5


def oracle(q, k, v, rt, rows, lens, scale):
    """Naive float64 attention per request and head (GQA: head i reads KV head i // G)."""
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        slots = rt[rows[b], : lens[b]].long()
        for i in range(Hq):
            kk = k[slots, i // G].double()  # [L, D]
            vv = v[slots, i // G].double()  # [L, D]
            p = torch.softmax(kk @ q[b, i].double() * scale, dim=0)  # [L]
            out[b, i] = p @ vv
    return out


CASES = [  # (lens, Hq, Hkv, D)
    ([1], 4, 4, 64),
    ([2], 3, 1, 64),
    ([37], 9, 3, 64),
    ([300], 8, 2, 64),
    ([1, 2, 37, 300], 9, 3, 64),
    ([5, 300, 1, 37, 2], 8, 2, 40),  # D not a multiple of 16
    ([17, 1], 6, 3, 256),
    ([2, 45, 1], 14, 2, 128),  # G = 7, D = 128 (Qwen-like)
    ([9, 4], 2, 2, 60),  # D padded to 64
    ([3, 9], 4, 1, 8),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize("lens,Hq,Hkv,D", CASES)
def test_matches_reference_and_float64_oracle(ops, lens, Hq, Hkv, D, dtype, head_major):
    case = make_case(lens, Hq, Hkv, D, dtype, head_major, seed=len(lens) * 7 + D + Hq)
    out = cpu_attention.decode_attention(*case)
    assert out.shape == case[0].shape and out.dtype == dtype
    want = oracle(*case)
    ref = reference.decode_attention(*case).double()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    else:  # one bf16 rounding of the output here; the reference also rounds scores and weights
        torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(out.double(), ref, atol=4e-2, rtol=4e-2)
        assert (out.double() - want).abs().mean() <= (ref - want).abs().mean() + 1e-4


def test_strided_query_and_thread_count_agree(ops):
    """The engine passes q as a view of the fused q/k projection; the result must not depend on threads."""
    q, k, v, rt, rows, lens, scale = make_case([7, 64, 1, 130], 9, 3, 64, torch.bfloat16, True, seed=5)
    wide = torch.randn(q.shape[0], 12, 64).to(torch.bfloat16)
    wide[:, :9] = q
    qv = wide[:, :9]  # [B, 9, 64] view, stride(0) = 12 * 64
    assert not qv.is_contiguous()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.decode_attention(qv, k, v, rt, rows, lens, scale)
        torch.set_num_threads(2)
        two = cpu_attention.decode_attention(qv, k, v, rt, rows, lens, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one, cpu_attention.decode_attention(q, k, v, rt, rows, lens, scale))


def test_bad_inputs_raise_clear_errors(ops):
    q, k, v, rt, rows, lens, scale = make_case([4, 6], 4, 2, 16, torch.float32, True, seed=3)
    bad_rt = rt.clone()
    bad_rt[rows[1], 2] = k.shape[0]  # one past the pool
    with pytest.raises(IndexError, match="slot outside the pool"):
        cpu_attention.decode_attention(q, k, v, bad_rt, rows, lens, scale)
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=0"):
        cpu_attention.decode_attention(q, k, v, rt, rows, torch.tensor([0, 6]), scale)
    with pytest.raises(ValueError, match="seq_lens"):
        cpu_attention.decode_attention(q, k, v, rt, rows, torch.tensor([4, rt.shape[1] + 1]), scale)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        cpu_attention.decode_attention(q[:, :3], k, v, rt, rows, lens, scale)


def test_dispatcher_defaults_to_cpp_on_cpu_and_env_overrides(ops, monkeypatch):
    case = make_case([3, 11], 6, 2, 32, torch.bfloat16, True, seed=9)
    calls = []
    real = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a: calls.append(1) or real(*a))
    monkeypatch.delenv("SGLITE_KERNEL", raising=False)
    assert dispatch.resolve_impl(None, case[0], "decode_attention") == "cpp"
    assert dispatch.resolve_impl(None, case[0], "sample") == "torch"  # other ops keep the reference
    assert torch.equal(kernels.decode_attention(*case), real(*case)) and len(calls) == 1
    monkeypatch.setenv("SGLITE_KERNEL", "torch")
    assert dispatch.resolve_impl(None, case[0], "decode_attention") == "torch"
    assert torch.equal(kernels.decode_attention(*case), reference.decode_attention(*case))
    assert len(calls) == 1
    monkeypatch.setenv("SGLITE_KERNEL", "cpp")  # ops without a C++ kernel run the reference
    logits = torch.randn(2, 50)
    args = (torch.zeros(2), torch.ones(2), torch.zeros(2, dtype=torch.long), torch.zeros(2),
            torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    assert kernels.sample(logits, *args).tolist() == logits.argmax(-1).tolist()


def test_build_failure_warns_once_and_falls_back(monkeypatch, caplog, tmp_path):
    monkeypatch.delenv("SGLITE_KERNEL", raising=False)
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_attention, "read_source", lambda name: "#error c++: command not found\n")  # the build fails
    cpu_attention.load.cache_clear()
    try:
        case = make_case([5, 2], 4, 2, 16, torch.float32, False, seed=1)
        with caplog.at_level(logging.WARNING, logger="sglite.kernels.cpu_build"):
            assert dispatch.resolve_impl(None, case[0], "decode_attention") == "torch"
            out = cpu_attention.decode_attention(*case)
            forced = kernels.decode_attention(*case, impl="cpp")
        assert torch.equal(out, reference.decode_attention(*case)) and torch.equal(forced, out)
        warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(warnings) == 1 and "sglite_cpu_attention" in warnings[0].getMessage()
    finally:
        cpu_attention.load.cache_clear()  # later tests build/load the real extension again
