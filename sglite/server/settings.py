"""ServerConfig: the HTTP server's own options (engine options live in :class:`sglite.EngineConfig`),
and the ``sglite serve`` flag parser generated from both (used by :mod:`sglite.launch_server` and
by :class:`sglite.server.launcher.LaunchedServer`'s thread mode)."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Optional

from .. import __version__
from ..errors import InvalidRequestError
from ..flags import FlagParser, add_config_args, add_engine_args
from .reasoning import get_reasoning_format
from .tool_parsers.formats import get_format


@dataclass(frozen=True)
class ServerConfig:
    """Options of the HTTP layer.

    Attributes:
        host: interface to bind (``127.0.0.1`` by default; ``0.0.0.0`` for all).
        port: TCP port.
        api_key: require ``Authorization: Bearer <api_key>`` on every route but ``/health`` and
            ``/metrics``; None = no key.
        admin_api_key: the key of the operator routes (``/flush_cache``, ``/start_profile``,
            ``/stop_profile``, ``/abort_request`` with ``abort_all``): when set, they require ``Authorization: Bearer <admin_api_key>`` and the
            ordinary ``api_key`` does not open them; unset, they are guarded like every other
            route (by ``api_key`` when that is set).
        served_model_name: the model id of ``/v1/models``; None = the model path's base name.
        max_request_bytes: request bodies above this many bytes get 413.
        log_level: uvicorn/sglite log level.
        enable_metrics: serve Prometheus metrics on ``/metrics`` (off: 404, as SGLang's
            ``--enable-metrics``).
        log_requests: log a summary of every request and its response at info (rid, prompt
            tokens, sampling params, finish reason, completion tokens, latency, truncated texts).
        log_requests_max_chars: texts in the request log are cut to this many characters.
        dp_size: data-parallel workers: more than 1 starts this many servers (same engine flags,
            free ports on 127.0.0.1) behind the cache-aware router (``sglite router``) on host:port.
        responses_store_size: ``/v1/responses`` results kept for retrieval and
            ``previous_response_id`` (the oldest is dropped first; 0 keeps none).
        responses_ttl: seconds a stored ``/v1/responses`` result is kept.
        responses_pin_tokens: radix-cache tokens kept pinned (out of LRU eviction) for stored
            ``/v1/responses`` conversations, so a ``previous_response_id`` follow-up prefills only
            its new input; over it the least recently pinned is released first; 0 = no pins.
        tool_call_parser: how the model writes tool calls (SGLang's names: ``qwen25``/``hermes``,
            ``llama3``, ``mistral``, ``pythonic``, ``granite``); unset = chosen from the chat
            template's markers or the model family, and logged at start-up.
        reasoning_parser: split the model's ``<think>`` reasoning from its answer
            (``deepseek-r1`` or ``qwen3``) into ``reasoning_content``; unset = no split.
        disable_tool_call_constraint: leave ``tool_choice: "auto"`` calls unconstrained (by
            default, from the tool-call opener on, the output must be a call of one of the tools
            with arguments following its schema; see :mod:`sglite.server.tool_constraint`).
    """

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None
    served_model_name: Optional[str] = None
    max_request_bytes: int = 8 * 1024 * 1024
    log_level: str = "info"
    enable_metrics: bool = False
    log_requests: bool = False
    log_requests_max_chars: int = 200
    dp_size: int = 1
    responses_store_size: int = 1000
    responses_ttl: float = 3600.0
    responses_pin_tokens: int = 16384
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    disable_tool_call_constraint: bool = False

    def __post_init__(self):
        if not (0 <= self.port <= 65535):
            raise InvalidRequestError(f"port: must be in [0, 65535], got {self.port}", field="port")
        if self.max_request_bytes < 1024:
            raise InvalidRequestError(f"max_request_bytes: must be >= 1024, got {self.max_request_bytes}",
                                      field="max_request_bytes")
        if self.dp_size < 1:
            raise InvalidRequestError(f"dp_size: must be >= 1, got {self.dp_size}", field="dp_size")
        if self.responses_store_size < 0:
            raise InvalidRequestError(f"responses_store_size: must be >= 0, got {self.responses_store_size}",
                                      field="responses_store_size")
        if self.responses_pin_tokens < 0:
            raise InvalidRequestError(f"responses_pin_tokens: must be >= 0, got {self.responses_pin_tokens}",
                                      field="responses_pin_tokens")
        if not self.responses_ttl > 0:
            raise InvalidRequestError(f"responses_ttl: must be > 0 seconds, got {self.responses_ttl}",
                                      field="responses_ttl")
        for name, check in (("tool_call_parser", get_format), ("reasoning_parser", get_reasoning_format)):
            if getattr(self, name) is not None:
                try:
                    check(getattr(self, name))
                except ValueError as e:
                    raise InvalidRequestError(str(e), field=name) from None
        if self.log_requests_max_chars < 0:
            raise InvalidRequestError(f"log_requests_max_chars: must be >= 0, got {self.log_requests_max_chars}",
                                      field="log_requests_max_chars")


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every server flag (ServerConfig, defaults shown) and engine flag (EngineConfig,
    default None = config default) to ``parser``; plus ``--version``."""
    parser.add_argument("--version", action="version", version=f"sglite {__version__}")
    add_config_args(parser, ServerConfig, skip=("log_level",), title="server (sglite.server.ServerConfig)",
                    defaults_none=False)
    add_engine_args(parser)
    return parser


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of parsed flags (``--log-level`` is shared with the engine).

    Raises:
        InvalidRequestError: a bad value, naming the field.
    """
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)
          if f.name != "log_level" and hasattr(args, f.name)}
    return ServerConfig(**kw, log_level=getattr(args, "log_level", None) or "info")


def build_parser() -> FlagParser:
    """The ``sglite serve`` parser: every ServerConfig and EngineConfig flag, ``--version``."""
    return add_server_args(FlagParser(prog="sglite serve",
                                      description="Serve a model over HTTP (native + OpenAI API)."))
