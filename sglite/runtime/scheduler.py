"""Scheduler: continuous batching over a radix-cached paged KV pool.

One :meth:`Scheduler.step` = schedule → forward → sample → process results. Every request in
``running`` holds a ``req_to_token`` row; each step it is extended by its pending tokens
(``seq[kv_len:]``): the whole prompt chunk by chunk (chunked prefill), one sampled token (decode),
or a jump-forward string. Pending runs of one token go through decode attention, longer ones
through extend attention, all in one mixed forward. When the pool cannot hold the next step, the
newest requests are retracted (KV left in the radix tree, request requeued) and later resumed with
identical greedy output. Source: SGLang paper §3 (RadixAttention, cache-aware scheduling).
"""
from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from ..config import EngineConfig
from .forward_batch import ForwardBatch
from .output import OutputProcessor
from .radix_cache import RadixCache
from .req import FinishReason, Req
from .sampler import Sampler
from .schedule_policy import order_waiting

log = logging.getLogger("sglite.scheduler")

SMALL_EXTEND = 8  # extends of at most this many tokens (jump-forward, cached prompts) run as decode rows
HOLD_BACK_TOKENS = 32  # defer a request sharing more than this many uncached tokens with a prefilling one


class Scheduler:
    """Owns the waiting/running queues, the KV pools' allocation and the radix cache."""

    def __init__(self, config: EngineConfig, runner, tokenizer):
        self.config = config
        self.runner = runner
        self.req_pool = runner.req_to_token_pool
        self.kv_pool = runner.token_to_kv_pool
        self.page_size = config.page_size
        self.cache = RadixCache(self.kv_pool, config.page_size, disabled=config.disable_radix_cache)
        self.sampler = Sampler(runner.vocab_size, tokenizer.eos_token_ids, runner.device)
        self.out = OutputProcessor(tokenizer, config.enable_jump_forward)
        self._decode_only_left = 0
        self._mask_executor: Optional[ThreadPoolExecutor] = None
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "retractions": 0,
                      "evicted_tokens": 0, "steps": 0, "finished_requests": 0, "aborted_requests": 0}

    # ------------------------------------------------------------------ queue API
    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, rid: str) -> int:
        """Finish request ``rid`` and its samples ``rid-<k>`` (waiting or running) with reason
        abort, freeing their KV now. Returns how many requests were aborted."""
        match = lambda r: r.rid == rid or r.rid.startswith(rid + "-")
        n = 0
        for queue_ in (self.waiting, self.running):
            for r in [r for r in queue_ if match(r)]:
                queue_.remove(r)
                self._finish(r, FinishReason("abort", message="aborted by client"))
                n += 1
        return n

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def available_tokens(self) -> int:
        """Free plus evictable KV tokens."""
        return self.kv_pool.free_tokens() + self.cache.evictable_size

    # ------------------------------------------------------------------ memory helpers
    def _ensure_free(self, need: int) -> bool:
        free = self.kv_pool.free_tokens()
        if free >= need:
            return True
        self.stats["evicted_tokens"] += self.cache.evict(need - free)
        return self.kv_pool.free_tokens() >= need

    def _alloc(self, req: Req, n: int) -> bool:
        last = int(self.req_pool.req_to_token[req.row, req.kv_len - 1]) if req.kv_len else None
        if not self._ensure_free(self.kv_pool.tokens_needed(req.kv_len, n)):
            return False
        slots = self.kv_pool.alloc_extend(last, req.kv_len, n)
        if slots is None:
            return False
        self.req_pool.req_to_token[req.row, req.kv_len:req.kv_len + n] = slots.to(torch.int32)
        req.alloc_len = req.kv_len + n
        return True

    def _release(self, req: Req) -> None:
        """Give a request's KV to the radix tree (or free it) and its row back to the pool."""
        if req.row is None:
            return
        slots = self.req_pool.req_to_token[req.row, :req.alloc_len].long()  # [alloc_len]
        aligned = req.kv_len - req.kv_len % self.page_size
        already = self.cache.insert(req.seq[:aligned], slots[:aligned])
        self.kv_pool.free(slots[req.prefix_len:already])
        # computed tokens past the last whole page, and slots allocated for this step but not
        # computed (retraction), lie in pages this request owns alone
        self.kv_pool.free(slots[max(aligned, already):])
        if req.last_node is not None:
            self.cache.dec_lock_ref(req.last_node)
        self.req_pool.free(req.row)
        req.row, req.last_node, req.kv_len, req.prefix_len, req.alloc_len = None, None, 0, 0, 0

    def _cache_unfinished(self, req: Req) -> None:
        """Insert a still-running request's computed tokens into the tree and lock them there.

        Requests arriving while this one runs (or its later prefill chunks) then reuse its
        prefix at once instead of after it finishes (SGLang's ``cache_unfinished_req``).
        """
        aligned = req.kv_len - req.kv_len % self.page_size
        if self.cache.disabled or aligned <= req.prefix_len:
            return
        table = self.req_pool.req_to_token
        slots = table[req.row, :aligned].long()  # [aligned]
        ids = req.tokens(0, aligned)
        already = self.cache.insert(ids, slots)
        self.kv_pool.free(slots[req.prefix_len:already])  # duplicates of what the tree had
        tree_slots, node = self.cache.match_prefix(ids)
        assert len(tree_slots) == aligned, "inserted prefix not found again"
        table[req.row, req.prefix_len:aligned] = tree_slots[req.prefix_len:].to(torch.int32)
        self.cache.inc_lock_ref(node)
        self.cache.dec_lock_ref(req.last_node)
        req.last_node, req.prefix_len = node, aligned

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finished = reason
        try:
            self._release(req)
        finally:
            self._count_and_emit(req, reason)

    def _count_and_emit(self, req: Req, reason: FinishReason) -> None:
        if reason.type == "abort":
            self.stats["aborted_requests"] += 1
        else:
            self.stats["finished_requests"] += 1
        self.out.emit_final(req)

    # ------------------------------------------------------------------ scheduling
    def _budget(self) -> int:
        c = self.config.chunk_size
        return min(c, self.config.max_prefill_tokens) if c else self.config.max_prefill_tokens

    def _retract_one(self, plan: list) -> bool:
        """Retract the running request with the fewest output tokens (newest); requeue it first."""
        cands = [r for r in self.running if not r.prefilling] or list(self.running)
        if len(self.running) <= 1:
            return False
        victim = min(cands, key=lambda r: (len(r.output_ids), -r.arrival))
        self.running.remove(victim)
        plan[:] = [(r, n) for r, n in plan if r is not victim]
        self._release(victim)
        victim.retracted += 1
        self.stats["retractions"] += 1
        self.waiting.appendleft(victim)
        return True

    def _plan_running(self, decode_only: bool = False) -> list[tuple[Req, int]]:
        plan, budget = [], self._budget()
        for r in list(self.running):
            if r not in self.running:  # retracted to make room for an earlier one
                continue
            if decode_only and r.prefilling:
                continue
            pending = r.seq_len - r.kv_len
            n = 1 if pending == 1 else min(pending, budget)
            if n == 0:
                continue
            if pending > 1:
                budget -= n
            while not self._alloc(r, n):
                if not self._retract_one(plan):
                    raise MemoryError("KV pool too small for a single request")  # guarded at admission
                if r not in self.running:
                    break
            else:
                plan.append((r, n))
        return plan

    def _prefix_cap(self, r: Req) -> int:
        cap = r.seq_len - 1
        if r.wants_input_logprobs():
            cap = min(cap, max(r.logprob_start_len - 1, 0))
        return cap

    def _shares_uncached_prefix(self, r: Req, m: int, prefilling: list) -> bool:
        """True when ``r`` shares more than ``HOLD_BACK_TOKENS`` beyond its cached ``m`` tokens with
        a request now prefilling: admitting it next step lets it reuse that prefix (SGLang's
        in-batch prefix caching)."""
        if self.cache.disabled or r.seq_len - m <= HOLD_BACK_TOKENS:
            return False
        head = r.tokens(m, m + HOLD_BACK_TOKENS + 1)
        for o in prefilling:
            if o.tokens(m, m + HOLD_BACK_TOKENS + 1) == head:
                return True
        return False

    def _admit(self, plan: list) -> None:
        budget = self._budget() - sum(n for r, n in plan if n > 1)
        order = order_waiting(self.config.schedule_policy, list(self.waiting), self.cache)
        prefilling = [r for r in self.running if r.prefilling]
        for r in order:
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if r.blocked_by is not None and r.blocked_by.finished is None:
                continue  # its shared prefix is being prefilled by another request
            prefix, node = self.cache.match_prefix(r.seq[:self._prefix_cap(r)])
            m = len(prefix)
            if self._shares_uncached_prefix(r, m, prefilling):
                continue
            n = min(r.seq_len - m, budget)
            reserve = (len(self.running) + 1) * self.page_size
            if self.kv_pool.tokens_needed(m, n) + reserve > self.kv_pool.free_tokens() + self.cache.evictable_size:
                break  # FIFO fairness: do not let later requests overtake
            row = self.req_pool.alloc()
            if row is None:
                break
            self.cache.inc_lock_ref(node)
            r.row, r.last_node, r.prefix_len, r.kv_len, r.alloc_len = row, node, m, m, m
            if m:
                self.req_pool.req_to_token[row, :m] = prefix.to(torch.int32)
            if not self._alloc(r, n):
                self.cache.dec_lock_ref(node)
                self.req_pool.free(row)
                r.row, r.last_node, r.prefix_len, r.kv_len = None, None, 0, 0
                break
            if not r.retracted:
                r.cached_tokens = m
                self.stats["prompt_tokens"] += len(r.input_ids)
                self.stats["cached_tokens"] += m
            self.waiting.remove(r)
            self.running.append(r)
            prefilling.append(r)
            plan.append((r, n))
            budget -= n

    # ------------------------------------------------------------------ one step
    def step(self) -> bool:
        """Run one scheduling step. Returns False when there was nothing to do."""
        if not self.has_work():
            return False
        # decode priority: after a step that carried a prefill chunk beside decoding requests, run
        # `decode_steps_per_chunk` decode-only steps, so a long prompt stalls each decoding
        # request for a fraction of the chunk time instead of the whole of it
        decode_only = self._decode_only_left > 0 and any(not r.prefilling for r in self.running)
        plan = self._plan_running(decode_only)
        if decode_only:
            self._decode_only_left -= 1
        else:
            self._decode_only_left = 0
            self._admit(plan)
        if not plan:
            return False
        had_chunk = any(r.prefilling for r, _ in plan)
        had_decode = any(not r.prefilling for r, _ in plan)
        if had_chunk and had_decode and self.config.chunk_size:
            self._decode_only_left = self.config.decode_steps_per_chunk
        self.stats["steps"] += 1
        plan.sort(key=lambda e: e[1] <= SMALL_EXTEND)  # extend entries first, then decode rows
        fb, rows = self._build_batch(plan)
        samples = [(r, srow) for (r, _), (srow, _) in zip(plan, rows) if srow is not None]
        sample_reqs = [r for r, _ in samples]
        mask = None
        if any(r.grammar is not None and not r.grammar.mask_is_cached() for r in sample_reqs):
            # a mask needs a vocabulary walk (ms): overlap it with the forward (it depends only on
            # tokens already accepted; the forward's ops release the GIL, the walk runs on the
            # spare core). Cached masks are filled after the forward instead: with all masks warm,
            # the hand-off cost more than it hid (JSON batch of 16: 21.1-21.8 vs 20.3-20.6 s)
            mask = self._mask_pool().submit(self.sampler.grammar_bitmask, sample_reqs)
        try:
            logits = self.runner.forward(fb)  # [M, V]
        finally:
            bitmask = mask.result() if mask is not None else None
        self._process(plan, rows, logits, samples, bitmask)
        return True

    def _mask_pool(self) -> ThreadPoolExecutor:
        if self._mask_executor is None:
            self._mask_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglite-grammar-mask")
        return self._mask_executor

    def close(self) -> None:
        """Stop the grammar-mask thread (the engine calls this when its loop ends)."""
        if self._mask_executor is not None:
            self._mask_executor.shutdown(wait=True)
            self._mask_executor = None

    def _build_batch(self, plan):
        ids, pos, locs, logit_idx = [], [], [], []
        ext_rows, ext_pre, ext_len, dec_rows, dec_lens = [], [], [], [], []
        rows = []  # per plan entry: (sample_row or None, [(input position, logits row)] for input logprobs)
        table = self.req_pool.req_to_token
        offset = 0
        for r, n in plan:
            start = r.kv_len
            ids.extend(r.tokens(start, start + n))
            pos.extend(range(start, start + n))
            locs.append(table[r.row, start:start + n])
            if n > SMALL_EXTEND:
                ext_rows.append(r.row); ext_pre.append(start); ext_len.append(n)
            else:  # one decode-attention row per token, each seeing the tokens up to itself
                dec_rows.extend([r.row] * n); dec_lens.extend(range(start + 1, start + n + 1))
            in_rows = []
            if r.wants_input_logprobs():
                lo = max(start, r.logprob_start_len - 1, 0)
                hi = min(start + n, len(r.input_ids) - 1)
                for p in range(lo, hi):
                    in_rows.append((p + 1, len(logit_idx)))
                    logit_idx.append(offset + p - start)
            sample_row = None
            if start + n == r.seq_len and r.params.max_new_tokens > 0 and not r.finished:
                sample_row = len(logit_idx)
                logit_idx.append(offset + n - 1)
            rows.append((sample_row, in_rows))
            offset += n
        t = lambda x: torch.tensor(x, dtype=torch.int64)
        fb = ForwardBatch(
            input_ids=t(ids), positions=t(pos), out_cache_loc=torch.cat(locs).long(), req_to_token=table,
            ext_req_pool_indices=t(ext_rows), ext_prefix_lens=t(ext_pre), ext_extend_lens=t(ext_len),
            dec_req_pool_indices=t(dec_rows), dec_seq_lens=t(dec_lens), logits_indices=t(logit_idx))
        return fb, rows

    def _process(self, plan, rows, logits: torch.Tensor, samples: list, bitmask: Optional[torch.Tensor] = None) -> None:
        """Advance the plan's requests past this step; ``samples`` = [(req, logits row)] of the
        requests that sample a token (in plan order), ``bitmask`` their grammar masks if computed."""
        for (r, n), (_, in_rows) in zip(plan, rows):
            r.kv_len += n
            if n > 1:
                self._cache_unfinished(r)
            if in_rows or (r.wants_input_logprobs() and r.logprob_start_len == 0):
                self.out.record_input_logprobs(r, logits, in_rows)
        sample_reqs = [r for r, _ in samples]
        sample_rows = [row for _, row in samples]
        if sample_reqs:
            sl = logits[torch.tensor(sample_rows)]  # [B, V]
            res = self.sampler.sample(sl, sample_reqs, bitmask)
            for i, (r, tok) in enumerate(zip(sample_reqs, res.next_ids)):
                self.stats["generated_tokens"] += 1
                reason = self.out.append_token(r, tok, res.logprobs[i] if res.logprobs is not None and r.return_logprob else None)
                if reason is not None:
                    self.running.remove(r)
                    self._finish(r, reason)
        for r, n in plan:  # prefill-only requests (max_new_tokens == 0)
            if r.finished is None and r.params.max_new_tokens == 0 and not r.prefilling:
                self.running.remove(r)
                self._finish(r, FinishReason("length", length=0))

    # ------------------------------------------------------------------ maintenance
    def flush_cache(self) -> bool:
        """Drop the radix tree. Refused (False) while requests run or wait."""
        if self.has_work():
            return False
        self.cache.flush()
        return True

    def check_invariants(self) -> None:
        """Assert pool + tree consistency: every page is free, in the tree, or owned by exactly one
        running request; counters match; locked paths cover running requests' prefixes."""
        self.cache.check_invariants()
        ps = self.page_size
        free = self.kv_pool.free_page_set()
        assert len(free) == len(self.kv_pool._free_pages), "a page is free twice"
        tree_pages = {s // ps for s in self.cache.tree_slots()}
        assert not (tree_pages & free), "a page is both free and in the tree"
        owned = set()
        for r in self.running:
            assert r.row is not None, "running request without a row"
            s = r.slots(self.req_pool.req_to_token)[r.prefix_len:].tolist()
            pages = {x // ps for x in s}
            assert not (pages & free), f"request {r.rid} reads a free page"
            assert not (pages & tree_pages), f"request {r.rid} owns a tree page"
            assert not (pages & owned), f"request {r.rid} shares a page with another request"
            owned |= pages
        total = len(free) + len(tree_pages) + len(owned)
        assert total == self.kv_pool.num_pages, f"pages lost: {total} accounted of {self.kv_pool.num_pages}"
