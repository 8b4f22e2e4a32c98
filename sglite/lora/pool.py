"""Adapter slots on the model's device and the per-step view the model applies (S-LoRA's unified
adapter memory, Sheng et al. 2023, §4, simplified to fixed slots).

:class:`LoraPool` holds, per fused matmul ``key`` and layer, ``a`` [S, blocks·R, in] and ``b``
[S, blocks·R, out] (B transposed) buffers in the adapters' dtype (``--lora-dtype``; bf16 halves what
a step reads; ``S = max_loras_per_batch`` slots, ``R = max_lora_rank``, ``blocks`` the parts of the fused matmul: 3 for qkv, 2 for gate_up), allocated
on first use of that key. An adapter of rank r < R fills the first r rows of each rank block and
zeros the rest, so every slot runs one segmented matmul per fused weight
(:func:`sglite.kernels.lora_add`). Slots are handed out least recently used first; the scheduler
keeps at most S adapters in a step (``max_loras_per_batch``), so a step's adapters always fit.

:class:`LoraBatch` is one step's view: row segments (consecutive rows of one adapter) and, per
key, the slot of each segment (-1: no adapter, or the adapter does not change that matmul).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

from sglite import kernels

from .adapter import KEY_BLOCKS, LoraAdapter, ModelShape, fused_layout


class LoraPool:
    """Slots of loaded adapters on ``device`` (see the module docstring)."""

    def __init__(self, shape: ModelShape, dtype: torch.dtype, device, max_loras_per_batch: int, max_lora_rank: int):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.slots_n, self.rank = max_loras_per_batch, max_lora_rank
        self.layout = fused_layout(shape)
        self.a: dict[str, list[torch.Tensor]] = {}  # key -> per layer [S, blocks*R, in]
        self.b: dict[str, list[torch.Tensor]] = {}  # key -> per layer [S, blocks*R, out] (B transposed)
        # key -> [S, blocks, 3] int64 (CPU): per slot and rank block the rank rows in use and the output
        # columns [lo, hi) they write, over all layers (zeros: unused); read by the fused C++ decode
        self.spans: dict[str, torch.Tensor] = {}
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter uid -> slot, least recent first
        self.loads = 0  # adapters copied into a slot (counter)
        self._fused: dict = {}  # (keys, adapted) -> the fused decode's lora_ab list (fused_ab)

    def _buffers(self, key: str) -> None:
        if key in self.a:
            return
        in_w, out_w = self.layout[key]
        rt, S, L = KEY_BLOCKS[key] * self.rank, self.slots_n, self.shape.num_layers
        kw = dict(dtype=self.dtype, device=self.device)
        self.a[key] = [torch.zeros(S, rt, in_w, **kw) for _ in range(L)]
        self.b[key] = [torch.zeros(S, rt, out_w, **kw) for _ in range(L)]
        self.spans[key] = torch.zeros(S, KEY_BLOCKS[key], 3, dtype=torch.int64)

    def slot_of(self, adapter: LoraAdapter, keep: set) -> int:
        """The slot holding ``adapter``, copying it in (into a free slot, else the least recently
        used one whose adapter is not in ``keep``, the uids of this step). Raises RuntimeError
        when all slots are kept (the scheduler admits at most ``max_loras_per_batch`` adapters)."""
        uid = adapter.uid
        if uid in self.resident:
            self.resident.move_to_end(uid)
            return self.resident[uid]
        used = set(self.resident.values())
        free = [s for s in range(self.slots_n) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next((u for u in self.resident if u not in keep), None)
            if victim is None:
                raise RuntimeError(f"more adapters in one step than max_loras_per_batch={self.slots_n}")
            slot = self.resident.pop(victim)
        self._write(slot, adapter)
        self.resident[uid] = slot
        return slot

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        R = self.rank
        for key in adapter.keys:
            self._buffers(key)
        for key in self.a:
            span = self.spans[key][slot]
            span.zero_()
            for layer in range(self.shape.num_layers):
                a, b = self.a[key][layer][slot], self.b[key][layer][slot]
                a.zero_()
                b.zero_()
                for p in adapter.parts.get((layer, key), ()):
                    r, lo = p.a.shape[0], p.block * R
                    a[lo:lo + r].copy_(p.a)
                    b[lo:lo + r, p.row:p.row + p.b.shape[0]].copy_(p.b.t())
                    sp, hi = span[p.block], p.row + p.b.shape[0]
                    sp[1], sp[2] = (p.row, hi) if sp[0] == 0 else (min(int(sp[1]), p.row), max(int(sp[2]), hi))
                    sp[0] = max(int(sp[0]), r)
        self.loads += 1

    def fused_ab(self, keys: tuple, adapted: tuple) -> list:
        """Per layer, per key of ``keys``: ``a``, ``b`` of this pool where ``adapted``, else two empty
        tensors (the fused decode's ``lora_ab``); cached (the buffers never move once allocated)."""
        got = self._fused.get((keys, adapted))
        if got is None:
            empty = torch.empty(0)
            got = [t for layer in range(self.shape.num_layers) for k, on in zip(keys, adapted)
                   for t in ((self.a[k][layer], self.b[k][layer]) if on else (empty, empty))]
            self._fused[(keys, adapted)] = got
        return got

    def drop(self, adapter: LoraAdapter) -> None:
        """Forget ``adapter``'s slot (unloaded); the slot is rewritten by its next user."""
        self.resident.pop(adapter.uid, None)

    def batch(self, segments: list) -> Optional["LoraBatch"]:
        """The :class:`LoraBatch` of one step's ``segments`` (``[(rows, adapter or None), ...]``,
        consecutive rows), or None when no segment has an adapter."""
        adapters = {a.uid: a for _, a in segments if a is not None}
        if not adapters:
            return None
        keep = set(adapters)
        slot = {uid: self.slot_of(a, keep) for uid, a in adapters.items()}
        lens = torch.tensor([n for n, _ in segments], dtype=torch.int64)
        per_key = {}
        for key in self.a:
            s = [slot[a.uid] if a is not None and key in a.keys else -1 for _, a in segments]
            if any(x >= 0 for x in s):
                per_key[key] = torch.tensor(s, dtype=torch.int64)
        return LoraBatch(self, lens, per_key)


_NO_SPANS = torch.empty(0, dtype=torch.int64)


class LoraBatch:
    """One step's adapters (module docstring): ``seg_lens`` [G] int64 and ``slots[key]`` [G] int64."""

    def __init__(self, pool: LoraPool, seg_lens: torch.Tensor, slots: dict):
        self.pool, self.seg_lens, self.slots = pool, seg_lens, slots

    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: int, key: str) -> torch.Tensor:
        """``y`` [N, out] (the base matmul of ``x`` [N, in]) plus each adapted row's LoRA delta of
        fused matmul ``key`` in ``layer``, in place; ``y`` as is when no row's adapter changes it."""
        s = self.slots.get(key)
        if s is None:
            return y
        return kernels.lora_add(y, x, self.pool.a[key][layer], self.pool.b[key][layer], self.seg_lens, s,
                                spans=self.pool.spans[key])

    def fused_args(self, keys: tuple, num_rows: int) -> tuple[list, torch.Tensor, list]:
        """This step's adapters as the fused C++ decode takes them (:mod:`sglite.kernels.decode_fused`),
        for the fused matmuls ``keys`` in the C++ order: ``ab`` (per layer, per key: ``a`` [S, RT,
        in], ``b`` [S, RT, out], or two empty tensors where no row is adapted), ``rows`` [len(keys),
        num_rows] int64 (each row's slot per key, -1: none) and ``spans`` (per key [S, blocks, 3]
        int64, or empty). Little Python per step (the engine loop's thread shares the GIL): the
        ``ab`` list is built once per set of adapted keys. Raises ValueError when the segments do
        not cover ``num_rows`` rows."""
        lens = self.seg_lens.tolist()
        if sum(lens) != num_rows:
            raise ValueError(f"lora segments cover {sum(lens)} rows, the step has {num_rows}")
        rows = []
        for key in keys:
            s = self.slots.get(key)
            rows.append([-1] * num_rows if s is None else [x for x, n in zip(s.tolist(), lens) for _ in range(n)])
        adapted = tuple(k in self.slots for k in keys)
        return self.pool.fused_ab(keys, adapted), torch.tensor(rows, dtype=torch.int64), \
            [self.pool.spans[k] if on else _NO_SPANS for k, on in zip(keys, adapted)]
