"""Helpers for tests: tiny random-weight Llama-family checkpoints with the real tokenizer."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
                    "added_tokens.json")


def make_tiny_llama(out_dir, *, seed: int = 0, vocab_from=None, qkv_bias: bool = False,
                    **config_overrides) -> Path:
    """Write a tiny random-weight HF checkpoint into ``out_dir`` and return its path.

    Defaults: hidden 64, 2 layers, 4 heads, 2 KV heads (GQA), head_dim 16, intermediate 128,
    vocabulary of the tokenizer copied in, tied embeddings, rope_theta 10000, 2048 positions,
    float32 safetensors. ``qkv_bias=True`` writes a Qwen2 config (``Qwen2ForCausalLM``, biases
    on q/k/v). ``config_overrides`` go into the config (e.g. ``num_hidden_layers=4``).

    Weights are drawn from a ``torch.Generator`` seeded with ``seed`` (same seed, same files).
    They are scaled so logits are non-degenerate: greedy decoding does not just repeat the last
    token and the distribution is neither flat nor one-hot.

    Args:
        out_dir: folder to create (may exist; files are overwritten).
        vocab_from: HF folder whose tokenizer files are copied; default: the converted default
            model (converted on first use, see :func:`sglite.runtime.model_loader.load_checkpoint`).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from .runtime.model_loader import load_checkpoint

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(vocab_from) if vocab_from is not None else load_checkpoint(None).model_dir
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    vocab_size, special = _vocab_facts(out)

    model_type = "qwen2" if qkv_bias else "llama"
    fields = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=vocab_size, tie_word_embeddings=True,
        rope_theta=10000.0, max_position_embeddings=2048, rms_norm_eps=1e-6, hidden_act="silu",
        bos_token_id=special.get("bos"), eos_token_id=special.get("eos"),
        pad_token_id=special.get("pad"), dtype="float32",
    )
    if model_type == "llama":
        fields.update(attention_bias=False, mlp_bias=False)
    else:
        fields.update(use_sliding_window=False)
    fields.update(config_overrides)
    if "head_dim" not in config_overrides and "hidden_size" in config_overrides:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = ["Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"]

    torch.manual_seed(seed)  # HF init draws from the global generator; overwritten below anyway
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill_weights(model, config, seed)
    model.save_pretrained(str(out))
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(str(out))
    return out


def _vocab_facts(folder: Path) -> tuple[int, dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    special = {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id}
    return len(tok), special


def _fill_weights(model, config, seed: int) -> None:
    """Overwrite every parameter deterministically.

    Linear weights ~ N(0, 0.02) except the residual-output projections (``o_proj``,
    ``down_proj``), drawn larger (std 1/sqrt(fan_in)) so the layers actually move the residual
    stream away from the input embedding; the final norm weight is scaled up so the tied-head
    logits have a spread of a few units rather than ~0.1 (greedy tokens vary, softmax not flat).
    Biases ~ N(0, 0.02); norm weights 1.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                value = torch.ones_like(param)
                if name == "model.norm.weight":
                    value *= 16.0
            elif name.endswith("bias"):
                value = torch.randn(param.shape, generator=gen) * 0.02
            elif name == "model.embed_tokens.weight":
                value = torch.randn(param.shape, generator=gen) * 0.02
            else:  # projections: std 1/sqrt(fan_in) keeps activations O(1)
                value = torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[1])
            param.copy_(value)


def rerun_in_triton_interpreter(test_file: str, timeout: float = 600.0):
    """Run one pytest file in a fresh interpreter with ``TRITON_INTERPRET=1`` set before triton is
    imported (``SGLITE_TEST_DEVICE=cpu``): for Triton test files collected after another module
    imported triton. Returns the ``subprocess.CompletedProcess`` (text stdout/stderr); raises
    ``subprocess.TimeoutExpired`` past ``timeout`` seconds."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1", SGLITE_TEST_DEVICE="cpu")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file],
                          env=env, capture_output=True, text=True, timeout=timeout)
