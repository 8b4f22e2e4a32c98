"""The AMX attention's softmax (csrc/amx_attention.h): the degree-3 exp2 polynomial of
csrc/avx512_math.h against 2^x (read from the header, evaluated in float32), and the lazy running
max (kTau) on scores that grow and fall across key blocks, against a float64 oracle."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.kernels.builds import built
from tests.kernels.test_cpu_extend_attention import make_case, oracle
from sglite.kernels import cpu_attention

HEADER = Path(cpu_attention.__file__).parent / "csrc" / "avx512_math.h"


def exp2_deg3_coefficients(name="exp2_deg3("):
    """c3, c2, c1, c0 of exp2_deg3's Horner chain (or exp2_deg3_maskz's), as written in the header."""
    src = HEADER.read_text()
    body = src[src.index("inline __m512 " + name):]
    body = body[:body.index("\n}\n")]
    return [float(c) for c in re.findall(r"_mm512_set1_ps\(([0-9.e+-]+)f\)", body)]


def test_masked_exp2_uses_the_same_polynomial():
    """exp2_deg3_maskz (the attention's form: the mask on the final VSCALEFPS) spells the same four
    coefficients as exp2_deg3, which the next test evaluates."""
    assert len(exp2_deg3_coefficients()) == 4
    assert exp2_deg3_coefficients("exp2_deg3_maskz(") == exp2_deg3_coefficients()


def test_exp2_polynomial_error_is_far_below_bf16_rounding():
    """Max relative error of p(r) against 2^r on [0, 1) (the whole reduced range: r = x - floor(x))
    in float32: 7.5e-5 as the header states, 26x below half a bf16 ulp (2^-9), the rounding every
    weight then takes; scalef by 2^floor(x) adds no error (exact for results >= 2^-126)."""
    c3, c2, c1, c0 = exp2_deg3_coefficients()
    r = np.linspace(0.0, 1.0, 200001, dtype=np.float32)[:-1]
    p = np.float32(c3)
    for c in (c2, c1, c0):
        p = (p * r + np.float32(c)).astype(np.float32)
    rel = np.abs(p.astype(np.float64) / np.exp2(r.astype(np.float64)) - 1.0)
    assert rel.max() < 7.6e-5
    assert rel.max() < 2.0 ** -9 / 25


@pytest.mark.parametrize("slope", [0.02, 0.1, -0.05])
def test_growing_and_falling_scores_across_blocks(slope):
    """One 700-token prompt whose scores move by `slope` (natural units) per key position: from a
    fraction of kTau per block to several kTau, up and down; the tiles' output stays within the
    bf16 tolerance of the float64 oracle (the same bound as the random cases)."""
    built(cpu_attention.load_extend)
    if not cpu_attention.amx_ready():
        pytest.skip("no AMX tiles on this CPU")
    q, k, v, rt, rows, pre, ext, scale = make_case([(0, 700)], 3, 1, 64, torch.bfloat16, True, seed=5)
    g = torch.Generator().manual_seed(6)
    u = torch.randn(64, generator=g)
    u /= u.norm()
    slots = rt[rows[0], :700].long()
    pos = torch.arange(700, dtype=torch.float32)[:, None]
    k[slots, 0] = (u * pos * slope / (4.0 * scale) + 0.3 * torch.randn(700, 64, generator=g)).bfloat16()
    q[:, :] = (4.0 * u).bfloat16()
    out = cpu_attention.extend_attention(q, k, v, rt, rows, pre, ext, scale, amx=True)
    torch.testing.assert_close(out.double(), oracle(q, k, v, rt, rows, pre, ext, scale), atol=1e-2, rtol=1e-2)
