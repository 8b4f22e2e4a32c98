"""Async facade over an engine (:class:`~sglite.runtime.engine_protocol.EngineProtocol`) for the
HTTP layer.

One HTTP request is one engine call (:class:`GenCall`): every prompt of a batch and every one of
``n`` samples is the engine's to fan out, with the engine's request ids and sample seeds (see
:mod:`sglite.runtime.engine_protocol`), so a seeded request samples the same over HTTP as in
Python. Streams are opened by pulling their first event, so that validation errors surface as
HTTP 400 before any response byte is sent. Whatever ends a stream early (client gone, error,
cancellation) aborts the call's engine requests in a ``finally``.
"""
from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Optional

from ..errors import InvalidRequestError, QueueFullError
from ..config import EngineConfig
from ..runtime.engine_protocol import EngineProtocol, matches_rid
from ..runtime.engine_requests import prepare_within
from ..runtime.logprob_options import NO_LOGPROBS, LogprobOptions
from ..sampling_params import SamplingParams
from .template_facts import TemplateFacts


@dataclass
class GenCall:
    """One engine call: the prompts of one HTTP request (text or token ids), their sampling params
    (``n`` included), the request id and the logprob options.

    ``batch`` False sends the single prompt as is (the engine uses ``rid`` unchanged); True sends
    a list (the engine names item ``i`` ``<rid>-<i>``). Outputs come in engine order: prompt-major,
    ``n`` per prompt.
    """

    prompts: Optional[list[str]] = None
    input_ids: Optional[list[list[int]]] = None
    sampling_params: list[dict] = field(default_factory=lambda: [{}])
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    logprobs: LogprobOptions = NO_LOGPROBS
    batch: bool = False
    lora_path: Any = None  # LoRA adapter name (a list: one per prompt); None: the base model

    @property
    def num_outputs(self) -> int:
        return sum(int(sp.get("n", 1) or 1) for sp in self.sampling_params)

    def kwargs(self, stream: bool, incremental: bool = False) -> dict:
        """Keyword arguments of ``engine.async_generate`` for this call."""
        one = lambda xs: xs if self.batch else xs[0]  # noqa: E731
        kw: dict[str, Any] = {"sampling_params": one(self.sampling_params), "stream": stream, "rid": self.rid,
                              **self.logprobs.to_kwargs()}
        if stream:
            kw["incremental"] = incremental
        if self.lora_path is not None:
            kw["lora_path"] = self.lora_path
        if self.input_ids is not None:
            kw["input_ids"] = one(self.input_ids)
        else:
            kw["prompt"] = one(self.prompts)
        return kw


def is_finished(chunk: dict) -> bool:
    """True when an engine output dict carries a finish reason (the last one of its output)."""
    return chunk["meta_info"]["finish_reason"] is not None


class EngineStream:
    """One open engine stream: iterate it for ``(output index, dict)``; ``abort()`` is idempotent.

    The dicts are cumulative or, when opened with ``incremental=True``, deltas.
    """

    def __init__(self, client: "EngineClient", call: GenCall, it, first: dict, incremental: bool = False):
        self._client, self.call, self._it, self._first = client, call, it, first
        self._incremental = incremental
        self._left = call.num_outputs
        self.finished = False

    def abort(self) -> None:
        """Abort the call's engine requests unless they all finished (never raises)."""
        if not self.finished:
            self.finished = True
            self._client.abort(self.call.rid)
        self._client.release(self.call.rid)

    def _take(self, chunk: dict) -> tuple[int, dict]:
        self._left -= is_finished(chunk)
        self._client.observe(chunk, text_complete=not self._incremental)
        return chunk.pop("index", 0), chunk

    async def __aiter__(self) -> AsyncIterator[tuple[int, dict]]:
        try:
            chunk, self._first = self._first, None
            yield self._take(chunk)
            while self._left > 0:
                yield self._take(await self._it.__anext__())
            self.finished = True
        finally:
            self.abort()


class EngineClient:
    """Async access to an engine: validation, single and streamed calls, aborts, metrics.

    Args:
        engine: an :class:`~sglite.runtime.engine_protocol.EngineProtocol` implementation.
        metrics: a :class:`sglite.server.metrics.ServerMetrics` or None.
        request_log: a :class:`sglite.server.request_log.RequestLog` (``--log-requests``) or None.
    """

    def __init__(self, engine: EngineProtocol, metrics=None, request_log=None,
                 prep_timeout: float = EngineConfig.request_prep_timeout):
        self.engine = engine
        self.metrics = metrics
        self.request_log = request_log
        self.prep_timeout = prep_timeout
        self._prep = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sglite-http-prep")
        self.template_facts = TemplateFacts()  # what the chat template does with tools (probed once)
        self.active: set[str] = set()  # rids of the calls in flight
        self.model_info = dict(engine.model_info())
        self.context_length = int(self.model_info["context_length"])
        self.vocab_size = int(self.model_info["vocab_size"])

    # ---------------------------------------------------------------- helpers
    async def prepare(self, fn, *args, field: str):
        """``fn(*args)`` (chat template, tokenizing, request planning) on the preparation pool, so
        the event loop never computes; within ``prep_timeout`` seconds
        (:func:`~sglite.runtime.engine_requests.prepare_within`).

        Raises:
            InvalidRequestError: over the budget (naming ``field`` and the budget; HTTP 400).
            Whatever ``fn`` raises.
        """
        return await prepare_within(self._prep, lambda: fn(*args), self.prep_timeout, field,
                                    "chat template, tokenizing")

    def validate(self, sampling_params: dict) -> None:
        """Check a sampling-params dict with ``SamplingParams.from_dict`` (nothing is scheduled).

        Raises:
            InvalidRequestError: naming the field.
        """
        SamplingParams.from_dict(dict(sampling_params), vocab_size=self.vocab_size)

    def check_ids(self, ids: list, field: str) -> None:
        """Raise InvalidRequestError unless ``ids`` is a non-empty list of token ids in the vocabulary."""
        if not ids:
            raise InvalidRequestError(f"{field}: must not be empty", field=field)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"{field}: token id {bad} outside [0, {self.vocab_size})", field=field)

    def count_tokens(self, text: str) -> Optional[int]:
        """Number of tokens of ``text`` with the engine's tokenizer, or None when it cannot encode
        it (e.g. a lone surrogate): counting is advisory, the engine re-checks and names the field."""
        try:
            return len(self.engine.tokenizer.encode_prompt(text))
        except Exception:  # noqa: BLE001
            return None

    def abort(self, rid) -> None:
        """Abort engine request ``rid`` and its ``rid-...`` ones (never raises); counted in the
        metrics when it was ours. A list (a batch's per-prompt rids) aborts each."""
        if isinstance(rid, list):
            for r in _rid_keys(rid):
                self.abort(r)
            return
        if rid in self.active and self.metrics is not None:
            self.metrics.aborted.inc()
        try:
            self.engine.abort(rid)
        except Exception:  # noqa: BLE001 - abort of an unknown/finished rid is fine
            pass
        self.release(rid)

    def release(self, rid) -> None:
        """Forget ``rid`` (or each rid of a batch's list) as in flight."""
        for r in _rid_keys(rid):
            self.active.discard(r)

    def abort_matching(self, rid: str) -> int:
        """Abort ``rid`` and its ``rid-...`` requests; returns how many calls in flight it hit
        (calls named ``rid`` or ``rid-...``, or the one call of which ``rid`` is an item/sample)."""
        inside = [r for r in list(self.active) if matches_rid(r, rid)]
        for r in inside:
            self.abort(r)
        if inside:
            return len(inside)
        self.abort(rid)  # one item or sample of a call (or unknown): the engine aborts just that
        return sum(matches_rid(rid, r) for r in self.active)

    def abort_all(self) -> int:
        rids = list(self.active)
        for rid in rids:
            self.abort(rid)
        return len(rids)

    def observe(self, chunk: dict, text_complete: bool = True) -> None:
        """Account a finished output (metrics, request log); other chunks are ignored."""
        if not is_finished(chunk):
            return
        if self.metrics is not None:
            self.metrics.observe_finished(chunk["meta_info"])
        if self.request_log is not None:
            self.request_log.finished(chunk, text_complete)

    # ---------------------------------------------------------------- generation
    async def run(self, call: GenCall) -> list[dict]:
        """Run one call to completion: its outputs in engine order. Cancelled -> aborted.

        Raises:
            ValueError: refused before scheduling (bad input, rid in flight); nothing to abort.
        """
        out = await self._started(call, self.engine.async_generate(**call.kwargs(stream=False)))
        self.release(call.rid)
        outs = out if isinstance(out, list) else [out]
        for o in outs:
            self.observe(o)
        return outs

    async def open(self, call: GenCall, incremental: bool = False) -> EngineStream:
        """Start a streamed call and pull its first event (errors raise here, before any output)."""
        async def first_event() -> tuple:
            it = (await self.engine.async_generate(**call.kwargs(stream=True, incremental=incremental))).__aiter__()
            return it, await it.__anext__()

        it, first = await self._started(call, first_event())
        return EngineStream(self, call, it, first, incremental)

    async def _started(self, call: GenCall, start: Awaitable):
        """Register ``call``'s rids as in flight, log its receipt and await ``start`` (the engine
        call). A refusal before scheduling (ValueError, QueueFullError) releases the rids this call
        registered (nothing to abort); any other failure or a cancellation aborts the call."""
        fresh = not any(r in self.active for r in _rid_keys(call.rid))
        self.active.update(_rid_keys(call.rid))
        if self.request_log is not None:
            self.request_log.received(call)
        try:
            return await start
        except (ValueError, QueueFullError):  # refused before scheduling: nothing to abort
            if fresh:
                self.release(call.rid)
            raise
        except BaseException:
            self.abort(call.rid)
            raise


def _rid_keys(rid) -> list[str]:
    """The rids a call is tracked under: ``rid`` itself, or the non-empty entries of a batch's
    per-prompt rid list (empty ones get fresh ids in the engine and cannot be named anyway)."""
    if isinstance(rid, list):
        return [r for r in rid if isinstance(r, str) and r]
    return [rid]


class ClientDisconnected(ConnectionResetError):
    """The HTTP client went away before its (non-streamed) answer was ready (a
    ``ConnectionResetError``, so the error middleware logs one info line, not an internal error)."""


async def until_disconnect(receive, awaitable):
    """Await ``awaitable`` unless the client disconnects first (ASGI ``receive`` gives
    ``http.disconnect``); then cancel it (which aborts its engine requests) and raise
    :class:`ClientDisconnected`."""
    task = asyncio.ensure_future(awaitable)

    async def watch():
        while True:
            msg = await receive()
            if msg.get("type") == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()
