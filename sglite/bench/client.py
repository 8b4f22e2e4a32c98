"""Streaming HTTP clients that time every chunk of a response (httpx, asyncio).

Two backends:

* ``sglite`` – native ``POST /generate`` with ``stream: true``: SSE ``data: {json}`` events with
  cumulative ``text``/``output_ids`` and ``meta_info`` (``prompt_tokens``, ``completion_tokens``,
  ``cached_tokens``), ending with ``data: [DONE]``. A chunk counts as a token arrival when its
  ``output_ids`` (or, lacking those, its text) grew.
* ``openai`` – ``POST /v1/completions`` with ``stream: true`` and ``stream_options.include_usage``
  (any OpenAI-compatible server): text deltas, token counts from the final ``usage``.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Optional

import httpx

from .stats import RequestOutcome, outcome_from_timeline

BACKENDS = ("sglite", "openai")


@dataclass(frozen=True)
class ClientConfig:
    """Where and how to send requests.

    Attributes:
        base_url: server root, e.g. ``http://127.0.0.1:30000``.
        backend: ``sglite`` (native API) or ``openai`` (``/v1/completions``).
        model: model name for the OpenAI API (default: the first of ``/v1/models``).
        api_key: sent as a bearer token when given.
        temperature: sampling temperature of every request (0 = greedy).
    """

    base_url: str
    backend: str = "sglite"
    model: Optional[str] = None
    api_key: Optional[str] = None
    temperature: float = 0.0

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {BACKENDS}, got {self.backend!r}")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _data_lines(line: str) -> Optional[str]:
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


class _StreamFailed(Exception):
    """An HTTP error status or an ``error`` event in a streamed response."""


async def _sse_events(http: httpx.AsyncClient, url: str, payload: dict, headers: dict):
    """POST ``payload`` to ``url`` and yield ``(arrival time, event dict)`` per SSE ``data:`` line
    until ``[DONE]``. Raises _StreamFailed on a non-200 status or an ``error`` event, and
    httpx / JSON errors as they come."""
    async with http.stream("POST", url, json=payload, headers=headers) as r:
        if r.status_code != 200:
            body = (await r.aread()).decode(errors="replace")
            raise _StreamFailed(f"HTTP {r.status_code}: {body[:300]}")
        async for line in r.aiter_lines():
            data = _data_lines(line)
            if not data or data == "[DONE]":
                continue
            now = time.perf_counter()
            ev = json.loads(data)
            if "error" in ev:
                raise _StreamFailed(str(ev["error"])[:300])
            yield now, ev


def _failed(start: float, t0: float, error: str) -> tuple[RequestOutcome, str]:
    return RequestOutcome(False, start=start - t0, error=error), ""


async def send_native(http: httpx.AsyncClient, cfg: ClientConfig, prompt: str, max_tokens: int,
                      extra: dict, ignore_eos: bool, t0: float) -> tuple[RequestOutcome, str]:
    """One streamed native ``/generate`` request; returns its outcome and final text.

    ``t0`` is the benchmark's start (``time.perf_counter()``); ``outcome.start`` is relative to it.
    Errors (HTTP status, an ``error`` event, a broken stream) give ``success=False``.
    """
    extra = dict(extra)
    lora = extra.pop("lora_path", None)  # a LoRA adapter's name: a top-level field (bench --lora-names)
    sp = {"max_new_tokens": max_tokens, "temperature": cfg.temperature, "ignore_eos": ignore_eos, **extra}
    payload = {"text": prompt, "sampling_params": sp, "stream": True, **({"lora_path": lora} if lora else {})}
    start = time.perf_counter()
    times, n_ids, text, meta, last = [], 0, "", {}, None
    try:
        async for now, ev in _sse_events(http, cfg.base_url + "/generate", payload, cfg.headers):
            last = now
            ids = ev.get("output_ids")
            grew = len(ids) > n_ids if ids is not None else len(ev.get("text", "")) > len(text)
            if grew:
                times.append(now)
            n_ids = len(ids) if ids is not None else n_ids
            text, meta = ev.get("text", text), ev.get("meta_info", meta)
    except _StreamFailed as e:
        return _failed(start, t0, str(e))
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return _failed(start, t0, f"{type(e).__name__}: {e}")
    if (meta.get("finish_reason") or {}).get("type") == "abort":
        return RequestOutcome(False, start=start - t0, error=str(meta["finish_reason"].get("message"))), text
    out = outcome_from_timeline(start, times, int(meta.get("prompt_tokens") or 0),
                                int(meta.get("completion_tokens") or n_ids), int(meta.get("cached_tokens") or 0),
                                end=last if times else None)
    out.start, out.output_text = start - t0, text
    return out, text


async def send_openai(http: httpx.AsyncClient, cfg: ClientConfig, prompt: str, max_tokens: int,
                      extra: dict, ignore_eos: bool, t0: float) -> tuple[RequestOutcome, str]:
    """One streamed OpenAI ``/v1/completions`` request; returns its outcome and final text.

    ``json_schema`` in ``extra`` is sent as sglite's/SGLang's extra ``json_schema`` field.
    """
    extra = dict(extra)
    lora = extra.pop("lora_path", None)  # a LoRA adapter is a model of the OpenAI API
    payload = {"model": lora or cfg.model or "default", "prompt": prompt, "max_tokens": max_tokens,
               "temperature": cfg.temperature, "stream": True, "stream_options": {"include_usage": True},
               **({"ignore_eos": True} if ignore_eos else {}), **extra}
    start = time.perf_counter()
    times, text, usage, chunks, last = [], "", {}, 0, None
    try:
        async for now, ev in _sse_events(http, cfg.base_url + "/v1/completions", payload, cfg.headers):
            last = now
            delta = "".join(c.get("text") or "" for c in ev.get("choices") or [])
            if delta:
                times.append(now)
                text += delta
                chunks += 1
            usage = ev.get("usage") or usage
    except _StreamFailed as e:
        return _failed(start, t0, str(e))
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return _failed(start, t0, f"{type(e).__name__}: {e}")
    details = usage.get("prompt_tokens_details") or {}
    out = outcome_from_timeline(start, times, int(usage.get("prompt_tokens") or 0),
                                int(usage.get("completion_tokens") or chunks), int(details.get("cached_tokens") or 0),
                                end=last if times else None)
    out.start, out.output_text = start - t0, text
    return out, text


async def send(http: httpx.AsyncClient, cfg: ClientConfig, prompt: str, max_tokens: int, extra: dict,
               ignore_eos: bool, t0: float) -> tuple[RequestOutcome, str]:
    """Dispatch to :func:`send_native` or :func:`send_openai` by ``cfg.backend``."""
    fn = send_native if cfg.backend == "sglite" else send_openai
    return await fn(http, cfg, prompt, max_tokens, extra, ignore_eos, t0)


def server_info(cfg: ClientConfig, timeout: float = 30.0) -> dict:
    """``GET /get_server_info`` (sglite native servers), or ``{}`` when the route is missing."""
    try:
        r = httpx.get(cfg.base_url + "/get_server_info", headers=cfg.headers, timeout=timeout)
        return r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def flush_cache(cfg: ClientConfig, timeout: float = 30.0) -> bool:
    """``POST /flush_cache``; True when the server flushed its prefix cache."""
    try:
        return httpx.post(cfg.base_url + "/flush_cache", headers=cfg.headers, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def first_model(cfg: ClientConfig, timeout: float = 30.0) -> Optional[str]:
    """The first model id of ``GET /v1/models`` (None when unavailable)."""
    try:
        data = httpx.get(cfg.base_url + "/v1/models", headers=cfg.headers, timeout=timeout).json()
        return data["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None
