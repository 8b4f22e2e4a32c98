"""SSE framing of the router's relayed streams: where complete events end in a buffer, and the
error event that ends a stream whose worker failed."""
from __future__ import annotations

from ..server.errors import error_body
from ..server.sse import sse_event


def stream_error_event(message: str) -> bytes:
    """The SSE error frame of a stream the router has to end (502: the worker failed)."""
    body = error_body(message, 502)
    body["type"] = body["error"]["type"] = "worker_error"
    return sse_event(body)


def event_end(buf: bytes) -> int:
    """Length of the complete SSE events at the start of ``buf`` (0 if none is complete)."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)
