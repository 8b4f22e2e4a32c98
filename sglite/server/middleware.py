"""Pure-ASGI middleware: API key, request-body cap, HTTP request counting.

Pure ASGI (not Starlette's ``BaseHTTPMiddleware``) so that streaming responses and client
disconnects pass through untouched.
"""
from __future__ import annotations

import hmac
import json
import logging
from typing import Optional

from .errors import error_body

OPEN_PATHS = frozenset({"/health", "/metrics"})
logger = logging.getLogger("sglite.server")


async def _send_error(send, status: int, message: str, param: Optional[str] = None) -> None:
    body = json.dumps(error_body(message, status, param)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class ApiKeyMiddleware:
    """Require ``Authorization: Bearer <api_key>`` on every route except ``/health`` and ``/metrics``."""

    def __init__(self, app, api_key: str):
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
            return await _send_error(send, 401, "missing or invalid API key (Authorization: Bearer <key>)",
                                     "authorization")
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answer 413 when a request body exceeds ``max_bytes``.

    The body is read up front (it is JSON and must be parsed whole anyway) and replayed to the
    app; later ``receive`` calls go to the server, so disconnects are still seen.
    """

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_error(send, 413, f"request body of {int(length)} bytes exceeds the limit of "
                                     f"{self.max_bytes} bytes", "body")
        chunks, total = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # disconnected before the body arrived
                return
            body = msg.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                return await _send_error(send, 413, f"request body exceeds the limit of {self.max_bytes} bytes",
                                         "body")
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay_receive():
            return replay.pop() if replay else await receive()

        return await self.app(scope, replay_receive, send)


class HttpMetricsMiddleware:
    """Count responses by route template and status into ``ServerMetrics.observe_http``."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_wrapper(msg):
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.observe_http(path, status["code"])


class InternalErrorMiddleware:
    """Turn an unexpected exception into a 500 error body, without re-raising.

    (Starlette's own handler re-raises after answering, which makes uvicorn drop the
    keep-alive connection.) If the response has already started, the error is only logged.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_wrapper(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:  # noqa: BLE001 - the server must keep serving
            logger.exception("internal error on %s: %s", scope.get("path"), exc)
            if not started:
                await _send_error(send, 500, f"internal server error: {type(exc).__name__}: {exc}")


class ClientErrorLogMiddleware:
    """Log the reason of every 4xx answer at info, one line:
    ``HTTP 400 POST /generate param=sampling_params.temperature: <message>``.

    The status comes from ``http.response.start``; field and message from the JSON error body
    (:func:`sglite.server.errors.error_body`; the first 64 KiB are read, error bodies are small).
    Streaming 2xx responses pass through untouched.
    """

    MAX_BODY = 64 * 1024

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"status": 0, "body": b"", "logged": False}

        async def send_wrapper(msg):
            if msg["type"] == "http.response.start":
                state["status"] = msg["status"]
            elif msg["type"] == "http.response.body" and 400 <= state["status"] < 500 and not state["logged"]:
                if len(state["body"]) < self.MAX_BODY:
                    state["body"] += msg.get("body", b"")[: self.MAX_BODY]
                if not msg.get("more_body", False):
                    state["logged"] = True
                    self._log(scope, state["status"], state["body"])
            await send(msg)

        await self.app(scope, receive, send_wrapper)

    @staticmethod
    def _log(scope, status: int, body: bytes) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        param, message = None, body.decode("utf-8", "replace")[:500]
        try:
            data = json.loads(body)
            err = data.get("error", data) if isinstance(data, dict) else {}
            param, message = err.get("param"), str(err.get("message", message))
        except (ValueError, AttributeError):
            pass
        logger.info("HTTP %d %s %s param=%s: %s", status, scope.get("method"), scope.get("path"), param,
                    message[:500])
