"""ForwardBatch: the tensors one model step needs, passed explicitly to ``model.forward``.

A step is *mixed*: the first ``num_extend_tokens`` entries of ``input_ids`` belong to extend
requests (prefill chunks), the rest are decode rows: one per decode request, and one per token
of short extends (jump-forward appends, the uncached tail of a cached prompt), each row with its
own causal length. All linear layers run once over the concatenation; attention runs per part.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import chain
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .step_plan import StepPlan


@dataclass
class ForwardBatch:
    """Tensors of one model step (no policy, no Python objects per request).

    Attributes:
        input_ids: [N] int64 new tokens, extend part first, then decode part.
        positions: [N] int64 absolute position of each token.
        out_cache_loc: [N] int64 KV slot each token's K/V is written to.
        req_to_token: [R, Lmax] int32 slot table (shared, not copied).
        ext_req_pool_indices: [Be] int64 rows of extend requests.
        ext_prefix_lens: [Be] int64 tokens already in the pool per extend request.
        ext_extend_lens: [Be] int64 new tokens per extend request (sum = num_extend_tokens).
        dec_req_pool_indices: [Bd] int64 ``req_to_token`` row of each decode row.
        dec_seq_lens: [Bd] int64 tokens each decode row attends to (incl. its own token).
        logits_indices: [M] int64 indices into ``input_ids`` whose next-token logits are needed.
        swa: the local (sliding-window) layers' slots of this step, a
            :class:`~sglite.runtime.swa_pool.SWAView` set by a hybrid pool's ``begin_step``; None
            otherwise (every layer reads the slots above).
        lora_segments: ``[(rows, adapter or None), ...]`` runs of consecutive rows of one LoRA
            adapter (:class:`sglite.lora.LoraAdapter`), or None when no row has an adapter.
        lora: the step's :class:`sglite.lora.LoraBatch` (set by the model runner from
            ``lora_segments``), or None: every matmul is the base model's alone.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_to_token: torch.Tensor
    ext_req_pool_indices: torch.Tensor
    ext_prefix_lens: torch.Tensor
    ext_extend_lens: torch.Tensor
    dec_req_pool_indices: torch.Tensor
    dec_seq_lens: torch.Tensor
    logits_indices: torch.Tensor
    # not a dataclass field (tensor-parallel commands ship the fields): a hybrid pool's begin_step
    # sets it on the instance
    swa = None
    # not dataclass fields either (the tensor-parallel wire ships the fields): set on the instance only
    # when a row has an adapter
    lora_segments = None  # Optional[list]; unannotated: not a field
    lora = None  # Optional[LoraBatch]

    @classmethod
    def from_plan(cls, plan: "StepPlan", req_to_token: torch.Tensor) -> "ForwardBatch":
        """The tensors of a laid-out :class:`~sglite.runtime.step_plan.StepPlan` (extend entries
        first), reading each entry's slots from ``req_to_token`` ([R, Lmax] int32, reserved by the
        KV manager for this step)."""
        ids, pos, locs = [], [], []
        ext_rows, ext_pre, ext_len, dec_rows, dec_lens = [], [], [], [], []
        width = req_to_token.shape[1]
        segs: list = []  # (rows, adapter) runs, in row order (the entries' order)
        for e in plan.entries:
            r, start, n = e.req, e.start, e.n
            row = r.kv.row
            lora = getattr(r, "lora", None)  # duck-typed rows (the draft model's) have none
            if segs and segs[-1][1] is lora:
                segs[-1][0] += n
            else:
                segs.append([n, lora])
            if n == 1 and e.decode_rows and not e.draft and e.tree is None:  # a decode row: appends only
                ids.append(r.token_at(start))
                locs.append(row * width + start)
                pos.append(start)
                dec_rows.append(row)
                dec_lens.append(start + 1)
                continue
            ids.extend(r.tokens(start, start + n - len(e.draft)))
            ids.extend(e.draft)  # speculative draft tokens (not in the sequence yet)
            base = row * width + start  # flat index of req_to_token[row, start]
            locs.extend(range(base, base + n))
            if e.tree is not None:  # a speculative token tree: per-node positions and slot rows
                p, rows, lens = e.tree.layout(row, start, n)
                pos.extend(p); dec_rows.extend(rows); dec_lens.extend(lens)  # noqa: E702
                continue
            pos.extend(range(start, start + n))
            if e.decode_rows:  # one decode-attention row per token, each seeing the tokens up to itself
                dec_rows.extend([row] * n)
                dec_lens.extend(range(start + 1, start + n + 1))
            else:
                ext_rows.append(row); ext_pre.append(start); ext_len.append(n)  # noqa: E702
        # one host tensor for every index list (a torch.tensor call per list cost more than the
        # lists themselves at batch 1), split into views
        parts = (ids, pos, locs, ext_rows, ext_pre, ext_len, dec_rows, dec_lens, plan.logits_offsets())
        flat = torch.tensor(list(chain.from_iterable(parts)), dtype=torch.int64)
        ids_t, pos_t, locs_t, *rest = flat.split([len(part) for part in parts])
        if req_to_token.device != flat.device:
            locs_t = locs_t.to(req_to_token.device)
        slots = torch.take(req_to_token, locs_t).long()  # [N] int64
        fb = cls(ids_t, pos_t, slots, req_to_token, *rest)
        if any(a is not None for _, a in segs):
            fb.lora_segments = [(n, a) for n, a in segs]
        return fb

    @property
    def num_extend_tokens(self) -> int:
        return int(self.input_ids.shape[0] - self.dec_req_pool_indices.shape[0])

    def to(self, device) -> "ForwardBatch":
        """Copy every tensor except the (already resident) slot table to ``device``."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        kw = {k: (v if k == "req_to_token" else v.to(device, non_blocking=True)) for k, v in kw.items()}
        fb = ForwardBatch(**kw)
        for extra in ("lora_segments", "lora"):
            if extra in self.__dict__:
                setattr(fb, extra, self.__dict__[extra])
        return fb
