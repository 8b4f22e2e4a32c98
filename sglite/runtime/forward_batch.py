"""ForwardBatch: the tensors one model step needs, passed explicitly to ``model.forward``.

A step is *mixed*: the first ``num_extend_tokens`` entries of ``input_ids`` belong to extend
requests (prefill chunks), the rest are decode rows: one per decode request, and one per token
of short extends (jump-forward appends, the uncached tail of a cached prompt), each row with its
own causal length. All linear layers run once over the concatenation; attention runs per part.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def num_extend_tokens(self) -> int:
        return int(self.input_ids.shape[0] - self.dec_req_pool_indices.shape[0])

    def to(self, device) -> "ForwardBatch":
        """Copy every tensor except the (already resident) slot table to ``device``."""
        kw = {k: (v if k == "req_to_token" else v.to(device, non_blocking=True)) for k, v in self.__dict__.items()}
        return ForwardBatch(**kw)
