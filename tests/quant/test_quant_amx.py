"""The AMX bf16 GEMM on GGUF blocks in 16-row tiles (:mod:`sglite.kernels.quant_amx`) against its
torch reference (bf16 activations x the bf16-rounded dequantized weight, float32 sums), for every
native GGUF type, random shapes (odd row counts: the zero-padded tails), both scale dtypes, float32
and bf16 outputs, one and two threads; and the dispatcher's choice of it by row count."""
import numpy as np
import pytest
import torch

from sglite.kernels import gemm_paths, quant_amx, quant_cpu
from sglite.kernels.quant_layout import compact_scales, tile_rows
from sglite.runtime.gguf_blocks import NATIVE_TYPES, blocks_to_weight
from sglite.testing import random_gguf_blocks

NONE = torch.empty(0, dtype=torch.int16)  # no repacked copy: dequantize per call
amx = pytest.mark.skipif(not quant_amx.available(), reason="no AMX-BF16 here")


def _weight(type_name, n, k, seed, compact=True):
    w = blocks_to_weight(type_name, random_gguf_blocks(type_name, n, k, seed=seed), k)
    if compact:
        compact_scales(w)
    assert tile_rows(w) and quant_amx.supports(w)
    return w


@amx
@pytest.mark.parametrize("type_name", NATIVE_TYPES)
def test_amx_gemm_matches_reference(type_name):
    rng = np.random.default_rng(5)
    k = 256 * int(rng.integers(1, 3)) if type_name.endswith("_K") else 32 * int(rng.integers(1, 12))
    for n, compact in ((16, True), (48, False), (80, True)):  # one tile, an odd tile count, pairs
        w = _weight(type_name, n, k, n, compact)
        for m in (1, 17, 32, 45, 70):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
            r = quant_amx.reference(x, w)
            tol = 2e-6 * k ** 0.5 * (r.abs().max().item() + 1e-6)
            y32 = quant_amx.load().quant_gemm_amx(x.contiguous(), w.qweight, w.scales,
                                                  torch.empty(0) if w.mins is None else w.mins,
                                                  w.bits, w.group_size, False, NONE)
            assert (y32 - r).abs().max().item() <= tol, (n, m)
            y = quant_amx.gemm(x, w)
            assert y.dtype == torch.bfloat16
            assert torch.equal(y, y32.bfloat16())  # one rounding of the float32 sums


@amx
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_gemm_runs_in_l2_blocks_of_pairs(threads):
    """K = 4096: two dequantized tile pairs fill the kernel's L2 block, so 9 tiles (5 pairs, the
    last one a single tile) run as several blocks per thread, each over every 32-row chunk."""
    w = _weight("Q4_1", 144, 4096, 3)
    x = torch.randn(70, 4096, generator=torch.Generator().manual_seed(4)).bfloat16()
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        y32 = quant_amx.load().quant_gemm_amx(x, w.qweight, w.scales, w.mins, w.bits, w.group_size, False, NONE)
        w.amx_packed = quant_amx.pack(w)
        packed = quant_amx.gemm(x, w)
    finally:
        torch.set_num_threads(prev)
    r = quant_amx.reference(x, w)
    assert (y32 - r).abs().max().item() <= 2e-6 * 4096 ** 0.5 * r.abs().max().item()
    assert torch.equal(packed, y32.bfloat16())  # the repacked copy, block by block too


@amx
@pytest.mark.parametrize("type_name", NATIVE_TYPES)
def test_repacked_copy_gives_the_same_bits(type_name):
    """``quant_amx.pack``: the values the GEMM dequantizes per call, so the output is bit-identical
    (an odd tile count: the lone last tile's zero partner), and ``nbytes`` counts the copy."""
    k = 512 if type_name.endswith("_K") else 96
    w = _weight(type_name, 48, k, 7)
    x = torch.randn(45, k, generator=torch.Generator().manual_seed(8)).bfloat16()
    plain, before = quant_amx.gemm(x, w), w.nbytes()
    w.amx_packed = quant_amx.pack(w)
    assert w.amx_packed.dtype == torch.int16 and w.amx_packed.numel() == 2 * 2 * (k // 32) * 512  # 3 tiles: 2 pairs
    assert w.nbytes() == before + 2 * w.amx_packed.numel()
    assert torch.equal(quant_amx.gemm(x, w), plain)


@amx
def test_repack_policy(monkeypatch):
    """``SGLITE_AMX_REPACK``: 0 never, 1 always, auto within the memory share; a bad value is refused."""
    ws = [_weight("Q4_1", 32, 64, s) for s in (1, 2)]
    monkeypatch.setenv("SGLITE_AMX_REPACK", "0")
    assert quant_amx.repack(ws) == 0 and ws[0].amx_packed is None
    monkeypatch.setenv("SGLITE_AMX_REPACK", "auto")
    assert gemm_paths.amx_repack(100, 1000) and not gemm_paths.amx_repack(200, 1000)
    monkeypatch.setenv("SGLITE_AMX_REPACK", "1")
    assert quant_amx.repack(ws) == 2 and all(w.amx_packed is not None for w in ws)
    assert quant_amx.repack(ws) == 0  # already packed
    monkeypatch.setenv("SGLITE_AMX_REPACK", "yes")
    with pytest.raises(ValueError, match="SGLITE_AMX_REPACK"):
        gemm_paths.amx_repack(1, 1)


@amx
def test_amx_gemm_takes_rows_off_a_cache_line_boundary():
    """A view 16 bytes past a 64-byte boundary (as malloc's buffers are): the kernel copies it to an
    aligned buffer first (a tile row must be one cache line), same bits as the aligned input."""
    w = _weight("Q4_1", 64, 576, 3)
    for m in (32, 45):
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m)).bfloat16()
        buf = torch.zeros(m * 576 + 32, dtype=torch.bfloat16)
        off = (16 - buf.data_ptr() % 64) % 64 // 2
        v = buf[off:off + m * 576].view(m, 576)
        v.copy_(x)
        assert v.data_ptr() % 64 == 16 and v.is_contiguous()
        args = (w.qweight, w.scales, w.mins, w.bits, w.group_size, True, NONE)
        assert torch.equal(quant_amx.load().quant_gemm_amx(v, *args), quant_amx.load().quant_gemm_amx(x, *args))


@amx
def test_amx_gemm_threads_agree():
    w = _weight("Q4_1", 96, 576, 1)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant_amx.gemm(x, w)
        torch.set_num_threads(2)
        two = quant_amx.gemm(x, w)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(one, two)  # each output tile is computed by one thread, same code


@amx
def test_dispatcher_takes_amx_for_many_bf16_rows(monkeypatch):
    w = _weight("Q4_1", 64, 576, 3)
    monkeypatch.delenv(gemm_paths.ENV, raising=False)
    rows = gemm_paths.AMX_MIN_ROWS
    assert gemm_paths.quant_path(rows, True, True, amx_ok=True) == "amx_gemm"
    assert gemm_paths.quant_path(rows - 1, True, True, amx_ok=True) != "amx_gemm"
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert torch.equal(quant_cpu.linear(x, w), quant_amx.gemm(x, w))
    monkeypatch.setenv(gemm_paths.ENV, "vnni")  # AMX off: the int8 GEMM
    assert gemm_paths.quant_path(rows, True, True, amx_ok=True) == "vnni_gemm"


def test_amx_path_needs_the_cpu():
    assert gemm_paths.quant_path(512, True, True, amx_ok=False) == "vnni_gemm"
    if not quant_amx.available():
        with pytest.raises(RuntimeError, match="AMX kernel is unavailable"):
            quant_amx.gemm(torch.zeros(32, 32, dtype=torch.bfloat16), None)
