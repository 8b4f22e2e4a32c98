"""Triton batch-invariant matmul (sglite.kernels.triton_matmul) and RMSNorm (triton_norm) against
torch, and their row invariance (row i alone == row i inside batches of other sizes, bitwise).

On CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
imported; a fresh subprocess when another module imported triton first), as in
tests/kernels/test_attention.py; ``SGLITE_TEST_DEVICE=cuda`` runs it compiled on a GPU.
"""
import os

DEVICE = os.environ.get("SGLITE_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed on this platform")

from sglite.kernels import triton_matmul as TM  # noqa: E402
from sglite.kernels import triton_norm as TN  # noqa: E402
from sglite.kernels import triton_ops as T  # noqa: E402

from sglite.testing import rerun_in_triton_interpreter  # noqa: E402

pytestmark = pytest.mark.triton
IN_PROCESS = DEVICE != "cpu" or T.INTERPRETED


if not IN_PROCESS:  # the other tests of this file skip (tests/conftest.py) and run in a subprocess
    @pytest.mark.slow  # 7-14 s of the fast tier's worker time; make test-all (CI) runs it
    def test_file_in_fresh_interpreter():
        r = rerun_in_triton_interpreter(__file__)
        assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,N", [(40, 70), (96, 64)])
def test_linear_invariant_rows_and_accuracy(dtype, K, N):
    g = torch.Generator().manual_seed(K + N)
    dev = torch.device(DEVICE)
    x = torch.randn(70, K, generator=g).to(dtype).to(dev)
    w = torch.randn(N, K, generator=g).to(dtype).to(dev)
    b = torch.randn(N, generator=g).to(dtype).to(dev)
    full = TM.linear_invariant(x, w, b)
    ref = F.linear(x.double(), w.double(), b.double())
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert float(((full.double() - ref).abs() / ref.abs().max()).max()) < tol
    alone = [TM.linear_invariant(x[i:i + 1], w, b) for i in range(0, 70, 7)]
    for n in (1, 3, 64, 65):
        part = TM.linear_invariant(x[:n], w, b)
        for j, i in enumerate(range(0, 70, 7)):
            if i < n:
                assert torch.equal(part[i], alone[j][0]), (n, i)
    assert TM.linear_invariant(x[:0], w).shape == (0, N)
    with pytest.raises(ValueError, match="dtype|is"):
        TM.linear_invariant(x, w.float() if dtype != torch.float32 else w.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [16, 37, 64])
def test_rms_norm_rows_and_accuracy(dtype, H):
    g = torch.Generator().manual_seed(H)
    dev = torch.device(DEVICE)
    x = (torch.randn(20, H, generator=g) * 3).to(dtype).to(dev)
    w = torch.randn(H, generator=g).to(dtype).to(dev)
    full = TN.rms_norm(x, w, 1e-5)
    ref = F.rms_norm(x.double(), (H,), w.double(), 1e-5)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert float(((full.double() - ref).abs() / ref.abs().max()).max()) < tol
    for n in (1, 3, 20):
        part = TN.rms_norm(x[:n], w, 1e-5)
        for i in range(n):
            assert torch.equal(part[i], TN.rms_norm(x[i:i + 1], w, 1e-5)[0]), (n, i)
    x3 = x.view(4, 5, H)[:, 1:3]  # a strided 3-D view (as the q/k norms of Qwen3)
    assert torch.equal(TN.rms_norm(x3, w, 1e-5), full.view(4, 5, H)[:, 1:3])
    with pytest.raises(ValueError, match="weight"):
        TN.rms_norm(x, w[:-1], 1e-5)
