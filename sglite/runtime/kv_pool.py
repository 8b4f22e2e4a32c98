"""KV memory: ``ReqToTokenPool`` (request rows → token slots) and ``TokenToKVPool`` (slots → K/V).

Layout follows SGLang's token-level paged KV (SGLang paper, §3 "RadixAttention"): every token of
every running request owns one *slot*; ``req_to_token[row, pos]`` is the slot of token ``pos`` of
the request in ``row``. Slots are handed out in pages of ``page_size`` tokens (slot
``page * page_size + offset``); slot 0 (page 0) is reserved as padding and never allocated.
"""
from __future__ import annotations

import heapq
from typing import Optional

import torch

from sglite.kernels.host_memory import zeros_untouched

from ..config import KV_CACHE_DTYPES
from ..errors import InvalidRequestError


def kv_bytes_per_token(kv_cache_dtype: str, num_layers: int, num_kv_heads: int, head_dim: int,
                       model_dtype_bytes: int = 2, group: int = 128) -> int:
    """Pool bytes per token over every layer, K and V, scales included (rounded down): the one
    formula behind the pools, the model runner, the tensor-parallel client and ``sglite kv-estimate``.

    ``auto`` = the model dtype (``model_dtype_bytes`` per element): ``2 x layers x KV heads x
    head dim x bytes``; ``bfloat16`` 2 bytes per element; ``fp8_e4m3`` 1 (its per-head scales are
    per layer, not per token); ``int8`` / ``int4`` (KIVI layout, :mod:`sglite.runtime.kv_quant`):
    codes (D or D/2 bytes per head), 4 bytes of value scale + min per head, and each key group's
    ``2 x 2 x D`` bytes per head shared by its ``group`` tokens.

    Raises:
        InvalidRequestError: an unknown ``kv_cache_dtype``.
    """
    hd = num_layers * num_kv_heads
    if kv_cache_dtype == "auto":
        return 2 * hd * head_dim * model_dtype_bytes
    if kv_cache_dtype == "bfloat16":
        return 2 * hd * head_dim * 2
    if kv_cache_dtype == "fp8_e4m3":
        return 2 * hd * head_dim
    if kv_cache_dtype not in ("int8", "int4"):
        raise InvalidRequestError(f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}",
                                  field="kv_cache_dtype")
    codes = head_dim if kv_cache_dtype == "int8" else head_dim // 2
    return (hd * (2 * codes + 4) * group + hd * 4 * head_dim) // group


class ReqToTokenPool:
    """Rows of the slot table, one per running request.

    Attributes:
        req_to_token: [max_reqs, max_context] int32 slot of each token of each row.
    """

    def __init__(self, max_reqs: int, max_context: int, device="cpu"):
        self.size = max_reqs
        self.max_context = max_context
        self.req_to_token = torch.zeros(max_reqs, max_context, dtype=torch.int32, device=device)  # [R, L]
        self._free = list(range(max_reqs - 1, -1, -1))

    def alloc(self) -> Optional[int]:
        """A free row index, or None when all rows are in use."""
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        """Return ``row`` to the pool."""
        assert row not in self._free, f"row {row} freed twice"
        self._free.append(row)

    def available(self) -> int:
        return len(self._free)


class TokenToKVPool:
    """Per-layer K/V buffers ``[num_slots, n_kv_heads, head_dim]`` plus a page allocator.

    The buffers are views of head-major storage (``[n_kv_heads, num_slots, head_dim]``); kernels
    take them by strides and must accept both this and a contiguous ``[S, Hkv, D]`` layout.

    ``num_slots = (num_pages + 1) * page_size``; page 0 is padding. Capacity in tokens is
    ``num_pages * page_size``. Allocation never splits a page between owners.
    """

    residual_bytes = 0  # fixed bytes beside the pages (a quantized pool's residual windows)

    def __init__(self, num_tokens: int, page_size: int, num_layers: int, n_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device="cpu"):
        self.page_size = page_size
        self.num_pages = max(1, num_tokens // page_size)
        self.capacity = self.num_pages * page_size
        num_slots = (self.num_pages + 1) * page_size
        # head-major storage [Hkv, S, D], exposed as [S, Hkv, D] views: one head's keys form a
        # contiguous plane, so a gather of one head's rows takes index_select's fast path (on CPU
        # 0.09 vs 1.0 ms for 16.6k rows of a strided head view, the bulk of batched decode)
        # (on CPU untouched until used, in 4 KiB pages: see host_memory)
        def storage():
            shape = (n_kv_heads, num_slots, head_dim)
            if str(device) == "cpu":
                return zeros_untouched(shape, dtype)
            return torch.zeros(shape, dtype=dtype, device=device)

        self.k_buffers = [storage().transpose(0, 1) for _ in range(num_layers)]  # L x [S, Hkv, D], strides (D, S*D, 1)
        self.v_buffers = [storage().transpose(0, 1) for _ in range(num_layers)]  # L x [S, Hkv, D], strides (D, S*D, 1)
        self.bytes_per_token = kv_bytes_per_token("auto", num_layers, n_kv_heads, head_dim, torch.finfo(dtype).bits // 8)
        self.device = device
        self._reset_free()

    def _reset_free(self) -> None:
        """Every page free. Allocation always takes the lowest free page (:meth:`_pop`): the
        never-used pages are a stack whose top is the lowest, the freed ones a min-heap, so a
        prompt's slots are one ascending run (with the holes of pages still in use) and the
        lowest freed pages are reused before fresh ones are touched. Pushing freed pages straight
        back on the stack (as before) handed later requests the last-freed pages first, and the
        shared-prefix workload ran ~10 % slower on every run after a server's first (2026-12-07,
        the 2-core EPYC: docs/changelog.md)."""
        self._free_pages = list(range(self.num_pages, 0, -1))
        self._released: list = []  # freed pages, a min-heap (heapq)
        self._is_free = bytearray(b"\x00" + b"\x01" * self.num_pages)  # [page] 1 = free (page 0: padding)

    def _pop(self) -> int:
        """The lowest free page, taken."""
        if self._released and (not self._free_pages or self._released[0] < self._free_pages[-1]):
            p = heapq.heappop(self._released)
        else:
            p = self._free_pages.pop()
        self._is_free[p] = 0
        return p

    def num_free_pages(self) -> int:
        """Pages free (never used, or freed)."""
        return len(self._free_pages) + len(self._released)

    def begin_step(self, fb) -> None:
        """Per-step hook the runner calls before each forward with the step's
        :class:`~sglite.runtime.forward_batch.ForwardBatch`: a no-op here (the plain pool keeps no
        per-step state); a quantized pool records the step's token rows and positions."""

    # ------------------------------------------------------------------ allocation
    def free_tokens(self) -> int:
        return self.num_free_pages() * self.page_size

    def tokens_needed(self, seq_len: int, n_new: int) -> int:
        """Slots (whole pages, in tokens) that extending a sequence of ``seq_len`` by ``n_new`` takes."""
        ps = self.page_size
        have = -(-seq_len // ps) * ps
        return max(0, -(-(seq_len + n_new) // ps) * ps - have)

    def alloc_extend(self, last_slot: Optional[int], seq_len: int, n_new: int) -> Optional[torch.Tensor]:
        """Slots for ``n_new`` tokens appended to a sequence of ``seq_len`` tokens.

        ``last_slot`` is the slot of the sequence's last token (None when ``seq_len == 0``);
        the rest of its page is used first. Returns [n_new] int64, or None when memory is short
        (nothing is allocated then). One item of :meth:`alloc_extend_many`.
        """
        slots = self.alloc_extend_many([(last_slot, seq_len, n_new)])
        return None if slots is None else torch.tensor(slots, dtype=torch.int64)

    def alloc_extend_many(self, items: list) -> Optional[list]:
        """The pool's one allocation: slots for each ``(last_slot, seq_len, n_new)`` of ``items``
        in order (as :meth:`alloc_extend` describes one), as one flat list of ``sum(n_new)`` slot
        ids, pages popped in the items' order; None with nothing allocated when the free pages do
        not cover them all. A batch of requests extended at once (``KVManager.extend_all``) takes
        no tensor per request. Subclasses that attach more to a slot override this one."""
        ps = self.page_size
        if ps == 1:  # every token its own page: one run of pops
            total = sum(n for _, _, n in items)
            if self.num_free_pages() < total:
                return None
            return [self._pop() for _ in range(total)]
        need = sum(self.tokens_needed(s if last is not None else 0, n) for last, s, n in items)
        if self.num_free_pages() * ps < need:
            return None
        out: list = []
        for last, s, n in items:
            out.extend(self._slots_after(last, s, n))
        return out

    def _slots_after(self, last_slot: Optional[int], seq_len: int, n_new: int) -> list:
        """The slots of ``n_new`` tokens after ``seq_len`` (the rest of ``last_slot``'s page
        first, then fresh pages; pages of more than one token); the caller checked that the free
        pages suffice."""
        ps = self.page_size
        used_in_page = seq_len % ps
        head = min(n_new, ps - used_in_page) if (used_in_page and last_slot is not None) else 0
        out = list(range(last_slot + 1, last_slot + 1 + head)) if head else []
        remaining = n_new - head
        while remaining > 0:
            p = self._pop()
            take = min(ps, remaining)
            out.extend(range(p * ps, p * ps + take))
            remaining -= take
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages holding ``slots`` ([n] int64). Callers free whole pages only.

        Raises:
            ValueError: a page outside the pool, or one that is already free (freed twice, or
                never handed out); nothing is freed then. (Accepting it put the page in the free
                lists twice and a later allocation handed it to two owners.)"""
        if slots.numel() == 0:
            return
        pages = torch.unique(slots // self.page_size).tolist()
        assert 0 not in pages, "slot 0 (padding) freed"
        if pages[0] < 0 or pages[-1] > self.num_pages:
            raise ValueError(f"free: page {pages[0] if pages[0] < 0 else pages[-1]} is outside the pool "
                             f"(pages 1..{self.num_pages} of {self.page_size} slots)")
        is_free = self._is_free
        dup = [pg for pg in pages if is_free[pg]]
        if dup:
            raise ValueError(f"free: page(s) {dup[:8]} already free (freed twice or never allocated)")
        for pg in pages:
            is_free[pg] = 1
            heapq.heappush(self._released, pg)

    def free_page_set(self) -> set[int]:
        return set(self._free_pages) | set(self._released)
