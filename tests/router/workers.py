"""Fake router workers: a FastAPI app served on 127.0.0.1 by the server's own UvicornThread."""
from sglite.server.runner import UvicornThread, bind_listener


def Worker(app, port: int = 0) -> UvicornThread:  # noqa: N802 - used like the class it builds
    """``app`` on ``127.0.0.1:port`` (0: a free port) in a daemon thread; a context manager that
    starts it and stops it (``url``, ``port``, ``app`` as attributes)."""
    return UvicornThread(app, bind_listener("127.0.0.1", port), "test worker")
