"""Qwen2-MoE (``Qwen2MoeForCausalLM``; Qwen Team 2024, "Qwen1.5-MoE" / Yang et al. 2024, "Qwen2
Technical Report", sec. 2.2.2): the Qwen2 layer (q/k/v biases) whose sparse MLPs route each token
to ``num_experts_per_tok`` of ``num_experts`` fine-grained SwiGLU experts (softmax over all
experts, top-k, renormalised only when ``norm_topk_prob``) and add a shared expert
(``shared_expert_intermediate_size``) gated per token by ``sigmoid(h @ shared_expert_gate.T)``.
Layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` keep a dense MLP
(``intermediate_size``). Runs on :class:`~.moe.MoeModel`.
"""
from __future__ import annotations

from .family import refuse
from .moe import MoeArch, moe_arch, qwen_sparse_layers

ARCHS = ("Qwen2MoeForCausalLM",)


def arch_from_hf_config(cfg) -> MoeArch:
    """The :class:`~.moe.MoeArch` of a Qwen2-MoE config (``transformers.Qwen2MoeConfig``).

    Raises:
        InvalidRequestError: ``use_sliding_window`` set, a ``shared_expert_intermediate_size``
            below 1, or what :func:`~.moe.moe_arch` refuses; the message names the field.
    """
    if getattr(cfg, "use_sliding_window", False):
        refuse("use_sliding_window", cfg.use_sliding_window, [False])
    shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    if shared < 1:
        refuse("shared_expert_intermediate_size", shared, "an integer >= 1")
    return moe_arch(cfg, family="qwen2_moe", num_experts=int(cfg.num_experts), top_k=int(cfg.num_experts_per_tok),
                    moe_intermediate_size=int(cfg.moe_intermediate_size),
                    renormalize=bool(getattr(cfg, "norm_topk_prob", False)), sparse_layers=qwen_sparse_layers(cfg),
                    qkv_bias=bool(getattr(cfg, "qkv_bias", True)), qk_norm=False,
                    shared_expert_intermediate_size=shared)
