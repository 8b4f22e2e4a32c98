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
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from sglite.runtime.model_loader import default_model_path

    cfg = AutoConfig.from_pretrained(str(hf_dir))
    sd = {k: v.float().numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), "qwen2moe")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for key, f in (gguf.GGUFReader(str(default_model_path())).fields if tokenizer else {}).items():
        if key.startswith("tokenizer."):
            vt = gguf.GGUFValueType(f.types[0])
            sub = gguf.GGUFValueType(f.types[-1]) if vt == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), vt, sub_type=sub)
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
