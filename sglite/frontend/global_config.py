"""``global_config``: the frontend's process-wide settings, as SGLang's ``sglang.global_config``.

SGLang programs read and write these attributes (``sgl.global_config.default_backend`` …), so
this is the one piece of process-wide state the DSL keeps. Every attribute is guarded by a lock.

Attributes (SGLang's names and defaults, ``sglang/lang/global_config.py``):
    verbosity: 0 prints nothing; 2 prints each program's final text when ``run`` returns.
    default_backend: the backend ``run`` uses when given none (set with ``set_default_backend``
        or by assignment; an ``sglite.Engine``, a ``Runtime``, a server URL or a Backend).
    skip_special_tokens_in_output / spaces_between_special_tokens_in_out: kept for programs
        that set them; sglite's servers always skip special tokens in output text.
    enable_precache_with_tracing: ``run_batch`` prefills the batch's shared constant prefix once
        before running the items (True).
    enable_parallel_encoding: kept for compatibility; ``join("concate_and_append")`` always
        joins by text (SGLang's KV-level join route no longer exists upstream either).
"""
from __future__ import annotations

import threading
from typing import Any, Optional


class GlobalConfig:
    """Process-wide frontend settings (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._backend = None
        self.verbosity = 0
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True
        self.enable_precache_with_tracing = True
        self.enable_parallel_encoding = True

    @property
    def default_backend(self) -> Optional[Any]:
        """The default Backend (None until set)."""
        with self._lock:
            return self._backend

    @default_backend.setter
    def default_backend(self, backend) -> None:
        from .backend import as_backend  # a Backend, Engine, Runtime or URL; TypeError otherwise
        value = None if backend is None else as_backend(backend)
        with self._lock:
            self._backend = value

    def __repr__(self):
        return (f"GlobalConfig(verbosity={self.verbosity}, default_backend={self.default_backend!r}, "
                f"enable_precache_with_tracing={self.enable_precache_with_tracing})")


global_config = GlobalConfig()

__all__ = ["GlobalConfig", "global_config"]
