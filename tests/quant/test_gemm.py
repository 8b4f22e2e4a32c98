"""The int8 VNNI GEMM on 16-row quantized tiles (sglite.kernels.quant_gemm, csrc/quant_gemm.cpp):
on random shapes (4/8 bits, float32/float16 scales, with and without offsets, 1..300 rows, bf16 and
float32 activations, with a bias and an input permutation) it equals its torch reference (the
int8-quantized activations times the dequantized weight in float32) to float32 summation order,
stays within the bound the activation rounding allows of the exact product, and quant_cpu.linear
routes rows past the GEMV to it (SGLITE_GEMM=torch restores the dequantize path); refusals name
the field."""
import pytest
import torch

from sglite.kernels import gemm_paths, quant_cpu, quant_gemm
from sglite.kernels.quant_linear import QuantLinearWeight, compact_scales, reference_linear, tile_rows

pytestmark = pytest.mark.skipif(not quant_gemm.available(), reason="no AVX-512 VNNI build of the GEMM here")


def make(n, k, bits, seed, mins=True, half=False, perm=False, bias=False):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    s = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    m = (-torch.rand(n, k // 32, generator=g) * 0.05).half().float() if mins else None
    p = torch.randperm(k, generator=g) if perm else None
    b = torch.randn(n, generator=g) if bias else None
    w = QuantLinearWeight.from_codes(codes, s, m, bits, 32, perm=p, bias=b)
    if half:
        assert compact_scales(w)
    assert tile_rows(w)
    return w


CASES = [(4, True, False, False, False), (4, False, True, True, False), (8, True, True, False, True),
         (8, False, False, True, True), (4, True, True, False, True)]


@pytest.mark.parametrize("bits,mins,half,perm,bias", CASES)
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (9, 48, 64), (37, 80, 576), (300, 32, 1536)])
def test_gemm_matches_reference(bits, mins, half, perm, bias, m, n, k):
    w = make(n, k, bits, seed=m * 7 + n + bits, mins=mins, half=half, perm=perm, bias=bias)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 2
    ref = quant_gemm.reference(x, w)
    y = quant_gemm.gemm(x, w)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    # same int8 products (exact) and float32 per-block terms: only the summation order differs
    tol = 1e-5 * (k // 32) * ref.abs().amax().clamp_min(1.0)
    assert (y - ref).abs().max() <= tol
    # and within the activation-rounding bound of the exact float32 product
    exact = reference_linear(x, w)
    assert ((y - exact).abs() <= quant_gemm.error_bound(x, w) + tol).all()
    yb = quant_gemm.gemm(x.bfloat16(), w)  # bf16 activations: the same math on x rounded to bf16
    refb = quant_gemm.reference(x.bfloat16(), w)
    assert yb.dtype == torch.bfloat16
    # the product rounded once to bf16, then (with a bias) the bf16 sum rounded once more
    mag = refb.abs() + (0 if w.bias is None else w.bias.abs())
    assert ((yb.float() - refb).abs() <= mag * 2 ** -7 + tol).all()


def test_activation_quantization_is_the_reference_bit_for_bit():
    """The vectorised quantizer of the GEMM equals quantize_act_q8_reference exactly: with a weight of
    one-hot rows (code 1 at channel j, no offsets, unit scales), y[:, j] = d * xq[:, j]."""
    k = 64
    codes = torch.zeros(k, k, dtype=torch.uint8)
    codes[torch.arange(k), torch.arange(k)] = 1
    w = QuantLinearWeight.from_codes(codes, torch.ones(k, k // 32), None, 8, 32)
    assert tile_rows(w)
    x = torch.randn(13, k) * torch.logspace(-3, 3, 13)[:, None]
    xq, d, _ = quant_cpu.quantize_act_q8_reference(x)
    want = (xq.float().reshape(13, 2, 32) * d[..., None]).reshape(13, k)
    assert torch.equal(quant_gemm.gemm(x, w), want)


def test_linear_routes_batches_to_gemm(monkeypatch):
    w = make(64, 128, 4, seed=3)
    x = torch.randn(40, 128).bfloat16()
    monkeypatch.setenv("SGLITE_GEMM", "vnni")  # auto takes the AMX GEMM from gemm_paths.AMX_MIN_ROWS rows on AMX CPUs
    assert gemm_paths.quant_path(40, True, True) == "vnni_gemm" and gemm_paths.quant_path(4, True, True) == "gemv_q8"
    assert torch.equal(quant_cpu.linear(x, w), quant_gemm.gemm(x, w))
    monkeypatch.setenv("SGLITE_GEMM", "torch")  # the pre-GEMM path: dequantize, then F.linear
    assert gemm_paths.quant_path(40, True, True) == "dequant_gemm"
    y_old = quant_cpu.linear(x, w)
    assert torch.equal(y_old, torch.nn.functional.linear(x, quant_cpu.dequantize(w, torch.bfloat16)))
    assert ((y_old.float() - quant_cpu.linear(x, w, invariant=True).float()).abs() < 0.1).all()
    monkeypatch.setenv("SGLITE_GEMM", "cpp")
    assert gemm_paths.quant_path(1, True, True) == "vnni_gemm"
    assert torch.equal(quant_cpu.linear(x[:2], w), quant_gemm.gemm(x[:2], w))
    monkeypatch.setenv("SGLITE_GEMM", "fast")
    with pytest.raises(ValueError, match="SGLITE_GEMM"):
        quant_cpu.linear(x, w)


def test_invariant_never_takes_the_gemm():
    w = make(32, 64, 8, seed=5)
    x = torch.randn(48, 64)
    rows = torch.cat([quant_cpu.linear(x[i:i + 1], w, invariant=True) for i in range(48)])
    assert torch.equal(quant_cpu.linear(x, w, invariant=True), rows)


def test_refusals_name_the_field():
    w = make(32, 64, 4, seed=1)
    u = w.untiled()
    with pytest.raises(RuntimeError, match="tiled"):
        quant_gemm.gemm(torch.randn(3, 64), u)
    with pytest.raises(RuntimeError, match="x must be"):
        quant_gemm.load().quant_gemm_q8(torch.randn(3, 64).half(), w.qweight, w.scales, torch.empty(0), 4, 32, False)
    with pytest.raises(RuntimeError, match="group_size must be 32 \\(or 16 with 8-bit codes\\), got 16"):
        quant_gemm.load().quant_gemm_q8(torch.randn(3, 64), w.qweight, w.scales, torch.empty(0), 4, 16, False)
    assert quant_gemm.gemm(torch.randn(0, 64), w).shape == (0, 32)
