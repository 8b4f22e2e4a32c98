"""Messages on the engine's inbox (caller threads -> the scheduler loop thread).

One small frozen dataclass per kind instead of string-tagged tuples; the loop dispatches on the
type (:meth:`sglite.runtime.engine_loop.EngineLoop.handle`).
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Union


@dataclass(frozen=True)
class SubmitReqs:
    """Queue these validated :class:`~sglite.runtime.req.Req` objects (one generate call)."""

    reqs: tuple


@dataclass(frozen=True)
class Abort:
    """Abort request ``rid`` and its samples ``rid-<k>``."""

    rid: str


@dataclass(frozen=True)
class Call:
    """Run ``fn()`` on the loop thread between steps; its result or exception goes to ``future``."""

    fn: Callable[[], Any]
    future: Future


@dataclass(frozen=True)
class Stop:
    """Abort everything unfinished and end the loop."""


Message = Union[SubmitReqs, Abort, Call, Stop]
