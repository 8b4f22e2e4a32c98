"""Qwen3-MoE (``Qwen3MoeForCausalLM``; Yang et al. 2025, "Qwen3 Technical Report", sec. 2): the
Qwen3 layer (RMS QK-norm over each head, no q/k/v biases) whose sparse MLPs route each token to
``num_experts_per_tok`` of ``num_experts`` SwiGLU experts (softmax over all experts, top-k,
renormalised when ``norm_topk_prob``, as the released checkpoints set it); no shared expert.
Layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` keep a dense MLP. Runs on
:class:`~.moe.MoeModel`.
"""
from __future__ import annotations

from .family import refuse
from .moe import MoeArch, moe_arch, qwen_sparse_layers

ARCHS = ("Qwen3MoeForCausalLM",)


def arch_from_hf_config(cfg) -> MoeArch:
    """The :class:`~.moe.MoeArch` of a Qwen3-MoE config (``transformers.Qwen3MoeConfig``).

    Raises:
        InvalidRequestError: ``attention_bias`` or ``use_sliding_window`` set, or what
            :func:`~.moe.moe_arch` refuses; the message names the field.
    """
    if getattr(cfg, "attention_bias", False):
        refuse("attention_bias", cfg.attention_bias, [False])
    if getattr(cfg, "use_sliding_window", False):
        refuse("use_sliding_window", cfg.use_sliding_window, [False])
    return moe_arch(cfg, family="qwen3_moe", num_experts=int(cfg.num_experts), top_k=int(cfg.num_experts_per_tok),
                    moe_intermediate_size=int(cfg.moe_intermediate_size),
                    renormalize=bool(getattr(cfg, "norm_topk_prob", False)), sparse_layers=qwen_sparse_layers(cfg),
                    qkv_bias=False, qk_norm=True)
