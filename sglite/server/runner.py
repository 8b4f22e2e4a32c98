"""Run the app with uvicorn in a background thread (tests, notebooks, benchmarks).

    with ServerThread(engine) as srv:          # free port on 127.0.0.1
        httpx.get(srv.url + "/health")
"""
from __future__ import annotations

import random
import socket
import threading
import time
from dataclasses import replace
from typing import Optional

import uvicorn

from .app import create_app
from .settings import ServerConfig


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux), else IANA's."""
    try:
        lo, hi = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 49152, 65535


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``.

    Chosen at random *below* the kernel's ephemeral range where possible: a port from
    ``bind(0)`` comes from that range, which every outgoing connection (an HTTP client, a
    ``TCPStore`` client) also draws from, so it can be taken before the caller binds it.
    Still a race with other processes; in-process servers should bind first
    (:class:`UvicornThread` does)."""
    lo, _ = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(10000, lo) if lo > 11000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port == 0``: a free port) for uvicorn to listen on.

    Raises:
        OSError: the address is in use or not local."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port or free_port(host)))
    except OSError:
        if port:
            sock.close()
            raise
        sock.bind((host, 0))
    return sock


class UvicornThread:
    """An ASGI app under uvicorn in a daemon thread, on a socket bound before the thread starts
    (so ``url`` is valid as soon as the object exists, and no other socket can take the port).

    Args:
        app: the ASGI app.
        host, port: where to listen; ``port == 0`` picks a free port; ``port`` may also be a
            socket already bound with :func:`bind_listener` (for an app that must know its port).
        name: thread name, also used in the start-up error.
        startup_timeout: seconds to wait for the server to accept connections.
    Raises:
        OSError: ``host:port`` cannot be bound.
        RuntimeError: (from :meth:`start`) the server did not start in time.
    """

    def __init__(self, app, host: str, port: "int | socket.socket", name: str, startup_timeout: float = 30.0,
                 **uvicorn_kw):
        self.app, self.startup_timeout, self._name = app, startup_timeout, name
        self._sock = port if isinstance(port, socket.socket) else bind_listener(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning",
                                                     timeout_graceful_shutdown=2, **uvicorn_kw))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=name, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self):
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self._name} did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerThread(UvicornThread):
    """uvicorn serving ``create_app(engine, config)`` in a daemon thread.

    Args:
        engine: the engine to serve (not shut down by this class).
        config: server options; ``port == 0`` picks a free port (``self.config.port`` is the one bound).
        startup_timeout: seconds to wait for the server to accept connections.
    Raises:
        RuntimeError: the server did not start in time.
    """

    def __init__(self, engine, config: Optional[ServerConfig] = None, startup_timeout: float = 30.0):
        config = config or ServerConfig(port=0)
        sock = bind_listener(config.host, config.port)
        self.engine, self.config = engine, replace(config, port=sock.getsockname()[1])
        super().__init__(create_app(engine, self.config), config.host, sock, "sglite server",
                         startup_timeout, lifespan="off")
