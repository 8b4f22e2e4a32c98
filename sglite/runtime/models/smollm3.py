"""SmolLM3 (``SmolLM3ForCausalLM``, Hugging Face's SmolLM3-3B, 2025): the Llama decoder (grouped-query
attention, SwiGLU, pre-norms, a tied LM head) in which some layers use no positional encoding
(NoPE; Kazemnejad et al. 2023, "The Impact of Positional Encoding on Length Generalization in
Transformers"): layer ``i`` rotates q and k only when ``no_rope_layers[i]`` is 1 (the config's
default: every layer but each ``no_rope_layer_interval``-th, i.e. 3 of every 4, as llama.cpp's
``smollm3`` graph hard-codes). A NoPE layer rotates with the identity tables (cos 1, sin 0), so the
attention kernels, the KV cache and the fused C++ decode run it unchanged (:mod:`.family`).
Sliding-window layers (``use_sliding_window``) are refused.
"""
from __future__ import annotations

from .family import FamilyArch, FamilyModel, family_arch, refuse

ARCHS = ("SmolLM3ForCausalLM",)


def arch_from_hf_config(cfg) -> FamilyArch:
    """The :class:`FamilyArch` of a SmolLM3 config (``transformers.SmolLM3Config``).

    Raises:
        InvalidRequestError (field ``model_path``): sliding-window layers, an MLP bias, or a
            ``no_rope_layers`` list whose length is not the layer count.
    """
    if getattr(cfg, "use_sliding_window", False):
        refuse("use_sliding_window", cfg.use_sliding_window, [False])
    if getattr(cfg, "mlp_bias", False):
        refuse("mlp_bias", cfg.mlp_bias, [False])
    rope = list(getattr(cfg, "no_rope_layers", None) or [1] * cfg.num_hidden_layers)
    if len(rope) != cfg.num_hidden_layers:
        refuse("no_rope_layers", rope, f"one 0/1 entry per layer ({cfg.num_hidden_layers})")
    return family_arch(cfg, family="smollm3", nope_layers=tuple(not r for r in rope))


class SmolLM3Model(FamilyModel):
    """SmolLM3 weights and forward (module docstring): Llama's norm placement."""
