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
