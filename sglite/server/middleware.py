"""Pure-ASGI middleware: API keys, request-body cap, HTTP request counting, 500s with an error id.

Pure ASGI (not Starlette's ``BaseHTTPMiddleware``) so that streaming responses and client
disconnects pass through untouched.
"""
from __future__ import annotations

import hmac
import json
import logging
import uuid
from typing import Optional

from .errors import error_body

OPEN_PATHS = frozenset({"/health", "/metrics"})
#: operator routes: with an admin key configured, only that key opens them (``/abort_request`` is an
#: operator route only with ``abort_all``: its route checks :meth:`Keys.admits_admin` itself)
ADMIN_PATHS = frozenset({"/flush_cache", "/start_profile", "/stop_profile", "/load_lora_adapter",
                         "/unload_lora_adapter"})
#: exceptions that mean the client went away, not that the server failed
try:
    from starlette.requests import ClientDisconnect as _ClientDisconnect
except ImportError:  # pragma: no cover
    _ClientDisconnect = ConnectionResetError
DISCONNECTS = (_ClientDisconnect, ConnectionResetError, BrokenPipeError)
logger = logging.getLogger("sglite.server")


async def _send_error(send, status: int, message: str, param: Optional[str] = None) -> None:
    body = json.dumps(error_body(message, status, param)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Keys:
    """The server's API keys and who they admit (constant-time comparisons).

    Args:
        api_key: the key of every route but ``/health`` and ``/metrics``; None = open.
        admin_api_key: the key of the operator routes; None = they take ``api_key`` like the rest.
            When set, it also opens the ordinary routes.
    """

    def __init__(self, api_key: Optional[str] = None, admin_api_key: Optional[str] = None):
        self._key = api_key.encode() if api_key else None
        self._admin = admin_api_key.encode() if admin_api_key else None

    @staticmethod
    def _token(headers) -> Optional[bytes]:
        auth = dict(headers or []).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return token.strip() if scheme.lower() == b"bearer" else None

    def _matches(self, token: Optional[bytes], key: Optional[bytes]) -> bool:
        return token is not None and key is not None and hmac.compare_digest(token, key)

    def admits(self, headers) -> bool:
        """May a request with these ASGI headers use an ordinary route?"""
        if self._key is None:
            return True
        token = self._token(headers)
        return self._matches(token, self._key) or self._matches(token, self._admin)

    def admits_admin(self, headers) -> bool:
        """May a request with these ASGI headers use an operator route?"""
        if self._admin is None:
            return self.admits(headers)
        return self._matches(self._token(headers), self._admin)


async def _send_error_id(send, error_id: str) -> None:
    body = error_body(f"internal server error (error id {error_id}; the server log has the details)", 500)
    body["error_id"] = body["error"]["error_id"] = error_id
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": 500,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
    await send({"type": "http.response.body", "body": raw, "more_body": False})


class ApiKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` (:class:`Keys`) on every route except ``/health`` and
    ``/metrics``; the admin key on :data:`ADMIN_PATHS` when one is configured."""

    def __init__(self, app, keys: Keys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        headers = scope.get("headers")
        if scope.get("path") in ADMIN_PATHS:
            if not self.keys.admits_admin(headers):
                return await _send_error(send, 401, "missing or invalid admin API key (Authorization: Bearer "
                                         "<admin key>, set with --admin-api-key)", "authorization")
        elif not self.keys.admits(headers):
            return await _send_error(send, 401, "missing or invalid API key (Authorization: Bearer <key>)",
                                     "authorization")
        return await self.app(scope, receive, send)


#: state-changing routes a browser could reach with a body-less "simple" cross-site POST
OPERATOR_POSTS = ADMIN_PATHS | {"/abort_request"}


def _guarded(path: str) -> bool:
    return path in OPERATOR_POSTS or (path.startswith("/v1/responses/") and path.endswith("/cancel"))


class CrossSiteMiddleware:
    """Refuse cross-site requests to the body-less state-changing POST routes (:data:`OPERATOR_POSTS`
    and ``/v1/responses/{id}/cancel``), which a web page could otherwise send as a "simple" request
    without a CORS preflight: a ``Content-Type`` other than JSON is a 415 naming ``content-type``;
    an ``Origin`` other than the server's own host (``Host``) is a 403 naming ``origin``. curl and
    SGLang's clients send JSON or no body, and no ``Origin``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or not _guarded(scope.get("path", "")):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        ctype = headers.get(b"content-type")
        if ctype is not None:
            mime = ctype.split(b";")[0].strip().lower()
            if mime != b"application/json" and not mime.endswith(b"+json"):
                return await _send_error(send, 415, "content-type: this route takes application/json or no body, "
                                         f"got {mime.decode('latin-1')!r}", "content-type")
        origin = headers.get(b"origin")
        if origin is not None:
            host = origin.partition(b"://")[2].rstrip(b"/").lower()
            if not host or host != headers.get(b"host", b"").lower():
                return await _send_error(send, 403, f"origin: cross-site request from {origin.decode('latin-1')!r} "
                                         "refused (an operator route takes requests from the server's own "
                                         "origin or none)", "origin")
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

    The body names an error id and nothing else of the failure (no exception text, no path); the
    log line carries the same id with the traceback. A client that disconnected is not a server
    error: one info line. (Starlette's own handler re-raises after answering, which makes uvicorn
    drop the keep-alive connection.) If the response has already started, the error is only logged.
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
        except DISCONNECTS:
            logger.info("client disconnected on %s %s", scope.get("method"), scope.get("path"))
        except Exception:  # noqa: BLE001 - the server must keep serving
            error_id = uuid.uuid4().hex[:16]
            logger.exception("internal error %s on %s %s", error_id, scope.get("method"), scope.get("path"))
            if not started:
                await _send_error_id(send, error_id)


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
