"""The AMX tile GEMM at prefill sizes (:mod:`sglite.kernels.quant_amx`): several 128-row blocks swept
pair by pair (K <= 640) or one 32-row chunk at a time (larger K), the output written during the next
chunk's K loop, against the torch reference for every native GGUF type, odd tile counts, float32 and
bf16 outputs, one and two threads; and the gate/up GEMM's SwiGLU output stage
(:func:`~sglite.kernels.quant_amx.gemm_silu_mul`, ``kernels.linear_silu``) against its reference and,
bit for bit, the product followed by ``silu_mul``."""
import numpy as np
import pytest
import torch

from sglite import kernels
from sglite.kernels import cpu_gemv, gemm_paths, quant_amx
from sglite.kernels.quant_layout import compact_scales, tile_rows
from sglite.runtime.gguf_blocks import NATIVE_TYPES, blocks_to_weight
from sglite.testing import random_gguf_blocks

NONE = torch.empty(0, dtype=torch.int16)
amx = pytest.mark.skipif(not quant_amx.available(), reason="no AMX-BF16 here")


def _weight(type_name, n, k, seed):
    w = blocks_to_weight(type_name, random_gguf_blocks(type_name, n, k, seed=seed), k)
    compact_scales(w)
    assert tile_rows(w) and quant_amx.supports(w)
    return w


def _mins(w):
    return torch.empty(0) if w.mins is None else w.mins


def _inputs(k, rows, threads):
    """(m, x [m, k] bf16 seeded by m) for each row count, with torch (and sglite's pool) at ``threads``."""
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for m in rows:
            yield m, torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    finally:
        torch.set_num_threads(prev)


def _check_rows(w, k, rows, threads):
    for m, x in _inputs(k, rows, threads):
        r = quant_amx.reference(x, w)
        y32 = quant_amx.load().quant_gemm_amx(x, w.qweight, w.scales, _mins(w), w.bits, w.group_size, False, NONE)
        assert (y32 - r).abs().max().item() <= 2e-6 * k ** 0.5 * (r.abs().max().item() + 1e-6), (m, threads)
        assert torch.equal(quant_amx.gemm(x, w), y32.bfloat16()), (m, threads)  # one rounding of the sums


@amx
@pytest.mark.parametrize("type_name", NATIVE_TYPES)
def test_row_blocks_match_the_reference(type_name):
    """Rows past one 128-row block (and a ragged last chunk), an odd tile count, K in both blockings."""
    rng = np.random.default_rng(11)
    small_k = 256 if type_name.endswith("_K") else 32 * int(rng.integers(2, 20))  # pairs swept over row blocks
    for k in (small_k, 768 if type_name.endswith("_K") else 704):  # <= 640 / past it: one chunk at a time
        w = _weight(type_name, 48, k, k)
        _check_rows(w, k, (129, 300), threads=1 + k % 2)


@amx
@pytest.mark.slow
@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_0", "Q8_0"])
def test_prefill_shapes_match_the_reference(type_name):
    """The default model's shapes (K = 576 -> 960 / 3,072 columns, K = 1,536 -> 576) at 2,100 rows
    and a random count, one and two threads."""
    rows = (2100, int(np.random.default_rng(3).integers(1, 2100)))
    for n, k in ((960, 576), (3072, 576), (576, 1536)):
        w = _weight(type_name, n, k, n + k)
        for threads in (1, 2):
            _check_rows(w, k, rows, threads)


def _silu_check(w, k, rows, threads=1):
    for m, x in _inputs(k, rows, threads):
        act = quant_amx.gemm_silu_mul(x, w)
        assert act.shape == (m, w.shape[0] // 2) and act.dtype == torch.bfloat16
        g, u = quant_amx.gemm(x, w).chunk(2, dim=-1)
        assert torch.equal(act, cpu_gemv.silu_mul(g, u)), (m, threads)  # the unfused path, bit for bit
        ref = quant_amx.silu_reference(x, w).float()
        # the tile order of the float32 sums (or the kernel's exp, rel. error ~2e-7) may move g, u or
        # silu(g) by one bf16 step (2^-8 relative) before the product's own rounding
        gr, ur = quant_amx.reference(x, w).chunk(2, dim=-1)
        tol = 2 ** -6 * (ref.abs() + (gr * ur).abs()) + 1e-6
        assert ((act.float() - ref).abs() <= tol).all(), (m, threads)


@amx
@pytest.mark.parametrize("type_name", NATIVE_TYPES)
def test_silu_output_stage_matches_the_product_then_silu_mul(type_name):
    """Gate/up halves of 1 and 3 tile pairs (odd), rows within one chunk, a ragged last chunk, past
    one 128-row block; K in both blockings (768 / 704: one chunk at a time over the block's pairs)."""
    for n, k in ((64, 256 if type_name.endswith("_K") else 96), (192, 768 if type_name.endswith("_K") else 704)):
        w = _weight(type_name, n, k, n)
        _silu_check(w, k, (9, 45, 300), threads=1 + n % 3)


@amx
@pytest.mark.slow
def test_silu_output_stage_at_prefill_size():
    w = _weight("Q4_1", 3072, 576, 5)
    _silu_check(w, 576, (2100, 1000), threads=2)


@amx
def test_linear_silu_dispatch(monkeypatch):
    """``kernels.linear_silu``: the output stage from ``AMX_MIN_ROWS`` bf16 rows of a ``quant_cpp``
    tiled weight, None below, for float32 rows, another implementation or ``SGLITE_AMX_SILU=0``;
    a bad switch value is refused."""
    monkeypatch.delenv(gemm_paths.ENV, raising=False)
    monkeypatch.delenv(gemm_paths.SILU_ENV, raising=False)
    w = _weight("Q4_1", 128, 96, 9).use("quant_cpp")
    rows = gemm_paths.AMX_MIN_ROWS
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    g, u = kernels.linear(x, w).chunk(2, dim=-1)
    assert torch.equal(kernels.linear_silu(x, w), kernels.silu_mul(g, u))
    assert kernels.linear_silu(x[: rows - 1], w) is None
    assert kernels.linear_silu(x.float(), w) is None
    monkeypatch.setenv(gemm_paths.SILU_ENV, "0")
    assert kernels.linear_silu(x, w) is None
    monkeypatch.setenv(gemm_paths.SILU_ENV, "yes")
    with pytest.raises(ValueError, match="SGLITE_AMX_SILU"):
        kernels.linear_silu(x, w)
    monkeypatch.delenv(gemm_paths.SILU_ENV)
    assert kernels.linear_silu(x, w.use("quant_ref")) is None


@amx
def test_silu_output_stage_refuses_other_weights():
    w = _weight("Q4_1", 48, 96, 1)  # 3 tiles: the halves are not whole tile pairs
    x = torch.zeros(32, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out_features % 64"):
        quant_amx.gemm_silu_mul(x, w)
    with pytest.raises(ValueError, match="must be bf16"):
        quant_amx.gemm_silu_mul(x.float(), _weight("Q4_1", 64, 96, 1))
    with pytest.raises(RuntimeError, match="N % 64"):
        quant_amx.load().quant_gemm_amx_silu(x, w.qweight, w.scales, _mins(w), w.bits, w.group_size, NONE)


@amx
def test_silu_output_stage_reads_the_repacked_copy():
    """With ``w.amx_packed`` (``SGLITE_AMX_REPACK=1``) the stage reads each half's pairs from the copy:
    the same bits as from the codes."""
    w = _weight("Q4_1", 192, 96, 4)
    x = torch.randn(150, 96, generator=torch.Generator().manual_seed(6)).bfloat16()
    plain = quant_amx.gemm_silu_mul(x, w)
    w.amx_packed = quant_amx.pack(w)
    assert torch.equal(quant_amx.gemm_silu_mul(x, w), plain)
