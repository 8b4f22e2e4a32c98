"""The FastAPI application: native + OpenAI routes over one in-process engine.

``create_app(engine, ServerConfig(...))`` builds a fresh app (its own metrics registry, its own
set of in-flight requests); nothing is global, so tests may run several apps side by side.
"""
from __future__ import annotations

import os

from fastapi import FastAPI

from .. import __version__
from ..config import EngineConfig
from .engine_client import EngineClient
from .errors import install_error_handlers
from .metrics import ServerMetrics
from .middleware import (ApiKeyMiddleware, BodyLimitMiddleware, ClientErrorLogMiddleware, HttpMetricsMiddleware,
                         InternalErrorMiddleware, Keys)
from .native_api import build_native_router, public_server_info
from .openai_api import build_openai_router
from .openai_common import OpenAIContext
from .request_log import RequestLog
from .settings import ServerConfig


def served_model_name(model_info: dict, config: ServerConfig) -> str:
    """The model id clients pass as ``model``: the configured name or the model path's base name."""
    if config.served_model_name:
        return config.served_model_name
    path = str(model_info.get("model_path") or "default").rstrip("/")
    base = os.path.basename(path) or path
    return base[:-5] if base.endswith(".gguf") else base


def create_app(engine, config: ServerConfig | None = None) -> FastAPI:
    """Build the HTTP app for ``engine`` (an object with the ``sglite.Engine`` contract).

    Middleware, outermost first: 500 on unexpected errors, HTTP metrics, the 4xx log (one info
    line per client error: method, path, status, field, message), API key (when
    ``config.api_key`` or ``config.admin_api_key``), body cap. ``/metrics`` only with ``config.enable_metrics``; request
    summaries logged with ``config.log_requests``.
    """
    config = config or ServerConfig()
    metrics = ServerMetrics(engine.get_server_info)
    request_log = RequestLog(config.log_requests_max_chars) if config.log_requests else None
    ecfg = getattr(engine, "config", None)  # the fake engines of tests have none
    client = EngineClient(engine, metrics, request_log=request_log,
                          prep_timeout=getattr(ecfg, "request_prep_timeout", EngineConfig.request_prep_timeout))
    name = served_model_name(client.model_info, config)
    path = str(client.model_info.get("model_path") or name)
    names = {name, path, os.path.basename(path.rstrip("/")), "default"}  # "default": SGLang clients' habit
    app = FastAPI(title="sglite", version=__version__,
                  description="SGLang-compatible native API and OpenAI-compatible API")
    app.state.client, app.state.metrics, app.state.config = client, metrics, config
    app.state.keys = keys = Keys(config.api_key, config.admin_api_key)
    install_error_handlers(app)
    app.include_router(build_native_router(client, metrics, {**public_server_info(config),
                                                             "served_model_name": name},
                                           enable_metrics=config.enable_metrics))
    app.include_router(build_openai_router(OpenAIContext(client, name, names)))
    if getattr(ecfg, "disaggregation_mode", "null") != "null":  # prefill/decode half (sglite.server.disaggregation)
        from .disaggregation import disaggregation_routes
        app.include_router(disaggregation_routes(engine, ecfg, config.host))
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    if config.api_key or config.admin_api_key:
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(ClientErrorLogMiddleware)
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics)
    app.add_middleware(InternalErrorMiddleware)
    return app
