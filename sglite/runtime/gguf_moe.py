"""Mixture-of-experts tensors of a GGUF file kept quantized (for :mod:`.gguf_native`).

llama.cpp stores a layer's routed experts stacked: ``blk.{i}.ffn_gate_exps`` / ``ffn_up_exps`` /
``ffn_down_exps``, ggml shape ``[K, N, E]`` (a ``GGUFReader`` block tensor: uint8 ``[E, N, bytes
per row]``). Each expert's ``[N, K]`` slice becomes its own
:class:`~sglite.kernels.QuantLinearWeight` under the per-expert HF name
``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`` (Qwen2-MoE / Qwen3-MoE, as
:class:`~sglite.runtime.models.moe.MoeModel` reads them). The shared expert (``ffn_*_shexp``) is
a plain 2-D matmul tensor, mapped by :data:`SHARED_NAMES`; the routers (``ffn_gate_inp``,
``ffn_gate_inp_shexp``) stay float, from the dequantized cache.
"""
from __future__ import annotations

from typing import Callable

EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
#: GGUF name suffix -> HF name suffix of the Qwen2-MoE shared expert's matmuls
SHARED_NAMES = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                "ffn_down_shexp": "mlp.shared_expert.down_proj"}


def expert_kind(gguf_name: str) -> str:
    """The HF projection name of a stacked expert tensor (``blk.0.ffn_up_exps.weight`` ->
    ``up_proj``), or "" for any other tensor."""
    parts = gguf_name.split(".")
    ok = len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight"
    return EXPERT_NAMES.get(parts[2], "") if ok else ""


def split_experts(gguf_name: str, data, k: int, to_weight: Callable) -> dict:
    """``{HF name: weight}`` of each expert of one stacked tensor: ``data`` uint8 [E, N, bytes per
    row], ``k`` the input features, ``to_weight(rows [N, bytes], k)`` one expert's blocks -> a
    QuantLinearWeight (:func:`.gguf_native.blocks_to_weight`). Raises ValueError for a tensor that
    is not 3-D."""
    if data.ndim != 3:
        raise ValueError(f"GGUF {gguf_name}: expected stacked experts [E, N, bytes], got {data.shape}")
    layer, proj = gguf_name.split(".")[1], expert_kind(gguf_name)
    return {f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight": to_weight(data[e], k)
            for e in range(data.shape[0])}


def superseded(name: str, state: dict) -> bool:
    """Whether a stacked float tensor of the dequantized cache (``...mlp.experts.gate_up_proj`` /
    ``down_proj``) is not needed because ``state`` holds its experts quantized (expert 0's
    projections stand for the layer's)."""
    for stacked, projs in ((".mlp.experts.gate_up_proj", ("gate_proj", "up_proj")),
                           (".mlp.experts.down_proj", ("down_proj",))):
        if name.endswith(stacked):
            base = name[: -len(stacked)] + ".mlp.experts.0."
            return all(base + f"{p}.weight" in state for p in projs)
    return False
