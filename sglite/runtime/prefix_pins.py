"""Pinned radix-cache prefixes: a caller-chosen key holds a lock on the radix node of a prefix, so
LRU eviction skips it until the key is unpinned (the Responses API pins a stored conversation's
prompt + output, so the next turn via ``previous_response_id`` prefills only its new input).

How it coexists with LRU eviction: a pin is one :meth:`RadixCache.inc_lock_ref` on the deepest
node of the prefix, exactly what a running request holds on its cached prefix. Pinned tokens
count as protected (not evictable); everything else in the tree is evicted least recently used
first as before. The pinned total is bounded by the caller's ``max_tokens`` on every :meth:`pin`,
and never more than half the KV pool (:attr:`MAX_POOL_FRACTION`: running requests keep room):
over it, the least recently pinned keys are unpinned first (their tokens become ordinary LRU
entries again, evicted only when space is needed). A flush of the cache drops every pin.

Sizes are in tokens of the pin's own prefix (a prefix shared by two pins counts twice: the bound
is conservative). Only the engine's loop thread calls this class.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from .radix_cache import RadixCache


MAX_POOL_FRACTION = 0.5


class PrefixPins:
    """``key -> locked radix node`` with a token budget enforced LRU (see the module docstring).

    Args:
        cache: the engine's radix cache.
    """

    def __init__(self, cache: RadixCache):
        self.cache = cache
        self._pins: OrderedDict[Hashable, tuple[object, int]] = OrderedDict()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, key: Hashable, ids: list[int], max_tokens: int) -> tuple[int, list]:
        """Pin the cached part of ``ids`` under ``key`` (replacing ``key``'s old pin), then unpin the
        least recently pinned keys while more than ``max_tokens`` tokens are pinned.

        Returns ``(tokens pinned for key, keys unpinned to make room)``: 0 pinned when nothing of
        ``ids`` is cached, the cache is disabled, or the prefix alone exceeds the budget
        (``max_tokens``, capped at half the pool).
        """
        self.unpin(key)
        max_tokens = min(max_tokens, int(self.cache.pool.capacity * MAX_POOL_FRACTION))
        if self.cache.disabled or max_tokens <= 0 or not ids:
            return 0, []
        slots, node = self.cache.match_prefix(list(ids))
        n = len(slots)
        if n == 0 or n > max_tokens:
            return 0, []
        self.cache.inc_lock_ref(node)
        self._pins[key] = (node, n)
        self.tokens += n
        dropped = []
        while self.tokens > max_tokens:
            old, _ = next(iter(self._pins.items()))
            self.unpin(old)
            dropped.append(old)
        return n, dropped

    def unpin(self, key: Hashable) -> bool:
        """Release ``key``'s pin; False when it had none."""
        hit = self._pins.pop(key, None)
        if hit is None:
            return False
        node, n = hit
        self.cache.dec_lock_ref(node)
        self.tokens -= n
        return True

    def clear(self) -> None:
        """Release every pin (before a cache flush)."""
        for key in list(self._pins):
            self.unpin(key)
