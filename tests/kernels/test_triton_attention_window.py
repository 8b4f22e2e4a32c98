"""Sliding window and logit soft-capping in the Triton attention kernels (decode and extend)
against the torch reference, under ``TRITON_INTERPRET=1`` on CPU (the file re-runs itself in a
fresh interpreter process when triton was already imported for a GPU), as tests/kernels/test_attention.py."""
import os

DEVICE = os.environ.get("SGLITE_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed on this platform")

from sglite.kernels import reference as R  # noqa: E402
from sglite.kernels import triton_ops as T  # noqa: E402
from sglite.testing import rerun_in_triton_interpreter  # noqa: E402
from tests.kernels.test_attention import make_pool, rel_err  # noqa: E402

pytestmark = pytest.mark.triton
IN_PROCESS = DEVICE != "cpu" or T.INTERPRETED

if not IN_PROCESS:
    def test_file_in_fresh_interpreter():
        r = rerun_in_triton_interpreter(__file__)
        assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# (window, softcap, GQA ratio, KV heads, head dim, dtype, lengths)
CASES = [
    (8, 0.0, 2, 1, 64, torch.float32, [1, 40, 9, 70]),
    (0, 5.0, 1, 2, 32, torch.float32, [17, 3]),
    (16, 30.0, 3, 1, 64, torch.bfloat16, [100, 16, 5]),
    (1, 0.0, 1, 1, 16, torch.float32, [12, 1]),
]


@pytest.mark.parametrize("window,softcap,group,hkv,d,dtype,lens", CASES)
def test_decode_window_softcap(window, softcap, group, hkv, d, dtype, lens):
    gen = torch.Generator().manual_seed(window * 3 + len(lens))
    kb, vb, r2t, rows = make_pool(lens, hkv, d, dtype, gen)
    q = torch.randn(len(lens), group * hkv, d, generator=gen).to(dtype).to(DEVICE)
    sl = torch.tensor(lens, dtype=torch.int64, device=DEVICE)
    ref = R.decode_attention(q.float(), kb.float(), vb.float(), r2t, rows, sl, d ** -0.5, window, softcap)
    for splits in (1, 3):
        out = T.decode_attention(q, kb, vb, r2t, rows, sl, d ** -0.5, window, softcap, num_splits=splits)
        assert rel_err(out, ref) < TOL[dtype], (splits, rel_err(out, ref))


@pytest.mark.parametrize("window,softcap,group,hkv,d,dtype,lens", CASES)
def test_extend_window_softcap(window, softcap, group, hkv, d, dtype, lens):
    gen = torch.Generator().manual_seed(window * 5 + len(lens))
    kb, vb, r2t, rows = make_pool(lens, hkv, d, dtype, gen)
    ext = [max(1, n // 2 + (i % 3)) if n > 1 else 1 for i, n in enumerate(lens)]
    ext = [min(e, n) for e, n in zip(ext, lens)]
    pre = torch.tensor([n - e for n, e in zip(lens, ext)], dtype=torch.int64, device=DEVICE)
    el = torch.tensor(ext, dtype=torch.int64, device=DEVICE)
    q = torch.randn(sum(ext), group * hkv, d, generator=gen).to(dtype).to(DEVICE)
    ref = R.extend_attention(q.float(), kb.float(), vb.float(), r2t, rows, pre, el, d ** -0.5, window, softcap)
    out = T.extend_attention(q, kb, vb, r2t, rows, pre, el, d ** -0.5, window, softcap, block_m=16, block_n=16)
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)
