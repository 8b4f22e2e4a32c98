"""sglite's HTTP server: SGLang's native API and the OpenAI API over one in-process engine.

    from sglite.server import create_app, ServerConfig, ServerThread
    app = create_app(engine, ServerConfig(port=30000))     # a FastAPI app
    with ServerThread(engine) as srv: ...                   # uvicorn in a thread, free port

Modules: protocol (request models), app (assembly), native_api, openai_api / openai_chat /
openai_params / openai_format / openai_common, tool_calls, engine_client (async engine access,
aborts), sse, metrics (Prometheus), middleware (API key, body cap, 500s), errors, settings
(ServerConfig), runner (ServerThread), launcher (LaunchedServer: a server in a subprocess or
thread), disaggregation (P/D endpoints), pd_transfer (their wire: tokens, peers, checked
payloads), testing (FakeEngine). The command line (``sglite serve``) is :mod:`sglite.launch_server`.
Imports are lazy so ``import sglite.server`` stays light.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "create_app": ("sglite.server.app", "create_app"),
    "ServerConfig": ("sglite.server.settings", "ServerConfig"),
    "ServerThread": ("sglite.server.runner", "ServerThread"),
    "FakeEngine": ("sglite.server.testing", "FakeEngine"),
}


def __getattr__(name):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'sglite.server' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
