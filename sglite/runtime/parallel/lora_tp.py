"""LoRA adapters under tensor parallelism: each rank holds its shard of every adapter, split like
the base layer it adapts (Megatron-LM's split, Shoeybi et al. 2019, §3; as S-LoRA's tensor
parallelism, Sheng et al. 2023, §5).

- Column-parallel matmuls (fused q/k/v, gate/up): ``A`` [r, in] is replicated, ``B`` [out, r] keeps
  the rank's output rows (its heads, its MLP columns), so the rank's delta is exactly its slice.
- Row-parallel matmuls (o, down): ``A`` keeps the rank's input columns, ``B`` is replicated; the
  rank's delta ``(x_rank · A_rankᵀ) · Bᵀ`` is a partial sum added to the base matmul's partial sum
  before the layer's all-reduce (:meth:`~sglite.runtime.models.llama.LlamaModel._reduce`), so the
  sum over ranks is the full delta (up to float summation order).

:func:`shard_adapter` cuts a loaded adapter; :class:`WorkerLora` is a worker's side (its
:class:`~sglite.lora.LoraManager` over the shard's shape, the commands of
:mod:`.commands`); the scheduler's manager mirrors loads and unloads to the workers through
:class:`~sglite.runtime.parallel.tp_client.TPRunnerClient` (``load_lora`` / ``unload_lora``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ...lora import LoraAdapter, LoraManager, initial_max_rank, load_adapter, resolve_lora_dtype
from ...lora.adapter import Part
from .parallel_state import TPLayout


def _kept_rows(key: str, layout: TPLayout, shape) -> Optional[torch.Tensor]:
    """Global output rows of fused matmul ``key`` this rank keeps, in local order (column-parallel
    ``qkv`` / ``gate_up``), or None for a row-parallel matmul (``o`` / ``down``)."""
    D = shape.head_dim

    def span(lo, n):
        return torch.arange(lo, lo + n)

    if key == "qkv":
        q, kv = shape.num_heads * D, shape.num_kv_heads * D
        return torch.cat([span(layout.q_start * D, layout.num_heads * D), span(q + layout.kv_start * D,
                          layout.num_kv_heads * D), span(q + kv + layout.kv_start * D, layout.num_kv_heads * D)])
    if key == "gate_up":
        I = shape.intermediate_size
        return torch.cat([span(layout.i_start, layout.intermediate), span(I + layout.i_start, layout.intermediate)])
    return None


def _kept_cols(key: str, layout: TPLayout, shape) -> slice:
    """Input columns of row-parallel matmul ``key`` (``o``: the rank's heads; ``down``: its MLP columns)."""
    if key == "o":
        D = shape.head_dim
        return slice(layout.q_start * D, (layout.q_start + layout.num_heads) * D)
    return slice(layout.i_start, layout.i_start + layout.intermediate)


def shard_adapter(adapter: LoraAdapter, layout: TPLayout, shape) -> LoraAdapter:
    """Rank ``layout.tp_rank``'s shard of ``adapter`` (loaded against the full model ``shape``, a
    :class:`~sglite.lora.adapter.ModelShape`): the module docstring's split. Returns a new adapter
    with the same name, uid, rank and scaling; its parts' rows are the shard's fused rows."""
    out = LoraAdapter(adapter.name, adapter.path, adapter.uid, adapter.rank, adapter.scaling)
    for (layer, key), parts in adapter.parts.items():
        rows = _kept_rows(key, layout, shape)
        new = []
        for p in parts:
            if rows is None:  # row-parallel: A's input columns split, B replicated
                new.append(Part(p.block, p.row, p.a[:, _kept_cols(key, layout, shape)].contiguous(), p.b))
                continue
            mine = (rows >= p.row) & (rows < p.row + p.b.shape[0])  # the part's rows this rank keeps
            local = torch.nonzero(mine).flatten()
            if local.numel():  # contiguous in local order: each part covers one run of the fused rows
                new.append(Part(p.block, int(local[0]), p.a, p.b[rows[local] - p.row].contiguous()))
        out.parts[(layer, key)] = new
    return out


class WorkerLora:
    """One worker's adapters: a :class:`~sglite.lora.LoraManager` over the shard's shape
    (``local_shape``) in ``config``'s ``lora_dtype`` / ``max_loras_per_batch`` / ``max_lora_rank``
    (resolved as the scheduler resolves them, so the slots agree)."""

    def __init__(self, config, layout: TPLayout, full_shape, local_shape, dtype: torch.dtype, device):
        self.layout, self.full_shape = layout, full_shape
        self.rank = initial_max_rank(config.max_lora_rank, tuple(config.lora_paths or ()))
        self.manager = LoraManager(local_shape, resolve_lora_dtype(config.lora_dtype, dtype), device,
                                   config.max_loras_per_batch, self.rank)
        self.by_uid: dict[int, LoraAdapter] = {}

    def load(self, name: str, path: str, uid: int) -> None:
        """Read adapter ``name`` against the full model, keep this rank's shard under ``uid``."""
        full = load_adapter(name, path, self.full_shape, self.rank, self.manager.dtype, uid)
        adapter = shard_adapter(full, self.layout, self.full_shape)
        self.manager.add(adapter)
        self.by_uid[uid] = adapter

    def unload(self, name: str) -> None:
        adapter = self.manager.remove(name)
        self.by_uid.pop(adapter.uid, None)

    def attach(self, fb, lens: Optional[torch.Tensor], uids: Optional[torch.Tensor]) -> None:
        """Set ``fb.lora`` from a step's runs (``lens`` / ``uids`` of :class:`.commands.Forward`;
        None: no adapter). Raises KeyError naming an adapter uid this rank does not hold."""
        if lens is None:
            return
        segs = []
        for n, u in zip(lens.tolist(), uids.tolist()):
            if u and u not in self.by_uid:
                raise KeyError(f"LoRA adapter uid {u} is not loaded on tensor-parallel rank {self.layout.tp_rank}")
            segs.append((n, self.by_uid[u] if u else None))
        fb.lora_segments = segs
        fb.lora = self.manager.batch(segs)
