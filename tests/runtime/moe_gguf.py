"""A tiny random Qwen2-MoE written as a GGUF file with the ``gguf`` writer (llama.cpp's tensor
names: ``ffn_gate_inp``, ``ffn_{gate,up,down}_exps``, ``ffn_{gate,up,down}_shexp``,
``ffn_gate_inp_shexp``), experts quantized (Q8_0 / Q4_0), for the native-vs-dequantized oracle.

transformers' GGUF reader maps neither ``expert_feed_forward_length`` nor the shared expert's size
for ``qwen2moe`` (sglite's conversion reads them from the metadata: test_expert_sizes_read_from_metadata);
the slow oracle's checkpoint keeps Qwen2MoeConfig's defaults for them (1408 and 5632)."""
from pathlib import Path

MOE_I, SHARED_I = 1408, 5632  # Qwen2MoeConfig defaults (see module docstring)


def make_moe_gguf(path: Path, hf_dir: Path, expert_type: str = "Q8_0", tokenizer: bool = True) -> Path:
    """Write the HF Qwen2-MoE checkpoint ``hf_dir`` (from :func:`sglite.testing.make_tiny_family`)
    as ``path``: experts and shared expert in ``expert_type``, attention / embedding float32,
    the default model's GGUF tokenizer fields (``tokenizer=False``: none, for tests that only read
    the tensors: parsing the default model's vocabulary takes ~20 s)."""
    import gguf
    import numpy as np

    from sglite.testing_gguf import copy_default_tokenizer, open_gguf_writer

    cfg, sd, w = open_gguf_writer(path, hf_dir, "qwen2moe")
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if tokenizer:
        copy_default_tokenizer(w)
    w.add_vocab_size(cfg.vocab_size)
    qt = gguf.GGMLQuantizationType[expert_type]

    def quant(name, arr):
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(arr), qt), raw_dtype=qt)

    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for n, g in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v")):
            w.add_tensor(b + g + ".weight", sd[p + f"self_attn.{n}_proj.weight"])
            w.add_tensor(b + g + ".bias", sd[p + f"self_attn.{n}_proj.bias"])
        w.add_tensor(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        m = p + "mlp."
        w.add_tensor(b + "ffn_gate_inp.weight", sd[m + "gate.weight"])
        for hf, gg in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            quant(b + f"ffn_{gg}_exps.weight",
                  np.stack([sd[m + f"experts.{e}.{hf}.weight"] for e in range(cfg.num_experts)]))
            quant(b + f"ffn_{gg}_shexp.weight", sd[m + f"shared_expert.{hf}.weight"])
        w.add_tensor(b + "ffn_gate_inp_shexp.weight", sd[m + "shared_expert_gate.weight"][0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
