"""Granite (``GraniteForCausalLM``, IBM Granite 3.x): the Llama decoder with four scalars from the
config: the embedding is multiplied by ``embedding_multiplier``, each attention and MLP output by
``residual_multiplier`` before its residual add, ``attention_multiplier`` is the softmax scale
(instead of 1/sqrt(D)), and the logits are divided by ``logits_scaling`` (HF's
``modeling_granite``). Runs on :class:`~.family.FamilyModel`'s layer with Llama's norms.
"""
from __future__ import annotations

from .family import FamilyArch, FamilyModel, family_arch, refuse

ARCHS = ("GraniteForCausalLM",)


def arch_from_hf_config(cfg) -> FamilyArch:
    """The :class:`FamilyArch` of a Granite config (``transformers.GraniteConfig``)."""
    if getattr(cfg, "mlp_bias", False):
        refuse("mlp_bias", cfg.mlp_bias, [False])
    return family_arch(cfg, family="granite", embed_scale=float(cfg.embedding_multiplier),
                       residual_scale=float(cfg.residual_multiplier), attn_scale=float(cfg.attention_multiplier),
                       logits_divisor=float(cfg.logits_scaling))


class GraniteModel(FamilyModel):
    """Granite weights and forward (module docstring): Llama's norm placement."""
