"""Triton quantized matmul (sglite.kernels.triton_quant) against the torch reference
(quant_linear.reference_linear): 4/8 bits, group sizes 32/128, offsets or none, input permutation,
bias, odd N, 1..8 rows and more. On CPU under ``TRITON_INTERPRET=1`` (a fresh subprocess when
triton was imported first), as tests/kernels/test_matmul.py; ``SGLITE_TEST_DEVICE=cuda`` runs it
compiled on a GPU."""
import os

DEVICE = os.environ.get("SGLITE_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed on this platform")

from sglite.kernels import triton_ops as T  # noqa: E402
from sglite.kernels import triton_quant as TQ  # noqa: E402
from sglite.kernels.quant_linear import QuantLinearWeight, reference_linear  # noqa: E402
from sglite.testing import rerun_in_triton_interpreter  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.slow]
IN_PROCESS = DEVICE != "cpu" or T.INTERPRETED


if not IN_PROCESS:  # the other tests of this file skip (tests/conftest.py) and run in a subprocess
    def test_file_in_fresh_interpreter():
        r = rerun_in_triton_interpreter(__file__)
        assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]


@pytest.mark.parametrize("bits,gs,n,k,mins,perm", [(4, 32, 37, 96, True, False), (8, 32, 20, 64, False, True),
                                                   (4, 128, 70, 256, True, True), (8, 16, 24, 96, True, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_triton_matches_reference(bits, gs, n, k, mins, perm, dtype):
    g = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    s = (torch.rand(n, k // gs, generator=g) * 0.1).half().float()
    m = (torch.randn(n, k // gs, generator=g) * 0.05).half().float() if mins else None
    p = torch.randperm(k, generator=g) if perm else None
    w = QuantLinearWeight.from_codes(codes, s, m, bits, gs, perm=p, bias=torch.randn(n, generator=g) if n == 37 else None)
    w = w.to(DEVICE)
    for rows in (1, 5, 8, 19):
        x = torch.randn(rows, k, generator=g).to(device=DEVICE, dtype=dtype)
        y, r = TQ.linear(x, w), reference_linear(x, w)
        assert y.shape == (rows, n) and y.dtype == dtype
        scale = r.float().abs().max().item()
        tol = (1e-5 * k ** 0.5 if dtype == torch.float32 else 1.5e-2) * scale
        assert (y.float() - r.float()).abs().max().item() <= tol
