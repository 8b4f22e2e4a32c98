"""``sglite router``: a data-parallel HTTP router in front of sglite servers (FastAPI + httpx).

    sglite router --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002 --port 30000

Generation routes (``/generate``, ``/v1/completions``, ``/v1/chat/completions``) go to the worker a
:class:`~sglite.router.policy.Policy` picks (cache-aware by default); streamed responses are passed
through chunk by chunk. A worker that cannot be reached (connection error, or 502/503/504 before
any byte was sent) is marked unhealthy and the request is retried on another (``max_retries``);
a background task probes every worker's ``/health`` every ``health_check_interval_secs`` and
brings recovered workers back (with an empty approximate tree). ``/flush_cache`` goes to every
worker (and every prefill server of a P/D router); ``/get_server_info`` lists the workers with
their health, load and own server info; other GET routes (``/v1/models``, ``/get_model_info``) go to a healthy worker.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import replace
from typing import Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..server.runner import UvicornThread, bind_listener
from .pd import ClientGone
from .policy import Policy, RouterConfig

log = logging.getLogger("sglite.router")

GENERATE_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
RETRY_STATUS = (502, 503, 504)
FORWARD_HEADERS = ("authorization", "content-type")


def request_text(path: str, body: dict) -> str:
    """The text a request's prompt starts with, for prefix matching (no tokenizer: characters).
    ``/generate``: ``text`` (the first of a batch) or the ``input_ids`` as text; completions:
    ``prompt``; chat: the messages' roles and contents in order."""
    if path == "/v1/chat/completions":
        parts = []
        for m in body.get("messages") or []:
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

    async def proxy(self, path: str, body: dict, headers: dict, before=None) -> Response:
        """Send the request to a worker the policy picks; ``before(i, text)`` (a coroutine), when
        given, runs first for the chosen worker ``i`` (the prefill/decode KV transfer)."""
        text, stream = request_text(path, body), bool(body.get("stream"))
        tried: set = set()
        last = "no healthy worker"
        for _ in range(self.config.max_retries + 1):
            i = self._pick(text, tried)
            if i is None:
                break
            tried.add(i)
            self.loads[i] += 1
            released = False
            try:
                if before is not None:
                    await before(i, text)
                req = self.client.build_request("POST", self.urls[i] + path, json=body, headers=headers)
                resp = await self.client.send(req, stream=True)
                if resp.status_code in RETRY_STATUS:
                    await resp.aclose()
                    last = f"{self.urls[i]} answered {resp.status_code}"
                    self._mark_down(i, last)
                    continue
                self.routed[i] += 1
                if stream:
                    released = True  # the generator releases the load when the stream ends
                    return StreamingResponse(self._relay(resp, i), status_code=resp.status_code,
                                             media_type=resp.headers.get("content-type"))
                content = await resp.aread()
                await resp.aclose()
                return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                last = f"{self.urls[i]}: {type(exc).__name__}: {exc}"
                self._mark_down(i, last)
            except ClientGone as exc:  # nobody to answer (499: nginx's "client closed request")
                return JSONResponse({"error": {"message": str(exc), "code": 499}}, status_code=499)
            finally:
                if not released:
                    self.loads[i] -= 1
        return JSONResponse({"error": {"message": f"no worker could serve the request ({last})", "code": 503,
                                       "type": "ServiceUnavailable"}}, status_code=503)

    async def _relay(self, resp: httpx.Response, i: int):
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
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
        return JSONResponse({"error": {"message": "no healthy worker", "code": 503}}, status_code=503)


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

    def fwd(request: Request) -> dict:
        return {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}

    def generate_route(path):
        async def generate(request: Request):
            try:
                body = await request.json()
            except ValueError:
                return JSONResponse({"error": {"message": "request body is not valid JSON", "code": 400}}, 400)
            if not isinstance(body, dict):
                return JSONResponse({"error": {"message": "request body must be a JSON object", "code": 400}}, 400)
            return await router.proxy(path, body, fwd(request), before=before and (
                lambda i, text: before(router.urls[i], body, text, path, request)))
        return generate

    for path in GENERATE_ROUTES:
        app.add_api_route(path, generate_route(path), methods=["POST"], operation_id="route" + path.replace("/", "_"))

    @app.get("/health")
    async def health():
        return Response(status_code=200 if any(router.healthy) else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        return await router.first_healthy_get("/v1/models", fwd(request))

    @app.get("/get_model_info")
    async def model_info(request: Request):
        return await router.first_healthy_get("/get_model_info", fwd(request))

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
            out["pd"] = {"prefill_urls": [u for u, _ in pairing.prefill], "transfers": pairing.transfers,
                         "transferred_tokens": pairing.transferred_tokens, "failures": pairing.failures,
                         "aborted": pairing.aborted}
        return out

    @app.api_route("/flush_cache", methods=["GET", "POST"])
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
