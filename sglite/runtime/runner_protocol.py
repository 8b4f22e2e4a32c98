"""RunnerProtocol: what the scheduler, the engine and speculative decoding use of a model runner.

Three classes implement it: :class:`~sglite.runtime.model_runner.ModelRunner` (the model in this
process), :class:`~sglite.runtime.parallel.tp_client.TPRunnerClient` (``tp_size`` worker processes; its
pool is an allocator whose K/V buffers live in the workers) and the fake runner of the scheduler's
unit tests. ``tests/runtime/test_runner_contract.py`` checks all three against this contract.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from .forward_batch import ForwardBatch
    from .kv_pool import ReqToTokenPool, TokenToKVPool


@runtime_checkable
class RunnerProtocol(Protocol):
    """A model runner as the scheduler drives it.

    Attributes:
        req_to_token_pool: rows of the slot table (``req_to_token`` [R, Lmax] int32); the scheduler's
            :class:`~sglite.runtime.kv_manager.KVManager` allocates them.
        token_to_kv_pool: the page allocator (and, in this process, the K/V buffers); its
            ``begin_step(fb)`` runs before each forward (a no-op on the plain pool).
        vocab_size: logits columns V (int).
        device: where the scheduler's tensors live and the logits arrive (``"cpu"``, ``"cuda"``...).
        dtype: the model's torch dtype (``torch.float32`` / ``bfloat16`` / ``float16``).
        context_length: the longest sequence a request may reach, in tokens.
        max_total_tokens: KV capacity of the pool, in tokens.
        bytes_per_token: KV bytes per token (all layers, K and V, all ranks together).
        measure_forward: True when the speculative draft policy may time :meth:`forward` at
            start-up to learn what extra rows cost (a real model in this process); False for
            stand-ins whose time says nothing about the model.
    """

    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "TokenToKVPool"
    vocab_size: int
    device: str
    dtype: torch.dtype
    context_length: int
    max_total_tokens: int
    bytes_per_token: int
    measure_forward: bool

    def forward(self, fb: "ForwardBatch") -> torch.Tensor:
        """Run one step (writes the step's K/V into ``fb.out_cache_loc``). Returns [M, V] float32
        logits on the CPU for ``fb.logits_indices`` ([M] int64). Raises RuntimeError when the model
        (or a worker) failed; the scheduler then aborts the running requests."""
        ...

    def close(self) -> None:
        """Release what the runner holds outside Python's memory (worker processes); idempotent.
        The engine calls it when its loop ends."""
        ...
