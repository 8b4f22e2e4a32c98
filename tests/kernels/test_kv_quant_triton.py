"""Triton decode attention over int8 / int4 quantized KV pages (sglite.kernels.kv_quant_triton)
against the torch reference, under the Triton interpreter (``SGLITE_TEST_DEVICE=cuda``: compiled)."""
import os

DEVICE = os.environ.get("SGLITE_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed on this platform")

from sglite.kernels import kv_quant as kq  # noqa: E402
from sglite.kernels import kv_quant_triton as KT  # noqa: E402
from sglite.kernels import triton_ops as T  # noqa: E402
from sglite.testing import rerun_in_triton_interpreter  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.slow]
IN_PROCESS = DEVICE != "cpu" or T.INTERPRETED


if not IN_PROCESS:
    def test_file_in_fresh_interpreter():
        r = rerun_in_triton_interpreter(__file__)
        assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("D,Hq,Hkv", [(16, 4, 2), (32, 6, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_matches_reference(kind, D, Hq, Hkv, dtype):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_kv_quant import Seq  # the pool-writing helper of the reference tests

    s = Seq(kind, G=16, page=16, Hkv=Hkv, D=D, rows=3, dtype=dtype, seed=D + Hq)
    s.step({0: 37, 1: 16, 2: 5})
    s.step({0: 1, 2: 20})
    rows = torch.tensor([0, 1, 2])
    lens = torch.tensor([len(x) for x in s.k])
    q = torch.randn(3, Hq, D).to(dtype)
    ref = kq.decode_attention(q, s.layer, s.table, rows, lens, 0.125)
    out = KT.decode_attention(q, s.layer, s.table, rows, lens, 0.125, block_n=16)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and torch.allclose(out.float(), ref.float(), atol=tol)
