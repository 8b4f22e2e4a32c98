"""End to end, fast tier: a tiny random Llama (hidden 256, so K-quants fit) whose layer matmuls are
replaced by random valid GGUF blocks in llama.cpp-like Q4_K_M and Q5_K_M mixes
(:data:`sglite.testing_gguf.MIXES`: Q4_K / Q5_0 / Q6_K, and Q5_K / Q5_1 / Q5_0 / Q8_0 / Q6_K),
fused per layer as the loader fuses them (QKV, gate-up: mixed parts widened exactly). float32: the
fused C++ decode on the codes gives the greedy tokens and logprobs of the per-op path on the
dequantized float weights (the oracle); bf16: the fused int8 decode (tiles, VNNI) stays close to the
per-op path on the same quantized weights, step by step."""
import pytest
import torch

from sglite import kernels
from sglite.kernels import decode_fused, quant_cpu
from sglite.runtime.gguf_blocks import blocks_to_weight
from sglite.testing_gguf import MIXES, random_gguf_blocks

pytestmark = pytest.mark.skipif(not quant_cpu.available(), reason="the C++ quant kernel did not build here")
PROMPTS = [[504, 3458, 3502, 314, 253, 5426], [1314, 28, 5248, 11633, 28, 690, 9095, 30, 378], [357, 12, 99]]
PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
         "down": ("ffn_down",)}


@pytest.fixture(scope="module")
def wide_tiny(tmp_path_factory, real_checkpoint):
    from sglite.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny256"), seed=3, vocab_from=real_checkpoint.model_dir,
                           hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64)


def _quantize_layers(model, mix: dict, seed: int) -> dict:
    """Replace every layer matmul by the mix's GGUF blocks (fused as the loader does); returns the
    dequantized float weights by (layer, key)."""
    floats = {}
    for i, L in enumerate(model.layers):
        for key, names in PARTS.items():
            n_k = _shapes(model, key)
            parts = [blocks_to_weight(mix[nm], random_gguf_blocks(mix[nm], n, k, seed=seed + 10 * i + j), k)
                     for j, (nm, (n, k)) in enumerate(zip(names, n_k))]
            L[key] = kernels.make_linear(parts, None, model.dtype, "cpu").use("auto")
            assert isinstance(L[key], kernels.QuantLinearWeight), key  # kept quantized, mixed parts too
            floats[i, key] = L[key].dequantize(torch.float32)
    return floats


def _shapes(model, key) -> list:
    """[N, K] of each part of the layer matmul ``key`` (in PARTS order)."""
    a = model.arch
    h, q, kv, i = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
    return {"qkv": [(q, h), (kv, h), (kv, h)], "o": [(h, q)], "gate_up": [(i, h), (i, h)], "down": [(h, i)]}[key]


# with_portable: the portable C++ build too (a second compile of the extension): slow tier
@pytest.mark.parametrize("with_portable", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_mix_fused_native_float32_equals_dequantized(wide_tiny, mix, with_portable):
    from sglite import Engine

    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with Engine(model_path=str(wide_tiny), dtype="float32", max_total_tokens=2048) as e:
        model = e.runner.model
        floats = _quantize_layers(model, MIXES[mix], seed=7)
        fmts = {f for L in model.layers for k in PARTS for f in L[k].fmt.split("+")}
        assert fmts == {f"gguf:{t}" for t in MIXES[mix].values()}
        portable = None
        if with_portable:
            model.decode_fused = decode_fused.prepare(model, portable=True)  # the portable C++ build first
            assert model.decode_fused is not None
            portable = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=sp)]
            e.flush_cache()
        model.decode_fused = decode_fused.prepare(model)
        assert model.decode_fused is not None  # every type runs in the fused C++ decode
        native = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=sp)]
        lp_native = e.generate(input_ids=PROMPTS[1], sampling_params={"max_new_tokens": 0}, return_logprob=True,
                               logprob_start_len=0)["meta_info"]["input_token_logprobs"][1:]
        for (i, key), w in floats.items():  # the oracle: dequantized float weights, per-op path
            model.layers[i][key] = kernels.make_linear([w], None, torch.float32, "cpu")
        model.decode_fused = None
        e.flush_cache()
        ref = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=sp)]
        lp_ref = e.generate(input_ids=PROMPTS[1], sampling_params={"max_new_tokens": 0}, return_logprob=True,
                            logprob_start_len=0)["meta_info"]["input_token_logprobs"][1:]
    assert native == ref and portable in (None, ref)
    assert max(abs(a[0] - b[0]) for a, b in zip(lp_native, lp_ref)) < 1e-3


def test_mix_fused_bf16_int8_close_to_per_op(wide_tiny):
    from sglite import Engine

    with Engine(model_path=str(wide_tiny), dtype="bfloat16", max_total_tokens=2048) as e:
        model = e.runner.model
        _quantize_layers(model, MIXES["Q4_K_M"], seed=9)
        fused = decode_fused.prepare(model)
        assert fused is not None
        if quant_cpu.vnni():
            assert fused.q8 and fused.tiled  # Q6_K's group 16 in 16-row tiles too
        seen = []

        class Checked:
            def forward(self, fb, kb, vb):
                got = fused.forward(fb, kb, vb)
                if got is not None:
                    ref = model._forward(fb, kb, vb)  # the per-op path on the same quantized weights
                    assert (got - ref).abs().max().item() <= 0.1 * (ref.abs().max().item() + 1e-6)
                    seen.append(fb.input_ids.shape[0])
                return got

        model.decode_fused = Checked()
        e.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert 3 in seen
