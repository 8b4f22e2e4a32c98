"""``sglite serve`` / ``python -m sglite.launch_server``: parse flags, build the engine, run uvicorn.

Engine flags are generated from :class:`sglite.config.EngineConfig` fields with SGLang's
spelling (``max_running_requests`` -> ``--max-running-requests``); only flags given on the
command line override the config defaults. Server flags: ``--host``, ``--port``, ``--api-key``,
``--served-model-name``, ``--max-request-bytes``, ``--log-level``.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Sequence, Union

from ..config import DTYPES, SCHEDULE_POLICIES, EngineConfig
from ..logging_setup import configure as configure_logging
from .settings import ServerConfig

logger = logging.getLogger("sglite.server")
_CHOICES = {"dtype": DTYPES, "schedule_policy": SCHEDULE_POLICIES}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _type_of(annotation: str):
    a = str(annotation)
    return int if "int" in a else float if "float" in a else bool if "bool" in a else str


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every server and engine flag to ``parser`` (engine flags default to None = config default)."""
    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 for all)")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>'")
    s.add_argument("--served-model-name", default=None, help="model id of /v1/models (default: path base name)")
    s.add_argument("--max-request-bytes", type=int, default=ServerConfig.max_request_bytes)
    e = parser.add_argument_group("engine (sglite.EngineConfig)")
    for f in dataclasses.fields(EngineConfig):
        typ = _type_of(f.type)
        if typ is bool:
            e.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=None,
                           help=f"default {f.default}")
        else:
            e.add_argument(_flag(f.name), type=typ, default=None, choices=_CHOICES.get(f.name),
                           help=f"default {f.default}")
    return parser


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments given on the command line."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                        served_model_name=args.served_model_name, max_request_bytes=args.max_request_bytes,
                        log_level=args.log_level or "info")


def build_parser() -> argparse.ArgumentParser:
    return add_server_args(argparse.ArgumentParser(prog="sglite serve",
                                                   description="Serve a model over HTTP (native + OpenAI API)."))


def main(args_or_argv: Union[argparse.Namespace, Sequence[str], None] = None, engine=None) -> None:
    """Start the server and block until it stops (Ctrl-C). ``engine`` overrides building one."""
    import uvicorn

    from .app import create_app

    args = args_or_argv if isinstance(args_or_argv, argparse.Namespace) else build_parser().parse_args(args_or_argv)
    cfg = server_config(args)
    configure_logging(cfg.log_level)
    own = engine is None
    if own:
        from ..runtime.engine import Engine
        engine = Engine(**engine_kwargs(args))
    try:
        info = engine.get_server_info()
        logger.warning("sglite: KV cache of %s tokens, %s bytes per token; serving %s on http://%s:%d",
                       info.get("max_total_tokens"), info.get("bytes_per_token"),
                       engine.model_info().get("model_path"), cfg.host, cfg.port)
        uvicorn.run(create_app(engine, cfg), host=cfg.host, port=cfg.port, log_level=cfg.log_level.lower(),
                    timeout_graceful_shutdown=5)
    finally:
        if own:
            engine.shutdown()

