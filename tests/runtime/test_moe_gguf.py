"""A tiny random Qwen2-MoE as a GGUF file (``gguf`` writer, llama.cpp's MoE tensor names) with
quantized experts and shared expert: its stacked expert blocks split into one quantized weight per
expert under the HF names, bit-exact against gguf-py's dequantizer (fast), and, loaded natively,
the same greedy text and prompt logprobs as its dequantized float32 conversion (slow: transformers'
GGUF conversion takes about a minute here)."""
import pytest

from tests.runtime.moe_gguf import MOE_I, SHARED_I, make_moe_gguf


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory, real_checkpoint):
    from sglite.testing import make_tiny_family

    return make_tiny_family(tmp_path_factory.mktemp("hf_moe"), "qwen2_moe", "Qwen2MoeForCausalLM", seed=3,
                            vocab_from=real_checkpoint.model_dir, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=MOE_I, shared_expert_intermediate_size=SHARED_I, qkv_bias=True)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_stacked_expert_blocks_split_per_expert(qtype, tmp_path, real_checkpoint):
    import gguf
    import torch
    from transformers import AutoConfig

    from sglite.kernels import QuantLinearWeight
    from sglite.runtime import gguf_native
    from sglite.testing import make_tiny_family

    hf = make_tiny_family(tmp_path / "hf", "qwen2_moe", "Qwen2MoeForCausalLM", vocab_from=real_checkpoint.model_dir,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                          shared_expert_intermediate_size=96)
    path = make_moe_gguf(tmp_path / "m.gguf", hf, qtype, tokenizer=False)
    reader = gguf.GGUFReader(str(path))
    state = gguf_native._read_blocks(reader, AutoConfig.from_pretrained(str(hf)), "cpu")
    tensors = {t.name: t for t in reader.tensors}
    for i in range(2):
        for gg, hf in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            t = tensors[f"blk.{i}.ffn_{gg}_exps.weight"]
            ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())  # [E, N, K]
            for e in range(4):
                w = state[f"model.layers.{i}.mlp.experts.{e}.{hf}.weight"]
                assert isinstance(w, QuantLinearWeight) and w.fmt == f"gguf:{qtype}"
                assert torch.equal(w.dequantize(torch.float32), ref[e])
            assert isinstance(state[f"model.layers.{i}.mlp.shared_expert.{hf}.weight"], QuantLinearWeight)
    assert not any("gate_inp" in n or n.endswith("mlp.gate.weight") for n in state)  # routers stay float


def test_expert_sizes_read_from_metadata(tmp_path, real_checkpoint):
    """transformers' GGUF reader leaves ``moe_intermediate_size`` / ``shared_expert_intermediate_size``
    at the config defaults; the conversion's config takes them from the file's metadata."""
    from transformers import AutoConfig

    from sglite.runtime import model_loader
    from sglite.testing import make_tiny_family

    hf = make_tiny_family(tmp_path / "hf", "qwen2_moe", "Qwen2MoeForCausalLM", vocab_from=real_checkpoint.model_dir,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                          shared_expert_intermediate_size=96)
    path = make_moe_gguf(tmp_path / "m.gguf", hf, "Q8_0", tokenizer=False)
    cfg = model_loader._moe_config(path, str(tmp_path), path.name)["config"]
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (64, 96)
    plain = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert (plain.moe_intermediate_size, plain.shared_expert_intermediate_size) == (MOE_I, SHARED_I)  # the gap


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_expert_gguf_native_equals_dequantized(qtype, hf_moe, tmp_path, monkeypatch):
    from sglite import Engine

    path = make_moe_gguf(tmp_path / f"tiny-moe-{qtype}.gguf", hf_moe, qtype)
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3, 4,"]
    ids = [504, 3458, 3502, 314, 253, 5426, 1314, 28, 5248, 11633, 28, 690, 9095, 30]
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))  # its conversion stays in tmp_path
    got = {}
    for q in ("gguf", "none"):
        with Engine(model_path=str(path), dtype="float32", quantization=q, max_total_tokens=2048) as e:
            model = e.runner.model
            moe = [L["moe"] for L in model.layers]
            fmts = {getattr(w, "fmt", "float") for m in moe
                    for w in m.gate_up + m.down + [m.shared_gate_up, m.shared_down]}  # routers stay float
            outs = e.generate(prompts, sampling_params={"max_new_tokens": 16, "temperature": 0})
            lp = e.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                            logprob_start_len=0)
            got[q] = ([o["text"] for o in outs], [x[0] for x in lp["meta_info"]["input_token_logprobs"][1:]])
        assert fmts == ({f"gguf:{qtype}"} if q == "gguf" else {"float"}), fmts
        assert all(len(m.gate_up) == 4 and m.shared_gate is not None for m in moe)
    assert len(set(got["none"][0])) > 1
    assert got["gguf"][0] == got["none"][0]
    assert max(abs(a - b) for a, b in zip(got["gguf"][1], got["none"][1])) < 1e-3


def test_mixtral_gguf_refused_before_conversion(tmp_path):
    """A llama-architecture GGUF with experts (Mixtral's layout): refused naming ``model_path``
    before transformers would convert it without its experts."""
    import gguf
    import numpy as np

    from sglite.errors import InvalidRequestError
    from sglite.runtime.model_loader import load_checkpoint

    path = tmp_path / "mixtral-like.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4, 8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InvalidRequestError, match="expert_count") as ei:
        load_checkpoint(path, tmp_path / "cache")
    assert ei.value.field == "model_path"
    assert not any((tmp_path / "cache").glob("mixtral-like-*"))  # nothing converted
