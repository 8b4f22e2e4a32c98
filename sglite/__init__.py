"""sglite: a structured-generation and agent-program runtime for LLMs.

``import sglite`` is light (no torch): heavy parts load on first use.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "Engine": ("sglite.runtime.engine", "Engine"),
    "EngineConfig": ("sglite.config", "EngineConfig"),
    "SamplingParams": ("sglite.sampling_params", "SamplingParams"),
    "SgliteError": ("sglite.errors", "SgliteError"),
    "InvalidRequestError": ("sglite.errors", "InvalidRequestError"),
    "GrammarError": ("sglite.errors", "GrammarError"),
    "CapacityError": ("sglite.errors", "CapacityError"),
}
_FRONTEND = ("function", "gen", "gen_int", "gen_string", "select", "system", "user", "assistant",
             "system_begin", "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
             "set_default_backend", "RuntimeEndpoint", "flush_cache", "get_server_info")


def __getattr__(name):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    if name in _FRONTEND:
        return getattr(importlib.import_module("sglite.frontend"), name)
    raise AttributeError(f"module 'sglite' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY) + list(_FRONTEND))
