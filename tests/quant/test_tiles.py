"""16-row tiles of quantized weights (sglite.kernels.quant_linear.tile_rows, csrc/quant_tiles.h):
the torch layout change is a bijection (round trip bit for bit; dequantize, rows, permute_rows and
cat_rows unchanged), its int8-activation GEMV equals the torch reference of the int8 product on
random shapes (4/8 bits, float32/float16 scales, with and without offsets, 1..32 rows, both
builds) and the row layout's kernel up to float32 summation order, refusals name the field, and
the fused bf16 decode of a tiny model runs on tiles (VNNI CPUs) with the per-op path close."""
import pytest
import torch

from sglite.kernels import decode_fused, quant_cpu
from sglite.kernels.quant_linear import QuantLinearWeight, cat_rows, compact_scales, tile_rows

pytestmark = pytest.mark.skipif(not quant_cpu.available(), reason="the C++ quant kernel did not build here")


def make(n, k, bits, seed, mins=True, half=False):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    s = (torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    m = (torch.randn(n, k // 32, generator=g) * 0.05).half().float() if mins else None
    w = QuantLinearWeight.from_codes(codes, s, m, bits, 32)
    if half:
        assert compact_scales(w)
    return w


def tiled_copy(w):
    t = QuantLinearWeight(w.qweight.clone(), w.scales.clone(), None if w.mins is None else w.mins.clone(),
                          w.bits, w.group_size, w.in_features)
    assert tile_rows(t) and t.tiled
    return t


@pytest.mark.parametrize("bits,mins,half", [(4, True, False), (4, False, True), (8, True, True), (8, False, False)])
def test_layout_round_trip(bits, mins, half):
    w = make(48, 96, bits, seed=bits, mins=mins, half=half)
    t = tiled_copy(w)
    assert t.qweight.shape == w.qweight.shape and t.scales.shape == w.scales.shape
    assert not torch.equal(t.qweight, w.qweight)  # the bytes moved
    u = t.untiled()
    assert not u.tiled and torch.equal(u.qweight, w.qweight) and torch.equal(u.scales, w.scales)
    assert (u.mins is None) == (w.mins is None) and (w.mins is None or torch.equal(u.mins, w.mins))
    assert torch.equal(t.dequantize(), w.dequantize()) and torch.equal(t.codes(), w.codes())
    ids = torch.tensor([47, 0, 16, 5, 31, 5])
    assert torch.equal(t.rows(ids, torch.float32), w.rows(ids, torch.float32))
    idx = torch.randperm(48, generator=torch.Generator().manual_seed(1))
    assert torch.equal(t.permute_rows(idx).dequantize(), w.permute_rows(idx).dequantize())
    assert torch.equal(cat_rows([t, w]).dequantize(), cat_rows([w, w]).dequantize())
    assert t.nbytes() == w.nbytes()


def test_refusals():
    w = make(40, 64, 4, seed=3)  # 40 rows: not whole tiles
    assert not tile_rows(w) and not w.tiled
    g64 = QuantLinearWeight.from_codes(torch.zeros(16, 128, dtype=torch.uint8), torch.ones(16, 2), None, 4, 64)
    assert not tile_rows(g64)
    with pytest.raises(ValueError, match="tiled layout needs out_features % 16"):
        QuantLinearWeight(w.qweight, w.scales, w.mins, 4, 32, 64, tiled=True)
    t = tiled_copy(make(16, 64, 8, seed=4))
    with pytest.raises(RuntimeError, match="N % 16"):  # the kernel checks the contract too
        quant_cpu._mod(False).quant_gemv_q8(torch.randn(1, 64), t.qweight[:8].contiguous(), t.scales[:8].contiguous(),
                                            t.mins[:8].contiguous(), 8, 32, False, True)


@pytest.mark.parametrize("portable", [False, pytest.param(True, marks=pytest.mark.slow)])  # portable: a second build
@pytest.mark.parametrize("bits,n,k,mins,half", [(4, 48, 96, True, True), (4, 64, 576, True, False),
                                                (8, 32, 160, True, True), (8, 16, 64, False, False),
                                                (4, 16, 32, False, True)])
def test_tiled_gemv_matches_reference(portable, bits, n, k, mins, half):
    w = make(n, k, bits, seed=n + k + bits, mins=mins, half=half)
    t = tiled_copy(w)
    for rows in (1, 2, 3, 7, 8, 13, 32):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
        y, r = quant_cpu.gemv_q8(x, t, portable=portable), quant_cpu.gemv_q8_reference(x, w)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        tol = 1e-5 * k ** 0.5 * (r.abs().max().item() + 1e-6)
        assert (y - r).abs().max().item() <= tol
        assert (y - quant_cpu.gemv_q8(x, w, portable=portable)).abs().max().item() <= tol  # the row layout's kernel
    # linear() on a tiled weight: 1..32 rows the int8 GEMV, more the dequantized GEMM (bf16 and float32 x)
    for rows in (5, 40):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
        exact = x @ w.dequantize().T
        for dt in (torch.float32, torch.bfloat16):
            y = quant_cpu.linear(x.to(dt), t, portable=portable)
            assert y.dtype == dt and (y.float() - exact).abs().max().item() <= 0.05 * exact.abs().max().item()


def test_fused_bf16_decode_runs_on_tiles(tiny_model_dir, tmp_path):
    from sglite import Engine
    from sglite.quant.calibrate import QuantOptions
    from sglite.quantize import quantize

    if not quant_cpu.vnni():
        pytest.skip("no AVX-512 VNNI here: the fused decode keeps the row layout")
    path = quantize(str(tiny_model_dir), tmp_path / "rtn4", QuantOptions(method="rtn", bits=4, group_size=32),
                    n_samples=1, seq_len=16)
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with Engine(model_path=str(path), dtype="bfloat16", max_total_tokens=1024) as e:
        model = e.runner.model
        fused = model.decode_fused
        assert fused is not None and fused.q8 and fused.tiled
        assert all(model.layers[0][k].tiled for k in decode_fused.LINEAR_KEYS)
        got = e.generate(input_ids=[[504, 3458, 3502, 314], [357, 12, 99]], sampling_params=sp)
        fb_logits = []
        orig = fused.forward

        def both(fb, kb, vb):  # the fused step against the per-op path on the same batch
            out = orig(fb, kb, vb)
            if out is not None:
                ref = model._forward(fb, kb, vb).float()
                fb_logits.append((out - ref).abs().max().item() / (ref.abs().max().item() + 1e-6))
            return out

        fused.forward = both
        e.generate(input_ids=[[1314, 28, 5248]], sampling_params=sp)
        assert fb_logits and max(fb_logits) <= 0.1
        assert [len(o["output_ids"]) for o in got] == [8, 8]
