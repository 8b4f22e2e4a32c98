"""``sglite router``: a data-parallel HTTP router in front of sglite servers (FastAPI + httpx).

    sglite router --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002 --port 30000

Generation routes (``/generate``, ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``: its
follow-ups go to the response's worker, :mod:`~sglite.router.responses_routes`) go to the worker a
:class:`~sglite.router.policy.Policy` picks (cache-aware by default); streams pass through. Bodies are checked first, as the server checks them: over
``max_request_bytes`` is 413, a body that is not JSON or whose fields have the wrong types is 400
naming the field (the server's own request models), so nothing malformed reaches a worker. Every
forwarded request carries a ``rid`` (the client's, or a new one), and the client's
``Authorization`` header goes with it.

Failures: a worker that fails before any output was sent to the client (connection error, dropped
connection, or 502/503/504) is marked unhealthy and the request is tried on one other worker at
most (``max_retries``, 0 or 1: a request that kills its worker reaches at most two). A worker that
dies mid-stream ends the client's stream with an error event (``data: {"error": {...}}``, then
``data: [DONE]``) and is marked unhealthy; the request is not replayed. A non-streamed client that
disconnects has its request aborted on the worker (``/abort_request`` with its rid), as does one
that runs past ``request_timeout_secs`` (504). Unexpected errors are 500s naming an error id only
(the log has the traceback). A background task probes every worker's ``/health`` every
``health_check_interval_secs`` and brings recovered workers back (with an empty approximate tree).

Other routes: ``/abort_request`` goes to every worker (``abort_all`` needs the router's
``admin_api_key`` when one is set); ``/flush_cache`` (POST, an operator route) goes to every worker
(and every prefill server of a P/D router); ``/get_server_info`` lists the workers with their
health, load and own server info; other GET routes (``/v1/models``, ``/get_model_info``) go to a
healthy worker.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import replace
from typing import Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from ..server.engine_client import ClientDisconnected, until_disconnect
from ..server.errors import ApiError, validation_message, error_body, error_response, install_error_handlers
from ..server.middleware import (ApiKeyMiddleware, BodyLimitMiddleware, ClientErrorLogMiddleware,
                                 CrossSiteMiddleware, InternalErrorMiddleware, Keys)
from ..server.protocol import AbortRequest, ChatCompletionRequest, CompletionRequest, GenerateRequest
from ..server.runner import UvicornThread, bind_listener
from ..server.sse import DONE
from .pd import ClientGone
from .policy import Policy, RouterConfig
from .relay import event_end, stream_error_event
from .responses_routes import add_responses_routes, responses_text

log = logging.getLogger("sglite.router")

GENERATE_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
#: the server's request model of each generation route: the router checks bodies against them
REQUEST_MODELS = {"/generate": GenerateRequest, "/v1/completions": CompletionRequest,
                  "/v1/chat/completions": ChatCompletionRequest}
RETRY_STATUS = (502, 503, 504)
FORWARD_HEADERS = ("authorization", "content-type")
ABORT_TIMEOUT_SECS = 5.0  # how long the router waits for a worker's answer to /abort_request
#: failures of a request on its worker before anything came back (the request may be tried elsewhere)
RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
             httpx.WriteError, httpx.CloseError)


async def read_body(request: Request, model: type[BaseModel]) -> dict:
    """The request's JSON object, checked against the server's ``model`` (the dict itself is
    returned, unchanged, to be forwarded as the client sent it).

    Raises:
        ApiError: 400 naming ``body`` (not JSON, not an object) or the first wrong field.
    """
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ApiError(f"body: malformed JSON ({exc})", 400, param="body") from None
    if not isinstance(body, dict):
        raise ApiError(f"body: must be a JSON object, got {type(body).__name__}", 400, param="body")
    try:
        model.model_validate(body)
    except ValidationError as exc:
        msg, param = validation_message(exc)
        raise ApiError(msg, 400, param=param) from None
    return body


def rids_of(body: dict) -> list[str]:
    """The request ids of a (checked) generation body: its ``rid`` or list of rids."""
    rid = body.get("rid")
    return [r for r in (rid if isinstance(rid, list) else [rid]) if isinstance(r, str) and r]


def request_text(path: str, body: dict) -> str:
    """The text a request's prompt starts with, for prefix matching (no tokenizer: characters).
    ``/generate``: ``text`` (the first of a batch) or the ``input_ids`` as text; completions:
    ``prompt``; chat: the messages' roles and contents in order."""
    if path == "/v1/responses":
        return responses_text(body)
    if path == "/v1/chat/completions":
        parts = []
        messages = body.get("messages")
        for m in messages if isinstance(messages, list) else []:
            c = m.get("content") if isinstance(m, dict) else m
            parts.append(f"<{m.get('role') if isinstance(m, dict) else ''}>{c if isinstance(c, str) else json.dumps(c)}")
        return "".join(parts)
    v = body.get("text") if path == "/generate" else body.get("prompt")
    if v is None and path == "/generate":
        v = body.get("input_ids")
    if isinstance(v, list) and v and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, list):
        return " ".join(map(str, v))
    return v if isinstance(v, str) else ""


class Router:
    """Worker state (health, requests in flight) and the proxy; one per app."""

    def __init__(self, config: RouterConfig):
        if not config.worker_urls:
            raise ValueError("worker_urls: at least one worker URL is required")
        self.config = config
        self.urls = [u.rstrip("/") for u in config.worker_urls]
        self.policy = Policy(config, len(self.urls))
        self.loads = [0] * len(self.urls)
        self.healthy = [True] * len(self.urls)
        self.routed = [0] * len(self.urls)
        self.client: Optional[httpx.AsyncClient] = None

    def _pick(self, text: str, exclude: set) -> Optional[int]:
        healthy = [h and i not in exclude for i, h in enumerate(self.healthy)]
        if not any(healthy):
            return None
        return self.policy.select(text, self.loads, healthy)

    def _mark_down(self, i: int, why: str) -> None:
        if self.healthy[i]:
            log.warning("worker %s marked unhealthy: %s", self.urls[i], why)
        self.healthy[i] = False

    async def check_health(self) -> None:
        """Probe every worker's ``/health`` once."""
        async def probe(i):
            try:
                r = await self.client.get(self.urls[i] + "/health", timeout=5.0)
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok and not self.healthy[i]:
                log.info("worker %s is healthy again", self.urls[i])
                self.policy.forget(i)
            elif not ok:
                self._mark_down(i, "health check failed")
            self.healthy[i] = ok
        await asyncio.gather(*(probe(i) for i in range(len(self.urls))))

    async def abort_on(self, i: int, rids: list[str], headers: dict) -> None:
        """Ask worker ``i`` to abort ``rids`` (``/abort_request``; failures are logged, not raised)."""
        for rid in rids:
            try:
                r = await self.client.post(self.urls[i] + "/abort_request", json={"rid": rid},
                                           headers=_auth(headers), timeout=ABORT_TIMEOUT_SECS)
                if r.status_code != 200:
                    log.warning("abort of %s on %s answered %d: %s", rid, self.urls[i], r.status_code, r.text[:200])
            except httpx.HTTPError as exc:
                log.warning("abort of %s on %s failed: %s: %s", rid, self.urls[i], type(exc).__name__, exc)

    async def proxy(self, path: str, body: dict, headers: dict, before=None, receive=None, pin=None,
                    picked=None) -> Response:
        """Send the request to worker ``pin`` (when given and healthy) or one the policy picks (``picked(i)``
        is told each one tried); ``before(i, text)`` (a coroutine), when given, runs first for the chosen worker ``i``
        (the prefill/decode KV transfer).

        ``body`` is forwarded as is (give it a ``rid``: an abort names it). ``receive`` is the
        client's ASGI receive: when the client disconnects before a non-streamed answer (or a
        stream's first byte) came, the request is aborted on its worker and the answer is 499.
        A worker that fails before anything was sent is marked down and the request tried on
        one other worker at most (``config.max_retries``)."""
        text, stream = request_text(path, body), bool(body.get("stream"))
        tried: set = set()
        last, busy = "no healthy worker", None  # busy: a worker's Retry-After (its queue is full)
        for _ in range(self.config.max_retries + 1):
            i = pin if pin is not None and pin not in tried and self.healthy[pin] else self._pick(text, tried)
            if i is None:
                break
            tried.add(i)
            if picked is not None:
                picked(i)
            self.loads[i] += 1
            released = sent = False
            try:
                if before is not None:
                    await before(i, text)
                req = self.client.build_request("POST", self.urls[i] + path, json=body, headers=headers)
                sent = True
                resp = await self._until_disconnect(receive, self.client.send(req, stream=True))
                if resp.status_code == 503 and "retry-after" in resp.headers:  # queue full: busy, not down
                    busy = resp.headers["retry-after"]
                    await resp.aclose()
                    last = f"worker {i} is busy (its waiting queue is full)"
                    continue
                if resp.status_code in RETRY_STATUS:
                    await resp.aclose()
                    last = f"worker {i} answered {resp.status_code}"  # the client sees no worker address
                    self._mark_down(i, f"answered {resp.status_code}")
                    continue
                self.routed[i] += 1
                ctype = resp.headers.get("content-type") or ""
                if stream and resp.status_code == 200 and ctype.startswith("text/event-stream"):
                    released = True  # the generator releases the load when the stream ends
                    return StreamingResponse(self._relay(resp, i), status_code=resp.status_code,
                                             media_type=ctype, headers={"Cache-Control": "no-cache",
                                                                        "X-Accel-Buffering": "no"})
                try:
                    content = await self._until_disconnect(receive, resp.aread())
                finally:
                    await resp.aclose()
                return Response(content, status_code=resp.status_code, media_type=ctype or None)
            except RETRYABLE as exc:
                last = f"worker {i}: {type(exc).__name__}"
                self._mark_down(i, f"{type(exc).__name__}: {exc}")
            except httpx.TimeoutException:  # read, write or pool timeout: the worker may still be at it
                if sent:
                    await self.abort_on(i, rids_of(body), headers)
                return JSONResponse(error_body(f"the worker did not answer within request_timeout_secs="
                                               f"{self.config.request_timeout_secs:g} s", 504), status_code=504)
            except ClientDisconnected:
                log.info("client disconnected before the answer of %s from %s: aborting it there",
                         rids_of(body), self.urls[i])
                if sent:
                    await self.abort_on(i, rids_of(body), headers)
                return JSONResponse(error_body("the client disconnected", 499), status_code=499)
            except ClientGone as exc:  # nobody to answer (499: nginx's "client closed request")
                return JSONResponse(error_body(str(exc), 499), status_code=499)
            finally:
                if not released:
                    self.loads[i] -= 1
        headers_out = {"Retry-After": busy} if busy is not None else None
        return JSONResponse(error_body(f"no worker could serve the request ({last})", 503), status_code=503,
                            headers=headers_out)

    @staticmethod
    async def _until_disconnect(receive, awaitable):
        if receive is None:
            return await awaitable
        return await until_disconnect(receive, awaitable)

    async def _relay(self, resp: httpx.Response, i: int):
        """The worker's SSE stream, whole events at a time; when the worker fails mid-stream, an
        error event and ``[DONE]`` end it (the partial event, if any, is dropped)."""
        buf = b""
        try:
            async for chunk in resp.aiter_raw():
                buf += chunk
                cut = event_end(buf)
                if cut:
                    yield buf[:cut]
                    buf = buf[cut:]
            if buf:
                yield buf
        except httpx.HTTPError as exc:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self._mark_down(i, f"failed mid-stream ({why})")
            yield stream_error_event(f"the worker serving this request failed mid-stream ({type(exc).__name__}); "
                                     f"the output is incomplete")
            yield DONE
        finally:
            self.loads[i] -= 1
            await resp.aclose()

    async def first_healthy_get(self, path: str, headers: dict) -> Response:
        for i in [i for i, h in enumerate(self.healthy) if h]:
            try:
                r = await self.client.get(self.urls[i] + path, headers=headers)
                return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
            except httpx.HTTPError as exc:
                self._mark_down(i, str(exc))
        return JSONResponse(error_body("no healthy worker", 503), status_code=503)

    async def abort(self, body: dict, headers: dict) -> Response:
        """Forward ``/abort_request`` to every worker; 200 with the sum of their ``aborted`` counts
        when at least one accepted it, else the first worker's answer (503 when none answered)."""
        async def one(u):
            try:
                return await self.client.post(u + "/abort_request", json=body, headers=_auth(headers),
                                              timeout=ABORT_TIMEOUT_SECS)
            except httpx.HTTPError as exc:
                log.warning("abort_request to %s failed: %s: %s", u, type(exc).__name__, exc)
                return None

        answers = [r for r in await asyncio.gather(*(one(u) for u in self.urls)) if r is not None]
        ok = [r for r in answers if r.status_code == 200]
        if ok:
            aborted = 0
            for r in ok:
                with contextlib.suppress(ValueError, AttributeError, TypeError):
                    aborted += int(r.json().get("aborted", 0))
            return JSONResponse({"success": True, "aborted": aborted})
        if answers:
            r = answers[0]
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return JSONResponse(error_body("no worker answered /abort_request", 503), status_code=503)


def _auth(headers: dict) -> dict:
    """Only the ``Authorization`` entry of ``headers`` (for requests whose body the router builds)."""
    return {k: v for k, v in headers.items() if k.lower() == "authorization"}


def create_router_app(config: RouterConfig) -> FastAPI:
    """The router's FastAPI app (``app.state.router`` is its :class:`Router`; over the decode
    servers with ``pd_disaggregation``, see :mod:`~sglite.router.pd`)."""
    before = pairing = None
    if config.pd_disaggregation:
        from .pd import PrefillPairing

        pairing = PrefillPairing(config)
        router = Router(replace(config, worker_urls=config.decode_urls))
        before = pairing.transfer
    else:
        router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        router.client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_secs, connect=5.0))
        if before is not None:
            pairing.client = router.client

        async def health_loop():
            while True:
                await asyncio.sleep(config.health_check_interval_secs)
                await router.check_health()

        task = asyncio.create_task(health_loop())
        try:
            yield
        finally:
            task.cancel()
            await router.client.aclose()

    app = FastAPI(title="sglite router", lifespan=lifespan)
    app.state.router, app.state.pairing = router, pairing
    app.state.keys = keys = Keys(config.api_key, config.admin_api_key)
    install_error_handlers(app)

    def fwd(request: Request) -> dict:
        return {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}

    def generate_route(path):
        async def generate(request: Request):
            body = await read_body(request, REQUEST_MODELS[path])
            if body.get("rid") is None:  # every forwarded request has a rid: an abort names it
                body["rid"] = uuid.uuid4().hex
            return await router.proxy(path, body, fwd(request), receive=request.receive, before=before and (
                lambda i, text: before(router.urls[i], body, text, path, request)))
        return generate

    for path in GENERATE_ROUTES:
        app.add_api_route(path, generate_route(path), methods=["POST"], operation_id="route" + path.replace("/", "_"))
    app.state.responses = add_responses_routes(app, router, fwd, read_body)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if any(router.healthy) else 503)

    def any_worker_get(path):
        async def get(request: Request):
            return await router.first_healthy_get(path, fwd(request))
        return get
    for path in ("/v1/models", "/get_model_info"):
        app.add_api_route(path, any_worker_get(path), methods=["GET"], operation_id="route" + path.replace("/", "_"))

    @app.get("/get_server_info")
    async def server_info(request: Request):
        workers = []
        for i, u in enumerate(router.urls):
            info = None
            if router.healthy[i]:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    info = (await router.client.get(u + "/get_server_info", headers=fwd(request))).json()
            workers.append({"url": u, "healthy": router.healthy[i], "load": router.loads[i],
                            "routed_requests": router.routed[i], "tree_chars": router.policy.trees[i].size,
                            "server_info": info})
        out = {"policy": config.policy, "workers": workers}
        if pairing is not None:
            out["pd"] = pairing.stats()
        return out

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await read_body(request, AbortRequest)
        if body.get("abort_all"):
            if not keys.admits_admin(request.scope.get("headers")):
                raise ApiError("abort_all: requires the admin API key (Authorization: Bearer <admin key>, "
                               "set with --admin-api-key)", status=401, param="abort_all")
        elif not body.get("rid"):
            raise ApiError("rid: give rid or abort_all", param="rid")
        return await router.abort(body, fwd(request))

    @app.post("/flush_cache")  # state-changing: POST only (a GET is reachable cross-site)
    async def flush_cache(request: Request):
        codes = []
        for i, u in enumerate(router.urls):
            try:
                codes.append((await router.client.post(u + "/flush_cache", headers=fwd(request))).status_code)
                router.policy.forget(i)
            except httpx.HTTPError:
                codes.append(503)
        for u, _ in (pairing.prefill if pairing is not None else ()):  # the prefill servers' caches too
            try:
                codes.append((await router.client.post(u + "/flush_cache", headers=fwd(request))).status_code)
            except httpx.HTTPError:
                codes.append(503)
        ok = all(c == 200 for c in codes)
        return Response("Cache flushed.\n" if ok else "Cache flush failed on some worker.\n",
                        status_code=200 if ok else 500)

    # outermost last: 500s with an error id, the 4xx log, keys, the body cap (as the server's app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    app.add_middleware(CrossSiteMiddleware)
    if config.api_key or config.admin_api_key:
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(ClientErrorLogMiddleware)
    app.add_middleware(InternalErrorMiddleware)
    return app


class RouterThread(UvicornThread):
    """The router app under uvicorn in a daemon thread (tests, benchmarks); ``port=0`` = free
    port (``self.config.port`` is the one bound). Raises OSError when the address cannot be bound."""

    def __init__(self, config: RouterConfig, startup_timeout: float = 30.0):
        sock = bind_listener(config.host, config.port)
        self.config = replace(config, port=sock.getsockname()[1])
        super().__init__(create_router_app(config), sock, "sglite router", startup_timeout)

    @property
    def router(self) -> Router:
        return self.app.state.router
