"""Scheduler: continuous batching over a radix-cached paged KV pool.

One :meth:`Scheduler.step` = schedule → build → (grammar masks) → forward → sample → process.
Every request in ``running`` holds a slot-table row (its :class:`~.kv_manager.KVState`, owned by
the :class:`~.kv_manager.KVManager`); each step extends it by its pending tokens
(``seq[kv_len:]``): the whole prompt chunk by chunk (chunked prefill), one sampled token (decode),
or a jump-forward string, as one :class:`~.step_plan.StepEntry` of the step's
:class:`~.step_plan.StepPlan`. Pending runs of a few tokens go through decode attention, longer
ones through extend attention, all in one mixed forward (with ``enable_deterministic_inference``
every token is a decode row). When the pool cannot hold the next step, the newest requests are
retracted (KV left in the radix tree, request requeued) and later resumed with identical greedy
output. Source: SGLang paper §3 (RadixAttention, cache-aware scheduling).
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Optional

import torch

from ..config import EngineConfig
from ..errors import CapacityError
from .engine_protocol import matches_rid
from .forward_batch import ForwardBatch
from .grammar_masks import MaskOverlap
from .kv_manager import KVManager
from .output import OutputProcessor
from .profiler import phase
from .req import FinishReason, Req
from .runner_protocol import RunnerProtocol
from .sampler import SampleOutput, Sampler, select_rows
from .schedule_policy import order_waiting
from .speculative.decoder import make_spec_decoder
from .step_log import StepLogger
from .step_plan import SMALL_EXTEND, StepEntry, StepPlan

log = logging.getLogger("sglite.scheduler")

HOLD_BACK_TOKENS = 32  # defer a request sharing more than this many uncached tokens with a prefilling one


class Scheduler:
    """Owns the waiting/running queues and the step loop; KV state lives in ``self.kv``.

    Args:
        config: engine options (chunking, admission limits, policy, page size, determinism).
        runner: a :class:`~sglite.runtime.runner_protocol.RunnerProtocol` (pools, ``vocab_size``,
            ``device``, ``forward(ForwardBatch) -> [M, V] float32 logits``, ``close``; a fake one in
            unit tests).
        tokenizer: EOS ids, ``id_to_text``, ``encode`` (jump-forward).
    """

    def __init__(self, config: EngineConfig, runner: RunnerProtocol, tokenizer):
        self.config = config
        self.runner = runner
        self.kv = KVManager(runner.req_to_token_pool, runner.token_to_kv_pool, config.page_size,
                            disable_radix_cache=config.disable_radix_cache)
        self.sampler = Sampler(runner.vocab_size, tokenizer.eos_token_ids, runner.device)
        self.out = OutputProcessor(tokenizer, config.enable_jump_forward, config.stream_interval)
        self.masks = MaskOverlap(self.sampler)
        self.spec = make_spec_decoder(config, runner, self.kv, self.sampler, self.out)  # None: off
        self.small_extend = None if config.enable_deterministic_inference else SMALL_EXTEND
        self.step_log = StepLogger(config.decode_log_interval)
        self._decode_only_left = 0
        self._bursting = False  # burst admission (see _note_burst)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.counters = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "retractions": 0,
                         "steps": 0, "finished_requests": 0, "aborted_requests": 0}

    @property
    def stats(self) -> dict:
        """Counters since start (tokens, steps, requests, retractions, evicted tokens)."""
        return {**self.counters, "evicted_tokens": self.kv.evicted_tokens, **(self.spec.stats if self.spec else {})}

    # ------------------------------------------------------------------ queue API
    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, rid: str) -> int:
        """Finish request ``rid`` and its samples ``rid-<k>`` (waiting or running) with reason
        abort, freeing their KV now. Returns how many requests were aborted."""
        n = 0
        for queue_ in (self.waiting, self.running):
            for r in [r for r in queue_ if matches_rid(r.rid, rid)]:
                queue_.remove(r)
                self._finish(r, FinishReason("abort", message="aborted by client"))
                n += 1
        return n

    def abort_all(self, message: str, running_only: bool = False) -> None:
        """Finish every running (and, unless ``running_only``, waiting) request with reason abort,
        freeing its KV; never raises (the engine calls it to recover from a failed step)."""
        queues = (self.running,) if running_only else (self.waiting, self.running)
        if self.spec is not None:
            self.spec.release_scratch()  # token-tree rows a failed step left borrowed
        for queue_ in queues:
            for r in list(queue_):
                try:
                    queue_.remove(r)
                    self._finish(r, FinishReason("abort", message=message))
                except Exception:  # never let recovery kill the loop
                    log.exception("could not finish request %s cleanly", r.rid)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _end(self, req: Req, reason: FinishReason) -> None:
        self.running.remove(req)
        self._finish(req, reason)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finished = reason
        try:
            self.kv.release(req)
        finally:
            self.counters["aborted_requests" if reason.type == "abort" else "finished_requests"] += 1
            self.out.emit_final(req)

    # ------------------------------------------------------------------ one step
    def step(self) -> bool:
        """Run one scheduling step. Returns False when there was nothing to do."""
        with phase("step"):  # profiler ranges (sglite.runtime.profiler; no-ops unless profiling)
            with phase("schedule"):
                plan = self.schedule()
            if plan is None:
                return False
            with phase("build_batch"):
                batch = ForwardBatch.from_plan(plan, self.kv.req_to_token)
            masks = self.masks.start(plan.sampling_reqs)  # on a second thread when a vocabulary walk is needed
            try:
                with phase("forward"):
                    logits = self.runner.forward(batch)  # [M, V] float32
            finally:
                bitmask = masks()
            with phase("sample"):
                sampled = self.sample(plan, logits, bitmask)
            with phase("process"):
                self.process(plan, logits, sampled)
        return True

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> Optional[StepPlan]:
        """The next step's plan (KV reserved for every entry), or None when nothing can run.

        Decode priority: after a step whose prefill tokens filled the budget (a long prompt's chunk)
        beside decoding requests, the next ``decode_steps_per_chunk`` steps are decode-only, so a
        long prompt stalls each decoding request for a fraction of the chunk time instead of the
        whole of it; steps that admit only short prompts never hold the next arrivals back.
        Beside decoding requests a step admits the first waiting prompt and further ones only
        within ``max_mixed_prefill_tokens`` (see :meth:`_admit`): arrivals get short steps of
        their own instead of sharing one long step. Neither applies during a burst (from a step
        at which more requests wait than decode until the queue is empty, :meth:`_note_burst`):
        a burst is admitted as fast as the prefill budget allows.
        """
        if not self.has_work():
            return None
        decoding = sum(1 for r in self.running if not r.prefilling)
        self._note_burst(decoding)
        decode_only = self._decode_only_left > 0 and decoding > 0 and not self._bursting
        entries = self._plan_running(decode_only)
        if decode_only:
            self._decode_only_left -= 1
        else:
            self._decode_only_left = 0
            self._admit(entries)
        if self.spec is not None:
            self.spec.attach_drafts(entries)  # speculative drafts of decoding requests (KV reserved)
        if not entries:
            return None
        plan = StepPlan(entries, decode_only).layout(self.small_extend)
        if not self.waiting:
            self._bursting = False
        if plan.has_chunk and plan.has_decode and self.config.chunk_size and self._fills_budget(entries) \
                and not self._bursting:
            self._decode_only_left = self.config.decode_steps_per_chunk
        self.counters["steps"] += 1
        self.step_log.log_step(plan, self.kv, len(self.running), len(self.waiting))
        return plan

    def _note_burst(self, decoding: int) -> None:
        """Start burst admission when more requests wait than decode (``decoding``: running
        requests past their prompt), e.g. 64 requests sent at once or an offline batch larger than
        one step's prefill budget; it lasts until the waiting queue is empty. Decode priority (the
        decode-only steps, the mixed-prefill cap) holds every waiting request back to spare each
        decoding one a slower next token: when the waiting ones are the majority that trade loses,
        and spreading a burst over many capped steps leaves a long tail of small decode batches
        (more steps for the same tokens). A burst is admitted within the prefill budget alone, as
        into an idle engine (SGLang's prefill-first order). Kept until the queue drains, so the
        second half of a burst is not capped once the first half decodes."""
        if not self.waiting:
            self._bursting = False
        elif len(self.waiting) > decoding:
            self._bursting = True

    def _fills_budget(self, entries: list[StepEntry]) -> bool:
        """True when the step's prefill tokens used the whole prefill budget (a long prompt's chunk,
        or a burst of arrivals): only such steps earn the decode-only steps that follow. A step that
        admits a few short prompts beside the decoding requests costs them little, and holding the
        next arrivals back behind decode-only steps would only add to their time to first token."""
        return sum(e.n for e in entries if e.req.prefilling and e.n > 1) >= self._budget()

    def _budget(self) -> int:
        c = self.config.chunk_size
        return min(c, self.config.max_prefill_tokens) if c else self.config.max_prefill_tokens

    def _retract_one(self, entries: list[StepEntry]) -> bool:
        """Retract the running request with the fewest output tokens (newest); requeue it first."""
        if len(self.running) <= 1:
            return False
        cands = [r for r in self.running if not r.prefilling] or list(self.running)
        victim = min(cands, key=lambda r: (len(r.output_ids), -r.arrival))
        self.running.remove(victim)
        entries[:] = [e for e in entries if e.req is not victim]
        self.kv.release(victim)
        victim.retracted += 1
        self.counters["retractions"] += 1
        self.waiting.appendleft(victim)
        return True

    def _wanted(self, decode_only: bool) -> list[tuple[Req, int]]:
        """``(request, tokens)`` of each running request this step, in running order, with the
        prefill budget applied (what :meth:`_plan_running`'s loop plans when nothing is retracted)."""
        out, budget = [], self._budget()
        for r in self.running:
            pending = r.pending
            if decode_only and r.prefilling:
                continue
            n = 1 if pending == 1 else min(pending, budget)
            if n == 0:
                continue
            if pending > 1:
                budget -= n
            out.append((r, n))
        return out

    def _plan_running(self, decode_only: bool = False) -> list[StepEntry]:
        wanted = self._wanted(decode_only)
        if self.kv.extend_all(wanted):  # the usual step: room for everyone, one slot-table write
            return [StepEntry(r, n, r.kv.kv_len) for r, n in wanted]
        entries: list[StepEntry] = []
        budget = self._budget()
        for r in list(self.running):
            if r not in self.running or (decode_only and r.prefilling):  # retracted for an earlier one
                continue
            pending = r.pending
            n = 1 if pending == 1 else min(pending, budget)
            if n == 0:
                continue
            if pending > 1:
                budget -= n
            while not self.kv.extend(r, n):
                if not self._retract_one(entries):  # admission guarantees one request fits
                    raise CapacityError(f"KV pool ({self.kv.kv_pool.capacity} tokens) too small for "
                                        f"request {r.rid} ({r.seq_len} tokens)", field="max_total_tokens")
                if r not in self.running:
                    break
            else:
                entries.append(StepEntry(r, n, r.kv.kv_len))
        return entries

    def _prefix_cap(self, r: Req) -> int:
        cap = r.seq_len - 1
        if r.wants_input_logprobs():
            cap = min(cap, max(r.logprob_start_len - 1, 0))
        return cap

    def _shares_uncached_prefix(self, r: Req, m: int, prefilling: list) -> bool:
        """True when ``r`` shares more than ``HOLD_BACK_TOKENS`` beyond its cached ``m`` tokens with
        a request now prefilling: admitting it next step lets it reuse that prefix (SGLang's
        in-batch prefix caching)."""
        if self.kv.cache.disabled or r.seq_len - m <= HOLD_BACK_TOKENS:
            return False
        head = r.tokens(m, m + HOLD_BACK_TOKENS + 1)
        return any(o.cache_ns == r.cache_ns and o.tokens(m, m + HOLD_BACK_TOKENS + 1) == head for o in prefilling)

    def _admit(self, entries: list[StepEntry]) -> None:
        if not self.waiting:
            return
        budget = self._budget() - sum(e.n for e in entries if e.n > 1)
        # beside decoding requests, prompts after the first fit whole within the mixed cap or wait
        # (not during a burst, see _note_burst)
        decoding = any(not e.req.prefilling for e in entries)
        cap = self.config.mixed_prefill_cap if decoding and not self._bursting else None
        used = sum(e.n for e in entries if e.req.prefilling)
        order = order_waiting(self.config.schedule_policy, list(self.waiting), self.kv.cache)
        prefilling = [r for r in self.running if r.prefilling]
        adapters = {r.lora.uid for r in self.running if r.lora is not None}
        for r in order:
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if r.blocked_by is not None and r.blocked_by.finished is None:
                continue  # its shared prefix is being prefilled by another request
            if r.lora is not None and r.lora.uid not in adapters and len(adapters) >= self.config.max_loras_per_batch:
                continue  # a step holds at most max_loras_per_batch adapters
            prefix, node = self.kv.match_prefix(r.seq[:self._prefix_cap(r)], r.cache_ns)
            m = len(prefix)
            if self._shares_uncached_prefix(r, m, prefilling):
                continue
            n = min(r.seq_len - m, budget)
            if cap is not None and used > 0 and used + n > cap:
                break  # the next step takes it: this one stays short (its arrivals' TTFT)
            # FIFO fairness: when the head does not fit, later requests do not overtake it
            if not self.kv.can_admit(m, n, len(self.running) + 1) or not self.kv.admit(r, prefix, node, n):
                break
            if not r.retracted:
                r.cached_tokens = m
                self.counters["prompt_tokens"] += len(r.input_ids)
                self.counters["cached_tokens"] += m
            self.waiting.remove(r)
            self.running.append(r)
            prefilling.append(r)
            if r.lora is not None:
                adapters.add(r.lora.uid)
            entries.append(StepEntry(r, n, m))
            budget -= n
            used += n

    # ------------------------------------------------------------------ results
    def sample(self, plan: StepPlan, logits: torch.Tensor, bitmask: Optional[torch.Tensor] = None) -> Optional[SampleOutput]:
        """Next tokens of the plan's sampling entries (``logits``: [M, V] float32, rows as laid out
        by the plan; ``bitmask``: their grammar masks when computed already). None when no entry
        samples (a step of non-final prefill chunks)."""
        idx = [e.sample_row for e in plan.sampling]
        if not idx:
            return None
        return self.sampler.sample(select_rows(logits, idx), plan.sampling_reqs, bitmask)

    def process(self, plan: StepPlan, logits: torch.Tensor, sampled: Optional[SampleOutput]) -> None:
        """Advance the plan's requests past this step: commit their KV, record input logprobs,
        append the sampled tokens (grammar, detokenizer, stop checks, jump-forward), finish."""
        for e in plan.entries:
            r = e.req
            if not e.draft:  # verify steps commit what was accepted (speculative.process)
                self.kv.commit(r, e.n)
            if e.input_rows or (r.wants_input_logprobs() and r.logprob_start_len == 0):
                self.out.record_input_logprobs(r, logits, e.input_rows)
        if sampled is not None:
            for i, (r, tok) in enumerate(zip(plan.sampling_reqs, sampled.next_ids)):
                self.counters["generated_tokens"] += 1
                lp = sampled.logprobs[i] if sampled.logprobs is not None and r.return_logprob else None
                reason = self.out.append_token(r, tok, lp)
                if reason is not None:
                    self._end(r, reason)
        if self.spec is not None:  # verify steps; draft heads also read every step's hidden states
            self.counters["generated_tokens"] += self.spec.process(plan, logits, self._end)
        for e in plan.entries:  # prefill-only requests (max_new_tokens == 0)
            r = e.req
            if r.finished is None and r.params.max_new_tokens == 0 and not r.prefilling:
                self._end(r, FinishReason("length", length=0))

    # ------------------------------------------------------------------ maintenance
    def flush_cache(self) -> bool:
        """Drop the radix tree. Refused (False) while requests run or wait."""
        if self.has_work():
            return False
        self.kv.flush()
        return True

    def check_invariants(self) -> None:
        """Assert pool + tree consistency (see :meth:`KVManager.check_invariants`)."""
        self.kv.check_invariants(self.running)
        if self.spec is not None:
            self.spec.check_invariants(self.running)  # slot-table rows (token-tree scratch rows)

    def close(self) -> None:
        """Stop the grammar-mask thread and the runner's worker processes, if it has any (the
        engine calls this when its loop ends)."""
        self.masks.close()
        self.runner.close()

