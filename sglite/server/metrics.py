"""Prometheus metrics of one server (its own registry: no global state).

Gauges are read from ``engine.get_server_info()`` at scrape time (running and queued requests,
KV usage, cache hit rate); histograms and counters are fed by the server as requests finish
(TTFT, TPOT and end-to-end latency in seconds, prompt / generated / cached tokens, requests by
finish reason, the speculative accept length per verify step). Names follow SGLang's ``sglang:*`` metrics with an ``sglite_`` prefix.
"""
from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

_ACCEPT_BUCKETS = tuple(float(i) for i in range(1, 18))  # accept lengths 1..17 (16 drafts + bonus)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineGauges:
    """A custom collector: reads the engine's live state on every scrape."""

    def __init__(self, info: Callable[[], dict]):
        self._info = info

    def describe(self):
        return []

    def collect(self):
        try:
            info = self._info() or {}
        except Exception:  # noqa: BLE001 - a scrape must not fail because the engine is busy
            info = {}
        total = float(info.get("max_total_tokens") or 0)
        avail = info.get("available_tokens")
        free = info.get("free_tokens")
        used = total - float(avail if avail is not None else (free or total)) if total else 0.0
        rows: list[tuple[str, str, Any]] = [
            ("sglite_num_running_reqs", "Requests decoding now", info.get("running_requests", 0)),
            ("sglite_num_queue_reqs", "Requests waiting to be scheduled", info.get("waiting_requests", 0)),
            ("sglite_max_total_tokens", "KV pool capacity in tokens", total),
            ("sglite_kv_used_tokens", "KV slots held by running requests (not evictable)", used),
            ("sglite_kv_usage", "Fraction of the KV pool held by running requests", used / total if total else 0.0),
            ("sglite_kv_evictable_tokens", "KV slots held only by the radix cache", info.get("evictable_tokens", 0)),
            ("sglite_cache_hit_rate", "Prompt tokens served from the radix cache / prompt tokens",
             info.get("cache_hit_rate", 0.0)),
        ]
        for name, doc, value in rows:
            g = GaugeMetricFamily(name, doc)
            try:
                g.add_metric([], float(value or 0.0))
            except (TypeError, ValueError):
                g.add_metric([], 0.0)
            yield g


class ServerMetrics:
    """The server's metrics registry. ``render()`` gives the Prometheus text exposition."""

    def __init__(self, engine_info: Callable[[], dict]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("sglite_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("sglite_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("sglite_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("sglite_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("sglite_generation_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter("sglite_cached_tokens", "Prompt tokens served from the cache", registry=r)
        self.requests = Counter("sglite_requests", "Finished engine requests by finish reason",
                                ["finish_reason"], registry=r)
        self.aborted = Counter("sglite_aborted_requests", "Engine requests aborted by the server "
                               "(client gone, abort_request)", registry=r)
        self.spec_accept = Histogram("sglite_spec_accept_length", "Tokens produced per speculative verify "
                                     "step (accepted draft tokens + 1)", buckets=_ACCEPT_BUCKETS, registry=r)
        self.http_requests = Counter("sglite_http_requests", "HTTP requests by route and status",
                                     ["route", "status"], registry=r)
        r.register(_EngineGauges(engine_info))

    def observe_finished(self, meta: dict) -> None:
        """Record one finished engine request from its ``meta_info`` (the engine contract's keys;
        times in seconds)."""
        completion = meta["completion_tokens"]
        self.prompt_tokens.inc(meta["prompt_tokens"])
        self.generation_tokens.inc(completion)
        self.cached_tokens.inc(meta["cached_tokens"])
        self.requests.labels(finish_reason=meta["finish_reason"]["type"]).inc()
        ttft, e2e = meta["ttft"], meta["e2e_latency"]  # ttft None: no token was generated
        if ttft is not None:
            self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        if ttft is not None and completion > 1 and e2e >= ttft:
            self.tpot.observe((e2e - ttft) / (completion - 1))
        for accepted, steps in enumerate(meta.get("spec_accept_histogram") or ()):  # speculative decoding
            for _ in range(steps):
                self.spec_accept.observe(accepted + 1)

    def observe_http(self, route: str, status: int) -> None:
        self.http_requests.labels(route=route, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
