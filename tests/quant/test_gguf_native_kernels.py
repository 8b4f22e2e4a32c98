"""Every GGUF type sglite keeps quantized (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) on every
C++ path, against the torch references, on random valid blocks and random shapes: the float-exact
GEMV and the dequantizer (vs :func:`.quant_linear.reference_linear` / ``dequantize_stored``), the
int8-activation GEMV in the row layout and in 16-row tiles (vs :func:`.quant_cpu.gemv_q8_reference`;
the native build in the fast tier, the portable build in the slow one), the VNNI GEMM (vs :func:`.quant_gemm.reference`) and the dispatcher's choice (the
quantized CPU path, never ``quant_ref``; group 16 only with 8-bit codes)."""
import numpy as np
import pytest
import torch

from sglite.kernels import quant_cpu, quant_gemm
from sglite.kernels.quant_layout import compact_scales, tile_rows
from sglite.kernels.quant_linear import QuantLinearWeight, reference_linear
from sglite.runtime.gguf_blocks import NATIVE_TYPES, blocks_to_weight
from sglite.testing import random_gguf_blocks

pytestmark = pytest.mark.skipif(not quant_cpu.available(), reason="the C++ quant kernel did not build here")


def _weight(type_name, n, k, seed):
    return blocks_to_weight(type_name, random_gguf_blocks(type_name, n, k, seed=seed), k)


def _shape(type_name, seed):
    rng = np.random.default_rng(seed)
    k = 256 * int(rng.integers(1, 3)) if type_name.endswith("_K") else 32 * int(rng.integers(1, 12))
    return 16 * int(rng.integers(1, 5)), k


@pytest.mark.parametrize("type_name", NATIVE_TYPES)
def test_float_gemv_and_dequant_match_reference(type_name):
    for seed in (0, 1):
        n, k = _shape(type_name, seed)
        n += 3  # odd row count: the row layout
        w = _weight(type_name, n, k, seed).use("auto")
        assert w.impl == "quant_cpp"  # the dispatcher picks the C++ path for every native type
        assert torch.equal(quant_cpu.dequantize(w), w.dequantize_stored())
        for rows in (1, 3, 8, 11):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + seed))
            want = reference_linear(x, w)
            tol = 1e-5 * k ** 0.5 * (want.abs().max().item() + 1e-6)
            assert (quant_cpu.linear(x, w) - want).abs().max().item() <= tol
            assert (quant_cpu.linear(x, w, invariant=True) - want).abs().max().item() <= tol
            xb = x.bfloat16()
            got = quant_cpu.linear(xb, w).float()
            torch.testing.assert_close(got, reference_linear(xb.float(), w), rtol=2e-2, atol=2e-2 * want.abs().max().item())


def check_int8_gemv(type_name, tiled, portable=False):
    """The int8-activation GEMV (row layout or 16-row tiles) against its torch reference."""
    n, k = _shape(type_name, 7)
    w = _weight(type_name, n if tiled else n + 5, k, 7)
    if tiled:
        compact_scales(w)
        assert tile_rows(w) and w.tiled
    for rows in (1, 4, 8, 13):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        r = quant_cpu.gemv_q8_reference(x, w)
        y = quant_cpu.gemv_q8(x, w, portable=portable)
        assert (y - r).abs().max().item() <= 1e-5 * k ** 0.5 * (r.abs().max().item() + 1e-6), (tiled, rows)


@pytest.mark.parametrize("type_name", NATIVE_TYPES)
@pytest.mark.parametrize("tiled", [False, True])
def test_int8_gemv_matches_reference(type_name, tiled):
    check_int8_gemv(type_name, tiled)


def test_int8_gemv_reads_float16_scales_as_stored():
    """quant_gemv_q8 checks float16 (compact) scales and mins as stored, with no float32 copy of
    them: row layout and tiles against the reference; a malformed float16 scale tensor (not
    contiguous, wrong count) is refused naming float16."""
    n, k = _shape("Q4_1", 2)
    for tiled in (False, True):
        w = _weight("Q4_1", n, k, 2)
        assert compact_scales(w) and w.scales.dtype == torch.float16
        if tiled:
            assert tile_rows(w)
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
        r = quant_cpu.gemv_q8_reference(x, w)
        assert (quant_cpu.gemv_q8(x, w) - r).abs().max().item() <= 1e-5 * k ** 0.5 * (r.abs().max().item() + 1e-6)
    mod, mins = quant_cpu.load(), w.mins if w.mins is not None else torch.empty(0, dtype=torch.float16)
    bad = torch.zeros(w.scales.numel() * 2, dtype=torch.float16)[::2]  # the right count, not contiguous
    with pytest.raises(RuntimeError, match="scales must be float16"):
        mod.quant_gemv_q8(x, w.qweight, bad, mins, w.bits, w.group_size, False, w.tiled)
    with pytest.raises(RuntimeError, match="scales must be float16"):
        mod.quant_gemv_q8(x, w.qweight, w.scales.reshape(-1)[1:].contiguous(), mins, w.bits, w.group_size, False, w.tiled)


@pytest.mark.slow  # the portable build is a second compile of the extension; the fast tier checks the native one
@pytest.mark.parametrize("type_name", NATIVE_TYPES)
def test_portable_build_matches_reference(type_name):
    """The portable build's dequantizer, float GEMV and int8 GEMV (row layout and tiles), as above."""
    for seed in (0, 1):
        n, k = _shape(type_name, seed)
        w = _weight(type_name, n + 3, k, seed).use("auto")
        assert torch.equal(quant_cpu.dequantize(w, portable=True), w.dequantize_stored())
        for rows in (1, 3, 8, 11):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + seed))
            want = reference_linear(x, w)
            tol = 1e-5 * k ** 0.5 * (want.abs().max().item() + 1e-6)
            assert (quant_cpu.linear(x, w, portable=True) - want).abs().max().item() <= tol
    for tiled in (False, True):
        check_int8_gemv(type_name, tiled, portable=True)


@pytest.mark.skipif(not quant_gemm.available(), reason="no AVX-512 VNNI here")
@pytest.mark.parametrize("type_name", NATIVE_TYPES)
def test_vnni_gemm_matches_reference(type_name):
    n, k = _shape(type_name, 3)
    w = _weight(type_name, n, k, 3)
    compact_scales(w)
    assert tile_rows(w) and quant_gemm.supports(w)
    for m in (1, 5, 9, 22):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        r = quant_gemm.reference(x, w)
        y = quant_gemm.gemm(x, w)
        assert (y - r).abs().max().item() <= 1e-5 * k ** 0.5 * (r.abs().max().item() + 1e-6)
        yb = quant_gemm.gemm(x.bfloat16(), w)
        assert yb.dtype == torch.bfloat16
        torch.testing.assert_close(yb.float(), quant_gemm.reference(x.bfloat16().float(), w), rtol=1e-2,
                                   atol=1e-2 * r.abs().max().item())
        assert ((y - x @ w.dequantize().T).abs() <= quant_gemm.error_bound(x, w) * 1.001 + 1e-5).all()


def test_group_16_needs_8_bit_codes():
    codes = torch.zeros(16, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="group_size .* or 16 with bits 8; got 16 with bits 4"):
        QuantLinearWeight.from_codes(codes, torch.ones(16, 4), None, 4, 16)
    with pytest.raises(ValueError, match="got 48 with bits 8"):
        QuantLinearWeight.from_codes(codes.repeat(1, 3), torch.ones(16, 4), None, 8, 48)


def test_mixed_parts_fuse_exactly():
    """A Q4_K_M layer's Q4_K q / k with a Q6_K v (and a Q5_0 up with a Q4_K gate) fuse into one
    quantized weight, widened exactly to 8-bit codes (group 16 with Q6_K): same dequantized rows."""
    from sglite.kernels.matmul import make_linear
    from sglite.kernels.quant_linear import cat_rows

    for types in (("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q5_0"), ("Q4_0", "Q8_0", "Q5_K")):
        parts = [_weight(t, 32, 256, i) for i, t in enumerate(types)]
        want = torch.cat([p.dequantize() for p in parts])
        fused = cat_rows(parts)
        assert fused.bits == max(p.bits for p in parts) and fused.group_size == min(p.group_size for p in parts)
        assert torch.equal(fused.dequantize(), want)
        lw = make_linear(parts, None, torch.float32, "cpu")
        assert isinstance(lw, QuantLinearWeight) and torch.equal(lw.dequantize(), want)
    with pytest.raises(ValueError, match="in_features differs"):
        cat_rows([_weight("Q4_K", 16, 256, 0), _weight("Q4_K", 16, 512, 0)])


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_K", "Q6_K"])
def test_tiles_keep_the_weight(type_name):
    """Tiling (group 16 too) moves bytes only: rows (a tied embedding's lookup), the row layout and
    row permutations read back the same weights."""
    w = _weight(type_name, 48, 512, 2)
    d = w.dequantize()
    assert tile_rows(w) and w.tiled
    ids = torch.tensor([0, 17, 47, 5])
    assert torch.equal(w.rows(ids, torch.float32), d[ids]) and torch.equal(w.untiled().dequantize(), d)
    assert torch.equal(w.permute_rows(torch.arange(47, -1, -1)).dequantize(), d.flip(0))
