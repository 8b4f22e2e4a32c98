"""sglite: a structured-generation and agent-program runtime for LLMs.

``import sglite`` is light (no torch): heavy parts load on first use. ``from sglite import *``
gives the frontend DSL as SGLang's ``from sglang import *`` does (``function``, ``gen``,
``select``, roles, ``Runtime``, ``RuntimeEndpoint``, ``OpenAI``, the choice methods, the
``REGEX_*`` constants, ``global_config``), still without torch; ``sglite.Engine`` is imported
by name.
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
    "Runtime": ("sglite.frontend.runtime", "Runtime"),
    "OpenAI": ("sglite.frontend.openai_backend", "OpenAI"),
    "global_config": ("sglite.frontend.global_config", "global_config"),
}
_FRONTEND = ("function", "gen", "gen_int", "gen_string", "select", "system", "user", "assistant",
             "system_begin", "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
             "set_default_backend", "RuntimeEndpoint", "flush_cache", "get_server_info",
             "greedy_token_selection", "token_length_normalized", "unconditional_likelihood_normalized",
             "REGEX_INT", "REGEX_FLOAT", "REGEX_BOOL", "REGEX_STR")

#: what ``from sglite import *`` gives: SGLang's top-level names (Engine aside: it needs torch)
__all__ = [*_FRONTEND, "Runtime", "OpenAI", "global_config", "__version__"]


def __getattr__(name):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    if name in _FRONTEND:
        return getattr(importlib.import_module("sglite.frontend"), name)
    raise AttributeError(f"module 'sglite' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY) + list(_FRONTEND))
