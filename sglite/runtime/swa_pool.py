"""Hybrid KV pool for sliding-window models (Gemma 2 / Gemma 3): the global layers' K/V in the
paged full pool, the local (sliding-window) layers' K/V in a second, smaller slot space.

A local layer reads only the last ``sliding_window`` positions of a request (Beltagy et al. 2020,
"Longformer", sec. 3.1; Gemma 2 report sec. 2.2), so the K/V of older positions is dead weight in
those layers. :class:`SWATokenToKVPool` keeps a request's positions in the full slot space as
before (``req_to_token`` holds full slots; the radix tree stores them), and gives each full slot
that still needs local K/V a *local slot*: ``full_to_swa[full_slot]`` (0 = none: never given or
freed; local slot 0 is padding, as full slot 0). The KV manager frees a request's local slots
once they fall out of its window (:meth:`SWATokenToKVPool.free_swa`), so a request of ``n``
tokens holds ``n`` full slots but at most about ``window`` local slots (two windows with the radix
cache on: chunks a request put in the tree lose their local slots too, except the window at the
tree prefix's end, where no other request locks them: :func:`free_tree_tail`). Prefix matches are
cut where the window before the match end was freed (:func:`usable_prefix`); a request whose chunk
duplicates cached slots that lost their local K/V hands its own to them (``adopt_swa``).

Per step (:meth:`SWATokenToKVPool.begin_step`) the full slots of the step's rows are translated
into local ones for the local layers (``fb.swa``, a :class:`SWAView`): out-of-window positions map
to padding slot 0, which the windowed kernels never read (they start at the window).

The local slot space is sized for what running requests can hold: each row's window twice
(its own tail and a tail locked in the radix tree) plus two contexts of in-flight prefill, capped
at the full pool (:func:`swa_pool_tokens`). The full pool holds only the global layers' K/V, so
it is sized from their bytes per token: a memory budget pays for the local slots first and buys
full-pool tokens with the rest (:func:`split_budget`; Gemma 3, 5 of 6 layers local: about 6x the
tokens full attention on every layer holds). Allocation takes a local slot for every new token; a
short local pool makes :meth:`free_tokens` small, so the KV manager evicts from the radix tree
(which frees both) as it does for the full pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglite.kernels.host_memory import zeros_untouched

from .kv_pool import TokenToKVPool, kv_bytes_per_token


@dataclass
class SWAView:
    """The local layers' view of one step (full slots translated through ``full_to_swa``).

    Attributes:
        out_cache_loc: [N] int64 local slot of each new token.
        req_to_token: [B', W] int32 local slots of the step's rows (extend rows first, then
            decode rows; W = longest position + 1); 0 where freed.
        ext_rows: [Be] int64 row of each extend request in ``req_to_token`` (0 .. Be-1).
        dec_rows: [Bd] int64 row of each decode row (Be .. Be+Bd-1).
    """

    out_cache_loc: torch.Tensor
    req_to_token: torch.Tensor
    ext_rows: torch.Tensor
    dec_rows: torch.Tensor


def _local_want(window: int, rows: int, context_length: int, page_size: int) -> int:
    """Local slots a hybrid pool wants: ``rows x (2 x window + 2 pages) + 2 x context`` (the
    windows running requests hold, plus in-flight prefill)."""
    return rows * (2 * window + 2 * page_size) + 2 * context_length


def swa_pool_tokens(full_tokens: int, window: int, rows: int, context_length: int, page_size: int) -> int:
    """Local slots of a hybrid pool: :func:`_local_want`, at most ``full_tokens``."""
    return int(min(full_tokens, _local_want(window, rows, context_length, page_size)))


def split_budget(budget_bytes: int, global_bytes: int, local_bytes: int, window: int, rows: int,
                 context_length: int, page_size: int, max_full: Optional[int] = None) -> tuple[int, int]:
    """(full-pool tokens, local slots) that ``budget_bytes`` of KV memory buys on a hybrid pool.

    The full pool holds only the global layers' K/V (``global_bytes`` per token), the local slot
    space the local layers' (``local_bytes`` per token), sized by :func:`swa_pool_tokens` from the
    window and the running rows; the full pool gets what is left:
    ``(budget - local_slots x local_bytes) // global_bytes`` tokens. When that is shorter than the
    local slots wanted (a budget of a few contexts), every full slot keeps a local slot and the
    split is ``budget // (global_bytes + local_bytes)`` each (the full-attention pool's size, never
    less). A model with no global layer holds no full-pool K/V: the full pool is the budget over the
    local bytes per token (what full attention would hold). ``max_full`` caps the full pool (memory left unspent);
    the full pool is whole pages and at least one page.

    Raises:
        ValueError: ``local_bytes`` <= 0 (no local layer: not a hybrid pool).
    """
    if local_bytes <= 0:
        raise ValueError(f"local_bytes must be > 0 on a hybrid pool, got {local_bytes}")
    want = _local_want(window, rows, context_length, page_size)
    if global_bytes <= 0:
        full = budget_bytes // local_bytes
    else:
        full = (budget_bytes - want * local_bytes) // global_bytes
        if full < want:
            full = budget_bytes // (global_bytes + local_bytes)
        if max_full is not None:
            full = min(full, max_full)
    full = max(1, full // page_size) * page_size
    return full, swa_pool_tokens(full, window, rows, context_length, page_size)


class SWATokenToKVPool(TokenToKVPool):
    """A :class:`TokenToKVPool` whose local layers live in a separate, smaller slot space.

    Args:
        num_tokens: full pool capacity (tokens), as for :class:`TokenToKVPool`.
        swa_tokens: local slot space capacity (tokens).
        page_size: tokens per page of the full pool (local slots are handed out one by one).
        local_layers: per model layer, True for a sliding-window layer.
        sliding_window: the local layers' window (tokens, > 0).
        n_kv_heads, head_dim, dtype, device: as for :class:`TokenToKVPool`.

    ``k_buffers`` / ``v_buffers`` hold one buffer per model layer: ``[S_full, Hkv, D]`` for the
    global layers, ``[S_swa, Hkv, D]`` for the local ones (indexed by local slots).
    """

    def __init__(self, num_tokens: int, swa_tokens: int, page_size: int, local_layers: tuple,
                 sliding_window: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device="cpu"):
        n_local = sum(1 for x in local_layers if x)
        super().__init__(num_tokens, page_size, len(local_layers) - n_local, n_kv_heads, head_dim, dtype, device)
        self.sliding_window = int(sliding_window)
        self.local_layers = tuple(bool(x) for x in local_layers)
        self.swa_capacity = max(1, int(swa_tokens))
        S = self.swa_capacity + 1  # local slot 0: padding

        def storage():
            if str(device) == "cpu":
                return zeros_untouched((n_kv_heads, S, head_dim), dtype).transpose(0, 1)
            return torch.zeros(n_kv_heads, S, head_dim, dtype=dtype, device=device).transpose(0, 1)

        full_k, full_v = iter(self.k_buffers), iter(self.v_buffers)
        self.k_buffers = [storage() if loc else next(full_k) for loc in self.local_layers]
        self.v_buffers = [storage() if loc else next(full_v) for loc in self.local_layers]
        db = torch.finfo(dtype).bits // 8
        self.global_bytes_per_token = self.bytes_per_token  # the full slot space: global layers
        self.local_bytes_per_token = kv_bytes_per_token("auto", n_local, n_kv_heads, head_dim, db)
        self.bytes_per_token = self.global_bytes_per_token + self.local_bytes_per_token
        num_full_slots = (self.num_pages + 1) * page_size
        self.full_to_swa = torch.zeros(num_full_slots, dtype=torch.int64)  # [S_full] local slot, 0 = none
        self._swa_free = list(range(self.swa_capacity, 0, -1))  # stack; pop() gives low slots first

    # ------------------------------------------------------------------ sizes
    @property
    def saved_bytes(self) -> int:
        """Bytes the local layers do not allocate against a pool of ``capacity`` tokens on every layer."""
        return (self.capacity - self.swa_capacity) * self.local_bytes_per_token

    def swa_free_tokens(self) -> int:
        return len(self._swa_free)

    def swa_used_tokens(self) -> int:
        """Local slots held (by running requests or the radix tree)."""
        return self.swa_capacity - len(self._swa_free)

    def free_tokens(self) -> int:
        """Tokens that can be appended now: the smaller of the free full slots and local slots."""
        return min(super().free_tokens(), len(self._swa_free))

    def full_free_tokens(self) -> int:
        """Free slots of the full (global layers') slot space alone."""
        return super().free_tokens()

    # ------------------------------------------------------------------ allocation
    def alloc_extend_many(self, items: list) -> Optional[list]:
        """Full slots as :meth:`TokenToKVPool.alloc_extend_many`, each given a local slot (popped
        in the same order); None (nothing allocated) when either space is short."""
        total = sum(n for _, _, n in items)
        if total > len(self._swa_free):
            return None
        slots = super().alloc_extend_many(items)
        if not slots:
            return slots
        local = [self._swa_free.pop() for _ in range(total)]
        self.full_to_swa[torch.tensor(slots, dtype=torch.int64)] = torch.tensor(local, dtype=torch.int64)
        return slots

    def free_swa(self, slots: torch.Tensor) -> None:
        """Free the local slots of full slots ``slots`` ([n] int64) that still hold one (positions
        out of every window); the full slots stay allocated."""
        if slots.numel() == 0:
            return
        slots = slots.to(torch.int64).cpu()
        local = self.full_to_swa[slots]
        held = local[local > 0]
        if held.numel():
            self._swa_free.extend(held.tolist())
            self.full_to_swa[slots] = 0

    def adopt_swa(self, tree_slots: torch.Tensor, own_slots: torch.Tensor) -> None:
        """Move the local slots of ``own_slots`` to ``tree_slots`` (same positions, [n] int64 each)
        where the tree's slot has none: a request whose freshly computed prefix duplicates a cached
        one keeps the local K/V its window still needs when it switches to the cached slots."""
        if tree_slots.numel() == 0:
            return
        t, o = tree_slots.to(torch.int64).cpu(), own_slots.to(torch.int64).cpu()
        mt, mo = self.full_to_swa[t], self.full_to_swa[o]
        move = (mt == 0) & (mo > 0)
        if bool(move.any()):
            self.full_to_swa[t[move]] = mo[move]
            self.full_to_swa[o[move]] = 0

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages holding ``slots`` and the local slots they still hold (the pages first:
        a page already free raises before any local slot is freed)."""
        super().free(slots)
        self.free_swa(slots)

    def held_mask(self, slots: torch.Tensor) -> torch.Tensor:
        """[n] bool: which full slots ``slots`` ([n] int64) still hold local K/V."""
        return self.full_to_swa[slots.to(torch.int64).cpu()] > 0

    # ------------------------------------------------------------------ per step
    def begin_step(self, fb) -> None:
        """Translate the step's slots for the local layers: sets ``fb.swa`` (:class:`SWAView`)."""
        rows = torch.cat((fb.ext_req_pool_indices, fb.dec_req_pool_indices))  # [B'] int64
        width = int(fb.positions.max()) + 1 if fb.positions.numel() else 1
        dev = fb.req_to_token.device
        mapping = self.full_to_swa if dev.type == "cpu" else self.full_to_swa.to(dev)
        table = mapping[fb.req_to_token[rows.to(dev), :width].long()].to(torch.int32)  # [B', W]
        be = fb.ext_req_pool_indices.numel()
        idx = torch.arange(rows.numel(), dtype=torch.int64, device=fb.ext_req_pool_indices.device)
        fb.swa = SWAView(mapping[fb.out_cache_loc.to(dev)], table, idx[:be], idx[be:])

    # ------------------------------------------------------------------ checks
    def check_swa(self) -> None:
        """Assert local-slot accounting: every local slot is free or held by exactly one full slot,
        and only allocated full pages hold one."""
        held = self.full_to_swa[self.full_to_swa > 0]
        assert held.numel() == held.unique().numel(), "a local slot is held by two full slots"
        free = set(self._swa_free)
        assert len(free) == len(self._swa_free), "a local slot is free twice"
        assert not (free & set(held.tolist())), "a local slot is both free and held"
        total = len(free) + held.numel()
        assert total == self.swa_capacity, f"local slots lost: {total} accounted of {self.swa_capacity}"
        pages = torch.nonzero(self.full_to_swa).flatten() // self.page_size
        assert not (set(pages.tolist()) & self.free_page_set()), "a free full page holds a local slot"


def wants_hybrid(arch, kv_cache_dtype: str) -> bool:
    """Whether a model of ``arch`` gets a :class:`SWATokenToKVPool`: it has sliding-window layers
    (``arch.local_layers``, ``arch.sliding_window`` > 0) and a float KV cache."""
    return (int(getattr(arch, "sliding_window", 0) or 0) > 0 and any(getattr(arch, "local_layers", ()) or ())
            and kv_cache_dtype in ("auto", "bfloat16"))


def layer_bytes(arch, kv_cache_dtype: str, model_dtype: torch.dtype) -> tuple[int, int]:
    """(global layers', local layers') KV bytes per token of ``arch`` on a hybrid pool (K and V)."""
    db = torch.finfo(model_dtype if kv_cache_dtype == "auto" else torch.bfloat16).bits // 8
    n_local = sum(1 for x in arch.local_layers if x)
    return (kv_bytes_per_token("auto", arch.num_layers - n_local, arch.num_kv_heads, arch.head_dim, db),
            kv_bytes_per_token("auto", n_local, arch.num_kv_heads, arch.head_dim, db))


def make_pool(arch, kv_cache_dtype: str, budget_bytes: int, page_size: int, rows: int, context_length: int,
              model_dtype: torch.dtype, device, max_full: Optional[int] = None) -> SWATokenToKVPool:
    """The hybrid pool of ``arch`` (see :func:`wants_hybrid`) that ``budget_bytes`` of KV memory
    buys (:func:`split_budget`: the full pool sized from the global layers' bytes per token, the
    local slots from the window and ``rows``), in the model dtype (``auto``) or bfloat16."""
    dt = model_dtype if kv_cache_dtype == "auto" else torch.bfloat16
    gb, lb = layer_bytes(arch, kv_cache_dtype, model_dtype)
    full, local = split_budget(budget_bytes, gb, lb, arch.sliding_window, rows, context_length, page_size, max_full)
    return SWATokenToKVPool(full, local, page_size, tuple(arch.local_layers), arch.sliding_window,
                            arch.num_kv_heads, arch.head_dim, dt, device)


def describe(pool: SWATokenToKVPool) -> str:
    """One start-up log line: layers per slot space, both capacities with their bytes per token,
    the memory they take, and the full-pool tokens the same memory holds on full attention."""
    n_local = sum(pool.local_layers)
    total = pool.capacity * pool.global_bytes_per_token + pool.swa_capacity * pool.local_bytes_per_token
    as_full = total // pool.bytes_per_token
    return (f"sliding-window KV: full pool {pool.capacity} tokens ({len(pool.local_layers) - n_local} global layers, "
            f"{pool.global_bytes_per_token} bytes per token), local slots {pool.swa_capacity} ({n_local} layers, "
            f"window {pool.sliding_window}, {pool.local_bytes_per_token} bytes per token): {total / 2**20:.1f} MiB, "
            f"which holds {as_full} tokens with full attention on every layer ({pool.capacity / max(1, as_full):.1f}x)")


# ---------------------------------------------------------------------- the KV manager's window rules
def usable_prefix(pool: SWATokenToKVPool, slots: torch.Tensor, page_size: int, window: int) -> int:
    """Longest page-aligned ``m <= len(slots)`` whose positions ``[m - window + 1, m)`` still hold
    local K/V (what a first new token at ``m`` sees besides itself); 0 when none."""
    missing = torch.cumsum((~pool.held_mask(slots)).to(torch.int64), 0)  # [m]
    missing = torch.cat((torch.zeros(1, dtype=torch.int64), missing)).tolist()  # [m + 1]
    m = len(slots) - len(slots) % page_size
    while m > 0 and missing[m] - missing[max(0, m - window + 1)] > 0:
        m -= page_size
    return m


def free_out_of_window(pool: SWATokenToKVPool, table: torch.Tensor, kv, window: int) -> None:
    """At commit: free the local slots of the request's own positions (past its tree prefix) that
    no later token of it sees, ``< kv_len - window``. ``kv``: its KVState, ``table``: the slot table."""
    lo, hi = max(kv.swa_lo, kv.prefix_len), kv.kv_len - window
    if hi > lo:
        pool.free_swa(table[kv.row, lo:hi].long())
    kv.swa_lo = max(kv.swa_lo, hi)


def free_tree_tail(pool: SWATokenToKVPool, kv, window: int) -> None:
    """After the request put its own computed positions in the radix tree (chunked prefill): free
    their local slots below ``prefix_len - window`` (the window at the tree prefix's end stays for
    later matches) where the tree nodes are locked by this request alone (``lock_ref == 1``: no
    other running request's prefix, hence window, lies in them). Positions of the prefix it was
    admitted with (``match_len``) are left to the tree."""
    a, b = max(kv.swa_tree_lo, kv.match_len), kv.prefix_len - window
    if b <= a:
        return
    path, node = [], kv.last_node
    while node is not None and node.parent is not None:  # up to (not including) the root
        path.append(node)
        node = node.parent
    start = 0
    for node in reversed(path):  # positions [start, start + len) of the prefix
        end = start + len(node.value)
        lo, hi = max(a, start), min(b, end)
        if hi > lo and node.lock_ref == 1:
            pool.free_swa(node.value[lo - start:hi - start])
        start = end
        if start >= b:
            break
    kv.swa_tree_lo = b


def check_windows(pool: SWATokenToKVPool, table: torch.Tensor, running, window: int) -> None:
    """Assert local-slot accounting and that every running request still holds the local K/V of
    the positions its next token sees (``[kv_len - window + 1, kv_len)``)."""
    pool.check_swa()
    for r in running:
        kv = r.kv
        s = table[kv.row, max(0, kv.kv_len - window + 1):kv.kv_len].long()
        assert bool(pool.held_mask(s).all()), f"request {r.rid} lost local K/V inside its window"
