"""Async facade over the in-process :class:`sglite.Engine` for the HTTP layer.

The server sends every prompt (and every one of ``n`` samples) as its own engine request with
its own request id, so that a disconnecting client can abort exactly its requests. Streams are
opened by pulling their first chunk, so that validation errors surface as HTTP 400 before any
response byte is sent. Whatever ends a stream early (client gone, error, cancellation) aborts
the engine request in a ``finally``.
"""
from __future__ import annotations

import asyncio
import inspect
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from ..errors import InvalidRequestError
from ..sampling_params import SamplingParams


@dataclass
class GenItem:
    """One engine request. Exactly one of ``prompt`` (text) / ``input_ids`` is set."""

    prompt: Optional[str] = None
    input_ids: Optional[list[int]] = None
    sampling_params: dict = field(default_factory=dict)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0

    def kwargs(self, stream: bool) -> dict:
        kw: dict[str, Any] = {"sampling_params": self.sampling_params, "stream": stream, "rid": self.rid}
        if self.input_ids is not None:
            kw["input_ids"] = self.input_ids
        else:
            kw["prompt"] = self.prompt
        if self.return_logprob:
            kw.update(return_logprob=True, logprob_start_len=self.logprob_start_len,
                      top_logprobs_num=self.top_logprobs_num)
        return kw


def is_finished(chunk: dict) -> bool:
    """True when an engine output dict carries a finish reason (the last chunk of a stream)."""
    return bool(chunk.get("meta_info", {}).get("finish_reason"))


class EngineStream:
    """One open engine stream: iterate it for cumulative output dicts; ``abort()`` is idempotent."""

    def __init__(self, client: "EngineClient", rid: str, it, first: Optional[dict]):
        self._client, self.rid, self._it, self._first = client, rid, it, first
        self.finished = first is not None and is_finished(first)

    def abort(self) -> None:
        """Abort the engine request unless it already finished (never raises)."""
        if not self.finished:
            self.finished = True
            self._client.abort(self.rid)
        self._client.release(self.rid)

    async def __aiter__(self) -> AsyncIterator[dict]:
        try:
            if self._first is not None:
                chunk, self._first = self._first, None
                self._client.observe(chunk)
                yield chunk
            if self.finished:
                return
            async for chunk in self._it:
                self.finished = is_finished(chunk)
                self._client.observe(chunk)
                yield chunk
                if self.finished:
                    break
            self.finished = True
        finally:
            self.abort()


class EngineClient:
    """Async access to an engine: validation, single and streamed generation, aborts, metrics.

    Args:
        engine: an object with the :mod:`sglite.runtime.engine` contract.
        metrics: a :class:`sglite.server.metrics.ServerMetrics` or None.
    """

    def __init__(self, engine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self.active: set[str] = set()
        self.model_info = dict(engine.model_info())
        self.context_length = int(self.model_info.get("context_length") or 0) or None
        self.vocab_size = self.model_info.get("vocab_size")

    # ---------------------------------------------------------------- helpers
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
        hi = self.vocab_size
        bad = next((t for t in ids if t < 0 or (hi and t >= hi)), None)
        if bad is not None:
            raise InvalidRequestError(f"{field}: token id {bad} outside [0, {hi})", field=field)

    def count_tokens(self, text: str) -> Optional[int]:
        """Number of tokens of ``text`` with the engine's tokenizer, or None if unavailable."""
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None or not hasattr(tok, "encode"):
            return None
        try:
            return len(tok.encode(text))
        except Exception:  # noqa: BLE001 - counting is advisory; the engine re-checks
            return None

    def abort(self, rid: str) -> None:
        """Abort engine request ``rid`` (never raises); counted in the metrics when it was ours."""
        if rid in self.active and self.metrics is not None:
            self.metrics.aborted.inc()
        try:
            self.engine.abort(rid)
        except Exception:  # noqa: BLE001 - abort of an unknown/finished rid is fine
            pass
        self.release(rid)

    def release(self, rid: str) -> None:
        self.active.discard(rid)

    def abort_all(self) -> int:
        rids = list(self.active)
        for rid in rids:
            self.abort(rid)
        return len(rids)

    def observe(self, chunk: dict) -> None:
        if self.metrics is not None and is_finished(chunk):
            self.metrics.observe_finished(chunk.get("meta_info", {}))

    async def _call(self, item: GenItem, stream: bool):
        res = self.engine.async_generate(**item.kwargs(stream))
        if inspect.isawaitable(res):
            res = await res
        return res

    # ---------------------------------------------------------------- generation
    async def generate(self, item: GenItem) -> dict:
        """Run one request to completion; cancelled -> the engine request is aborted."""
        fresh = item.rid not in self.active
        self.active.add(item.rid)
        try:
            out = await self._call(item, stream=False)
        except ValueError:  # refused before scheduling (e.g. its rid is in flight): nothing to abort
            if fresh:
                self.release(item.rid)
            raise
        except BaseException:
            self.abort(item.rid)
            raise
        self.release(item.rid)
        if isinstance(out, list):  # an engine answering a single prompt with a list
            out = out[0]
        self.observe(out)
        return out

    async def generate_many(self, items: list[GenItem]) -> list[dict]:
        """Run requests concurrently; the first error aborts the others and is re-raised."""
        tasks = [asyncio.ensure_future(self.generate(it)) for it in items]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def open_stream(self, item: GenItem) -> EngineStream:
        """Start a streamed request and pull its first chunk (errors raise here, before any output)."""
        fresh = item.rid not in self.active
        self.active.add(item.rid)
        try:
            res = await self._call(item, stream=True)
            if isinstance(res, dict):  # engine answered at once (e.g. max_new_tokens == 0)
                return EngineStream(self, item.rid, _empty(), res)
            it = res.__aiter__()
            try:
                first = await it.__anext__()
            except StopAsyncIteration:
                first = None
        except ValueError:  # refused before scheduling: nothing to abort
            if fresh:
                self.release(item.rid)
            raise
        except BaseException:
            self.abort(item.rid)
            raise
        return EngineStream(self, item.rid, it, first)

    async def open_streams(self, items: list[GenItem]) -> list[EngineStream]:
        """Open several streams concurrently; on any error abort all of them and re-raise."""
        tasks = [asyncio.ensure_future(self.open_stream(it)) for it in items]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for r in results:
                if isinstance(r, EngineStream):
                    r.abort()
            raise errors[0]
        return list(results)

    async def warm_prefix(self, item: GenItem) -> None:
        """Prefill ``item``'s prompt once (``max_new_tokens=0``) so ``n`` samples share its KV.

        SGLang does the same for parallel sampling; skipped when the radix cache is off.
        """
        sp = {k: v for k, v in item.sampling_params.items()
              if k not in ("regex", "json_schema", "ebnf", "lark", "n")}
        sp.update(max_new_tokens=0, min_new_tokens=0)
        await self.generate(GenItem(prompt=item.prompt, input_ids=item.input_ids, sampling_params=sp))


async def _empty():
    return
    yield  # pragma: no cover


async def merge_streams(streams: list[EngineStream]) -> AsyncIterator[tuple[int, dict]]:
    """Interleave several streams as ``(index, chunk)`` in arrival order.

    Errors of any stream are re-raised; leaving early (client gone) aborts every unfinished one.
    """
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, s: EngineStream):
        try:
            async for chunk in s:
                await queue.put((i, chunk, None))
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, None, e))
        finally:
            queue.put_nowait((i, end, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, chunk, err = await queue.get()
            if chunk is end:
                remaining -= 1
            elif err is not None:
                raise err
            else:
                yield i, chunk
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


class ClientDisconnected(Exception):
    """The HTTP client went away before its (non-streamed) answer was ready."""


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
