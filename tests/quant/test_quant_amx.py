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
@pytest.mark.parametrize("type_name", NATIVE_TYPES)
def test_k_loop_equals_the_repacked_copy_bitwise(type_name):
    """The default path (the codes dequantized inside the K loop: ``packed`` empty) against the
    repacked bf16 copy: the same bits in float32 and bf16 outputs, on random shapes -- rows 1..64
    (one or two 32-row chunks of a one-pair block) and past 64 (blocks of pairs), odd tile counts
    (a lone last tile with a zero partner), K of 1 to 40 blocks, both scale dtypes, 1 and 2 threads."""
    rng = np.random.default_rng(11)
    mod = quant_amx.load()
    prev = torch.get_num_threads()
    try:
        for case in range(3):
            tiles = int(rng.choice([1, 3, 5, 7]))
            k = 256 * int(rng.integers(1, 4)) if type_name.endswith("_K") else 32 * int(rng.integers(1, 41))
            w = _weight(type_name, 16 * tiles, k, 20 + case, compact=bool(case % 2))
            packed, mins = quant_amx.pack(w), torch.empty(0) if w.mins is None else w.mins
            for m in sorted({int(rng.integers(1, 33)), int(rng.integers(33, 65)), 64, int(rng.integers(65, 130))}):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
                torch.set_num_threads(1 + m % 2)
                for out_bf16 in (False, True):
                    args = (x, w.qweight, w.scales, mins, w.bits, w.group_size, out_bf16)
                    assert torch.equal(mod.quant_gemm_amx(*args, NONE), mod.quant_gemm_amx(*args, packed)), (tiles, k, m)
    finally:
        torch.set_num_threads(prev)


@amx
def test_repack_policy(monkeypatch):
    """``SGLITE_AMX_REPACK``: 0 and auto never (the K loop reads the codes), 1 always; a bad value is refused."""
    ws = [_weight("Q4_1", 32, 64, s) for s in (1, 2)]
    for v in ("0", "auto", ""):
        monkeypatch.setenv("SGLITE_AMX_REPACK", v)
        assert quant_amx.repack(ws) == 0 and ws[0].amx_packed is None and not gemm_paths.amx_repack()
    monkeypatch.setenv("SGLITE_AMX_REPACK", "1")
    assert quant_amx.repack(ws) == 2 and all(w.amx_packed is not None for w in ws)
    assert quant_amx.repack(ws) == 0  # already packed
    monkeypatch.setenv("SGLITE_AMX_REPACK", "yes")
    with pytest.raises(ValueError, match="SGLITE_AMX_REPACK"):
        gemm_paths.amx_repack()


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
