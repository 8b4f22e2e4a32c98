"""C++ quantized GEMV / dequantizer (sglite.kernels.quant_cpu) against the torch reference
(quant_linear.reference_linear / dequantize_stored): both builds (AVX-512-BF16 when the CPU has it,
portable always), 4 and 8 bits, group sizes 32/64/128, odd N, input permutation, bias, 1..8 rows
(GEMV) and more (dequantize + GEMM), float32 and bf16 activations; batch invariance of
``quant_invariant``."""
import pytest
import torch

from sglite.kernels import quant_cpu
from sglite.kernels.quant_linear import QuantLinearWeight, reference_linear

pytestmark = pytest.mark.skipif(not quant_cpu.available(), reason="the C++ quant kernel did not build here")
# portable=False: the AVX-512-BF16 build where the CPU has it; the portable build (a second compile)
# runs in the slow tier, the fast tier checks the native build
BUILDS = [False, pytest.param(True, marks=pytest.mark.slow)]


def make(n, k, bits, gs, seed, perm=True, mins=True, bias=False):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    s = (torch.rand(n, k // gs, generator=g) * 0.1).half().float()
    m = (torch.randn(n, k // gs, generator=g) * 0.05).half().float() if mins else None
    p = torch.randperm(k, generator=g) if perm else None
    b = torch.randn(n, generator=g) if bias else None
    return QuantLinearWeight.from_codes(codes, s, m, bits, gs, perm=p, bias=b)


def close(y, r, dtype, k):
    scale = r.float().abs().max().item() + 1e-6
    tol = (1e-5 * k ** 0.5 if dtype == torch.float32 else 1e-2) * scale
    err = (y.float() - r.float()).abs().max().item()
    assert err <= tol, (err, tol)


@pytest.mark.parametrize("portable", BUILDS)
@pytest.mark.parametrize("bits,gs,n,k", [(4, 32, 37, 96), (4, 64, 5, 384), (8, 32, 19, 160), (8, 128, 33, 256),
                                         (4, 128, 1, 128)])
def test_gemv_and_gemm_match_reference(portable, bits, gs, n, k):
    w = make(n, k, bits, gs, seed=n + k + bits, perm=(n % 2 == 1), mins=(bits == 4 or gs == 32), bias=(n == 37))
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 2, 3, 5, 8, 11):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
            y = quant_cpu.linear(x, w, portable=portable)
            assert y.shape == (rows, n) and y.dtype == dtype
            close(y, reference_linear(x, w), dtype, k)


@pytest.mark.parametrize("portable", BUILDS)
def test_dequantize_is_bit_exact(portable):
    w = make(21, 192, 4, 64, seed=3)
    assert torch.equal(quant_cpu.dequantize(w, torch.float32, portable), w.dequantize_stored())
    assert torch.equal(quant_cpu.dequantize(w, torch.bfloat16, portable), w.dequantize_stored().bfloat16())
    w8 = make(9, 64, 8, 32, seed=4, mins=False)
    assert torch.equal(quant_cpu.dequantize(w8, torch.float32, portable), w8.dequantize_stored())


def test_invariant_rows_do_not_depend_on_the_batch():
    w = make(40, 128, 4, 32, seed=5)
    x = torch.randn(19, 128).bfloat16()
    full = quant_cpu.linear(x, w, invariant=True)
    for i in (0, 7, 8, 18):
        assert torch.equal(quant_cpu.linear(x[i:i + 1], w, invariant=True)[0], full[i])
    w.use("invariant")
    assert w.impl == "quant_invariant"


def test_zero_rows_and_impl_choice():
    w = make(6, 64, 4, 32, seed=6)
    assert quant_cpu.linear(torch.zeros(0, 64), w).shape == (0, 6)
    assert w.use("torch").impl == "quant_cpp"


def test_fp32_activations_keep_fp32_accuracy():
    # three bf16 planes: a float32 x is not rounded to bf16 (that would be ~1e-3 relative)
    w = make(16, 512, 8, 32, seed=7, perm=False)
    x = torch.randn(1, 512)
    y = quant_cpu.gemv(x, w)
    r = x.double() @ w.dequantize_stored().double().T
    assert (y.double() - r).abs().max().item() <= 1e-5 * r.abs().max().item()
