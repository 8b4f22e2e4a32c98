"""Mixtral (``MixtralForCausalLM``; Jiang et al. 2024, "Mixtral of Experts", sec. 2.1): the Llama
(Mistral) layer with every MLP a mixture of ``num_local_experts`` SwiGLU experts, each token routed
to ``num_experts_per_tok`` of them with weights softmax(top-k logits) (computed as transformers
does: softmax over all experts, top-k, renormalised). Weights ``block_sparse_moe.gate`` and
``block_sparse_moe.experts.{e}.w1 / w3 / w2`` (gate / up / down). Runs on :class:`~.moe.MoeModel`.
"""
from __future__ import annotations

from .family import refuse
from .moe import MoeArch, moe_arch

ARCHS = ("MixtralForCausalLM",)


def arch_from_hf_config(cfg) -> MoeArch:
    """The :class:`~.moe.MoeArch` of a Mixtral config (``transformers.MixtralConfig``).

    Raises:
        InvalidRequestError: a ``sliding_window`` (sliding-window attention is not supported for
            this family), or what :func:`~.moe.moe_arch` refuses; the message names the field.
    """
    if getattr(cfg, "sliding_window", None):
        refuse("sliding_window", cfg.sliding_window, [None])
    n = int(getattr(cfg, "num_local_experts", 0) or 0)
    return moe_arch(cfg, family="mixtral", num_experts=n, top_k=int(cfg.num_experts_per_tok),
                    moe_intermediate_size=int(cfg.intermediate_size), renormalize=True,
                    sparse_layers=(True,) * cfg.num_hidden_layers, qkv_bias=False, qk_norm=False,
                    block="block_sparse_moe", expert_names=("w1", "w3", "w2"))
