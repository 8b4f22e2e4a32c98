"""Batch log lines of the scheduler, worded as SGLang's so its users read them at a glance.

    Prefill batch. #new-seq: 2, #new-token: 512, #cached-token: 48, token usage: 0.03, #running-req: 3, #queue-req: 5
    Decode batch. #running-req: 8, #token: 2304, token usage: 0.12, gen throughput (token/s): 61.40, #queue-req: 0

A prefill line for every step that carries prompt tokens; a decode line every
``decode_log_interval`` decode steps (SGLang's ``--decode-log-interval``, default 40), with the
generation throughput over the steps since the previous decode line. With a sliding-window pool
(:mod:`sglite.runtime.swa_pool`) ``token usage`` is the full slot space's and a ``swa token usage``
of the local slots follows it (as SGLang's hybrid pools log both): the smaller local space is not
counted as full-pool use.
"""
from __future__ import annotations

import logging
import time

from .step_plan import StepPlan

log = logging.getLogger("sglite.scheduler")


class StepLogger:
    """Writes the batch lines of one scheduler (state: the counters since the last decode line)."""

    def __init__(self, decode_log_interval: int = 40):
        self.interval = max(1, int(decode_log_interval))
        self._decode_steps = 0
        self._tokens = 0
        self._since = time.perf_counter()

    def log_step(self, plan: StepPlan, kv, running: int, waiting: int) -> None:
        """Log the step of ``plan`` (already laid out, not yet run). ``kv``: the KVManager;
        ``running``/``waiting``: queue lengths after scheduling."""
        chunks = [e for e in plan.entries if e.req.prefilling]
        decoding = len(plan.entries) - len(chunks)
        if decoding:
            self._decode_steps += 1
            self._tokens += decoding
        decode_line = decoding and self._decode_steps % self.interval == 0
        prefill_line = chunks and log.isEnabledFor(logging.INFO)
        if not (prefill_line or decode_line):  # most steps: no line, no pool usage to read
            return
        pool = kv.kv_pool
        cap = pool.capacity
        swa = getattr(pool, "swa_capacity", 0)
        free = pool.full_free_tokens() if swa else kv.free_tokens()
        used = cap - free - kv.cache.evictable_size  # tokens neither free nor evictable (SGLang's num_used)
        usage = used / cap if cap else 0.0
        swa_part = f"{usage:.2f}, swa token usage: {pool.swa_used_tokens() / swa:.2f}" if swa else f"{usage:.2f}"
        if prefill_line:
            new_tokens = sum(e.n for e in chunks)
            cached = sum(e.req.cached_tokens for e in chunks if e.start == e.req.cached_tokens)
            log.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %s, "
                     "#running-req: %d, #queue-req: %d", len(chunks), new_tokens, cached, swa_part,
                     running - len(chunks), waiting)
        if not decode_line:
            return
        now = time.perf_counter()
        rate = self._tokens / max(now - self._since, 1e-9)
        self._tokens, self._since = 0, now
        log.info("Decode batch. #running-req: %d, #token: %d, token usage: %s, gen throughput (token/s): %.2f, "
                 "#queue-req: %d", running, used, swa_part, rate, waiting)
