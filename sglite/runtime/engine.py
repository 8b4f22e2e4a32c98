"""Engine: the in-process serving runtime (SGLang's ``Engine`` shape).

    engine = Engine(model_path=None, **EngineConfig options)   # None = default model
    engine.generate(prompt="Hi", sampling_params={"max_new_tokens": 8, "temperature": 0})
        -> {"text": str, "output_ids": list[int],
            "meta_info": {"id": str, "prompt_tokens": int, "completion_tokens": int,
                          "cached_tokens": int,
                          "finish_reason": {"type": "stop", "matched": str | int | None}
                                           | {"type": "length", "length": int}
                                           | {"type": "abort", "message": str},
                          "e2e_latency": float (s), "ttft": float (s),
                          # when return_logprob:
                          "input_token_logprobs": [[logprob|None, token_id, text], ...],
                          "output_token_logprobs": [[logprob, token_id, text], ...],
                          "input_top_logprobs"/"output_top_logprobs": [[[lp, id, text], ...] | None, ...],
                          }}
    prompt may be a list of str (or input_ids a list of lists) -> list of such dicts, input order.
    sampling_params: dict of SamplingParams keys (or a list, one per prompt). With n > 1 each
        prompt gives n dicts (flattened, prompt-major); the n samples share the prompt's KV.
    engine.generate(..., stream=True) -> iterator of dicts of the same shape with CUMULATIVE
        "text"/"output_ids" so far (the last one per request has finish_reason set; earlier None);
        with several requests (batch or n > 1) each dict also has "index".
    engine.async_generate(...)  -> coroutine returning the same; with stream=True an async iterator.
    Extra keyword args of generate: input_ids, return_logprob=False, logprob_start_len=-1,
        top_logprobs_num=0, token_ids_logprob=None, rid=None (str, or list for a batch; used by abort).
    engine.score(prompt, continuations, unconditional=False) -> list of
        {"text", "token_ids", "logprobs", "unconditional_logprobs" (when asked)}.
    engine.abort(rid); engine.flush_cache() -> bool; engine.get_server_info() -> dict;
    engine.tokenizer; engine.apply_chat_template(...); engine.model_info(); engine.shutdown().
Errors: InvalidRequestError (ValueError) naming the field, raised before anything is scheduled;
    GrammarError for a bad regex/schema/grammar; CapacityError when a prompt can never fit.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import random
import threading
import uuid
from concurrent.futures import Future
from typing import Optional, Union

import torch

from ..config import EngineConfig
from .engine_requests import RequestBuilder
from .model_loader import load_checkpoint, load_state_dict
from .model_runner import ModelRunner, resolve_device, resolve_dtype
from ..errors import InvalidRequestError
from .req import FinishReason
from .scheduler import Scheduler
from .tokenizer import Tokenizer

log = logging.getLogger("sglite.engine")


class Engine:
    """Tokenizer + scheduler + model runner, with the step loop in one background thread.

    Callers (sync, asyncio, HTTP) talk to the loop through a thread-safe queue; results come back
    through per-request sinks. Options: see :class:`sglite.config.EngineConfig`.

    Raises:
        InvalidRequestError: a bad option or an unusable model path (names the field / path).
    """

    def __init__(self, model_path: Optional[str] = None, **kwargs):
        self.config = EngineConfig.from_kwargs(model_path=model_path, **kwargs)
        root = logging.getLogger("sglite")
        root.setLevel(self.config.log_level.upper())
        if not root.handlers and not logging.getLogger().handlers:
            h = logging.StreamHandler()
            h.setFormatter(logging.Formatter("[sglite %(asctime)s %(levelname)s] %(message)s", "%H:%M:%S"))
            root.addHandler(h)
        ckpt = load_checkpoint(model_path)
        self.checkpoint = ckpt
        self.tokenizer = Tokenizer.from_dir(ckpt.model_dir, ckpt.hf_config)
        device = resolve_device(self.config.device)
        if device == "cpu":
            torch.set_num_threads(self.config.num_threads or max(1, (os.cpu_count() or 2) - 1))
        sd = load_state_dict(ckpt, resolve_dtype(self.config.dtype, device), device)
        self.runner = ModelRunner(self.config, ckpt.hf_config, sd)
        del sd
        self.scheduler = Scheduler(self.config, self.runner, self.tokenizer)
        self.requests = RequestBuilder(self.config, self.tokenizer, self.runner, random.Random(self.config.random_seed))
        self._inbox: queue.Queue = queue.Queue()
        self._active: set[str] = set()  # rids in flight (duplicates are refused)
        self._active_lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="sglite-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ loop thread
    def _loop(self) -> None:
        sched = self.scheduler
        while True:
            try:
                item = self._inbox.get(timeout=0.1) if not sched.has_work() else self._inbox.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                if item[0] == "stop":
                    for r in list(sched.waiting) + list(sched.running):
                        sched.abort(r.rid)
                    sched.close()
                    return
                self._handle(item)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            try:
                sched.step()
                if self.config.check_invariants:
                    sched.check_invariants()
            except Exception as exc:  # keep serving: fail the running requests, free their KV
                log.exception("scheduler step failed")
                for r in list(sched.running):
                    try:
                        sched.running.remove(r)
                        sched._finish(r, FinishReason("abort", message=f"internal error: {exc!r}"))
                    except Exception:  # never let recovery kill the loop
                        log.exception("could not finish request %s cleanly", r.rid)

    def _handle(self, item) -> None:
        kind = item[0]
        if kind == "req":
            self.scheduler.add_request(item[1])
        elif kind == "abort":
            self.scheduler.abort(item[1])
        elif kind == "call":
            fn, fut = item[1], item[2]
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)

    def _call(self, fn):
        """Run ``fn`` on the loop thread between steps and return its result."""
        if self._stopped:
            raise RuntimeError("engine is shut down")
        fut: Future = Future()
        self._inbox.put(("call", fn, fut))
        return fut.result()

    def _submit(self, reqs) -> None:
        """Register the requests' rids (a duplicate in flight raises) and queue them."""
        if self._stopped or not self._thread.is_alive():
            raise RuntimeError("engine is shut down")
        with self._active_lock:
            rids = [r.rid for r in reqs]
            dup = sorted((set(rids) & self._active) | {x for x in rids if rids.count(x) > 1})
            if dup:
                raise InvalidRequestError(f"rid: request id(s) {dup[:3]} already in flight", field="rid")
            self._active.update(rids)
        for r in reqs:
            r.sink = self._releasing_sink(r.rid, r.sink)
            self._inbox.put(("req", r))

    def _releasing_sink(self, rid, sink):
        def wrapped(ev):
            if ev["meta_info"]["finish_reason"] is not None:
                with self._active_lock:
                    self._active.discard(rid)
            sink(ev)
        return wrapped

    def _wait(self, event: threading.Event) -> None:
        while not event.wait(0.5):
            if not self._thread.is_alive():
                raise RuntimeError("engine loop has stopped")

    def _run_to_completion(self, build):
        """Build a batch with ``build(sink_factory)``, submit it and wait for every final event.

        Returns (batch, final output dicts in output order)."""
        results: dict = {}
        done = threading.Event()
        lock = threading.Lock()

        def sink_factory(i):
            def sink(ev):
                if ev["meta_info"]["finish_reason"] is None:
                    return
                with lock:
                    results[i] = ev
                    if len(results) == batch.num_outputs:
                        done.set()
            return sink

        batch = build(sink_factory)
        self._submit(batch.all_reqs)
        self._wait(done)
        return batch, [results[i] for i in range(batch.num_outputs)]

    # ------------------------------------------------------------------ generate
    def _build(self, prompt, sampling_params, input_ids, rid, sink_factory, **kw):
        """Validate and build the requests of one call (raises before anything is queued)."""
        return self.requests.build(prompt, sampling_params, input_ids, rid, sink_factory, **kw)

    def generate(self, prompt: Union[str, list[str], None] = None, sampling_params: Union[dict, list, None] = None,
                 input_ids: Optional[list] = None, return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, token_ids_logprob: Optional[list[int]] = None,
                 stream: bool = False, rid: Union[str, list, None] = None):
        """Generate for one prompt (→ dict) or a batch (→ list of dicts); see the module docstring.

        Raises:
            InvalidRequestError / GrammarError / CapacityError before anything is scheduled.
        """
        kw = dict(return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                  top_logprobs_num=top_logprobs_num, token_ids_logprob=token_ids_logprob, stream=stream)
        if stream:
            q: queue.Queue = queue.Queue()
            batch = self._build(prompt, sampling_params, input_ids, rid, lambda i: (lambda ev: q.put((i, ev))), **kw)
            self._submit(batch.all_reqs)
            return self._stream_sync(q, batch)
        batch, outs = self._run_to_completion(
            lambda sink_factory: self._build(prompt, sampling_params, input_ids, rid, sink_factory, **kw))
        return outs if batch.is_list else outs[0]

    @staticmethod
    def _tag(batch, i: int, ev: dict) -> tuple[dict, bool]:
        """A stream event with its output ``index`` (several outputs) and whether it is final."""
        if batch.num_outputs > 1:
            ev = dict(ev, index=i)
        return ev, ev["meta_info"]["finish_reason"] is not None

    def _abort_batch(self, batch) -> None:
        for r in batch.all_reqs:
            self.abort(r.rid)

    def _stream_sync(self, q, batch):
        finished = 0
        try:
            while finished < batch.num_outputs:
                try:
                    i, ev = q.get(timeout=0.5)
                except queue.Empty:
                    if not self._thread.is_alive():
                        raise RuntimeError("engine loop has stopped") from None
                    continue
                ev, done = self._tag(batch, i, ev)
                finished += done
                yield ev
        finally:
            if finished < batch.num_outputs:  # the consumer stopped early: free the KV
                self._abort_batch(batch)

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None,
                             stream=False, rid=None):
        """Asyncio version of :meth:`generate`. With ``stream=True`` returns an async iterator."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        kw = dict(return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                  top_logprobs_num=top_logprobs_num, token_ids_logprob=token_ids_logprob, stream=stream)
        batch = self._build(prompt, sampling_params, input_ids, rid,
                            lambda i: (lambda ev: loop.call_soon_threadsafe(q.put_nowait, (i, ev))), **kw)
        self._submit(batch.all_reqs)

        async def agen():
            finished = 0
            try:
                while finished < batch.num_outputs:
                    i, ev = await q.get()
                    ev, done = self._tag(batch, i, ev)
                    finished += done
                    yield ev
            finally:
                if finished < batch.num_outputs:  # cancelled or closed early: free the KV
                    self._abort_batch(batch)

        if stream:
            return agen()
        results = {}
        async for ev in agen():
            if ev["meta_info"]["finish_reason"] is not None:
                results[ev.pop("index", 0)] = ev
        outs = [results[i] for i in sorted(results)]
        return outs if batch.is_list else outs[0]

    # ------------------------------------------------------------------ scoring
    def score(self, prompt: str, continuations: list[str], unconditional: bool = False) -> list[dict]:
        """Log-probabilities of each continuation's tokens given ``prompt`` (prompt prefilled once).

        The continuation's tokens are those of ``tokenize(prompt + continuation)`` past its common
        prefix with ``tokenize(prompt)`` (so a merge across the boundary is handled).
        Returns a list of ``{"text", "token_ids", "logprobs": [float], "unconditional_logprobs"}``.

        Raises:
            InvalidRequestError: empty ``continuations`` or a non-string entry.
        """
        spec = self.requests.score_requests(prompt, continuations, unconditional)
        _, outs = self._run_to_completion(lambda sink_factory: self.requests.build(
            None, spec.sampling_params, spec.input_ids, None, sink_factory, return_logprob=True,
            logprob_start_len=spec.logprob_start_lens, shared_prefix=spec.prompt_ids))
        return spec.collect(outs)

    # ------------------------------------------------------------------ control
    def abort(self, rid: str) -> None:
        """Abort request ``rid`` and its samples ``rid-<k>`` (n > 1); no-op if unknown or finished.

        The KV is freed within one step; the request ends with finish_reason type ``abort``.
        """
        self._inbox.put(("abort", rid))

    def flush_cache(self) -> bool:
        """Empty the radix cache. Returns False (refused) while requests are queued or running."""
        return self._call(self.scheduler.flush_cache)

    def check_invariants(self) -> None:
        """Assert pool and radix-tree invariants (on the loop thread)."""
        self._call(self.scheduler.check_invariants)

    def get_server_info(self) -> dict:
        """Config, KV capacity and usage, queue lengths and counters (a snapshot)."""
        def snap():
            s = self.scheduler
            free, ev = s.kv_pool.free_tokens(), s.cache.evictable_size
            st = dict(s.stats)
            hit = st["cached_tokens"] / st["prompt_tokens"] if st["prompt_tokens"] else 0.0
            return {**{k: v for k, v in self.config.__dict__.items()},
                    "max_total_tokens": self.runner.max_total_tokens, "free_tokens": free,
                    "evictable_tokens": ev, "available_tokens": free + ev,
                    "running_requests": len(s.running), "waiting_requests": len(s.waiting),
                    "cache_hit_rate": hit, "bytes_per_token": self.runner.bytes_per_token,
                    "dtype": str(self.runner.dtype).replace("torch.", ""), "device": self.runner.device,
                    "context_length": self.runner.context_length, **st}
        return self._call(snap)

    def model_info(self) -> dict:
        """Model facts clients need (path, context length, vocab, chat template markers)."""
        tk = self.tokenizer
        return {"model_path": self.checkpoint.source, "context_length": self.runner.context_length,
                "vocab_size": self.runner.vocab_size, "eos_token_ids": sorted(tk.eos_token_ids),
                "role_markers": {k: list(v) for k, v in tk.role_markers().items()},
                "end_of_turn": tk.end_of_turn, "default_system_prompt": tk.default_system_prompt,
                "dtype": str(self.runner.dtype).replace("torch.", ""), "device": self.runner.device}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> str:
        """Render ``messages`` with the model's chat template."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    def shutdown(self) -> None:
        """Stop the loop thread; unfinished requests end with reason abort."""
        if not self._stopped:
            self._stopped = True
            self._inbox.put(("stop",))
            self._thread.join(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
