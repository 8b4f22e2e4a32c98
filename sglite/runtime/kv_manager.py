"""KVManager: every transition of a request's KV state, over the slot table, the page pool and the
radix tree (SGLang paper §3, RadixAttention).

A request's KV state is one record, :class:`KVState` (``req.kv``): ``kv_len`` tokens of its
sequence have K/V in the pool at ``req_to_token[row, :kv_len]``; the first ``prefix_len`` of them
belong to the radix tree (locked at ``last_node``), the rest to the request; ``alloc_len`` slots
are reserved (``alloc_len - kv_len`` of them for the step being run). Only this class writes it:

    admit(req, n)          waiting -> running: take a row, reuse the cached prefix, reserve n slots
    extend(req, n)         reserve n more slots for the next step (evicting cached KV if needed)
    commit(req, n)         after the forward: n reserved slots now hold K/V (cache_unfinished if n > 1)
    reserve_more(req, n)   reserve n more slots past alloc_len (speculative drafts), free pages only
    trim(req)              free the reserved slots past kv_len (rejected drafts)
    release(req)           finished / aborted / retracted: KV to the tree (whole pages) or freed,
                           row returned, state reset in one assignment
    cache_unfinished(req)  insert a running request's computed prefix into the tree and lock it
    check_invariants(reqs) every page free, in the tree, or owned by exactly one running request

Prefix transfer (prefill/decode disaggregation, through ``Engine.export_prefix/import_prefix``):
:meth:`KVManager.read_prefix` copies a cached prefix's K/V out, :meth:`KVManager.write_prefix`
writes received K/V into free pages and inserts them into the tree.

Speculative decoding borrows whole rows of the slot table for a step (token-tree chains, the
start-up cost probe) and moves slots inside a request's row; those writes live here too, so every
write to the slot table is in this file:

    borrow_rows(n)         up to n free rows, lent until return_rows (scratch rows of a token tree)
    return_rows(rows)      give borrowed rows back (None: every row still borrowed)
    fill_scratch_row(...)  a scratch row = a request's slots up to a position, then a span of them
    reorder_slots(...)     permute a span of a request's row (the accepted tree chain first)
    write_slots(row, ...)  set a span of a row (a draft model's own table, ``STANDALONE``)
    probe_row(n)           a row over free slots past page 0 for a timing forward, zeroed after
    check_rows(reqs)       every row free, held by a running request, or borrowed (none between steps)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

from . import swa_pool
from .kv_pool import ReqToTokenPool, TokenToKVPool
from .radix_cache import RadixCache


@dataclass
class KVState:
    """KV bookkeeping of one request (see the module docstring). ``row`` is None when not running."""

    row: Optional[int] = None
    kv_len: int = 0
    alloc_len: int = 0
    prefix_len: int = 0
    last_node: Any = None
    swa_lo: int = 0  # sliding-window pool (swa_pool): own positions below this had local slots freed
    swa_tree_lo: int = 0  # ... and tree positions below this were considered (free_tree_tail)
    match_len: int = 0  # the prefix it was admitted with (sliding-window pool: left to the tree)


class KVManager:
    """Owns the slot table, the page pool and the radix cache of one scheduler.

    Args:
        req_pool: rows of the slot table (``req_to_token`` [R, Lmax] int32).
        kv_pool: the page allocator and K/V buffers.
        page_size: tokens per page (the tree stores whole pages only).
        disable_radix_cache: make the tree a pass-through (no reuse).
    """

    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool, page_size: int,
                 disable_radix_cache: bool = False):
        self.req_pool, self.kv_pool, self.page_size = req_pool, kv_pool, page_size
        self.cache = RadixCache(kv_pool, page_size, disabled=disable_radix_cache)
        self.evicted_tokens = 0
        # sliding-window pool (swa_pool): out-of-window local slots freed at commit; 0: none
        self.window = int(getattr(kv_pool, "sliding_window", 0) or 0)
        self._borrowed: list[int] = []  # scratch rows lent to the step in flight (borrow_rows)

    @property
    def req_to_token(self) -> torch.Tensor:
        """[R, Lmax] int32 slot table (shared)."""
        return self.req_pool.req_to_token

    # ------------------------------------------------------------------ capacity
    def free_tokens(self) -> int:
        return self.kv_pool.free_tokens()

    def available_tokens(self) -> int:
        """Free plus evictable KV tokens."""
        return self.kv_pool.free_tokens() + self.cache.evictable_size

    def match_prefix(self, ids: list[int], ns=None) -> tuple[torch.Tensor, Any]:
        """Longest cached prefix of ``ids`` in radix namespace ``ns`` (a request's ``cache_ns``):
        ([m] int64 slots, tree node). Nothing is locked.

        With a sliding-window pool the match is cut back to the longest whole-page length ``m'``
        whose last ``window - 1`` positions still hold local K/V (what the first new token, at
        ``m'``, sees besides itself); the node stays the full match's (locking it locks the shorter
        prefix too)."""
        slots, node = self.cache.match_prefix(ids, ns)
        if self.window and len(slots):
            slots = slots[:swa_pool.usable_prefix(self.kv_pool, slots, self.page_size, self.window)]
        return slots, node

    def can_admit(self, cached: int, n: int, running: int) -> bool:
        """Whether a request with ``cached`` tokens in the tree can take ``n`` new ones now, keeping
        one page of headroom per running request (``running`` includes the new one)."""
        need = self.kv_pool.tokens_needed(cached, n) + running * self.page_size
        return need <= self.available_tokens()

    def _ensure_free(self, need: int) -> bool:
        free = self.kv_pool.free_tokens()
        if free >= need:
            return True
        self.evicted_tokens += self.cache.evict(need - free)
        while self.window and self.kv_pool.free_tokens() < need and self.cache.evictable_size > 0:
            # local slots short: evicted tree entries may hold none (freed out of their window)
            self.evicted_tokens += self.cache.evict(need - self.kv_pool.free_tokens())
        return self.kv_pool.free_tokens() >= need

    # ------------------------------------------------------------------ transitions
    def admit(self, req, prefix: torch.Tensor, node: Any, n: int) -> bool:
        """Give ``req`` a row holding its cached ``prefix`` (slots from :meth:`match_prefix`, locked
        at ``node``) and reserve ``n`` more slots. Returns False with nothing changed when no row or
        not enough KV is left."""
        row = self.req_pool.alloc()
        if row is None:
            return False
        m = len(prefix)
        self.cache.inc_lock_ref(node)
        if m:
            self.req_pool.req_to_token[row, :m] = prefix.to(torch.int32)
        req.kv = KVState(row=row, kv_len=m, alloc_len=m, prefix_len=m, last_node=node, match_len=m)
        if not self.extend(req, n):
            self.cache.dec_lock_ref(node)
            self.req_pool.free(row)
            req.kv = KVState()
            return False
        return True

    def extend(self, req, n: int) -> bool:
        """Reserve slots for ``n`` tokens past ``req.kv.kv_len`` (evicting unlocked tree KV when the
        pool is short). Returns False with nothing reserved when it cannot."""
        kv = req.kv
        # the last token's slot matters only when its page has room left (never with page_size 1)
        last = int(self.req_pool.req_to_token[kv.row, kv.kv_len - 1]) if kv.kv_len % self.kv_pool.page_size else None
        if not self._ensure_free(self.kv_pool.tokens_needed(kv.kv_len, n)):
            return False
        slots = self.kv_pool.alloc_extend(last, kv.kv_len, n)
        if slots is None:
            return False
        self.req_pool.req_to_token[kv.row, kv.kv_len:kv.kv_len + n] = slots  # int64 -> int32 in the copy
        kv.alloc_len = kv.kv_len + n
        return True

    def extend_all(self, wanted: list) -> bool:
        """Reserve slots for every ``(req, n)`` of ``wanted`` at once, as :meth:`extend` in that
        order would (same slots), with one slot-table read and one write instead of a few torch
        calls per request. Only when it is the same as that loop without its slow case: enough
        free pages for all (no eviction). Returns False with nothing reserved otherwise (the caller
        then extends request by request)."""
        if not wanted:
            return False
        ps, table = self.page_size, self.req_pool.req_to_token
        width = table.shape[1]
        # the slot of each last token whose page has room, read in one gather (none at pages of 1)
        part = [kv.row * width + kv.kv_len - 1 for kv in (r.kv for r, _ in wanted) if kv.kv_len % ps]
        lasts = iter(table.view(-1)[torch.tensor(part, dtype=torch.int64, device=table.device)].tolist()
                     if part else ())
        slots = self.kv_pool.alloc_extend_many([(next(lasts) if r.kv.kv_len % ps else None, r.kv.kv_len, n)
                                                for r, n in wanted])
        if slots is None:
            return False
        flat: list[int] = []
        for req, n in wanted:
            kv = req.kv
            base = kv.row * width + kv.kv_len
            flat.extend(range(base, base + n))
            kv.alloc_len = kv.kv_len + n
        idx = torch.tensor(flat, dtype=torch.int64, device=table.device)
        table.view(-1)[idx] = torch.tensor(slots, dtype=table.dtype, device=table.device)
        return True

    def commit(self, req, n: int, share: bool = True) -> None:
        """The step computed K/V of ``n`` reserved tokens; a multi-token extend (prefill chunk) is
        then shared through the tree at once (:meth:`cache_unfinished`) unless ``share`` is False
        (speculative verify steps: accepted tokens enter the tree when the request ends)."""
        kv = req.kv
        assert kv.kv_len + n <= kv.alloc_len, f"request {req.rid}: commit past its reserved slots"
        kv.kv_len += n
        if self.window:
            swa_pool.free_out_of_window(self.kv_pool, self.req_pool.req_to_token, kv, self.window)
        if n > 1 and share:
            self.cache_unfinished(req)

    def reserve_more(self, req, n: int) -> bool:
        """Reserve ``n`` slots past ``req.kv.alloc_len`` (speculative draft tokens) from free pages
        only (nothing cached is evicted for a guess). Returns False with nothing reserved when the
        pool is short."""
        kv = req.kv
        if n <= 0:
            return n == 0
        if kv.alloc_len + n > self.req_pool.max_context:
            return False
        if self.kv_pool.free_tokens() < self.kv_pool.tokens_needed(kv.alloc_len, n):
            return False
        last = int(self.req_pool.req_to_token[kv.row, kv.alloc_len - 1]) if kv.alloc_len else None
        slots = self.kv_pool.alloc_extend(last, kv.alloc_len, n)
        if slots is None:
            return False
        self.req_pool.req_to_token[kv.row, kv.alloc_len:kv.alloc_len + n] = slots.to(torch.int32)
        kv.alloc_len += n
        return True

    def trim(self, req) -> None:
        """Give back the slots reserved past ``req.kv.kv_len`` (rejected draft tokens) at once:
        whole pages to the pool (a partly used last page stays with the request and is refilled by
        the next :meth:`extend`). The tree never sees them."""
        kv = req.kv
        keep = -(-kv.kv_len // self.page_size) * self.page_size
        if kv.alloc_len > keep:
            self.kv_pool.free(self.req_pool.req_to_token[kv.row, keep:kv.alloc_len].long())
        kv.alloc_len = kv.kv_len

    def release(self, req) -> None:
        """Give a request's computed whole pages to the radix tree (or free them), free the rest
        (partial last page, slots reserved but not computed), return its row; state reset."""
        kv = req.kv
        if kv.row is None:
            return
        slots = self.req_pool.req_to_token[kv.row, :kv.alloc_len].long()  # [alloc_len]
        aligned = kv.kv_len - kv.kv_len % self.page_size
        already = self.cache.insert(req.tokens(0, aligned), slots[:aligned], getattr(req, "cache_ns", None))
        self.kv_pool.free(slots[kv.prefix_len:already])  # duplicates of what the tree had
        self.kv_pool.free(slots[max(aligned, already):])  # pages this request owns alone
        if kv.last_node is not None:
            self.cache.dec_lock_ref(kv.last_node)
        self.req_pool.free(kv.row)
        req.kv = KVState()

    def cache_unfinished(self, req) -> None:
        """Insert a running request's computed whole pages into the tree and lock them there, so
        requests arriving meanwhile (or its later chunks) reuse them (SGLang's
        ``cache_unfinished_req``)."""
        kv = req.kv
        aligned = kv.kv_len - kv.kv_len % self.page_size
        if self.cache.disabled or aligned <= kv.prefix_len:
            return
        table = self.req_pool.req_to_token
        slots = table[kv.row, :aligned].long()  # [aligned]
        ids = req.tokens(0, aligned)
        already = self.cache.insert(ids, slots, getattr(req, "cache_ns", None))
        tree_slots, node = self.cache.match_prefix(ids, getattr(req, "cache_ns", None))
        assert len(tree_slots) == aligned, "inserted prefix not found again"
        if self.window:  # the tree's copies may have freed the local K/V this request's window needs
            self.kv_pool.adopt_swa(tree_slots[kv.prefix_len:already], slots[kv.prefix_len:already])
        self.kv_pool.free(slots[kv.prefix_len:already])  # duplicates of what the tree had
        table[kv.row, kv.prefix_len:aligned] = tree_slots[kv.prefix_len:].to(torch.int32)
        self.cache.inc_lock_ref(node)
        self.cache.dec_lock_ref(kv.last_node)
        kv.last_node, kv.prefix_len = node, aligned
        if self.window:
            swa_pool.free_tree_tail(self.kv_pool, kv, self.window)

    # ------------------------------------------------------------------ prefix transfer (P/D)
    def kv_layout(self) -> tuple[torch.dtype, tuple[int, int, int]]:
        """(dtype, (layers L, KV heads Hkv, head dim D)) of the pool's K/V buffers (fixed at start).
        Raises ValueError when the pool holds no plain K/V tensors in this process (a quantized
        pool; a tensor-parallel allocator)."""
        kb = self.kv_pool.k_buffers
        if self.window:
            raise ValueError("prefix export/import is not supported with a sliding-window KV pool")
        if not kb or not isinstance(kb[0], torch.Tensor):
            raise ValueError("prefix export/import needs this process's K/V in the model dtype "
                             "(kv_cache_dtype auto or bfloat16, tp_size 1)")
        return kb[0].dtype, (len(kb), int(kb[0].shape[1]), int(kb[0].shape[2]))

    def read_prefix(self, ids: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The cached prefix of ``ids`` and its K/V copied to the CPU: (ids [n], K [L, n, Hkv, D],
        V [L, n, Hkv, D]) in the pool dtype (``n``: whole pages). Nothing is locked or changed.
        Raises ValueError as :meth:`kv_layout`."""
        self.kv_layout()
        slots, _ = self.match_prefix(ids)
        pool = self.kv_pool
        k = torch.stack([b[slots.to(b.device)] for b in pool.k_buffers]).cpu()
        v = torch.stack([b[slots.to(b.device)] for b in pool.v_buffers]).cpu()
        return list(ids[:len(slots)]), k, v

    def write_prefix(self, ids: list[int], k: torch.Tensor, v: torch.Tensor) -> int:
        """Write ``ids``' K/V (``[L, n, Hkv, D]``, any float dtype, cast to the pool's) into free
        slots and insert the whole pages into the radix tree (evicting unlocked entries when the
        pool is short); the part already cached is kept, not rewritten. Returns the tokens of
        ``ids`` the tree holds afterwards: 0 when the cache is disabled or ``ids`` is shorter than a
        page, the cached part when the pool cannot take the rest. Raises ValueError when ``k`` /
        ``v`` are not ``[L, len(ids), Hkv, D]`` of this pool (or as :meth:`kv_layout`)."""
        _, (L, H, D) = self.kv_layout()
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != (L, len(ids), H, D):
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {(L, len(ids), H, D)} "
                                 "[layers, tokens, KV heads, head dim] of this pool")
        pool, cache, ps = self.kv_pool, self.cache, self.page_size
        n = len(ids) - len(ids) % ps
        if n == 0 or cache.disabled:
            return 0
        prefix, node = self.match_prefix(ids[:n])
        m = len(prefix)
        if m >= n:
            return m
        cache.inc_lock_ref(node)  # keep the matched part while evicting for the rest
        try:
            need = pool.tokens_needed(m, n - m)
            if pool.free_tokens() < need:
                self.evicted_tokens += cache.evict(need - pool.free_tokens())
            slots = pool.alloc_extend(int(prefix[-1]) if m else None, m, n - m)
        finally:
            cache.dec_lock_ref(node)
        if slots is None:
            return m
        dev = pool.k_buffers[0].device
        for layer, (kb, vb) in enumerate(zip(pool.k_buffers, pool.v_buffers)):
            kb[slots.to(dev)] = k[layer, m:n].to(dev, kb.dtype)
            vb[slots.to(dev)] = v[layer, m:n].to(dev, vb.dtype)
        dup = cache.insert(list(ids[:n]), torch.cat([prefix, slots]))
        assert dup == m, "radix cache changed during import"
        return n

    # ------------------------------------------------------------------ maintenance
    def flush(self) -> None:
        """Drop the radix tree (callers make sure nothing runs)."""
        self.cache.flush()

    def check_invariants(self, running: Iterable) -> None:
        """Assert pool + tree consistency: every page is free, in the tree, or owned by exactly one
        running request; counters match; running requests hold rows and read no free page."""
        self.cache.check_invariants()
        ps = self.page_size
        free = self.kv_pool.free_page_set()
        assert len(free) == self.kv_pool.num_free_pages(), "a page is free twice"
        tree_pages = {s // ps for s in self.cache.tree_slots()}
        assert not (tree_pages & free), "a page is both free and in the tree"
        owned: set = set()
        for r in running:
            kv = r.kv
            assert kv.row is not None, f"running request {r.rid} without a row"
            assert kv.prefix_len <= kv.kv_len <= kv.alloc_len, f"request {r.rid}: inconsistent KV lengths"
            s = self.req_pool.req_to_token[kv.row, kv.prefix_len:kv.kv_len].tolist()
            pages = {x // ps for x in s}
            assert not (pages & free), f"request {r.rid} reads a free page"
            assert not (pages & tree_pages), f"request {r.rid} owns a tree page"
            assert not (pages & owned), f"request {r.rid} shares a page with another request"
            owned |= pages
        total = len(free) + len(tree_pages) + len(owned)
        assert total == self.kv_pool.num_pages, f"pages lost: {total} accounted of {self.kv_pool.num_pages}"
        if self.window:
            swa_pool.check_windows(self.kv_pool, self.req_pool.req_to_token, running, self.window)

    # ------------------------------------------------------------------ scratch rows (speculative decoding)
    @property
    def borrowed_rows(self) -> list[int]:
        """Rows lent by :meth:`borrow_rows` and not yet returned (a copy)."""
        return list(self._borrowed)

    def borrow_rows(self, n: int) -> list[int]:
        """Up to ``n`` free slot-table rows (fewer when the table is short), lent until
        :meth:`return_rows` gives them back; :meth:`check_rows` fails while any is out."""
        out = []
        while len(out) < n:
            row = self.req_pool.alloc()
            if row is None:
                break
            out.append(row)
        self._borrowed.extend(out)
        return out

    def return_rows(self, rows: Optional[Sequence[int]] = None) -> None:
        """Give back borrowed rows: ``rows`` (rows not borrowed are ignored), or (None) every row
        still borrowed (a step that raised between drafting and verification left them)."""
        rows = list(self._borrowed) if rows is None else rows
        for row in rows:
            if row in self._borrowed:
                self._borrowed.remove(row)
                self.req_pool.free(row)

    def fill_scratch_row(self, dst: int, src: int, prefix: int, start: int, n: int) -> None:
        """Write scratch row ``dst``: row ``src``'s first ``prefix`` slots, then its ``n`` slots
        from position ``start`` (a token-tree chain's slots, after the root at ``prefix - 1``)."""
        table = self.req_pool.req_to_token
        table[dst, :prefix] = table[src, :prefix]
        table[dst, prefix:prefix + n] = table[src, start:start + n]

    def reorder_slots(self, row: int, start: int, order: Sequence[int]) -> None:
        """Permute the ``len(order)`` slots of ``row`` from ``start``: slot ``i`` of the span
        becomes the old slot ``order[i]`` (the accepted tree chain's slots moved first)."""
        table = self.req_pool.req_to_token
        n = len(order)
        seg = table[row, start:start + n].clone()
        table[row, start:start + n] = seg[torch.tensor(order)]

    def write_slots(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Set ``row``'s slots from ``start`` to ``slots`` ([n] int64, stored as int32)."""
        self.req_pool.req_to_token[row, start:start + len(slots)] = slots.to(torch.int32)

    @contextlib.contextmanager
    def probe_row(self, n: int) -> Iterator[Optional[int]]:
        """A row whose first ``n`` positions hold slots ``page_size .. page_size + n - 1`` (free
        pool slots while nothing runs: page 0 is padding; position p on slot p + page_size keeps
        each position at its offset in its page, as an int8 / int4 pool's key groups need), for a
        timing forward at start-up; zeroed and freed on exit. Yields None when no row is free."""
        row = self.req_pool.alloc()
        if row is None:
            yield None
            return
        table = self.req_pool.req_to_token
        try:
            table[row, :n] = torch.arange(self.page_size, self.page_size + n, dtype=table.dtype)
            yield row
        finally:
            table[row].zero_()
            self.req_pool.free(row)

    def check_rows(self, running: Iterable) -> None:
        """Assert the slot-table rows are accounted for: free, held by a running request, or
        borrowed by the step in flight (none between steps)."""
        pool = self.req_pool
        held = {r.kv.row for r in running if r.kv is not None and r.kv.row is not None}
        assert not self._borrowed, f"scratch rows {self._borrowed} still borrowed between steps"
        assert len(held) + pool.available() == pool.req_to_token.shape[0], (
            f"slot-table rows lost: {len(held)} held + {pool.available()} free of {pool.req_to_token.shape[0]}")
