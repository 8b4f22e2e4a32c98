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
        "text"/"output_ids" (and logprob lists) so far, as SGLang streams them (the last one per
        request has finish_reason set; earlier None); with several requests (batch or n > 1) each
        dict also has "index". With incremental=True each dict carries only what is new since the
        previous one of its request (SGLang's --incremental-streaming-output, per call).
    engine.async_generate(...)  -> coroutine returning the same; with stream=True an async iterator.
    Extra keyword args of generate: input_ids, return_logprob=False, logprob_start_len=-1,
        top_logprobs_num=0, token_ids_logprob=None, rid=None (str, or list for a batch; used by abort),
        incremental=False. Request ids and sample seeds: see sglite.runtime.engine_protocol.
    engine.cache_prefix(prompt | input_ids=...) -> {"prompt_tokens", "cached_tokens"}: prefill a
        prefix into the radix cache (what n > 1 and score do internally before fanning out).
    engine.score(prompt, continuations, unconditional=False) -> list of
        {"text", "token_ids", "logprobs", "unconditional_logprobs" (when asked)}.
    engine.export_prefix(ids) -> (ids[:n], K, V); engine.import_prefix(ids, K, V) -> int: a cached
        prefix's KV out of / into the radix cache (prefill/decode disaggregation); engine.kv_layout().
    engine.pin_prefix(key, ids, max_tokens) / engine.unpin_prefix(key): keep a cached prefix out of
        LRU eviction (sglite.runtime.prefix_pins).
    engine.abort(rid); engine.flush_cache() -> bool; engine.get_server_info() -> dict;
    engine.tokenizer; engine.apply_chat_template(...); engine.model_info(); engine.shutdown().
Errors: InvalidRequestError (ValueError) naming the field, raised before anything is scheduled;
    GrammarError for a bad regex/schema/grammar; CapacityError when a prompt can never fit.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Union

import torch

from ..kernels.decode_threads import default_threads, fallback_threads
from ..logging_setup import PhaseTimer, configure_if_unset
from ..lora import LoraManager
from ..errors import InvalidRequestError
from .engine_config import engine_config
from .engine_info import model_info, server_info
from .engine_loop import EngineLoop, loop_sink
from .engine_requests import RequestBuilder, prep_field, prepare_within
from .engine_stream import BatchView, OutputAccumulator, sync_stream
from .logprob_options import LogprobOptions
from .kv_quant import check_kv_cache_dtype
from .model_loader import load_checkpoint
from .models.registry import check_engine_config as check_family_config
from .model_runner import ModelRunner, resolve_device, resolve_dtype
from .prefix_pins import PrefixPins
from .quant_loader import load_weights
from .runner_protocol import RunnerProtocol
from .scheduler import Scheduler
from .tokenizer import Tokenizer

log = logging.getLogger("sglite.engine")


class Engine:
    """Tokenizer + scheduler + model runner, with the step loop in one background thread.

    Callers (sync, asyncio, HTTP) talk to the loop (:class:`~sglite.runtime.engine_loop.EngineLoop`)
    through its inbox; results come back through per-request sinks as deltas
    (:class:`~sglite.runtime.output.OutputEvent`), joined here into output dicts. Implements
    :class:`~sglite.runtime.engine_protocol.EngineProtocol`. Options: see :class:`sglite.config.EngineConfig`.

    Raises:
        InvalidRequestError: a bad option or an unusable model path (names the field / path).
    """

    def __init__(self, model_path: Optional[str] = None, **kwargs):
        self.config = engine_config(model_path=model_path, **kwargs)
        configure_if_unset(self.config.log_level)
        timer = PhaseTimer(log)
        cfg = self.config
        with timer.phase("checkpoint load"):
            ckpt = load_checkpoint(model_path)
        self.checkpoint = ckpt
        with timer.phase("tokenizer"):
            self.tokenizer = Tokenizer.from_dir(ckpt.model_dir, ckpt.hf_config, tokenizer_path=cfg.tokenizer_path,
                                                chat_template=cfg.chat_template)
        device = resolve_device(cfg.device)
        if device == "cpu":
            torch.set_num_threads(cfg.num_threads or fallback_threads())  # until the thread probe below
        check_kv_cache_dtype(cfg.kv_cache_dtype, ckpt.hf_config, device)  # before the weights load
        check_family_config(cfg, ckpt.hf_config)  # OLMo 2: no TP; Gemma: float KV
        self.runner: RunnerProtocol
        self.lora: LoraManager  # LoRA adapters (sglite.lora)
        if cfg.tp_size > 1:  # the model lives in tp_size worker processes (sglite.runtime.parallel)
            from .parallel.tp_client import TPRunnerClient
            with timer.phase("tensor-parallel workers"):
                self.runner = TPRunnerClient(cfg, ckpt)
            with timer.phase("LoRA adapters"):  # each worker holds its shards (parallel/lora_tp.py)
                self.lora = LoraManager.start(cfg, self.runner.arch, self.runner.dtype, "cpu", mirror=self.runner)
        else:
            with timer.phase("weights"):
                sd = load_weights(ckpt, cfg.quantization, resolve_dtype(cfg.dtype, device), device)
            # ModelRunner builds the model, probes the decode GEMV path, allocates the KV pool and
            # builds (or loads) the C++ attention kernel; it logs the KV pool size itself.
            with timer.phase("model, kernel build/probe, KV pool"):
                self.runner = ModelRunner(cfg, ckpt.hf_config, sd)
            del sd
            with timer.phase("LoRA adapters"):
                self.lora = self.runner.lora = LoraManager.start(cfg, self.runner.arch, self.runner.dtype,
                                                                 self.runner.device)
            if device == "cpu" and not cfg.num_threads:  # the fastest thread count for batch-1 decode
                with timer.phase("thread probe"):
                    torch.set_num_threads(default_threads(getattr(self.runner.model, "decode_fused", None)))
        with timer.phase("scheduler"):
            self.scheduler = Scheduler(cfg, self.runner, self.tokenizer)
            self.requests = RequestBuilder(cfg, self.tokenizer, self.runner, random.Random(cfg.random_seed))
            self.requests.lora = self.lora
            self._loop = EngineLoop(self.scheduler, cfg.check_invariants, cfg.max_queued_requests)
            self.pins = PrefixPins(self.scheduler.kv.cache)
            # async callers build requests here (tokenize, compile grammars, stop-regex checkers):
            # the caller's event loop never computes
            self._prep = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sglite-prep")
        # Stops the loop thread when the engine is collected or at interpreter exit (atexit runs
        # before daemon threads are frozen and torch's thread pools torn down), so a script that
        # never calls shutdown() exits cleanly. Holds the loop, not the engine.
        self._finalizer = weakref.finalize(self, EngineLoop.stop, self._loop)
        self.startup_phases: dict = dict(timer.phases)
        """Seconds of each start-up phase, in order (``checkpoint load``, ``tokenizer``, ...)."""
        log.info("Engine ready in %.2f s (%s)", timer.elapsed, timer.summary())

    # ------------------------------------------------------------------ plumbing
    def _run_to_completion(self, build):
        """Build a batch with ``build(sink_factory)``, submit it and wait for every final event.

        Returns (batch, final output dicts in output order)."""
        results: dict = {}
        done = threading.Event()
        lock = threading.Lock()

        def sink_factory(i):
            acc = OutputAccumulator()

            def sink(ev):
                out = acc.add(ev)
                if not ev.finished:
                    return
                with lock:
                    results[i] = out
                    if len(results) == batch.num_outputs:
                        done.set()
            return sink

        batch = build(sink_factory)
        self._loop.submit(batch.all_reqs)
        self._loop.wait(done)
        return batch, [results[i] for i in range(batch.num_outputs)]

    def _builder(self, prompt, sampling_params, input_ids, rid, return_logprob, logprob_start_len,
                 top_logprobs_num, token_ids_logprob, stream, lora_path=None):
        """``sink_factory -> Batch`` for one call; the logprob options are validated right away."""
        per_prompt = logprob_start_len if isinstance(logprob_start_len, list) else None
        lp = LogprobOptions.from_args(return_logprob, -1 if per_prompt is not None else logprob_start_len,
                                      top_logprobs_num, token_ids_logprob, self.runner.vocab_size)
        return lambda sink_factory: self.requests.build(prompt, sampling_params, input_ids, rid, sink_factory,
                                                        logprobs=lp, logprob_start_len=per_prompt, stream=stream,
                                                        lora_path=lora_path)

    # ------------------------------------------------------------------ generate
    def generate(self, prompt: Union[str, list[str], None] = None, sampling_params: Union[dict, list, None] = None,
                 input_ids: Optional[list] = None, return_logprob: bool = False,
                 logprob_start_len: Union[int, list] = -1, top_logprobs_num: int = 0,
                 token_ids_logprob: Optional[list[int]] = None, stream: bool = False,
                 rid: Union[str, list, None] = None, incremental: bool = False,
                 lora_path: Union[str, list, None] = None):
        """Generate for one prompt (→ dict) or a batch (→ list of dicts); see the module docstring.
        ``lora_path``: the LoRA adapter's name (a list: one per prompt; None: the base model).

        Raises:
            InvalidRequestError / GrammarError / CapacityError before anything is scheduled.
        """
        build = self._builder(prompt, sampling_params, input_ids, rid, return_logprob, logprob_start_len,
                              top_logprobs_num, token_ids_logprob, stream, lora_path)
        if stream:
            q: queue.Queue = queue.Queue()
            batch = build(lambda i: (lambda ev: q.put((i, ev))))
            self._loop.submit(batch.all_reqs)
            return sync_stream(q, batch, BatchView(batch.num_outputs, incremental), self._loop)
        batch, outs = self._run_to_completion(build)
        return outs if batch.is_list else outs[0]

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None,
                             stream=False, rid=None, incremental=False, lora_path=None):
        """Asyncio version of :meth:`generate`. With ``stream=True`` returns an async iterator."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        build = self._builder(prompt, sampling_params, input_ids, rid, return_logprob, logprob_start_len,
                              top_logprobs_num, token_ids_logprob, stream, lora_path)
        sink_factory = lambda i: loop_sink(loop, q, i)  # noqa: E731
        batch = await prepare_within(self._prep, lambda: build(sink_factory), self.config.request_prep_timeout,
                                     prep_field(prompt, input_ids, sampling_params),
                                     "tokenizing, compiling its grammar")
        self._loop.submit(batch.all_reqs)
        view = BatchView(batch.num_outputs, incremental and stream)

        async def agen():
            finished = 0
            try:
                while finished < batch.num_outputs:
                    i, ev = await q.get()
                    finished += ev.finished
                    yield view.view(i, ev)
            finally:
                if finished < batch.num_outputs:  # cancelled or closed early: free the KV
                    self._loop.abort_reqs(batch.all_reqs)

        if stream:
            return agen()
        results = {}
        async for out in agen():
            if out["meta_info"]["finish_reason"] is not None:
                results[out.pop("index", 0)] = out
        outs = [results[i] for i in sorted(results)]
        return outs if batch.is_list else outs[0]

    def cache_prefix(self, prompt: Optional[str] = None, input_ids: Optional[list[int]] = None) -> dict:
        """Prefill ``prompt`` (text) or ``input_ids`` into the radix cache, generating nothing.

        Later requests starting with it reuse its KV (page-aligned; at most ``len - 1`` tokens,
        as for any prompt). A no-op apart from validation when the radix cache is disabled.
        Returns ``{"prompt_tokens": int, "cached_tokens": int}`` (tokens of the prefix, and how
        many of them were cached already).

        Raises:
            InvalidRequestError: not exactly one prefix, or empty; CapacityError: it cannot fit.
        """
        done, box = threading.Event(), {}

        def sink(ev):
            if ev.finished:
                box["meta"] = ev.meta_info
                done.set()
        req = self.requests.prefix_request(prompt, input_ids, sink)
        if self.config.disable_radix_cache:
            return {"prompt_tokens": len(req.input_ids), "cached_tokens": 0}
        self._loop.submit([req])
        self._loop.wait(done)
        return {"prompt_tokens": box["meta"]["prompt_tokens"], "cached_tokens": box["meta"]["cached_tokens"]}

    # ------------------------------------------------------------------ prefix transfer (P/D)
    def export_prefix(self, ids: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The longest cached prefix of ``ids`` (token ids) and its K/V, copied on the loop thread
        between steps (nothing is locked or changed; prefill it first with :meth:`cache_prefix`).

        Returns ``(prefix_ids, k, v)``: ``prefix_ids`` the first ``n`` of ``ids`` (whole pages),
        ``k`` and ``v`` CPU tensors ``[L, n, Hkv, D]`` (layers, tokens, KV heads, head dim) in the
        pool's dtype (the model dtype, or bfloat16 with ``kv_cache_dtype=bfloat16``).

        Raises:
            ValueError: the engine's K/V is quantized (``kv_cache_dtype`` int8/int4/fp8_e4m3) or
                lives in tensor-parallel workers (``tp_size > 1``).
            RuntimeError: the engine is shut down.
        """
        return self._loop.call(lambda: self.scheduler.kv.read_prefix(list(ids)))

    def kv_layout(self) -> tuple[torch.dtype, tuple[int, int, int]]:
        """``(dtype, (L, Hkv, D))`` of the K/V that :meth:`export_prefix` returns and
        :meth:`import_prefix` takes (a receiver sizes its buffers from it). Raises ValueError as
        :meth:`export_prefix`."""
        return self.scheduler.kv.kv_layout()  # fixed at start-up: no need for the loop thread

    def import_prefix(self, ids: list[int], k: torch.Tensor, v: torch.Tensor) -> int:
        """Write the K/V of ``ids`` (token ids; ``k``, ``v``: ``[L, len(ids), Hkv, D]`` of this
        model, any float dtype, cast to the pool's) into free slots and insert them into the radix
        cache, on the loop thread between steps: a later request starting with ``ids`` reuses them
        as if this engine had prefilled them. Whole pages only; least-recently-used cache entries
        are evicted when the pool is short; a part already cached is kept.

        Returns the tokens of ``ids`` the cache holds afterwards (0 when the radix cache is disabled
        or ``ids`` is shorter than a page; the cached part when the pool cannot take the rest).

        Raises:
            ValueError: ``k``/``v`` are not ``[L, len(ids), Hkv, D]`` of this model, or the engine's
                K/V is quantized or tensor-parallel (as :meth:`export_prefix`).
            RuntimeError: the engine is shut down.
        """
        return self._loop.call(lambda: self.scheduler.kv.write_prefix(list(ids), k, v))

    # ------------------------------------------------------------------ scoring
    def score(self, prompt: str, continuations: list[str], unconditional: bool = False,
              lora_path: Optional[str] = None) -> list[dict]:
        """Log-probabilities of each continuation's tokens given ``prompt`` (prompt prefilled once),
        under the LoRA adapter ``lora_path`` (None: the base model).

        The continuation's tokens are those of ``tokenize(prompt + continuation)`` past its common
        prefix with ``tokenize(prompt)`` (so a merge across the boundary is handled).
        Returns a list of ``{"text", "token_ids", "logprobs": [float], "unconditional_logprobs"}``.

        Raises:
            InvalidRequestError: empty ``continuations`` or a non-string entry; an unknown ``lora_path``.
        """
        spec = self.requests.score_requests(prompt, continuations, unconditional)
        _, outs = self._run_to_completion(lambda sink_factory: self.requests.build(
            None, spec.sampling_params, spec.input_ids, None, sink_factory,
            logprobs=LogprobOptions(return_logprob=True), logprob_start_len=spec.logprob_start_lens,
            shared_prefix=spec.prompt_ids, lora_path=lora_path))
        return spec.collect(outs)

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora_adapter(self, lora_name: str, lora_path: str) -> list[str]:
        """Serve the PEFT adapter at folder ``lora_path`` as ``lora_name`` (read and checked on the
        caller's thread); returns the loaded names. Raises InvalidRequestError naming the field
        (see :mod:`sglite.lora.adapter`; ``lora_name`` when taken). With ``tp_size > 1`` every
        worker loads its shard; RuntimeError when one failed."""
        adapter = self.lora.read(lora_name, lora_path)
        self._loop.call(lambda: self.lora.add(adapter))
        return self.lora.names()

    def unload_lora_adapter(self, lora_name: str) -> list[str]:
        """Stop serving ``lora_name`` and drop its radix-cache entries; returns the loaded names.
        Raises InvalidRequestError (``lora_name``) when unknown or used by unfinished requests."""
        self._loop.call(lambda: self.lora.unload(lora_name, self.scheduler))
        return self.lora.names()

    # ------------------------------------------------------------------ control
    def abort(self, rid: str) -> None:
        """Abort request ``rid`` and every ``rid-...`` one (its samples, its batch items); no-op if
        unknown or finished. The KV is freed within one step; the request ends with finish_reason
        type ``abort``."""
        self._loop.abort(rid)

    def flush_cache(self) -> bool:
        """Empty the radix cache (dropping every pinned prefix). Returns False (refused) while
        requests are queued or running."""
        def flush() -> bool:
            if self.scheduler.has_work():
                return False
            self.pins.clear()
            return self.scheduler.flush_cache()
        return self._loop.call(flush)

    def pin_prefix(self, key, ids: list[int], max_tokens: int) -> tuple[int, list]:
        """Keep the cached part of ``ids`` (token ids) out of LRU eviction under ``key``, at most
        ``max_tokens`` pinned tokens in all (least recently pinned keys released first); see
        :mod:`sglite.runtime.prefix_pins`. Returns ``(tokens pinned, keys released)``."""
        return self._loop.call(lambda: self.pins.pin(key, ids, max_tokens))

    def unpin_prefix(self, key) -> bool:
        """Release ``key``'s pinned prefix (:meth:`pin_prefix`); False when it had none."""
        return self._loop.call(lambda: self.pins.unpin(key))

    def start_profile(self, output_dir: Optional[str] = None, num_steps: Optional[int] = None, activities=None,
                      record_shapes: bool = False, with_stack: bool = False) -> str:
        """Start torch.profiler on the engine thread (:class:`~sglite.runtime.profiler.ProfileSession`:
        ``output_dir`` else ``$SGLITE_TORCH_PROFILER_DIR`` else ``/tmp/sglite_profiles``; stops by
        itself after ``num_steps`` steps when given). Returns the output directory.

        Raises:
            InvalidRequestError: one is already running, or a bad option (naming the field).
        """
        return self._loop.call(lambda: self._loop.start_profile(
            output_dir=output_dir, num_steps=num_steps, activities=activities, record_shapes=record_shapes,
            with_stack=with_stack))

    def stop_profile(self) -> dict:
        """Stop the profile and write the Chrome trace and the per-op / per-phase summary; returns
        :meth:`~sglite.runtime.profiler.ProfileResult.to_json` (paths, steps, phase rows).

        Raises:
            InvalidRequestError: no profile was started (field ``profile``).
        """
        return self._loop.call(self._loop.stop_profile).to_json()

    def check_invariants(self) -> None:
        """Assert pool and radix-tree invariants (on the loop thread)."""
        self._loop.call(self.scheduler.check_invariants)

    def get_server_info(self) -> dict:
        """Config, KV capacity and usage, queue lengths and counters (a snapshot, taken on the loop
        thread; see :func:`~sglite.runtime.engine_info.server_info`)."""
        return self._loop.call(lambda: server_info(self.config, self.runner, self.scheduler))

    def model_info(self) -> dict:
        """Model facts clients need (path, context length, vocab, chat template markers)."""
        return model_info(self.checkpoint, self.runner, self.tokenizer)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None,
                            chat_template_kwargs: Optional[dict] = None) -> str:
        """Render ``messages`` with the model's chat template (``chat_template_kwargs``: extra
        template variables, e.g. ``enable_thinking``)."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                                  chat_template_kwargs=chat_template_kwargs)

    def shutdown(self) -> None:
        """Stop the loop thread (idempotent); unfinished requests end with reason abort.

        Called by ``with Engine() as e:``, when the engine is garbage-collected, and at interpreter
        exit for engines still alive then."""
        fin = getattr(self, "_finalizer", None)  # absent when __init__ failed
        if getattr(self, "_prep", None) is not None:
            self._prep.shutdown(wait=False, cancel_futures=True)
        if fin is not None:
            fin()
        elif getattr(self, "_loop", None) is not None:
            self._loop.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
