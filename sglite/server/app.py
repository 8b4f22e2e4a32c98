"""The FastAPI application: native + OpenAI routes over one in-process engine.

``create_app(engine, ServerConfig(...))`` builds a fresh app (its own metrics registry, its own
set of in-flight requests); nothing is global, so tests may run several apps side by side.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from fastapi import APIRouter, FastAPI

from .. import __version__
from ..config import EngineConfig
from .engine_client import EngineClient
from .errors import install_error_handlers
from .metrics import ServerMetrics
from .middleware import (ApiKeyMiddleware, BodyLimitMiddleware, ClientErrorLogMiddleware, CrossSiteMiddleware,
                         HttpMetricsMiddleware, InternalErrorMiddleware, Keys)
from .native_api import build_native_router, public_server_info
from .openai_api import build_openai_router
from .openai_common import OpenAIContext
from .request_log import RequestLog
from .responses_api import add_responses_routes
from .openapi_doc import install_openapi
from .responses_background import BackgroundResponses
from .responses_pins import ResponsePins
from .responses_store import ResponseStore
from .turn_tokens import TurnTokens
from .settings import ServerConfig
from .tokenize_api import build_tokenize_router
from .tool_constraint import reasoning_end_marker
from .tool_parsers.formats import detect_format, get_format

logger = logging.getLogger("sglite.server")
TURN_TOKENS_ENTRIES = 4096  # generated assistant turns remembered for token-exact resends (turn_tokens)


def choose_tool_parser(engine, config: ServerConfig) -> str:
    """The ``--tool-call-parser`` in effect: the flag, else the one the chat template's markers
    (or the model family) point to; logged at start-up either way."""
    if config.tool_call_parser:
        fmt, why = get_format(config.tool_call_parser), "--tool-call-parser"
    else:
        template = getattr(getattr(getattr(engine, "tokenizer", None), "hf", None), "chat_template", None)
        hf_config = getattr(getattr(engine, "checkpoint", None), "hf_config", None)
        fmt, why = detect_format(template if isinstance(template, str) else None,
                                 getattr(hf_config, "model_type", None))
    logger.info("tool-call parser: %s (%s)%s", fmt.name, why,
                f"; reasoning parser: {config.reasoning_parser}" if config.reasoning_parser else "")
    return fmt.name


def served_model_name(model_info: dict, config: ServerConfig) -> str:
    """The model id clients pass as ``model``: the configured name or the model path's base name."""
    if config.served_model_name:
        return config.served_model_name
    path = str(model_info.get("model_path") or "default").rstrip("/")
    base = os.path.basename(path) or path
    return base[:-5] if base.endswith(".gguf") else base


def _turn_tokens(engine) -> Optional[TurnTokens]:
    """The memory of generated assistant turns, when the engine has a tokenizer to splice with."""
    tok = getattr(engine, "tokenizer", None)
    if tok is None or not (hasattr(tok, "encode") and hasattr(tok, "decode")):
        return None
    return TurnTokens(tok, TURN_TOKENS_ENTRIES)


def create_app(engine, config: ServerConfig | None = None) -> FastAPI:
    """Build the HTTP app for ``engine`` (an object with the ``sglite.Engine`` contract).

    Middleware, outermost first: 500 on unexpected errors, HTTP metrics, the 4xx log (one info
    line per client error: method, path, status, field, message), API key (when
    ``config.api_key`` or ``config.admin_api_key``), cross-site refusal on the operator routes,
    body cap. ``/metrics`` only with ``config.enable_metrics``; request summaries logged with
    ``config.log_requests``.
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
                                           enable_metrics=config.enable_metrics,
                                           reasoning_parser=config.reasoning_parser))
    octx = OpenAIContext(client, name, names, tool_parser=choose_tool_parser(engine, config),
                         reasoning_parser=config.reasoning_parser,
                         constrain_auto_tools=not config.disable_tool_call_constraint,
                         reasoning_end=reasoning_end_marker(config.reasoning_parser),
                         turn_tokens=_turn_tokens(engine))
    app.state.openai = octx
    app.include_router(build_openai_router(octx))
    app.state.responses_pins = pins = ResponsePins(engine, config.responses_pin_tokens)
    app.state.responses_background = background = BackgroundResponses()

    def dropped(response_id: str) -> None:  # a response left the store: unpin it, stop it if it runs
        pins.unpin(response_id)
        background.dropped(response_id)
    app.state.responses_store = store = ResponseStore(config.responses_store_size, config.responses_ttl,
                                                      on_drop=dropped)
    responses = APIRouter()
    add_responses_routes(responses, octx, store, pins, background)
    app.include_router(responses)
    app.include_router(build_tokenize_router(octx))
    install_openapi(app)
    if getattr(ecfg, "disaggregation_mode", "null") != "null":  # prefill/decode half (sglite.server.disaggregation)
        from .disaggregation import disaggregation_routes
        app.include_router(disaggregation_routes(engine, ecfg, config.host))
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    app.add_middleware(CrossSiteMiddleware)
    if config.api_key or config.admin_api_key:
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(ClientErrorLogMiddleware)
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics)
    app.add_middleware(InternalErrorMiddleware)
    return app
