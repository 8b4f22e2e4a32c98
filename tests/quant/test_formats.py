"""GPTQ / AWQ checkpoint tensors: packing against a word-by-word oracle of the AutoGPTQ / AutoAWQ
layouts, bit-exact round trips, shape checks, and the map onto QuantLinearWeight."""
import pytest
import torch

from sglite.quant import hf_formats as hf


def _random_gq(n, k, bits, gs, act_order=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    groups = k // gs
    codes = torch.randint(0, 1 << bits, (n, k), generator=g).to(torch.uint8)
    zeros = torch.randint(1, 1 << bits, (n, groups), generator=g).to(torch.int32)
    scales = (torch.rand(n, groups, generator=g) * 0.01 + 1e-3).half().float()
    g_idx = torch.arange(k, dtype=torch.int32) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    return hf.GroupQuant(codes, zeros, scales, g_idx, bits, gs)


def _u32(x):
    return int(x) & 0xFFFFFFFF


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_layout_word_by_word(bits):
    q = _random_gq(16, 64, bits, 32)
    t = hf.pack_gptq(q)
    pf = 32 // bits
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (64 // pf, 16)
    assert t["qzeros"].shape == (2, 16 // pf) and t["scales"].shape == (2, 16) and t["scales"].dtype == torch.float16
    for r, n in [(0, 0), (1, 5), (64 // pf - 1, 15)]:
        want = sum(int(q.codes[n, r * pf + j]) << (bits * j) for j in range(pf))
        assert _u32(t["qweight"][r, n]) == want
    for gi, c in [(0, 0), (1, 16 // pf - 1)]:
        want = sum(((int(q.zeros[c * pf + j, gi]) - 1) & ((1 << bits) - 1)) << (bits * j) for j in range(pf))
        assert _u32(t["qzeros"][gi, c]) == want


def test_awq_layout_word_by_word():
    q = _random_gq(16, 64, 4, 32)
    t = hf.pack_awq(q)
    assert t["qweight"].shape == (64, 2) and t["qzeros"].shape == (2, 2) and "g_idx" not in t
    for k, c in [(0, 0), (7, 1), (63, 1)]:
        want = sum(int(q.codes[8 * c + hf.AWQ_ORDER[j], k]) << (4 * j) for j in range(8))
        assert _u32(t["qweight"][k, c]) == want
    want = sum(int(q.zeros[8 + hf.AWQ_ORDER[j], 1]) << (4 * j) for j in range(8))
    assert _u32(t["qzeros"][1, 1]) == want


@pytest.mark.parametrize("bits,gs,act", [(4, 32, False), (4, 64, True), (8, 128, False), (8, 32, True), (4, -1, False)])
def test_gptq_round_trip_bit_exact(bits, gs, act):
    k = 256
    q = _random_gq(24, k, bits, k if gs == -1 else gs, act)
    back = hf.unpack_gptq(hf.pack_gptq(q), bits, gs, "layer")
    assert torch.equal(back.codes, q.codes) and torch.equal(back.zeros, q.zeros)
    assert torch.equal(back.scales, q.scales) and torch.equal(back.g_idx, q.g_idx)


@pytest.mark.parametrize("gs", [32, 64, 128])
def test_awq_round_trip_bit_exact(gs):
    q = _random_gq(32, 256, 4, gs)
    q.zeros[0, 0] = 0  # AWQ stores zeros as they are (no -1 offset)
    back = hf.unpack_awq(hf.pack_awq(q), 4, gs, "layer")
    assert torch.equal(back.codes, q.codes) and torch.equal(back.zeros, q.zeros)
    assert torch.equal(back.scales, q.scales)


def test_shape_and_option_errors():
    q = _random_gq(16, 64, 4, 32)
    t = hf.pack_gptq(q)
    with pytest.raises(ValueError, match="layers.0.mlp.up_proj.scales"):
        hf.unpack_gptq({**t, "scales": t["scales"][:1]}, 4, 32, "layers.0.mlp.up_proj")
    with pytest.raises(ValueError, match="qzeros"):
        hf.unpack_gptq({**t, "qzeros": t["qzeros"][:, :1]}, 4, 32, "w")
    with pytest.raises(ValueError, match="group_size=128 does not divide in_features=64"):
        hf.unpack_gptq(t, 4, 128, "w")
    with pytest.raises(ValueError, match="bits must be one of"):
        hf.unpack_gptq(t, 3, 32, "w")
    with pytest.raises(ValueError, match="awq bits"):
        hf.unpack_awq(t, 8, 32, "w")
    with pytest.raises(ValueError, match="act-order"):
        hf.pack_awq(_random_gq(16, 64, 4, 32, act_order=True))


@pytest.mark.parametrize("act", [False, True])
def test_to_quant_linear_matches_dequantized(act):
    q = _random_gq(40, 128, 4, 32, act)
    w = hf.to_quant_linear(q, name="w")
    assert torch.equal(w.dequantize(), q.dequantize())
    assert (w.perm is not None) == act
    x = torch.randn(3, 128)
    from sglite import kernels
    torch.testing.assert_close(kernels.linear(x, w), x @ q.dequantize().T, rtol=1e-5, atol=1e-5)


def test_to_quant_linear_rejects_group_not_dividing():
    q = _random_gq(8, 576, 4, 576)
    q.group_size = 128
    with pytest.raises(ValueError, match="group_size=128 must be a multiple of 32 dividing in_features=576"):
        hf.to_quant_linear(q, name="model.layers.0.self_attn.q_proj")


def test_quantization_config_fields():
    c = hf.quantization_config("gptq", 4, 64, desc_act=True)
    assert (c["quant_method"], c["bits"], c["group_size"], c["desc_act"], c["sym"]) == ("gptq", 4, 64, True, True)
    a = hf.quantization_config("awq", 4, 32, sym=False)
    assert (a["quant_method"], a["zero_point"], a["version"]) == ("awq", True, "gemm")
