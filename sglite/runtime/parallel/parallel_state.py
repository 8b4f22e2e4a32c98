"""Tensor-parallel layout: which slice of every weight a rank holds, and the rank's collectives.

Megatron-LM's intra-layer split (Shoeybi et al. 2019, §3): the fused Q/K/V and gate/up projections
are *column*-parallel (each rank holds a slice of output features: its attention heads, its slice
of the MLP's intermediate features), the attention output and MLP down projections are
*row*-parallel (each rank holds the matching input features and produces a partial sum), so one
all-reduce after each of the two row-parallel matmuls per layer restores the full hidden state.
The embedding and LM head are split over the vocabulary (rows ``[r*Vp, (r+1)*Vp)``, ``Vp =
ceil(V / tp)``): an embedding lookup is masked to the rank's rows and all-reduced, the LM head's
logits all-gathered. Query heads are split evenly; KV heads are split evenly when
``tp_size <= num_kv_heads`` and replicated (each rank one KV head, ``tp_size / num_kv_heads``
copies of each) when ``tp_size > num_kv_heads``. RMSNorm weights, q/k norms and RoPE are replicated.

Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): every rank holds every expert, each expert's
gate/up split by output rows (its intermediate features) and its down projection by input columns,
like a dense MLP; the router and Qwen2-MoE's shared-expert gate are replicated (every rank routes
every token alike), the shared expert is split like a dense MLP. A rank's MoE output is then a
partial sum (the routing weights scale each expert's partial down projection), restored by the
layer's all-reduce after the MLP.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ...errors import InvalidRequestError


@dataclass(frozen=True)
class TPLayout:
    """Slices of one rank (all counts per rank; ``*_start`` are global indices).

    Raises (from :meth:`make`): InvalidRequestError (field ``tp_size``) when the heads or the
    MLP width do not divide as required.
    """

    tp_rank: int
    tp_size: int
    num_heads: int  # query heads of this rank
    q_start: int
    num_kv_heads: int  # KV heads of this rank (1 when replicated)
    kv_start: int
    intermediate: int
    i_start: int
    vocab: int  # padded vocabulary rows per rank (Vp)
    v_start: int
    vocab_size: int  # the model's full vocabulary (V)
    expert_inter: int = 0  # each routed expert's intermediate features on this rank (MoE; 0: none)
    e_start: int = 0
    shared_inter: int = 0  # the shared expert's intermediate features on this rank (Qwen2-MoE)
    s_start: int = 0

    @classmethod
    def make(cls, hf_config, tp_rank: int, tp_size: int) -> "TPLayout":
        """Rank ``tp_rank``'s slices of heads, KV heads (replicated when ``tp_size`` > KV heads),
        MLP columns and padded vocabulary rows (Megatron-LM, Shoeybi et al. 2019, §3). Raises
        ``InvalidRequestError`` (field ``tp_size``) when a dimension does not split."""
        hq = hf_config.num_attention_heads
        hkv = getattr(hf_config, "num_key_value_heads", None) or hq
        inter, vocab = hf_config.intermediate_size, hf_config.vocab_size

        def bad(msg):
            raise InvalidRequestError(f"tp_size={tp_size}: {msg}", field="tp_size")

        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            bad(f"tp_rank {tp_rank} out of range")
        if hq % tp_size:
            bad(f"the model's {hq} attention heads are not divisible by it")
        if inter % tp_size:
            bad(f"the model's intermediate_size {inter} is not divisible by it")
        if tp_size <= hkv:
            if hkv % tp_size:
                bad(f"the model's {hkv} KV heads are not divisible by it")
            kvn, kv0 = hkv // tp_size, tp_rank * (hkv // tp_size)
        else:
            if tp_size % hkv:
                bad(f"it exceeds the model's {hkv} KV heads and is not a multiple of them")
            kvn, kv0 = 1, tp_rank // (tp_size // hkv)  # replicated KV heads
        vp = -(-vocab // tp_size)
        moe = {}
        if getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None):
            ei = int(getattr(hf_config, "moe_intermediate_size", None) or inter)  # Mixtral: intermediate_size
            si = int(getattr(hf_config, "shared_expert_intermediate_size", None) or 0)
            for field, n in (("moe_intermediate_size", ei), ("shared_expert_intermediate_size", si)):
                if n % tp_size:
                    bad(f"the model's {field} {n} is not divisible by it")
            moe = dict(expert_inter=ei // tp_size, e_start=tp_rank * (ei // tp_size),
                       shared_inter=si // tp_size, s_start=tp_rank * (si // tp_size))
        return cls(tp_rank, tp_size, hq // tp_size, tp_rank * (hq // tp_size), kvn, kv0,
                   inter // tp_size, tp_rank * (inter // tp_size), vp, tp_rank * vp, vocab, **moe)

    def local_hf_config(self, hf_config):
        """A copy of ``hf_config`` with this rank's head counts, MLP width and vocabulary rows, so
        :class:`~sglite.runtime.models.llama.LlamaArch` describes the shard (head_dim kept)."""
        cfg = copy.deepcopy(hf_config)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        cfg.head_dim = head_dim
        cfg.num_attention_heads, cfg.num_key_value_heads = self.num_heads, self.num_kv_heads
        cfg.intermediate_size, cfg.vocab_size = self.intermediate, self.vocab
        if getattr(hf_config, "moe_intermediate_size", None):  # Qwen-MoE (Mixtral's experts: intermediate_size)
            cfg.moe_intermediate_size = self.expert_inter
        if getattr(hf_config, "shared_expert_intermediate_size", None):
            cfg.shared_expert_intermediate_size = self.shared_inter
        return cfg

    def shard(self, name: str, get_slice, shape: tuple, head_dim: int) -> torch.Tensor:
        """This rank's slice of the HF tensor ``name`` (full ``shape``), read through
        ``get_slice(name)`` (a safetensors slice: supports ``[a:b]`` and ``[:, a:b]``)."""
        sl = get_slice(name)
        D = head_dim
        if name.endswith("qkv_proj.weight"):  # Phi-3's fused q, k, v rows: this rank's rows of each
            hq = self.num_heads * self.tp_size
            hkv = (shape[0] // D - hq) // 2
            k0, v0 = hq * D, (hq + hkv) * D
            return torch.cat([sl[self.q_start * D:(self.q_start + self.num_heads) * D],
                              sl[k0 + self.kv_start * D:k0 + (self.kv_start + self.num_kv_heads) * D],
                              sl[v0 + self.kv_start * D:v0 + (self.kv_start + self.num_kv_heads) * D]])
        if name.endswith("gate_up_proj.weight"):  # Phi-3's fused gate, up rows
            half = shape[0] // 2
            return torch.cat([sl[self.i_start:self.i_start + self.intermediate],
                              sl[half + self.i_start:half + self.i_start + self.intermediate]])
        moe = self._moe_shard(name, sl)
        if moe is not None:
            return moe
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return sl[self.q_start * D:(self.q_start + self.num_heads) * D]
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return sl[self.kv_start * D:(self.kv_start + self.num_kv_heads) * D]
        if name.endswith("o_proj.weight"):
            return sl[:, self.q_start * D:(self.q_start + self.num_heads) * D]
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return sl[self.i_start:self.i_start + self.intermediate]
        if name.endswith("down_proj.weight"):
            return sl[:, self.i_start:self.i_start + self.intermediate]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = sl[self.v_start:min(self.v_start + self.vocab, self.vocab_size)]
            pad = self.vocab - rows.shape[0]  # the last rank's padding rows (never looked up)
            return torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad > 0 else rows
        return sl[:]  # norms, routers, the shared-expert gate: replicated

    def _moe_shard(self, name: str, sl):
        """This rank's slice of an MoE expert weight (None when ``name`` is not one): per-expert
        gate / up rows and down columns (Mixtral ``w1 / w3 / w2``, Qwen ``*_proj``), the stacked
        ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] of the GGUF conversion
        cache, and Qwen2-MoE's shared expert (its own width)."""
        if ".shared_expert." in name:
            a, b = self.s_start, self.s_start + self.shared_inter
        elif ".experts." in name:
            a, b = self.e_start, self.e_start + self.expert_inter
        else:
            return None
        if name.endswith(("gate_proj.weight", "up_proj.weight", ".w1.weight", ".w3.weight")):
            return sl[a:b]
        if name.endswith(("down_proj.weight", ".w2.weight")):
            return sl[:, a:b]
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: this rank's gate rows, then its up rows
            half = self.expert_inter * self.tp_size
            return torch.cat([sl[:, a:b], sl[:, half + a:half + b]], dim=1)
        if name.endswith("experts.down_proj"):  # [E, H, I]
            return sl[:, :, a:b]
        return None


def load_shard(checkpoint, layout: TPLayout, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Read only this rank's slices from the checkpoint's safetensors files (HF names, CPU,
    floating tensors cast to ``dtype``). A tied LM head shares the embedding shard."""
    from safetensors import safe_open

    cfg = checkpoint.hf_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out: dict[str, torch.Tensor] = {}
    for file in sorted(checkpoint.model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                t = layout.shard(name, lambda _n, _sl=sl: _sl, tuple(sl.get_shape()), head_dim)
                out[name] = t.to(dtype) if t.is_floating_point() else t
    if "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    from ..models import phi3

    if (getattr(cfg, "architectures", None) or [""])[0] == phi3.ARCH:  # this rank's fused rows -> Llama names
        phi3.split_fused_weights(out, layout.local_hf_config(cfg))
    return out


def tp_backend(device) -> str:
    """The torch.distributed backend of the tensor-parallel group on ``device`` (a ``str`` or
    ``torch.device``): ``"nccl"`` for CUDA devices, ``"gloo"`` otherwise (CPU). The one place this
    is decided; the control group and the P/D KV transfer always use gloo (host tensors)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def make_tp_group(store, rank: int, size: int, device: str, host: str | None = None):
    """The tensor-parallel process group of ``size`` model ranks, built on ``store`` (a
    ``torch.distributed`` store shared with the scheduler), backend :func:`tp_backend` of
    ``device``. A backend object, not the process's default group. ``host``: the address gloo's
    connections listen on (``"127.0.0.1"`` on a single machine; None = gloo's default)."""
    import torch.distributed as dist

    from .control import DEFAULT_TIMEOUT, gloo_group

    prefixed = dist.PrefixStore("sglite/tp", store)
    if tp_backend(device) == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, size)
    return gloo_group(prefixed, rank, size, DEFAULT_TIMEOUT, host)


class TPComm:
    """The collectives a sharded :class:`~sglite.runtime.models.llama.LlamaModel` calls (its
    ``tp`` attribute): vocab-parallel embedding, all-reduce after row-parallel matmuls, logits
    all-gather. ``group``: the torch.distributed backend of the ``tp_size`` model ranks
    (:func:`make_tp_group`; a ``ProcessGroupGloo`` / ``ProcessGroupNCCL``)."""

    def __init__(self, layout: TPLayout, group):
        self.layout, self.group = layout, group

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup. table: [Vp, H] this rank's rows; ids: [N] int64 global ids.
        Returns [N, H] full embeddings (all-reduced)."""
        local = ids - self.layout.v_start
        mine = (local >= 0) & (local < table.shape[0])
        x = table[local.clamp(0, table.shape[0] - 1)] * mine[:, None].to(table.dtype)  # [N, H]
        return self.all_reduce(x)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' partial results ([N, H], in place)."""
        x = x.contiguous()
        self.group.allreduce([x]).wait()
        return x

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[M, Vp] this rank's vocabulary columns -> [M, V] every rank's, in vocabulary order."""
        parts = [torch.empty_like(logits) for _ in range(self.layout.tp_size)]
        self.group.allgather([parts], [logits.contiguous()]).wait()
        return torch.cat(parts, dim=-1)[:, :self.layout.vocab_size]
