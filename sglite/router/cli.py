"""``sglite router`` flags (sglang-router's spellings) and ``sglite serve --dp-size N``.

    sglite router --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002 [--policy cache_aware]
    sglite serve --dp-size 2 --port 30000 [engine flags]   # 2 workers on free ports + the router

With ``--dp-size N`` the server starts N ``sglite serve`` processes (same engine flags, ports picked
free on the host), waits until each answers ``/health``, then serves the router on ``--host/--port``
in the foreground; the workers stop with it.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import subprocess
import sys
import time
from typing import Optional, Sequence

from ..errors import InvalidRequestError
from .policy import POLICIES, RouterConfig

log = logging.getLogger("sglite.router")


def build_parser() -> argparse.ArgumentParser:
    from ..flags import FlagParser, field_docs

    docs = field_docs(RouterConfig)
    p = FlagParser(prog="sglite router", description="Route requests over data-parallel sglite workers.")
    p.add_argument("--worker-urls", nargs="+", default=[], help=docs["worker_urls"] + " (default: none)")
    p.add_argument("--pd-disaggregation", action="store_true", help=docs["pd_disaggregation"] + " (default: off)")
    p.add_argument("--prefill", nargs="+", action="append", default=[], metavar="URL [BOOTSTRAP_PORT]",
                   help="a prefill server and its bootstrap port (default port: 8998); repeat per server")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode server; repeat per server (default: none)")
    d = RouterConfig()
    for f in dataclasses.fields(RouterConfig):
        if f.name in ("worker_urls", "pd_disaggregation", "prefill_urls", "decode_urls"):
            continue
        kw = {"choices": POLICIES} if f.name == "policy" else {}
        default = getattr(d, f.name)
        p.add_argument("--" + f.name.replace("_", "-"), type=str if default is None else type(default),
                       default=default, help=f"{docs[f.name]} (default: {default})", **kw)
    p.add_argument("--log-level", default="info", help="log level of the router (default: info)")
    return p


def router_config(args: argparse.Namespace) -> RouterConfig:
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(RouterConfig)
          if f.name not in ("prefill_urls", "decode_urls")}
    kw["worker_urls"] = tuple(args.worker_urls)
    prefill = []
    for item in args.prefill:
        if len(item) > 2 or (len(item) == 2 and not item[1].isdigit()):
            raise InvalidRequestError(f"prefill_urls: --prefill takes URL [BOOTSTRAP_PORT], got {item}",
                                      field="prefill_urls")
        prefill.append((item[0], int(item[1]) if len(item) == 2 else 8998))
    kw["prefill_urls"], kw["decode_urls"] = tuple(prefill), tuple(args.decode)
    if not args.pd_disaggregation and not args.worker_urls:
        raise InvalidRequestError("worker_urls: --worker-urls is required (or --pd-disaggregation with "
                                  "--prefill and --decode)", field="worker_urls")
    return RouterConfig(**kw)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import uvicorn

    from ..logging_setup import configure
    from .app import create_router_app

    p = build_parser()
    args = p.parse_args(argv)
    try:
        cfg = router_config(args)
    except InvalidRequestError as exc:
        p.error(str(exc))
    configure(args.log_level)
    log.info("router on http://%s:%d over %d workers (%s)", cfg.host, cfg.port, len(cfg.worker_urls), cfg.policy)
    uvicorn.run(create_router_app(cfg), host=cfg.host, port=cfg.port, log_level=args.log_level.lower())
    return 0


def strip_flags(argv: Sequence[str], names: dict) -> list[str]:
    """``argv`` without the flags in ``names`` (``{flag: takes_value}``), ``--flag=v`` forms too."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in names:
            skip = names[name] and "=" not in a
            continue
        out.append(a)
    return out


def wait_healthy(urls: Sequence[str], procs, timeout: float) -> None:
    """Block until every URL answers ``/health`` with 200; raises RuntimeError on timeout or when
    a worker process exits first."""
    import httpx

    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a data-parallel worker exited with code {p.returncode}")
        try:
            if httpx.get(pending[0] + "/health", timeout=2.0).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker {pending[0]} not healthy after {timeout:.0f} s")
        time.sleep(0.5)


def serve_data_parallel(argv: Sequence[str], dp_size: int, host: str, port: int, log_level: str = "info",
                        startup_timeout: float = 900.0) -> int:
    """``sglite serve --dp-size N``: N worker servers (``argv`` minus --dp-size/--host/--port) and
    the cache-aware router in front of them on ``host:port``."""
    import uvicorn

    from ..runtime.parallel.ports import free_port
    from .app import create_router_app

    import signal

    # uvicorn re-raises SIGTERM after its graceful shutdown; exit through ``finally`` (stopping
    # the workers) instead of dying on the default handler
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    base = strip_flags(argv, {"--dp-size": True, "--port": True, "--host": True})
    ports = [free_port("127.0.0.1") for _ in range(dp_size)]
    procs = [subprocess.Popen([sys.executable, "-m", "sglite.launch_server", *base, "--host", "127.0.0.1",
                               "--port", str(pt)]) for pt in ports]
    urls = [f"http://127.0.0.1:{pt}" for pt in ports]
    try:
        wait_healthy(urls, procs, startup_timeout)
        cfg = RouterConfig(worker_urls=tuple(urls), host=host, port=port)
        log.warning("sglite: data parallel over %d workers %s; router on http://%s:%d", dp_size, urls, host, port)
        uvicorn.run(create_router_app(cfg), host=host, port=port, log_level=log_level.lower())
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0
