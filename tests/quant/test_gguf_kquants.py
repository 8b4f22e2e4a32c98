"""GGUF K-quants (Q4_K, Q5_K, Q6_K) and the 32-weight types kept quantized (:mod:`sglite.runtime.gguf_native`): unpacking against
the gguf library's own numpy dequantizer (the oracle) on random blocks, the matmul paths against
the oracle's weights, and a whole tiny Llama written as a .gguf with Q4_K / Q6_K tensors run
natively against its dequantized path."""
import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sglite import kernels
from sglite.runtime.gguf_native import NATIVE_TYPES, blocks_to_weight, k_scale_min
from sglite.testing import make_tiny_gguf, random_gguf_blocks


@pytest.mark.parametrize("type_name", NATIVE_TYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_blocks_dequantize_exactly_as_gguf(type_name, seed):
    n, k = 24, 512
    data = random_gguf_blocks(type_name, n, k, seed=seed)
    want = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name]))
    w = blocks_to_weight(type_name, data, k)
    assert w.fmt == f"gguf:{type_name}" and w.shape == (n, k)
    got = w.dequantize(torch.float32)
    # equal values (torch.equal; only the sign of an exact zero may differ from numpy's d * 0)
    assert torch.equal(got, want)
    assert w.group_size == (16 if type_name == "Q6_K" else 32)
    assert w.bits == (4 if type_name in ("Q4_0", "Q4_1", "Q4_K") else 8)


def test_q4_k_scale_min_unpacking_matches_gguf():
    sc = np.random.default_rng(3).integers(0, 256, size=(50, 12), dtype=np.uint8)
    s, m = k_scale_min(sc)
    ws, wm = gguf.quants.Q4_K.get_scale_min(sc)
    assert np.array_equal(s, ws) and np.array_equal(m, wm) and s.max() < 64 and m.max() < 64


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_kquant_linear_matches_the_oracle_weights(type_name, rows):
    n, k = 40, 768
    data = random_gguf_blocks(type_name, n, k, seed=5)
    oracle = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name]))
    w = blocks_to_weight(type_name, data, k).use("auto")
    # every native type runs on the C++ kernels (Q6_K's group 16 too), none on the reference
    assert w.impl == kernels.quant_linear.best_impl(w) != "quant_ref" or not kernels.quant_cpu.available()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = F.linear(x.double(), oracle.double()).float()
    torch.testing.assert_close(kernels.linear(x, w), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kernels.linear(x, w.use("invariant")), want, rtol=1e-4, atol=1e-4)


def test_kquant_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"GGUF Q4_K tensor: .* rows of K=288 \(144-byte blocks of 256"):
        blocks_to_weight("Q4_K", np.zeros((2, 162), np.uint8), 288)
    with pytest.raises(ValueError, match="GGUF Q6_K tensor"):
        blocks_to_weight("Q6_K", np.zeros((2, 200), np.uint8), 256)
    with pytest.raises(ValueError, match="GGUF Q5_K tensor"):
        blocks_to_weight("Q5_K", np.zeros((2, 170), np.uint8), 256)
    with pytest.raises(ValueError, match=r"GGUF type Q3_K is not kept quantized \(native: \('Q4_0'"):
        blocks_to_weight("Q3_K", np.zeros((2, 110), np.uint8), 256)


@pytest.mark.slow
@pytest.mark.parametrize("mix", [None, "Q4_K_M", "Q5_K_M"])
def test_tiny_kquant_gguf_model_runs_natively_like_its_dequantized_path(tmp_path, mix):
    """A tiny random Llama .gguf with a llama.cpp-like type mix (None: Q4_K with Q6_K down
    projections; ``MIXES``: Q4_K / Q5_0 / Q6_K, and Q5_K / Q5_1 / Q5_0 / Q8_0 / Q6_K), Q8_0
    embedding; fp32 activations: the native run (the fused C++ decode on the codes: every layer
    weight kept quantized) gives the dequantized float model's greedy tokens and logprobs. The
    GGUF's conversion (transformers reads the tokenizer fields) is cached in the shared sglite
    cache, keyed by the file's content (same seed, same file)."""
    from sglite import Engine
    from sglite.testing_gguf import MIXES

    types = MIXES.get(mix)
    path = make_tiny_gguf(tmp_path / f"tiny-{mix or 'kquants'}.gguf", types)
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3, 4,"]
    ids = [504, 3458, 3502, 314, 253, 5426, 1314, 28, 5248, 11633, 28, 690, 9095, 30]
    got = {}
    for q in ("gguf", "none"):
        with Engine(model_path=str(path), dtype="float32", quantization=q, max_total_tokens=2048) as e:
            fmts = {getattr(lw, "fmt", "float") for lw in e.runner.model.linear_weights()}
            outs = e.generate(prompts, sampling_params={"max_new_tokens": 16, "temperature": 0})
            lp = e.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                            logprob_start_len=0)
            got[q] = ([o["text"] for o in outs], [x[0] for x in lp["meta_info"]["input_token_logprobs"][1:]])
            if q == "gguf":
                want = {f"gguf:{t}" for t in (types or {"x": "Q4_K", "y": "Q6_K"}).values()} | {"gguf:Q8_0"}
                assert want <= {f for fs in fmts for f in fs.split("+")}, fmts
                assert "float" not in fmts  # every matmul weight kept quantized
                if kernels.quant_cpu.available():
                    assert e.runner.model.decode_fused is not None  # the fused C++ decode takes every type
    assert got["gguf"][0] == got["none"][0]
    assert max(abs(a - b) for a, b in zip(got["gguf"][1], got["none"][1])) < 1e-3
