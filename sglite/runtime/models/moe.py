"""Mixture-of-experts decoder shared by Mixtral (:mod:`.mixtral`), Qwen2-MoE (:mod:`.qwen2_moe`)
and Qwen3-MoE (:mod:`.qwen3_moe`): the Llama layer (attention, norms, RoPE, Qwen2's q/k/v biases,
Qwen3's per-head QK-norm) whose feed-forward block is a sparsely-gated mixture of SwiGLU experts
(Shazeer et al. 2017, "Outrageously Large Neural Networks", sec. 2; Mixtral: Jiang et al. 2024,
"Mixtral of Experts", sec. 2.1).

Per token row h [H] of a sparse layer: router logits ``h @ W_r.T`` [E] (a float matmul of the
model's implementation: ``F.linear`` as transformers' routers unless the bf16 GEMV or the
batch-invariant matmul is chosen), :func:`sglite.kernels.moe_topk` (softmax over all experts,
top-k, renormalised for Mixtral and for Qwen's ``norm_topk_prob``), then
:func:`sglite.kernels.moe_experts` (rows grouped by expert, one gate/up and one down matmul per
active expert, scatter-added with their routing weights). Qwen2-MoE adds a shared expert (a SwiGLU
MLP every token runs) scaled by ``sigmoid(h @ w_g)``, its gate [1, H]. Qwen's dense layers
(``mlp_only_layers``, ``decoder_sparse_step``) keep Llama's MLP.

Weights: per-expert names as checkpoints store them (Mixtral ``block_sparse_moe.experts.{e}.w1 /
w3 / w2`` = gate / up / down, ``block_sparse_moe.gate``; Qwen ``mlp.experts.{e}.gate_proj / up_proj /
down_proj``, ``mlp.gate``, ``mlp.shared_expert.*``, ``mlp.shared_expert_gate``), or the stacked
tensors of transformers' in-memory modules (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]: the GGUF conversion cache). An expert may be a
:class:`~sglite.kernels.QuantLinearWeight` (GGUF blocks kept quantized, one per expert).

:class:`MoeModel` never takes the fused C++ decode (``fused_decode_ok = False``) and runs on one
device or over tensor-parallel ranks (every rank holds every expert's slice of the intermediate
features: :mod:`sglite.runtime.parallel.parallel_state`; the MLP's partial sum is all-reduced by
:class:`~.llama.LlamaModel`'s layer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglite import kernels
from sglite.errors import InvalidRequestError

from .family import base_arch, refuse
from .llama import LlamaArch, LlamaModel


@dataclass(frozen=True)
class MoeArch(LlamaArch):
    """A Llama shape plus the mixture-of-experts fields (module docstring)."""

    family: str = "mixtral"
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0  # each routed expert's I
    renormalize: bool = True  # top-k weights renormalised to sum to 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen2-MoE has one)
    sparse_layers: tuple = ()  # per layer: True = MoE block, False = dense Llama MLP
    block: str = "mlp"  # the layer's MoE module name in the checkpoint ("block_sparse_moe": Mixtral)
    expert_names: tuple = ("gate_proj", "up_proj", "down_proj")  # per-expert (gate, up, down) names


def moe_arch(cfg, *, family: str, num_experts: int, top_k: int, moe_intermediate_size: int, renormalize: bool,
             sparse_layers: tuple, **fields) -> MoeArch:
    """A :class:`MoeArch` from ``cfg``'s Llama shape (``fields`` override it, e.g. ``qkv_bias``),
    checking what every MoE family shares.

    Raises:
        InvalidRequestError: ``hidden_act`` other than silu, ``num_experts_per_tok`` outside
            [1, num_experts], a non-positive expert size (the message names the config field).
    """
    if getattr(cfg, "hidden_act", "silu") != "silu":
        refuse("hidden_act", cfg.hidden_act, ["silu"])
    if num_experts < 1:
        refuse("num_experts", num_experts, "an integer >= 1")
    if not 1 <= top_k <= num_experts:
        refuse("num_experts_per_tok", top_k, f"an integer in [1, num_experts={num_experts}]")
    if moe_intermediate_size < 1:
        refuse("moe_intermediate_size", moe_intermediate_size, "an integer >= 1")
    base = base_arch(cfg)
    kw = {f: getattr(base, f) for f in LlamaArch.__dataclass_fields__}
    kw.update(fields)
    return MoeArch(**kw, family=family, num_experts=num_experts, top_k=top_k,
                   moe_intermediate_size=moe_intermediate_size, renormalize=renormalize,
                   sparse_layers=tuple(bool(s) for s in sparse_layers))


def qwen_sparse_layers(cfg) -> tuple:
    """Which layers of a Qwen-MoE config are sparse (transformers' rule: not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``)."""
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    n = int(getattr(cfg, "num_experts", 0) or 0)
    return tuple(i not in dense and n > 0 and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers))


@dataclass
class MoeLayer:
    """One sparse feed-forward block: ``router`` [E, H], per expert ``gate_up`` [2I, H] and
    ``down`` [H, I] matmul weights, and optionally the shared expert (``shared_gate_up``,
    ``shared_down``) with its gate ``shared_gate`` [1, H]; float routers and gates."""

    router: object
    gate_up: list
    down: list
    shared_gate_up: Optional[object] = None
    shared_down: Optional[object] = None
    shared_gate: Optional[object] = None

    def linear_weights(self) -> list:
        """Every matmul weight: router, experts' gate_up then down, the shared expert and its gate."""
        shared = [self.shared_gate_up, self.shared_down, self.shared_gate] if self.shared_gate_up is not None else []
        return [self.router] + list(self.gate_up) + list(self.down) + shared

    def nbytes(self) -> int:
        """Bytes held (every expert: a decode step reads only the routed ones)."""
        return sum(w.nbytes() for w in self.linear_weights())


class MoeModel(LlamaModel):
    """Weights and forward of a mixture-of-experts model (module docstring)."""

    fused_decode_ok = False  # sglite.kernels.decode_fused: the C++ layer is plain Llama only

    def _mlp_weights(self, sd: dict, i: int, lin) -> dict:
        a = self.arch
        if not a.sparse_layers[i]:
            return super()._mlp_weights(sd, i, lin)
        p = f"model.layers.{i}.{a.block}."
        dt, dev = self.dtype, self.device

        def need(name):
            if name not in sd:
                raise InvalidRequestError(f"checkpoint is missing weight {name!r}", field="model_path")
            return sd[name]

        router = kernels.LinearWeight(need(p + "gate.weight").to(device=dev, dtype=dt).contiguous())  # [E, H]
        if router.shape[0] != a.num_experts:
            raise InvalidRequestError(f"model_path: {p}gate.weight has {router.shape[0]} experts, config says "
                                      f"{a.num_experts}", field="model_path")
        stacked = f"model.layers.{i}.mlp.experts."

        def part(e: int, j: int):  # expert e's gate (0), up (1) or down (2) weight, as stored
            name = f"{p}experts.{e}.{a.expert_names[j]}.weight"
            if name in sd:
                return sd[name]
            if j == 2:  # transformers' stacked tensors (the GGUF conversion cache)
                return need(stacked + "down_proj")[e]  # [H, I]
            return need(stacked + "gate_up_proj")[e].chunk(2, dim=0)[j]  # [I, H]

        gate_up = [kernels.make_linear([part(e, 0), part(e, 1)], None, dt, dev) for e in range(a.num_experts)]
        down = [kernels.make_linear([part(e, 2)], None, dt, dev) for e in range(a.num_experts)]
        layer = MoeLayer(router, gate_up, down)
        if a.shared_expert_intermediate_size:
            s = p + "shared_expert."
            layer.shared_gate_up = lin([s + "gate_proj.weight", s + "up_proj.weight"])
            layer.shared_down = lin([s + "down_proj.weight"])
            layer.shared_gate = kernels.LinearWeight(
                need(p + "shared_expert_gate.weight").to(device=dev, dtype=dt).reshape(1, -1).contiguous())  # [1, H]
        return {"moe": layer}

    def linear_weights(self) -> list:
        """Every matmul weight: per layer qkv, o, then the dense MLP's gate_up, down or the MoE
        block's experts (:meth:`MoeLayer.linear_weights`); then the LM head."""
        out = []
        for L in self.layers:
            out += [L["qkv"], L["o"]]
            out += L["moe"].linear_weights() if "moe" in L else [L["gate_up"], L["down"]]
        return out + [self.lm_head]

    def _mlp(self, h: torch.Tensor, L: dict, li: int, fb) -> torch.Tensor:
        if "moe" not in L:  # a dense layer (Qwen's mlp_only_layers): LoRA deltas apply as in Llama
            return super()._mlp(h, L, li, fb)
        a, m, inv = self.arch, L["moe"], self.batch_invariant
        weights, ids = kernels.moe_topk(kernels.linear(h, m.router), a.top_k, a.renormalize)  # [N, k] each
        out = kernels.moe_experts(h, ids, weights, m.gate_up, m.down, batch_invariant=inv)  # [N, H]
        if m.shared_gate_up is not None:  # Qwen2-MoE: sigmoid-gated shared expert
            g, u = kernels.linear(h, m.shared_gate_up).chunk(2, dim=-1)
            shared = kernels.linear(kernels.silu_mul(g, u, batch_invariant=inv), m.shared_down)  # [N, H]
            out = out + torch.sigmoid(kernels.linear(h, m.shared_gate)) * shared
        return out
