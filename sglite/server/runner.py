"""Run the app with uvicorn in a background thread (tests, notebooks, benchmarks).

    with ServerThread(engine) as srv:          # free port on 127.0.0.1
        httpx.get(srv.url + "/health")
"""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace
from typing import Optional

import uvicorn

from .app import create_app
from .settings import ServerConfig


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving ``create_app(engine, config)`` in a daemon thread.

    Args:
        engine: the engine to serve (not shut down by this class).
        config: server options; ``port == 0`` picks a free port.
        startup_timeout: seconds to wait for the server to accept connections.
    Raises:
        RuntimeError: the server did not start in time.
    """

    def __init__(self, engine, config: Optional[ServerConfig] = None, startup_timeout: float = 30.0):
        config = config or ServerConfig(port=0)
        if config.port == 0:
            config = replace(config, port=free_port(config.host))
        self.config, self.engine, self.startup_timeout = config, engine, startup_timeout
        self.app = create_app(engine, config)
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=config.host, port=config.port,
                                                     log_level="warning", lifespan="off",
                                                     timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._server.run, name="sglite-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"sglite server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
