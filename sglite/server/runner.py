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

from .settings import ServerConfig


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port == 0``: any free port) for uvicorn to listen on;
    bound here, so nothing can take the port between choosing and serving it.

    Raises:
        OSError: the address is in use or not local."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class UvicornThread:
    """An ASGI app under uvicorn in a daemon thread, serving a socket bound before the thread
    starts (:func:`bind_listener`), so ``url`` is valid as soon as the object exists.

    Args:
        app: the ASGI app.
        sock: the bound socket to serve (closed by :meth:`stop`).
        name: thread name, also used in the start-up error.
        startup_timeout: seconds :meth:`start` waits for the server to accept connections.
        uvicorn_kw: more ``uvicorn.Config`` options (e.g. ``lifespan="off"``).
    Raises:
        RuntimeError: (from :meth:`start`) the server did not start in time.
    """

    def __init__(self, app, sock: socket.socket, name: str, startup_timeout: float = 30.0, **uvicorn_kw):
        self.app, self.startup_timeout, self._name, self._sock = app, startup_timeout, name, sock
        self.host, self.port = sock.getsockname()[:2]
        self._server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level="warning",
                                                     timeout_graceful_shutdown=2, **uvicorn_kw))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name=name, daemon=True)

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
        OSError: ``config.host:config.port`` cannot be bound.
        RuntimeError: (from :meth:`start`) the server did not start in time.
    """

    def __init__(self, engine, config: Optional[ServerConfig] = None, startup_timeout: float = 30.0):
        from .app import create_app  # here: the router imports this module without the server stack

        config = config or ServerConfig(port=0)
        sock = bind_listener(config.host, config.port)
        self.engine, self.config = engine, replace(config, port=sock.getsockname()[1])
        super().__init__(create_app(engine, self.config), sock, "sglite server", startup_timeout, lifespan="off")

    def stop(self) -> None:
        """Stop serving, then release the stored responses' prefix pins this server took in the
        engine (the engine outlives this class; lifespan handlers are off here)."""
        super().stop()
        pins = getattr(self.app.state, "responses_pins", None) if hasattr(self, "app") else None
        if pins is not None:
            pins.release_all()
