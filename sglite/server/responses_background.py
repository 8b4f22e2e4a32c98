"""``background: true`` responses of ``/v1/responses``: the request returns at once (status
``queued``), the generation runs as a task of the server's event loop, and the client polls
``GET /v1/responses/{id}`` (``queued`` -> ``in_progress`` -> ``completed`` / ``incomplete`` /
``failed``) or stops it with ``POST /v1/responses/{id}/cancel`` (``cancelled``; the engine request
is aborted). As OpenAI documents, a background response needs ``store: true`` (it is polled from the
store) and cannot be streamed here (``stream: true`` with it is a 400).

Bounded by the store: a background response lives in the
:class:`~sglite.server.responses_store.ResponseStore` from the start, so ``--responses-store-size``
bounds how many there are; one that leaves the store while running (evicted, expired, deleted) is
cancelled.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Optional

log = logging.getLogger(__name__)

TERMINAL = ("completed", "incomplete", "failed", "cancelled")


class BackgroundResponses:
    """The running background responses: ``id -> asyncio.Task``.

    ``start`` is called on the event loop; ``dropped`` may be called from any thread (the store's
    ``on_drop``) and cancels on the loop the task was started on.
    """

    def __init__(self):
        self._tasks: dict[str, asyncio.Task] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def __len__(self) -> int:
        return len(self._tasks)

    def running(self, response_id: str) -> bool:
        return response_id in self._tasks

    def start(self, response_id: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run ``run()`` as a task under ``response_id`` (forgotten when it ends)."""
        self._loop = asyncio.get_running_loop()
        task = self._loop.create_task(run())
        self._tasks[response_id] = task
        task.add_done_callback(lambda t: self._done(response_id, t))

    def _done(self, response_id: str, task: asyncio.Task) -> None:
        if self._tasks.get(response_id) is task:
            del self._tasks[response_id]
        if not task.cancelled() and task.exception() is not None:
            log.warning("background response %s failed", response_id, exc_info=task.exception())

    def finish(self, response_id: str) -> None:
        """Forget ``response_id`` before its final result is stored (storing it replaces the
        entry, which must not cancel the task that stores it)."""
        self._tasks.pop(response_id, None)

    def cancel(self, response_id: str) -> bool:
        """Cancel a running response (on the event loop); True when it was running."""
        task = self._tasks.pop(response_id, None)
        if task is None:
            return False
        task.cancel()
        return True

    def dropped(self, response_id: str) -> None:
        """The store let ``response_id`` go: cancel it if it still runs (thread-safe)."""
        task = self._tasks.pop(response_id, None)
        if task is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(task.cancel)

    async def cancel_all(self) -> None:
        """Cancel every running response and wait for them (at the server's shutdown)."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
