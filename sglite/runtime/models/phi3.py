"""Phi-3 (``Phi3ForCausalLM``, Abdin et al. 2024, "Phi-3 Technical Report"): a Llama layer whose
Q/K/V and gate/up projections are stored fused (``self_attn.qkv_proj`` [(Hq+2Hkv)D, H],
``mlp.gate_up_proj`` [2I, H], rows in q, k, v / gate, up order) and whose RoPE is usually
``longrope`` (``su``; :mod:`.rope`). The math is Llama's, so the checkpoint is split into Llama's
names at load and :class:`~.llama.LlamaModel` runs it (and re-fuses the parts into its own fused
matmuls); tensor parallelism and the quantizers see the usual per-projection names.
"""
from __future__ import annotations

import torch

from sglite.errors import InvalidRequestError

ARCH = "Phi3ForCausalLM"


def split_fused_weights(state: dict, hf_config) -> dict:
    """Replace every layer's ``qkv_proj`` / ``gate_up_proj`` weight in ``state`` (mutated and
    returned) by ``q_proj`` / ``k_proj`` / ``v_proj`` and ``gate_proj`` / ``up_proj`` row views.

    Raises:
        InvalidRequestError: a fused weight that is not a plain tensor (a quantized one cannot be
            split by rows here) or of the wrong shape.
    """
    nh = hf_config.num_attention_heads
    hd = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // nh
    nkv = getattr(hf_config, "num_key_value_heads", None) or nh
    inter = hf_config.intermediate_size
    for name in [n for n in state if n.endswith(("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"))]:
        w = state.pop(name)
        if not isinstance(w, torch.Tensor):
            raise InvalidRequestError(f"model_path: {name} is {type(w).__name__}; a fused Phi-3 projection must "
                                      "be a float tensor to be split", field="model_path")
        prefix = name.rsplit(".", 2)[0]  # model.layers.i.self_attn | model.layers.i.mlp
        if name.endswith("qkv_proj.weight"):
            sizes, parts = [nh * hd, nkv * hd, nkv * hd], ["q_proj", "k_proj", "v_proj"]
        else:
            sizes, parts = [inter, inter], ["gate_proj", "up_proj"]
        if w.shape[0] != sum(sizes):
            raise InvalidRequestError(f"model_path: {name} has {w.shape[0]} rows, expected {sum(sizes)}",
                                      field="model_path")
        for part, t in zip(parts, w.split(sizes, dim=0)):
            state[f"{prefix}.{part}.weight"] = t
    return state
