"""silu_mul's activation (csrc/avx512_math.h silu16, used by cpu_gemv.cpp and quant_amx.h): g / (1 + 2^(-g log2 e)) with the degree-5 exp2
polynomial of csrc/avx512_math.h (exp2_deg5, read from the header and evaluated in float32) and a
Newton-refined VRCP14PS reciprocal, against float64 oracles; bf16 results stay equal to
F.silu(g) * u (tests/kernels/test_gemv.py) and the float32 ones within a few float32 ulps."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sglite.kernels import cpu_gemv

HEADER = Path(cpu_gemv.__file__).parent / "csrc" / "avx512_math.h"


def exp2_deg5_coefficients():
    """c5 .. c0 of exp2_deg5's Horner chain, as written in the header."""
    src = HEADER.read_text()
    body = src[src.index("inline __m512 exp2_deg5"):]
    body = body[:body.index("\n}\n")]
    return [float(c) for c in re.findall(r"_mm512_set1_ps\(([0-9.e+-]+)f\)", body)]


def test_exp2_deg5_polynomial_error_is_about_one_float32_ulp():
    """Max relative error of p(r) against 2^r on [0, 1) (r = x - floor(x), the whole reduced range)
    in float32: 1.6e-7 as the header states (float32's ulp is 1.2e-7 relative at most)."""
    coef = exp2_deg5_coefficients()
    assert len(coef) == 6
    r = np.linspace(0.0, 1.0, 200001, dtype=np.float32)[:-1]
    p = np.float32(coef[0])
    for c in coef[1:]:
        p = (p * r + np.float32(c)).astype(np.float32)
    rel = np.abs(p.astype(np.float64) / np.exp2(r.astype(np.float64)) - 1.0)
    assert rel.max() < 1.7e-7


def _kernel():
    if cpu_gemv.load() is None:
        pytest.skip("the C++ gemv kernels are not built on this CPU")


def test_silu_mul_float32_within_a_few_ulps_of_float64():
    """float32 g in [-80, 80] (no clamp reached): silu(g) * u within 1e-6 + 6e-8 |g| relative of
    the float64 value (the polynomial, the refined reciprocal, three roundings, and the rounding of
    g log2(e), whose absolute error grows with |g|: 3.8e-6 at g = -78, where the division form
    this replaced gave up to 6.2e-6)."""
    _kernel()
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(64, 1000, generator=g) * 160 - 80)
    u = torch.randn(64, 1000, generator=g)
    got = cpu_gemv.silu_mul(x, u).double()
    want = x.double() * torch.sigmoid(x.double()) * u.double()
    rel = ((got - want).abs() / want.abs().clamp_min(1e-300))
    assert bool((rel <= 1e-6 + 6e-8 * x.double().abs()).all())


def test_silu_mul_extremes():
    """Very negative gates give results of at most |g u| 2^-120 (torch: 0 or a denormal), large
    positive ones g u exactly (the sigmoid rounds to 1), zero gives zero; bf16 as float32."""
    _kernel()
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.tensor([-1e4, -500.0, -120.0, -90.0, 0.0, 90.0, 500.0, 1e4] * 2, dtype=dtype)
        u = torch.full_like(g, 3.0)
        got = cpu_gemv.silu_mul(g, u).double()
        neg = g.double() < -87
        assert bool((got[neg].abs() <= (g.double()[neg] * 3).abs() * 2.0 ** -120).all())
        pos = g.double() > 80
        assert torch.equal(got[pos], (g.double()[pos] * 3).to(dtype).double())
        assert bool((got[g.double() == 0] == 0).all())
