"""Logging set-up of sglite (SGLang's ``configure_logger``, one place for it).

Entry points configure it: the CLI and ``sglite serve`` call :func:`configure`; a library user
who builds an ``Engine`` gets :func:`configure_if_unset`, which adds a handler only when the
application has configured none (and otherwise only sets the level of the ``sglite`` logger),
so an application's own logging set-up always wins.
"""
from __future__ import annotations

import logging

LOGGER = "sglite"
FORMAT = "[sglite %(asctime)s %(levelname)s %(name)s] %(message)s"
LEVELS = ("debug", "info", "warning", "error", "critical")


def _level(level: str) -> int:
    name = str(level).lower()
    if name not in LEVELS:
        raise ValueError(f"log_level: must be one of {', '.join(LEVELS)}, got {level!r}")
    return getattr(logging, name.upper())


def _ours(h: logging.Handler) -> bool:
    return getattr(h, "_sglite", False)


def configure(level: str = "info") -> logging.Logger:
    """Give the ``sglite`` logger ``level`` and one stream handler (stderr); idempotent.

    Raises:
        ValueError: an unknown level (names ``log_level``).
    """
    lg = logging.getLogger(LOGGER)
    lg.setLevel(_level(level))
    if not any(_ours(h) for h in lg.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter(FORMAT, "%H:%M:%S"))
        h._sglite = True  # type: ignore[attr-defined]
        lg.addHandler(h)
    return lg


def is_configured() -> bool:
    """True when the ``sglite`` logger or the root logger already has a handler."""
    return bool(logging.getLogger(LOGGER).handlers or logging.getLogger().handlers)


def configure_if_unset(level: str = "info") -> logging.Logger:
    """:func:`configure` unless logging is set up already; then only set the ``sglite`` level."""
    if not is_configured():
        return configure(level)
    lg = logging.getLogger(LOGGER)
    lg.setLevel(_level(level))
    return lg


class PhaseTimer:
    """Times named start-up phases and logs each one at info as it ends.

        timer = PhaseTimer(logging.getLogger("sglite.engine"))
        with timer.phase("tokenizer"):
            ...
        timer.phases    # {"tokenizer": 0.12}  (seconds, wall clock, in the order they ran)

    One instance per start-up (no shared state). A phase that raises is not recorded.
    """

    def __init__(self, logger: logging.Logger, prefix: str = "Start-up"):
        import time

        self._log, self._prefix, self._clock = logger, prefix, time.perf_counter
        self._t0 = self._clock()
        self.phases: dict[str, float] = {}

    def phase(self, name: str):
        """Context manager timing the phase ``name`` (seconds, added to :attr:`phases`)."""
        import contextlib

        @contextlib.contextmanager
        def timed():
            t = self._clock()
            yield
            dt = self._clock() - t
            self.phases[name] = self.phases.get(name, 0.0) + dt
            self._log.info("%s: %s took %.2f s", self._prefix, name, dt)
        return timed()

    @property
    def elapsed(self) -> float:
        """Seconds since the timer was made."""
        return self._clock() - self._t0

    def summary(self) -> str:
        """``"checkpoint load 0.10 s, tokenizer 0.12 s, ..."``."""
        return ", ".join(f"{k} {v:.2f} s" for k, v in self.phases.items())
