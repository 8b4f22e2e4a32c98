"""Our quantizers on synthetic layers: GPTQ's Hessian-aware updates beat RTN on the layer-output
error, AWQ's scale search protects outlier channels, RTN's grid; the 8-bit kernels against their
references."""
import pytest
import torch

from sglite.quant.awq import search_scales
from sglite.quant.calibrate import smooth_scales
from sglite.quant.gptq import HessianAccumulator, gptq_quantize
from sglite.quant.rtn import fake_quant, rtn


def _layer(seed=0, n=96, k=128, t=1024):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5
    x = torch.randn(t, k, generator=g) @ mix  # correlated inputs
    x[:, :4] *= 20  # a few outlier channels, as in LLM activations
    w = torch.randn(n, k, generator=g) * 0.05
    return w, x


def _out_err(w, wq, x):
    return float(((x @ (w - wq).T) ** 2).mean())


def test_rtn_grid_and_codes():
    w = torch.tensor([[-1.0, 0.0, 0.5, 2.0]])
    q = rtn(w, 4, 4, sym=False)
    assert q.scales.item() == pytest.approx(3.0 / 15, rel=1e-3)
    assert q.zeros.item() == 5 and q.codes.tolist() == [[0, 5, 8, 15]]
    assert torch.allclose(q.dequantize(), w, atol=q.scales.item() / 2 + 1e-6)
    with pytest.raises(ValueError, match="group_size"):
        rtn(w, 4, 3)


@pytest.mark.parametrize("gs,act", [(32, False), (32, True), (128, False)])
def test_gptq_beats_rtn_on_layer_output(gs, act):
    w, x = _layer()
    acc = HessianAccumulator(x.shape[1])
    acc.add(x)
    q = gptq_quantize(w, acc.hessian(), 4, gs, sym=False, act_order=act)
    e_gptq, e_rtn = _out_err(w, q.dequantize(), x), _out_err(w, fake_quant(w, 4, gs), x)
    assert e_gptq < 0.7 * e_rtn, (e_gptq, e_rtn)
    assert q.codes.max() <= 15 and q.g_idx.bincount().tolist() == [gs] * (128 // gs)
    if not act:
        assert torch.equal(q.g_idx.long(), torch.arange(128) // gs)


def test_gptq_rejects_bad_hessian_and_groups():
    w, x = _layer()
    with pytest.raises(ValueError, match="Hessian must be"):
        gptq_quantize(w, torch.eye(4), 4, 32)
    with pytest.raises(ValueError, match="group_size"):
        gptq_quantize(w, torch.eye(128), 4, 48)


def test_awq_search_protects_salient_channels():
    w, x = _layer(1)
    s, alpha, info = search_scales([w], x, 4, 64)
    assert alpha > 0 and info["loss"] < 0.9 * info["loss_rtn"]
    assert s[:4].mean() > s[4:].mean()  # the outlier channels get the larger scales
    wq = fake_quant(w * s, 4, 64) / s
    assert _out_err(w, wq, x) == pytest.approx(info["loss"], rel=1e-4)


def test_smooth_scales_balance_activation_and_weight_ranges():
    w, x = _layer(2)
    s = smooth_scales(x.abs().amax(0), w, 0.5)
    xs, ws = x / s, w * s
    assert torch.allclose(xs.abs().amax(0), ws.abs().amax(0), rtol=1e-4)  # alpha 0.5: equal maxima
    assert torch.allclose(xs @ ws.T, x @ w.T, rtol=1e-4, atol=1e-3)  # exact in real arithmetic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [0, 1, 5, 33])
def test_w8_kernels_match_reference(dtype, m):
    from sglite import kernels
    from sglite.kernels import Fp8LinearWeight, Int8LinearWeight
    from sglite.kernels import w8_linear

    g = torch.Generator().manual_seed(m)
    w = torch.randn(48, 96, generator=g) * 0.1
    b = torch.randn(48, generator=g).to(dtype)
    x = torch.randn(m, 96, generator=g).to(dtype)
    f8 = Fp8LinearWeight.quantize(w, b)
    assert f8.weight.dtype == torch.float8_e4m3fn  # E4M3: 3 mantissa bits, relative error <= 2**-4
    assert bool(((f8.dequantize() - w).abs() <= w.abs() / 16 + f8.scale[:, None] * 2 ** -9).all())
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernels.linear(x, f8), w8_linear.fp8_reference(x, f8), **tol)
    torch.testing.assert_close(kernels.linear(x, f8.use("invariant")), w8_linear.fp8_reference(x, f8), **tol)
    i8 = Int8LinearWeight.quantize(w, b)
    got, ref = kernels.linear(x, i8), w8_linear.w8a8_reference(x, i8)
    torch.testing.assert_close(got, ref, **tol)
    if m:  # and W8A8 is close to the float product (per-token int8 activations)
        full = x.float() @ w.T + b.float()
        assert float((got.float() - full).abs().max()) < 0.05 * float(full.abs().max())


def test_w8a8_int_mm_is_exact_and_batch_invariant():
    from sglite.kernels import w8_linear
    from sglite.kernels import Int8LinearWeight

    g = torch.Generator().manual_seed(0)
    w8 = Int8LinearWeight.quantize(torch.randn(64, 256, generator=g))
    x = torch.randn(9, 256, generator=g)
    full = w8_linear.w8a8_linear(x, w8)
    rows = torch.cat([w8_linear.w8a8_linear(x[i:i + 1], w8) for i in range(9)])
    assert torch.equal(full, rows)
    xq, s = w8_linear.quantize_per_token(x)
    assert torch.equal(torch._int_mm(xq, w8.weight_t), (xq.long() @ w8.weight.long().T).int())
