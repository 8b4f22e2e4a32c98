"""FP8 E4M3 quantizers (:mod:`sglite.quant.fp8`): the grid, GPTQ with the E4M3 quantizer against
round to nearest on the layer-output error, block-wise scales; the block-wise FP8 matmul against
its reference; fp8 checkpoint load errors. (Checkpoint round trips through the engine are in
``tests/quant/test_checkpoints.py``.)"""
import pytest
import torch

from sglite import kernels
from sglite.kernels import Fp8BlockLinearWeight, Fp8LinearWeight, w8_linear
from sglite.quant.fp8 import block_scales, channel_scales, e4m3, expand_block_scales, gptq_fp8, rtn_fp8
from sglite.quant.gptq import HessianAccumulator


def _layer(seed=0, n=96, k=160, t=1024):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) @ (torch.randn(k, k, generator=g) / k ** 0.5)  # correlated
    x[:, :4] *= 20
    return torch.randn(n, k, generator=g) * 0.05, x


def _out_err(w, wq, x):
    return float(((x @ (w - wq).T) ** 2).mean())


def _deq(w8, s, block=None):
    return w8.float() * (s[:, None] if block is None else expand_block_scales(s, tuple(w8.shape), block))


def test_e4m3_grid_and_rtn_matches_the_online_quantizer():
    assert e4m3(torch.tensor([448.0, 500.0, -1e9, 1.0625, 0.0])).tolist() == [448.0, 448.0, -448.0, 1.0, 0.0]
    w, _ = _layer()
    w8, s = rtn_fp8(w)
    ref = Fp8LinearWeight.quantize(w)
    assert torch.equal(w8.view(torch.uint8), ref.weight.view(torch.uint8)) and torch.equal(s, ref.scale)
    rel = float((_deq(w8, s) - w).norm() / w.norm())
    assert 0.005 < rel < 2 ** -4  # 3 mantissa bits: a few percent, below the worst-case 2^-4


@pytest.mark.parametrize("act,block", [(False, None), (True, None), (False, (32, 48))])
def test_gptq_fp8_beats_rtn_fp8_on_layer_output(act, block):
    w, x = _layer()
    acc = HessianAccumulator(x.shape[1])
    acc.add(x)
    w8, s = gptq_fp8(w, acc.hessian(), act_order=act, block=block)
    r8, rs = rtn_fp8(w, block)
    # scales come from the original weights: GPTQ's max / 448 per channel (RTN searches per channel)
    assert torch.equal(s, channel_scales(w) if block is None else rs)
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == w.shape
    e_gptq, e_rtn = _out_err(w, _deq(w8, s, block), x), _out_err(w, _deq(r8, rs, block), x)
    assert e_gptq < 0.6 * e_rtn, (e_gptq, e_rtn)


def test_gptq_fp8_rejects_act_order_with_blocks():
    w, x = _layer()
    with pytest.raises(ValueError, match="act_order needs per-channel"):
        gptq_fp8(w, torch.eye(w.shape[1]), act_order=True, block=(32, 32))


def test_block_scales_cover_partial_tiles():
    w = torch.zeros(5, 7)
    w[4, 6] = 448.0 * 3
    w[0, 0] = -448.0
    s = block_scales(w, (4, 4))
    assert s.tolist() == [[1.0, 1.0], [1.0, 3.0]]
    with pytest.raises(ValueError, match="weight_block_size"):
        block_scales(w, (0, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [0, 1, 7])
def test_fp8_block_linear_matches_reference(dtype, m):
    w, _ = _layer(1, n=80, k=200)
    w8, tiles = rtn_fp8(w, (48, 64))
    bias = torch.randn(80)
    q = Fp8BlockLinearWeight.from_tiles(w8, tiles, (48, 64), bias.to(dtype))
    torch.testing.assert_close(q.dequantize(), _deq(w8, tiles, (48, 64)), rtol=0, atol=0)
    x = torch.randn(m, 200).to(dtype)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    want = w8_linear.fp8_block_reference(x, q)
    torch.testing.assert_close(kernels.linear(x, q), want, **tol)
    inv = kernels.linear(x, q.use("invariant"))
    assert q.impl == "fp8_block_invariant"
    torch.testing.assert_close(inv, want, **tol)
    for i in range(m):  # batch-invariant: a row's result does not depend on the batch
        assert torch.equal(inv[i:i + 1], kernels.linear(x[i:i + 1], q))
    q.use("auto")
    fused = Fp8BlockLinearWeight.concat([q, q])
    assert fused.shape == (160, 200) and torch.equal(fused.dequantize()[80:], q.dequantize())
    assert q.nbytes() == 80 * 200 + 80 * 4 * 4 + 80 * bias.to(dtype).element_size()


def test_fp8_block_weight_rejects_a_wrong_tile_grid():
    w8, tiles = rtn_fp8(torch.randn(64, 64), (32, 32))
    with pytest.raises(ValueError, match=r"weight_scale_inv \(2, 2\) disagrees .*expected \(1, 2\)"):
        Fp8BlockLinearWeight.from_tiles(w8, tiles, (64, 32))


def test_channel_scale_search_never_worse_and_never_clips():
    from sglite.kernels.w8_linear import FP8_MAX, fp8_channel_scales

    g = torch.Generator().manual_seed(3)
    # discrete weights (a 4-bit grid per row, like GGUF-dequantized ones) and a zero row
    w = (torch.randint(0, 16, (24, 128), generator=g).float() - 7.5) * (torch.rand(24, 1, generator=g) * 0.02 + 1e-3)
    w[5] = 0.0
    plain, searched = fp8_channel_scales(w, steps=1), fp8_channel_scales(w)
    amax = w.abs().amax(1)
    assert torch.equal(plain[amax > 0], (amax / FP8_MAX)[amax > 0]) and plain[5] == 1.0 == searched[5]
    assert bool((searched >= plain).all()) and bool((searched < 2 * plain).all())  # one binade up: no clipping
    assert float((w / searched[:, None]).abs().max()) <= FP8_MAX

    def err(s):
        return ((w / s[:, None]).to(torch.float8_e4m3fn).float() * s[:, None] - w).square().sum(1)

    assert bool((err(searched) <= err(plain)).all()) and float(err(searched).sum()) < 0.95 * float(err(plain).sum())
    with pytest.raises(ValueError, match="steps must be >= 1"):
        fp8_channel_scales(w, steps=0)
