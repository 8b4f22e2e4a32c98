"""Sliding window and logit soft-capping in the C++ CPU attention kernels (decode:
csrc/cpu_attention.cpp, extend: csrc/cpu_extend_attention.cpp) against the torch reference on
random ragged shapes with window < context, softcap > 0, both and neither; slots before a decode
window are never read; the dispatcher sends window / softcap to C++."""

import pytest
import torch

from tests.kernels.builds import built
from tests.kernels.test_cpu_extend_attention import make_case
from sglite import kernels
from sglite.kernels import cpu_attention, dispatch, reference

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
WS = [(5, 0.0), (0, 7.5), (13, 30.0), (1, 0.0), (200, 2.0)]  # (0, 0): tests/kernels/test_cpu*.py


@pytest.fixture(scope="module")
def dec_ops():
    return built(cpu_attention.load)


@pytest.fixture(scope="module")
def ext_ops():
    return built(cpu_attention.load_extend)


def decode_case(lens, Hq, Hkv, D, dtype, seed):
    """A decode step: each request's last token is the query; its pool rows from make_case."""
    q, k, v, rt, rows, _, _, scale = make_case([(n - 1, 1) for n in lens], Hq, Hkv, D, dtype, True, seed=seed)
    return q, k, v, rt, rows, torch.tensor(lens, dtype=torch.int64), scale


@pytest.mark.parametrize("window,softcap", WS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_window_softcap_matches_reference(dec_ops, window, softcap, dtype):
    g = torch.Generator().manual_seed(window * 7 + int(softcap))
    for trial in range(2):
        B = int(torch.randint(1, 5, (1,), generator=g))
        Hkv = int(torch.randint(1, 3, (1,), generator=g))
        G = int(torch.randint(1, 5, (1,), generator=g))
        D = [16, 64, 80, 128, 256][int(torch.randint(0, 5, (1,), generator=g))]
        lens = torch.randint(1, 90, (B,), generator=g).tolist()
        q, k, v, rt, rows, sl, scale = decode_case(lens, G * Hkv, Hkv, D, dtype, seed=trial)
        ref = reference.decode_attention(q.float(), k.float(), v.float(), rt, rows, sl, scale, window, softcap)
        out = cpu_attention.decode_attention(q, k, v, rt, rows, sl, scale, window, softcap)
        torch.testing.assert_close(out.float(), ref, **TOL[dtype])


def test_decode_window_never_reads_before_the_window(dec_ops):
    q, k, v, rt, rows, sl, scale = decode_case([40, 9, 25], 4, 2, 64, torch.float32, seed=5)
    window = 8
    poisoned = rt.clone()
    for b, n in enumerate(sl.tolist()):
        poisoned[rows[b], :max(0, n - window)] = k.shape[0] + 1000  # outside the pool: an IndexError if read
    out = cpu_attention.decode_attention(q, k, v, poisoned, rows, sl, scale, window, 0.0)
    torch.testing.assert_close(out, reference.decode_attention(q, k, v, rt, rows, sl, scale, window))
    with pytest.raises(IndexError, match="slot outside the pool"):
        cpu_attention.decode_attention(q, k, v, poisoned, rows, sl, scale)


@pytest.mark.parametrize("window,softcap", WS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_window_softcap_matches_reference(ext_ops, window, softcap, dtype):
    g = torch.Generator().manual_seed(window * 11 + int(softcap) + 1)
    for trial in range(2):
        B = int(torch.randint(1, 4, (1,), generator=g))
        Hkv = int(torch.randint(1, 3, (1,), generator=g))
        G = int(torch.randint(1, 5, (1,), generator=g))
        D = [16, 64, 80, 128, 256][int(torch.randint(0, 5, (1,), generator=g))]
        lens = [(int(torch.randint(0, 100, (1,), generator=g)), int(torch.randint(1, 80, (1,), generator=g)))
                for _ in range(B)]
        case = make_case(lens, G * Hkv, Hkv, D, dtype, True, seed=trial)
        q, k, v, rt, rows, pre, ext, scale = case
        ref = reference.extend_attention(q.float(), k.float(), v.float(), rt, rows, pre, ext, scale, window, softcap)
        out = cpu_attention.extend_attention(*case, window, softcap)
        torch.testing.assert_close(out.float(), ref, **TOL[dtype])


def test_dispatcher_sends_window_and_softcap_to_cpp(dec_ops, ext_ops, monkeypatch):
    monkeypatch.delenv("SGLITE_KERNEL", raising=False)
    calls = []
    for name in ("decode_attention", "extend_attention"):
        real = getattr(cpu_attention, name)
        monkeypatch.setattr(cpu_attention, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    case = make_case([(30, 9), (0, 5)], 4, 2, 32, torch.float32, True, seed=2)
    out = kernels.extend_attention(*case, window=6, softcap=20.0)
    torch.testing.assert_close(out, reference.extend_attention(*case, 6, 20.0), atol=2e-5, rtol=1e-4)
    q, k, v, rt, rows, sl, scale = decode_case([30, 7], 4, 2, 32, torch.float32, seed=3)
    for inv in (False, True):
        out = kernels.decode_attention(q, k, v, rt, rows, sl, scale, batch_invariant=inv, window=6, softcap=20.0)
        torch.testing.assert_close(out, reference.decode_attention(q, k, v, rt, rows, sl, scale, 6, 20.0),
                                   atol=2e-5, rtol=1e-4)
    assert calls == ["extend_attention", "decode_attention", "decode_attention"]
    assert dispatch.resolve_impl(None, q, "decode_attention") == "cpp"
