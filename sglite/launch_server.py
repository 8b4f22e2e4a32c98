"""``sglite serve`` / ``python -m sglite.launch_server --model-path P --port 30000``: parse flags,
build the engine, run uvicorn (both spellings take the same flags).

Flags are generated (:mod:`sglite.flags`) from the fields of
:class:`sglite.config.EngineConfig` and :class:`sglite.server.settings.ServerConfig`, with
SGLang's spelling and their docstrings as help; only engine flags given on the command line
override the config defaults. Every flag is validated before the model is loaded: a bad value
exits with status 2 and a message naming the flag. Start-up phases are logged at info with their
times (the engine's, then "server ready").
"""
from __future__ import annotations

import argparse
import logging
import threading
import time
from typing import Sequence, Union

from .config import EngineConfig
from .flags import engine_kwargs, fail
from .logging_setup import configure as configure_logging
from .runtime.engine_config import engine_config
from .server.settings import ServerConfig, add_server_args, build_parser, server_config

__all__ = ["add_server_args", "build_parser", "engine_kwargs", "server_config", "main"]

logger = logging.getLogger("sglite.server")


def _log_when_ready(server, cfg: ServerConfig, t0: float, engine_s: float) -> None:
    while not server.started and not server.should_exit:
        time.sleep(0.01)
    if server.started:
        logger.info("Start-up: server ready in %.2f s (engine %.2f s): http://%s:%d",
                    time.perf_counter() - t0, engine_s, cfg.host, cfg.port)


def main(args_or_argv: Union[argparse.Namespace, Sequence[str], None] = None, engine=None) -> None:
    """Start the server and block until it stops (Ctrl-C). ``engine`` overrides building one.

    Every flag is checked (EngineConfig and ServerConfig) before the model is loaded; a bad one
    exits with status 2 naming the flag.
    """
    t0 = time.perf_counter()
    parser = build_parser()
    args = args_or_argv if isinstance(args_or_argv, argparse.Namespace) else parser.parse_args(args_or_argv)
    try:
        cfg = server_config(args)
        kwargs = engine_kwargs(args)
        engine_config(**kwargs)  # validation only: fails before anything is loaded
    except ValueError as exc:
        fail(parser, exc)
    configure_logging(cfg.log_level)
    if cfg.dp_size > 1:  # N worker servers behind the cache-aware router (sglite.router)
        if isinstance(args_or_argv, argparse.Namespace):
            fail(parser, ValueError("dp_size: --dp-size > 1 needs the command line, not parsed arguments"))
        from .router.cli import serve_data_parallel
        import sys
        raise SystemExit(serve_data_parallel(list(sys.argv[1:] if args_or_argv is None else args_or_argv),
                                             cfg.dp_size, cfg.host, cfg.port, cfg.log_level))
    if kwargs.get("node_rank"):  # node k > 0 of a multi-node tensor-parallel engine: workers only
        from .runtime.parallel.tp_client import run_node_workers
        raise SystemExit(run_node_workers(EngineConfig.from_kwargs(**kwargs)))

    import uvicorn

    from .server.app import create_app

    own = engine is None
    if own:
        from .runtime.engine import Engine
        try:
            engine = Engine(**kwargs)
        except ValueError as exc:  # e.g. an unusable model path: named, no traceback
            fail(parser, exc)
    engine_s = time.perf_counter() - t0
    try:
        info = engine.get_server_info()
        logger.info("sglite: KV cache of %s tokens, %s bytes per token; serving %s on http://%s:%d",
                    info.get("max_total_tokens"), info.get("bytes_per_token"),
                    engine.model_info().get("model_path"), cfg.host, cfg.port)
        server = uvicorn.Server(uvicorn.Config(create_app(engine, cfg), host=cfg.host, port=cfg.port,
                                               log_level=cfg.log_level.lower(), timeout_graceful_shutdown=5))
        threading.Thread(target=_log_when_ready, args=(server, cfg, t0, engine_s), name="sglite-ready",
                         daemon=True).start()
        server.run()
    finally:
        if own:
            engine.shutdown()


if __name__ == "__main__":
    main()
