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


@dataclass(frozen=True)
class ServerConfig:
    """Options of the HTTP layer.

    Attributes:
        host: interface to bind (``127.0.0.1`` by default; ``0.0.0.0`` for all).
        port: TCP port.
        api_key: require ``Authorization: Bearer <api_key>`` on every route but ``/health`` and
            ``/metrics``; None = no key.
        admin_api_key: the key of the operator routes (``/flush_cache``, ``/abort_request`` with
            ``abort_all``): when set, they require ``Authorization: Bearer <admin_api_key>`` and the
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

    def __post_init__(self):
        if not (0 <= self.port <= 65535):
            raise InvalidRequestError(f"port: must be in [0, 65535], got {self.port}", field="port")
        if self.max_request_bytes < 1024:
            raise InvalidRequestError(f"max_request_bytes: must be >= 1024, got {self.max_request_bytes}",
                                      field="max_request_bytes")
        if self.dp_size < 1:
            raise InvalidRequestError(f"dp_size: must be >= 1, got {self.dp_size}", field="dp_size")
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
