"""Triton segmented LoRA (sglite.kernels.triton_lora) against the torch reference, under the
Triton interpreter (``SGLITE_TEST_DEVICE=cuda``: compiled)."""
import os

DEVICE = os.environ.get("SGLITE_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed on this platform")

from sglite.kernels import reference  # noqa: E402
from sglite.kernels import triton_lora as TL  # noqa: E402
from sglite.kernels import triton_ops as T  # noqa: E402
from sglite.testing import rerun_in_triton_interpreter  # noqa: E402

pytestmark = [pytest.mark.triton]
IN_PROCESS = DEVICE != "cpu" or T.INTERPRETED


if not IN_PROCESS:
    def test_file_in_fresh_interpreter():
        r = rerun_in_triton_interpreter(__file__)
        assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.bfloat16)])  # wdtype: --lora-dtype
@pytest.mark.parametrize("N,K,O,R,S,lens,slots", [
    (5, 40, 70, 6, 2, [2, 1, 2], [1, -1, 0]),
    (3, 16, 8, 16, 3, [3], [2]),
    (4, 24, 33, 3, 1, [4], [-1]),
])
def test_triton_matches_reference(N, K, O, R, S, lens, slots, dtype, wdtype):
    g = torch.Generator().manual_seed(N * 100 + O)
    x = torch.randn(N, K, generator=g).to(dtype)
    y = torch.randn(N, O, generator=g).to(dtype)
    a = (torch.randn(S, R, K, generator=g) / K ** 0.5).to(wdtype)
    b = torch.randn(S, R, O, generator=g).to(wdtype)
    lens, slots = torch.tensor(lens), torch.tensor(slots)
    ref = reference.lora_add(y.clone(), x, a, b, lens, slots)
    dev = torch.device(DEVICE)
    got = TL.lora_add(y.clone().to(dev), x.to(dev), a.to(dev), b.to(dev), lens, slots, block_k=16, block_o=16).cpu()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), ref.float(), **tol)
    untouched = torch.repeat_interleave(slots, lens) < 0
    assert torch.equal(got[untouched], y[untouched])
