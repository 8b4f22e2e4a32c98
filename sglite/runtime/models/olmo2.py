"""OLMo 2 (``Olmo2ForCausalLM``; OLMo et al. 2024, "2 OLMo 2 Furious", sec. 3.1): a Llama decoder
whose norms follow the attention and the MLP instead of preceding them (``x + norm(attn(x))``,
``x + norm(mlp(x))``, no input norm), with QK-norm over the whole q and k projection widths
(``[Hq*D]`` and ``[Hkv*D]`` weights, applied before the head split and RoPE). RMSNorm in float32,
cast back, as HF's ``Olmo2RMSNorm``. Runs on :class:`~.family.FamilyModel`'s layer.
"""
from __future__ import annotations

from .family import FamilyArch, FamilyModel, family_arch, refuse

ARCHS = ("Olmo2ForCausalLM",)


def arch_from_hf_config(cfg) -> FamilyArch:
    """The :class:`FamilyArch` of an OLMo 2 config (``transformers.Olmo2Config``)."""
    if getattr(cfg, "mlp_bias", False):
        refuse("mlp_bias", cfg.mlp_bias, [False])
    return family_arch(cfg, family="olmo2", norm_fp32=True, qk_norm_kind="full")


class Olmo2Model(FamilyModel):
    """OLMo 2 weights and forward (module docstring)."""

    def layer_norm_names(self, arch: FamilyArch) -> dict:
        return {"attn_out_norm": "post_attention_layernorm", "ffn_out_norm": "post_feedforward_layernorm",
                "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
