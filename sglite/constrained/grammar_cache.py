"""Thread-safe LRU cache of compiled grammars, keyed by (kind, spec): shared by sglite's own
:class:`~sglite.constrained.backend.GrammarBackend` and the optional external backends."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Callable

from sglite.errors import GrammarError


def cache_key(kind: str, spec) -> tuple:
    """Hashable key for a grammar spec: JSON-like specs by their JSON text, choices as a tuple."""
    if kind == "choices" and isinstance(spec, (list, tuple)):
        return kind, tuple(spec)
    if isinstance(spec, (dict, list, bool)):
        return kind, json.dumps(spec)  # key order kept: properties are emitted in schema order
    return kind, spec


class GrammarCache:
    """At most ``max_size`` compiled grammars, least recently used evicted first."""

    def __init__(self, max_size: int = 256):
        self.max_size = max_size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get_or_compile(self, kind: str, spec, compile_fn: Callable):
        """The cached grammar for (kind, spec), else ``compile_fn()`` stored under that key.

        Two threads missing at once may both compile; the later result wins (both are equal).
        Raises whatever ``compile_fn`` raises; a RecursionError becomes GrammarError.
        """
        key = cache_key(kind, spec)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                return hit
        try:
            out = compile_fn()
        except RecursionError:
            raise GrammarError(f"{kind} grammar is nested too deeply") from None
        with self._lock:
            self._items[key] = out
            while len(self._items) > self.max_size:
                self._items.popitem(last=False)
        return out

    def __len__(self) -> int:
        return len(self._items)
