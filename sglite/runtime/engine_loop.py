"""EngineLoop: the scheduler's background thread and its inbox.

Caller threads (sync, asyncio, HTTP) never touch the scheduler: they put messages
(:mod:`sglite.runtime.engine_messages`) on a thread-safe queue; the loop drains the queue
between steps, and results come back through each request's ``sink``. Request ids in flight are
registered here, so a duplicate is refused before anything is queued.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Optional

from ..errors import InvalidRequestError, QueueFullError
from .engine_messages import Abort, Call, Message, Stop, SubmitReqs
from .profiler import ProfileResult, ProfileSession
from .req import FinishReason

log = logging.getLogger("sglite.engine")


class EngineLoop:
    """Runs ``scheduler.step()`` in a daemon thread while there is work.

    Args:
        scheduler: the :class:`~sglite.runtime.scheduler.Scheduler` it owns from now on.
        check_invariants: assert pool/tree invariants after every step (tests).
    """

    def __init__(self, scheduler, check_invariants: bool = False, max_queued_requests: Optional[int] = None):
        self.scheduler = scheduler
        self.check_invariants = check_invariants
        self.max_queued_requests = max_queued_requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # C queue: a cheap empty() between steps
        self._active: set[str] = set()  # rids in flight (duplicates are refused)
        self._active_lock = threading.Lock()
        self.stopped = False
        self.profile: Optional[ProfileSession] = None  # the running profile (loop thread only)
        self.profile_result: Optional[ProfileResult] = None  # one that stopped by itself (num_steps)
        self._thread = threading.Thread(target=self._run, name="sglite-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side
    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, reqs) -> None:
        """Register the requests' rids and queue them.

        Raises:
            InvalidRequestError: a rid is already in flight or repeated (field ``rid``).
            QueueFullError: ``max_queued_requests`` requests already wait (in flight, not running).
            RuntimeError: the engine is shut down.
        """
        if self.stopped or not self.alive:
            raise RuntimeError("engine is shut down")
        rids = [r.rid for r in reqs]
        with self._active_lock:
            dup = sorted((set(rids) & self._active) | {x for x in rids if rids.count(x) > 1})
            if dup:
                raise InvalidRequestError(f"rid: request id(s) {dup[:3]} already in flight", field="rid")
            cap = self.max_queued_requests
            if cap is not None:
                queued = len(self._active) - len(self.scheduler.running)
                if queued >= cap:
                    raise QueueFullError(f"server busy: {queued} requests are waiting, the limit is "
                                         f"max_queued_requests={cap} (--max-queued-requests); retry later",
                                         retry_after=1)
            self._active.update(rids)
        for r in reqs:
            r.sink = self._releasing(r.rid, r.sink)
        self._inbox.put(SubmitReqs(tuple(reqs)))

    def _releasing(self, rid: str, sink):
        def wrapped(ev):
            if ev.finished:
                with self._active_lock:
                    self._active.discard(rid)
            sink(ev)
        return wrapped

    def abort(self, rid: str) -> None:
        self._inbox.put(Abort(rid))

    def abort_reqs(self, reqs) -> None:
        """Abort these requests (a call whose consumer went away)."""
        for r in reqs:
            self._inbox.put(Abort(r.rid))

    def call(self, fn):
        """Run ``fn`` on the loop thread between steps and return its result (or raise its error).
        Raises RuntimeError when the engine is shut down or its loop thread died (never hangs)."""
        if self.stopped:
            raise RuntimeError("engine is shut down")
        fut: Future = Future()
        done = threading.Event()
        fut.add_done_callback(lambda _: done.set())
        self._inbox.put(Call(fn, fut))
        self.wait(done)
        return fut.result()

    def wait(self, event: threading.Event) -> None:
        """Block until ``event`` is set. Raises RuntimeError if the loop died meanwhile."""
        while not event.wait(0.5):
            if not self.alive:
                raise RuntimeError("engine loop has stopped")

    def stop(self, timeout: float = 30) -> None:
        """Abort unfinished requests, close the scheduler (its grammar-mask thread) and join the
        loop thread (idempotent). Called from the loop thread itself (an engine collected there)
        it only asks the loop to stop."""
        if not self.stopped:
            self.stopped = True
            self._inbox.put(Stop())
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                log.warning("engine loop did not stop within %.0f s", timeout)

    # ------------------------------------------------------------------ loop thread
    def _next_message(self, block: bool):
        """The next inbox message, or None: waits up to 0.1 s when ``block`` (idle), else only
        looks (this thread is the only reader, so a non-empty inbox has a message for it)."""
        if not block:
            return None if self._inbox.empty() else self._inbox.get_nowait()
        try:
            return self._inbox.get(timeout=0.1)
        except queue.Empty:
            return None

    def _run(self) -> None:
        sched = self.scheduler
        while True:
            msg = self._next_message(block=not sched.has_work())
            while msg is not None:
                if isinstance(msg, Stop):
                    if self.profile is not None:  # write it, and take the kernels' probes off
                        try:
                            self.stop_profile()
                        except Exception:
                            log.exception("stopping the profile failed")
                    sched.abort_all("aborted by client")
                    sched.close()
                    return
                try:
                    self.handle(msg)
                except Exception:  # the loop thread must survive, or every caller hangs
                    log.exception("engine message %s failed", type(msg).__name__)
                msg = self._next_message(block=False)
            if not sched.has_work():
                continue
            try:
                stepped = sched.step()
                if self.check_invariants:
                    sched.check_invariants()
                if stepped and self.profile is not None and self.profile.step_done():
                    self.profile_result, self.profile = self.profile.stop(), None
            except Exception as exc:  # keep serving: fail the running requests, free their KV
                log.exception("scheduler step failed")
                try:
                    self._fail_running(exc)
                except Exception:  # the loop thread must survive, or every caller hangs
                    log.exception("failing the running requests failed")

    def start_profile(self, **options) -> str:
        """Start a :class:`~sglite.runtime.profiler.ProfileSession` (``options``: its arguments);
        returns its output directory. Loop thread only (through :meth:`call`).

        Raises:
            InvalidRequestError: a profile is already running (field ``profile``), or a bad option.
        """
        if self.profile is not None:
            raise InvalidRequestError("profile: a profile is already running; stop it first (/stop_profile)",
                                      field="profile")
        session = ProfileSession(**options)
        session.start()
        self.profile, self.profile_result = session, None
        return session.output_dir

    def stop_profile(self) -> ProfileResult:
        """Stop the running profile and write its files (or hand over one that stopped after its
        ``num_steps``). Loop thread only (through :meth:`call`).

        Raises:
            InvalidRequestError: no profile was started (field ``profile``).
        """
        if self.profile is None:
            if self.profile_result is None:
                raise InvalidRequestError("profile: no profile is running (start one with /start_profile)",
                                          field="profile")
            result, self.profile_result = self.profile_result, None
            return result
        session, self.profile = self.profile, None
        return session.stop()

    def handle(self, msg: Message) -> None:
        """Apply one inbox message (loop thread)."""
        if isinstance(msg, SubmitReqs):
            for r in msg.reqs:
                self.scheduler.add_request(r)
        elif isinstance(msg, Abort):
            self.scheduler.abort(msg.rid)
        elif isinstance(msg, Call):
            try:
                msg.future.set_result(msg.fn())
            except Exception as exc:
                msg.future.set_exception(exc)
        else:
            raise TypeError(f"unknown engine message {msg!r}")

    def _fail_running(self, exc: Exception) -> None:
        self.scheduler.abort_all(f"internal error: {exc!r}", running_only=True)


def loop_sink(loop, q, i: int):
    """An event sink (called on the engine's loop thread) that hands ``(i, event)`` to ``q`` on
    the asyncio ``loop``. A caller whose event loop has closed (``asyncio.run`` returned while the
    engine still held its request, which is then aborted) is no longer listening: its events are
    dropped instead of raising on the loop thread, which had killed the engine for every caller."""
    def put(ev) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, (i, ev))
        except RuntimeError:  # "Event loop is closed"
            pass
    return put
