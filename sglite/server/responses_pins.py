"""Multi-turn KV for ``/v1/responses``: while a response is stored, the radix-cache prefix of its
conversation (the prompt it was generated from plus its output) stays pinned in the engine, so a
follow-up with ``previous_response_id``, whose rendered prompt extends that prefix, prefills only
its new input.

* Bound: at most ``--responses-pin-tokens`` pinned tokens in all (0: off); over it the least
  recently pinned response is unpinned first (its prefix stays cached as an ordinary LRU entry,
  see :mod:`sglite.runtime.prefix_pins` for how pins coexist with LRU eviction).
* A response is unpinned when it leaves the store (deleted, evicted, expired) and when a
  follow-up chained from it is pinned (the follow-up's prefix contains it: the lock on the
  deeper node keeps the shorter prefix too).
* Engines without ``pin_prefix`` (the fake engine, remote engines) are left alone.

Pin and unpin calls go to the engine's loop thread from one worker thread, in order, never from
the event loop (they wait for the end of an engine step).
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

log = logging.getLogger(__name__)


class ResponsePins:
    """Pins stored responses' prefixes in ``engine`` (see the module docstring).

    Args:
        engine: the served engine; pinning is off unless it has ``pin_prefix``/``unpin_prefix``.
        max_tokens: the pinned-token budget (``--responses-pin-tokens``; 0 turns pinning off).
    """

    def __init__(self, engine, max_tokens: int):
        self.engine, self.max_tokens = engine, max_tokens
        self.enabled = max_tokens > 0 and hasattr(engine, "pin_prefix") and hasattr(engine, "unpin_prefix")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sglite-pins") if self.enabled else None
        self._held: set = set()  # response ids pinned by this server (released at its shutdown)

    def _ids(self, prompt, output_ids: Optional[list], text: str) -> list[int]:
        tok = self.engine.tokenizer
        head = list(prompt) if isinstance(prompt, list) else list(tok.encode_prompt(prompt))
        return head + (list(output_ids) if output_ids else list(tok.encode(text)))

    def _pin(self, response_id: str, prompt: str, output_ids, text: str, previous_id: Optional[str]) -> None:
        try:
            if previous_id is not None:
                self.engine.unpin_prefix(previous_id)
            n, dropped = self.engine.pin_prefix(response_id, self._ids(prompt, output_ids, text), self.max_tokens)
            self._held.add(response_id)
            self._held.difference_update(dropped)
            if previous_id is not None:
                self._held.discard(previous_id)
            log.debug("pinned %d tokens for %s (released %d older pins)", n, response_id, len(dropped))
        except Exception:  # noqa: BLE001 - a pin is an optimization: never fail a request for it
            log.warning("pinning the prefix of %s failed", response_id, exc_info=True)

    def pin(self, response_id: str, prompt, output_ids: Optional[list], text: str,
            previous_id: Optional[str] = None) -> None:
        """Pin ``prompt`` (its text, or its token ids as sent) + the output (``output_ids``, else ``text`` tokenized) under
        ``response_id``, releasing ``previous_id``'s pin (asynchronous; never raises)."""
        if self._pool is not None:
            self._pool.submit(self._pin, response_id, prompt, output_ids, text, previous_id)

    def unpin(self, response_id: str) -> None:
        """Release ``response_id``'s pin (asynchronous; never raises)."""
        if self._pool is not None:
            self._pool.submit(self._unpin, response_id)

    def _unpin(self, response_id: str) -> None:
        self._held.discard(response_id)
        try:
            self.engine.unpin_prefix(response_id)
        except Exception:  # noqa: BLE001
            log.warning("unpinning %s failed", response_id, exc_info=True)

    def release_all(self) -> None:
        """Release every pin this server took and wait for it (at the server's shutdown: the engine
        may outlive the server, e.g. an in-process Engine served more than once)."""
        if self._pool is None:
            return
        self._pool.submit(lambda: [self._unpin(k) for k in list(self._held)]).result()

    def drain(self) -> None:
        """Wait for the queued pin/unpin calls (tests)."""
        if self._pool is not None:
            self._pool.submit(lambda: None).result()
