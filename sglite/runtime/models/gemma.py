"""Gemma 2 and Gemma 3 text decoders (``Gemma2ForCausalLM``, Team Gemma 2024, "Gemma 2: Improving
Open Language Models at a Practical Size", sec. 2; ``Gemma3ForCausalLM``, Team Gemma 2025, "Gemma 3
Technical Report", sec. 2), on :class:`~.family.FamilyModel`'s layer:

* RMSNorm with ``(1 + w)`` weights, in float32 (HF's ``GemmaRMSNorm``), placed before and after
  both the attention and the MLP (``input_layernorm``, ``post_attention_layernorm``,
  ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``);
* the embedding times sqrt(hidden), the scale rounded to the model dtype first (as HF);
* GeGLU MLP with the tanh GELU (``gelu_pytorch_tanh``);
* softmax scale ``query_pre_attn_scalar ** -0.5``;
* Gemma 2: attention logits soft-capped at ``attn_logit_softcapping`` and the final logits at
  ``final_logit_softcapping`` (``cap * tanh(x / cap)``);
* Gemma 3: per-head QK-norm (``(1 + w)`` RMSNorm over D) before RoPE, and the local (sliding)
  layers rotate with their own base (``rope_parameters["sliding_attention"]``, formerly
  ``rope_local_base_freq``) while the global layers use the global RoPE (scaling included);
* sliding-window attention on the local layers (``layer_types``; older configs:
  ``sliding_window_pattern``, every n-th layer global): a token attends to the last
  ``sliding_window`` positions only (itself included). On a float KV cache the local layers keep
  their K/V in a separate slot space that holds only each request's window
  (:mod:`sglite.runtime.swa_pool`); the window and the soft-capping run in the C++ / Triton
  attention kernels (torch reference beside them).
"""
from __future__ import annotations

from .family import FamilyArch, FamilyModel, base_arch, family_arch, refuse

ARCHS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
LAYER_TYPES = ("sliding_attention", "full_attention")


def _layer_types(cfg, n: int) -> list:
    types = getattr(cfg, "layer_types", None)
    if not types:  # older configs: Gemma 2 alternates (even layers local); Gemma 3 every n-th global
        pat = getattr(cfg, "sliding_window_pattern", None) or getattr(cfg, "_sliding_window_pattern", None) or 2
        types = [LAYER_TYPES[0] if (i + 1) % pat else LAYER_TYPES[1] for i in range(n)]
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad or len(types) != n:
        refuse("layer_types", list(types), f"{n} entries among {list(LAYER_TYPES)}")
    return [t == LAYER_TYPES[0] for t in types]


def arch_from_hf_config(cfg) -> FamilyArch:
    """The :class:`FamilyArch` of a Gemma 2 / Gemma 3 text config; unsupported values raise
    InvalidRequestError naming the field."""
    name = (list(getattr(cfg, "architectures", None) or []) or ["Gemma2ForCausalLM"])[0]
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    if act != "gelu_pytorch_tanh":
        refuse("hidden_activation", act, ["gelu_pytorch_tanh"])
    if getattr(cfg, "use_bidirectional_attention", False):
        refuse("use_bidirectional_attention", True, [False])
    n = cfg.num_hidden_layers
    local = _layer_types(cfg, n)
    window = int(getattr(cfg, "sliding_window", None) or 0)
    if any(local) and window <= 0:
        refuse("sliding_window", getattr(cfg, "sliding_window", None), "a positive int for sliding layers")
    rope = getattr(cfg, "rope_parameters", None)
    nested = isinstance(rope, dict) and "full_attention" in rope
    gemma3 = name == "Gemma3ForCausalLM"
    local_rope = None
    if gemma3:
        local_params = rope.get("sliding_attention") if nested else {
            "rope_type": "default", "rope_theta": getattr(cfg, "rope_local_base_freq", 10000.0)}
        local_rope = base_arch(cfg, local_params)
    return family_arch(
        cfg, rope.get("full_attention") if nested else None,
        family="gemma3" if gemma3 else "gemma2", norm_fp32=True, norm_plus_one=True,
        qk_norm_kind="head" if gemma3 else "", embed_scale=float(cfg.hidden_size) ** 0.5,
        embed_scale_in_dtype=True, attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
        attn_softcap=float(getattr(cfg, "attn_logit_softcapping", None) or 0.0),
        final_softcap=float(getattr(cfg, "final_logit_softcapping", None) or 0.0),
        mlp_act="gelu_tanh", sliding_window=window, local_layers=tuple(local), local_rope=local_rope)


class GemmaModel(FamilyModel):
    """Gemma 2 / Gemma 3 weights and forward (module docstring)."""

    def layer_norm_names(self, arch: FamilyArch) -> dict:
        names = {"in_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                 "ffn_in_norm": "pre_feedforward_layernorm", "ffn_out_norm": "post_feedforward_layernorm"}
        if arch.qk_norm_kind == "head":
            names.update(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
        return names
