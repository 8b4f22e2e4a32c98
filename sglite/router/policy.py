"""Which worker gets a request: cache-aware (approximate radix trees + load balance), round robin, random.

Cache-aware, as SGLang's router documents it (sglang-router / SGLang Model Gateway, policy
``cache_aware``; defaults of its current docs):

1. load is *imbalanced* when ``max_load - min_load > balance_abs_threshold`` **and**
   ``max_load > min_load * balance_rel_threshold`` (load = requests in flight at the router);
   then the least-loaded worker gets the request;
2. otherwise the worker whose approximate tree (:class:`~.approx_tree.ApproxRadixTree`) matches the
   longest prefix of the request text gets it when ``matched / len(text) > cache_threshold``;
3. otherwise the worker with the smallest tree (the most room for a new prefix).

In every case the text is inserted into the chosen worker's tree.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

from ..errors import InvalidRequestError
from .approx_tree import ApproxRadixTree

POLICIES = ("cache_aware", "round_robin", "random")


@dataclass(frozen=True)
class RouterConfig:
    """Options of ``sglite router`` (sglang-router's names).

    Attributes:
        worker_urls: base URLs of the workers (``http://host:port``).
        host: interface the router binds.
        port: TCP port of the router.
        policy: ``cache_aware`` | ``round_robin`` | ``random``.
        cache_threshold: minimum matched fraction of a request's text (0..1) for the
            longest-prefix worker to win (cache_aware).
        balance_abs_threshold: load is imbalanced only if the busiest worker has more than this
            many requests in flight over the idlest (cache_aware) ...
        balance_rel_threshold: ... and more than this many times as many (cache_aware).
        max_tree_size: characters each worker's approximate tree keeps (LRU beyond).
        health_check_interval_secs: seconds between ``/health`` probes of every worker.
        max_retries: other workers a request is tried on when its worker fails before any output
            was sent to the client (connection errors, a dropped connection, 502/503/504): 0 or 1,
            so that a request that kills its worker reaches at most two.
        request_timeout_secs: seconds a proxied request may take (then 504, and the request is
            aborted on its worker).
        max_request_bytes: request bodies above this many bytes get 413 (the server's default).
        api_key: require ``Authorization: Bearer <api_key>`` on every route of the router but
            ``/health``; None = no key at the router (the header is forwarded to the workers
            either way, so workers started with ``--api-key`` still check it).
        admin_api_key: the key of the router's operator routes (``/flush_cache``,
            ``/abort_request`` with ``abort_all``); None = they are guarded like every other route.
        pd_disaggregation: route over prefill/decode server pairs instead of ``worker_urls``.
        prefill_urls: prefill servers as ``(url, bootstrap_port)`` pairs (pd_disaggregation).
        decode_urls: decode servers (pd_disaggregation).
    """

    worker_urls: tuple = ()
    host: str = "127.0.0.1"
    port: int = 30000
    policy: str = "cache_aware"
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 1 << 22
    health_check_interval_secs: float = 10.0
    max_retries: int = 1
    request_timeout_secs: float = 600.0
    max_request_bytes: int = 8 * 1024 * 1024
    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None
    pd_disaggregation: bool = False
    prefill_urls: tuple = ()
    decode_urls: tuple = ()

    def __post_init__(self):
        def bad(name, msg):
            raise InvalidRequestError(f"{name}: {msg}", field=name)

        if self.policy not in POLICIES:
            bad("policy", f"must be one of {POLICIES}, got {self.policy!r}")
        if not 0 <= self.cache_threshold <= 1:
            bad("cache_threshold", f"must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            bad("balance_abs_threshold", f"must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1:
            bad("balance_rel_threshold", f"must be >= 1, got {self.balance_rel_threshold}")
        if self.max_tree_size < 1:
            bad("max_tree_size", f"must be >= 1, got {self.max_tree_size}")
        if self.health_check_interval_secs <= 0:
            bad("health_check_interval_secs", f"must be > 0, got {self.health_check_interval_secs}")
        if not 0 <= self.max_retries <= 1:
            bad("max_retries", f"must be 0 or 1 (a request is retried on another worker at most once), "
                               f"got {self.max_retries}")
        if self.request_timeout_secs <= 0:
            bad("request_timeout_secs", f"must be > 0, got {self.request_timeout_secs}")
        if self.max_request_bytes < 1024:
            bad("max_request_bytes", f"must be >= 1024, got {self.max_request_bytes}")
        if self.pd_disaggregation and not (self.prefill_urls and self.decode_urls):
            bad("prefill_urls", "pd_disaggregation needs at least one --prefill and one --decode server")
        for u in (*self.worker_urls, *(p[0] for p in self.prefill_urls), *self.decode_urls):
            if not str(u).startswith(("http://", "https://")):
                bad("worker_urls", f"must be http(s)://host:port URLs, got {u!r}")


class Policy:
    """``select(text, loads, healthy) -> index`` over workers ``0..n-1``; ``loads[i]`` = requests in
    flight, ``healthy[i]`` = usable. Raises RuntimeError when no worker is healthy."""

    def __init__(self, config: RouterConfig, n: int, seed: int = 0):
        self.config, self.n = config, n
        self.trees = [ApproxRadixTree(config.max_tree_size) for _ in range(n)]
        self._rr = 0
        self._rng = random.Random(seed)

    def select(self, text: str, loads: list[int], healthy: list[bool]) -> int:
        """Index of the worker for a request of ``text`` under ``config.policy`` (see the class)."""
        ok = [i for i in range(self.n) if healthy[i]]
        if not ok:
            raise RuntimeError("no healthy worker")
        p = self.config.policy
        if p == "round_robin":
            for _ in range(self.n):
                i, self._rr = self._rr % self.n, self._rr + 1
                if healthy[i]:
                    return i
        if p == "random":
            return self._rng.choice(ok)
        i = self._cache_aware(text, loads, ok)
        self.trees[i].insert(text)
        return i

    def _cache_aware(self, text: str, loads: list[int], ok: list[int]) -> int:
        c = self.config
        lo, hi = min(loads[i] for i in ok), max(loads[i] for i in ok)
        if hi - lo > c.balance_abs_threshold and hi > lo * c.balance_rel_threshold:
            return min(ok, key=lambda i: loads[i])
        matches = {i: self.trees[i].match(text) for i in ok}
        best = max(ok, key=lambda i: (matches[i], -loads[i]))
        if text and matches[best] / len(text) > c.cache_threshold:
            return best
        return min(ok, key=lambda i: (self.trees[i].size, loads[i]))

    def forget(self, i: int) -> None:
        """Drop worker ``i``'s tree (its cache was flushed or it restarted)."""
        self.trees[i].clear()
