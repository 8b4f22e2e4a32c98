"""The bounded store of ``/v1/responses`` results (``store: true``), for ``GET``/``DELETE
/v1/responses/{id}``, ``/input_items`` and ``previous_response_id``.

Bounded two ways, each a flag: at most ``max_size`` responses (``--responses-store-size``; the
oldest stored is dropped first) and each kept ``ttl`` seconds after it was stored
(``--responses-ttl``). An evicted or expired response is gone: retrieving it is a 404 and chaining
from it a 400 naming ``previous_response_id`` (the client then resends the history). Only
metadata and token-free items are kept here; the KV of a stored conversation's prefix is pinned in
the engine's radix cache by :mod:`sglite.server.responses_pins` (``on_drop`` unpins it when the
entry leaves the store).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class StoredResponse:
    """One stored response: the response object, this request's input items (with ids), and the
    conversation up to and including its output (the items a follow-up request builds on)."""

    response: dict
    input_items: list[dict]
    conversation: list[dict]


class ResponseStore:
    """``id -> StoredResponse``, at most ``max_size`` entries, each kept ``ttl`` seconds.

    Args:
        max_size: entries kept (>= 0; 0 stores nothing).
        ttl: seconds an entry is kept (> 0).
        clock: monotonic seconds (tests pass a fake).
        on_drop: called with the id of every entry that leaves the store (replaced, evicted,
            expired or deleted), after the store's lock is released.
    Raises:
        ValueError: a bound out of range, naming it.
    """

    def __init__(self, max_size: int = 1000, ttl: float = 3600.0, clock: Callable[[], float] = time.monotonic,
                 on_drop: Optional[Callable[[str], None]] = None):
        if max_size < 0:
            raise ValueError(f"responses_store_size: must be >= 0, got {max_size}")
        if not ttl > 0:
            raise ValueError(f"responses_ttl: must be > 0 seconds, got {ttl}")
        self.max_size, self.ttl, self._clock = max_size, ttl, clock
        self._items: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()
        self._lock = threading.Lock()
        self._on_drop = on_drop
        self._dropped: list[str] = []

    def _notify(self) -> None:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        if self._on_drop is not None:
            for rid in dropped:
                self._on_drop(rid)

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            n = len(self._items)
        self._notify()
        return n

    def _expire(self) -> None:
        now = self._clock()
        while self._items:
            key, (t, _) = next(iter(self._items.items()))
            if now - t < self.ttl:
                break
            del self._items[key]
            self._dropped.append(key)

    def put(self, rid: str, entry: StoredResponse) -> None:
        """Store ``entry`` under ``rid`` (replacing one with that id), evicting the oldest over ``max_size``."""
        with self._lock:
            if self._items.pop(rid, None) is not None:
                self._dropped.append(rid)
            if self.max_size == 0:
                self._dropped.append(rid)  # never kept
            else:
                self._items[rid] = (self._clock(), entry)
                self._expire()
                while len(self._items) > self.max_size:
                    self._dropped.append(self._items.popitem(last=False)[0])
        self._notify()

    def get(self, rid: str) -> Optional[StoredResponse]:
        """The entry of ``rid``, or None when it was never stored, was deleted, evicted or expired."""
        with self._lock:
            self._expire()
            hit = self._items.get(rid)
        self._notify()
        return hit[1] if hit is not None else None

    def delete(self, rid: str) -> bool:
        """Forget ``rid``; True when it was there."""
        with self._lock:
            self._expire()
            gone = self._items.pop(rid, None) is not None
            if gone:
                self._dropped.append(rid)
        self._notify()
        return gone
