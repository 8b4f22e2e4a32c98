"""The quantized-weight seam: QuantLinearWeight's representation (packing, dequantize spec, input
permutation, row ops), GGUF block mapping against the gguf package's own dequantizer, make_linear,
and EngineConfig.quantization."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sglite import kernels
from sglite.config import EngineConfig
from sglite.errors import InvalidRequestError
from sglite.kernels.quant_linear import (QuantLinearWeight, cat_rows, pack_codes, reference_linear,
                                         unpack_codes)
from sglite.runtime import gguf_native


def rand_qw(n, k, bits=4, gs=32, mins=True, perm=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    s = torch.rand(n, k // gs, generator=g).half().float() * 0.1
    m = (torch.randn(n, k // gs, generator=g) * 0.05).half().float() if mins else None
    p = torch.randperm(k, generator=g) if perm else None
    return QuantLinearWeight.from_codes(codes, s, m, bits, gs, perm=p), codes, s, m, p


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_roundtrip_and_gguf_nibble_order(bits):
    codes = torch.randint(0, 2 ** bits, (3, 64), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, 64 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)
    if bits == 4:  # byte j of block b: channel 32b+j low nibble, 32b+j+16 high nibble
        assert int(packed[1, 16 + 3]) == int(codes[1, 32 + 3]) | (int(codes[1, 32 + 19]) << 4)


def test_dequantize_is_scale_times_code_plus_min_per_group():
    qw, codes, s, m, _ = rand_qw(5, 128, bits=4, gs=64)
    w = qw.dequantize()
    for n, k in [(0, 0), (4, 127), (2, 63), (3, 64)]:
        prod = np.float32(s[n, k // 64].item()) * np.float32(codes[n, k].item())  # float32, as the spec
        assert w[n, k].item() == float(np.float32(prod + np.float32(m[n, k // 64].item())))


def test_perm_means_stored_column_j_is_logical_channel_perm_j():
    qw, _, _, _, p = rand_qw(6, 96, bits=8, gs=32, perm=True)
    ws, w = qw.dequantize_stored(), qw.dequantize()
    assert torch.equal(w[:, p], ws)
    x = torch.randn(3, 96)
    torch.testing.assert_close(reference_linear(x, qw), x @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x[:, p] @ ws.T, x @ w.T, rtol=1e-5, atol=1e-5)


def test_cat_rows_permute_rows_rows_and_bytes():
    a, *_ = rand_qw(4, 64, seed=1)
    b, *_ = rand_qw(3, 64, seed=2, mins=False)
    c = cat_rows([a, b])
    assert c.shape == (7, 64)
    assert torch.equal(c.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    idx = torch.tensor([6, 0, 3, 1, 2, 5, 4])
    assert torch.equal(c.permute_rows(idx).dequantize(), c.dequantize()[idx])
    assert torch.equal(c.rows(torch.tensor([2, 5]), torch.float32), c.dequantize()[[2, 5]])
    assert c.nbytes() == 7 * 32 + 2 * 7 * 2 * 4
    wide = rand_qw(2, 64, gs=64)[0]  # another group size: widened exactly to the smaller one
    mixed = cat_rows([a, wide])
    assert mixed.group_size == 32 and torch.equal(mixed.dequantize(), torch.cat([a.dequantize(), wide.dequantize()]))
    with pytest.raises(ValueError, match="in_features"):
        cat_rows([a, rand_qw(2, 96)[0]])


def test_bad_fields_raise_naming_them():
    with pytest.raises(ValueError, match="bits"):
        rand_qw(2, 64, bits=3)
    with pytest.raises(ValueError, match="group_size"):
        QuantLinearWeight.from_codes(torch.zeros(2, 64, dtype=torch.uint8), torch.ones(2, 1), None, 4, 48)
    with pytest.raises(ValueError, match="scales"):
        QuantLinearWeight.from_codes(torch.zeros(2, 64, dtype=torch.uint8), torch.ones(2, 3), None, 4, 32)
    with pytest.raises(ValueError, match="4-bit code"):
        pack_codes(torch.full((1, 32), 16, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="unknown quantized implementation"):
        rand_qw(2, 32)[0].use("bogus")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_map_exactly(qtype):
    import gguf.quants as gq
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(0)
    w = rng.standard_normal((7, 96)).astype(np.float32) * 0.1
    blocks = gq.quantize(w, T[qtype])  # uint8 [7, 3 * block bytes]
    qw = gguf_native.blocks_to_weight(qtype, blocks, 96)
    ref = torch.from_numpy(gq.dequantize(blocks, T[qtype]).astype(np.float32))
    assert torch.equal(qw.dequantize(), ref)
    assert qw.bits == (8 if qtype == "Q8_0" else 4) and qw.group_size == 32
    with pytest.raises(ValueError, match="K=64"):
        gguf_native.blocks_to_weight(qtype, blocks, 64)


def test_unpermute_rows_inverts_the_converters_reorder():
    n_head, hd, k = 3, 8, 4
    hf = torch.randn(n_head * hd, k)
    gguf_rows = hf.reshape(n_head, 2, hd // 2, k).swapaxes(1, 2).reshape(hf.shape)  # llama.cpp's permute
    assert torch.equal(gguf_rows[gguf_native.unpermute_rows(n_head * hd, n_head)], hf)
    assert gguf_native.hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_native.hf_name("blk.3.attn_norm.weight") is None


def test_make_linear_fuses_quantized_parts_and_dequantizes_mixed():
    a, *_ = rand_qw(4, 64, seed=3)
    b, *_ = rand_qw(2, 64, seed=4)
    fused = kernels.make_linear([a, b], None, torch.float32, "cpu")
    assert isinstance(fused, QuantLinearWeight) and fused.shape == (6, 64)
    mixed = kernels.make_linear([a, torch.randn(2, 64)], None, torch.float32, "cpu")
    assert isinstance(mixed, kernels.LinearWeight) and torch.equal(mixed.weight[:4], a.dequantize())
    x = torch.randn(2, 64)
    fused.use("torch")
    bias = torch.randn(6)
    fused.bias = bias
    torch.testing.assert_close(kernels.linear(x, fused), F.linear(x, fused.dequantize(), bias), rtol=1e-5, atol=1e-5)


def test_engine_config_quantization_values():
    assert EngineConfig().quantization == "auto"
    assert EngineConfig(quantization="none").quantization is None
    assert EngineConfig(quantization=None).quantization is None
    with pytest.raises(InvalidRequestError, match="quantization"):
        EngineConfig(quantization="int3")


def test_bench_quant_agreement_and_args():
    import argparse

    from sglite.bench import quant as bq

    ag = bq.agreement([[1, 2, 3], [4, 5]], [[1, 9, 3], [4, 5]])
    assert ag == {"positions_equal": 4 / 5, "prompts_equal": 0.5, "positions": 5}
    assert len(set(bq.agreement_prompts(64))) == 64
    assert bq.build_parser().parse_args(["--agreement-dtype", "bfloat16"]).agreement_dtype == "bfloat16"
    a = bq.build_parser().parse_args(["--decode-tokens", "0"])
    with pytest.raises(ValueError, match="--decode-tokens"):
        bq.check_args(a)
    with pytest.raises(ValueError, match="--parts"):
        bq.check_args(argparse.Namespace(**{**vars(bq.build_parser().parse_args([])), "parts": "speed,x"}))


def test_bench_quant_thread_sweep_summary(tmp_path):
    from sglite.bench import quant as bq

    assert bq.thread_counts(2) == [1, 2] and bq.thread_counts(16) == [1, 2, 4, 8, 15, 16]
    rows = [{"threads": 1, "sglite_b1_tok_s": 100.0, "llama_cpp_b1_tok_s": 60.0},
            {"threads": 2, "sglite_b1_tok_s": 180.0, "llama_cpp_b1_tok_s": 110.0}]
    s = bq.summarize(rows)
    assert s["sglite_best_threads"] == 2 and s["sglite_scaling"] == pytest.approx(1.8)
    assert s["llama_cpp_scaling"] == pytest.approx(110 / 60) and s["best_vs_llama_cpp"] == pytest.approx(180 / 110)
    line = bq.sweep_summary({"rows": rows, **s})
    assert "1.80x" in line and "1.64x" in line
    assert "llama_cpp_best_tok_s" not in bq.summarize([{"threads": 1, "sglite_b1_tok_s": 5.0}])  # no binary: sglite alone
    a = bq.build_parser().parse_args(["--llama-bench", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="--llama-bench: .* not an executable"):
        bq.check_args(a)
    assert bq.build_parser().parse_args(["--llama-bench"]).llama_bench == "auto"
