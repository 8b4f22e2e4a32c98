"""The router is safe to put on a network: a body cap (413 naming the limit), 400 naming the field
for malformed bodies and 500s with an error id only, a non-streamed client that disconnects aborts
its request on the worker (by rid), ``/abort_request`` forwarded (``abort_all`` behind the admin
key), a worker dying mid-stream ends the client's stream with an error event and ``[DONE]``, a
request is retried on another worker at most once (never after output was sent), and the client's
``Authorization`` reaches the workers.

Workers are small FastAPI apps (or a raw socket that hangs up) in threads on 127.0.0.1."""
import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from sglite.errors import InvalidRequestError
from sglite.router.app import RouterThread
from sglite.router.policy import RouterConfig
from sglite.server.settings import ServerConfig
from tests.router.workers import Worker

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached after {timeout} s"
        time.sleep(0.02)


def scripted_worker(name="w", slow_secs=0.0, die_after_frames=None):
    """``/generate`` and the OpenAI routes record the body and headers; a non-streamed call waits
    up to ``slow_secs`` (or until aborted); a streamed one sends frames, or raises after
    ``die_after_frames`` frames (uvicorn then drops the connection mid-stream: a dead worker)."""
    app = FastAPI()
    app.state.calls, app.state.aborts, app.state.headers = [], [], []
    aborted = asyncio.Event()

    @app.get("/health")
    async def health():
        return {}

    async def generate(request: Request):
        body = await request.json()
        app.state.calls.append(body)
        app.state.headers.append(dict(request.headers))
        if not body.get("stream"):
            if slow_secs:
                aborted.clear()
                with_timeout = asyncio.wait_for(aborted.wait(), slow_secs)
                try:
                    await with_timeout
                except asyncio.TimeoutError:
                    pass
            return {"text": name}

        async def frames():
            for i in range(3):
                if die_after_frames is not None and i == die_after_frames:
                    raise RuntimeError("worker died")
                yield f'data: {{"text": "{name}{i}"}}\n\n'
                await asyncio.sleep(0.05)
            yield "data: [DONE]\n\n"
        return StreamingResponse(frames(), media_type="text/event-stream")

    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, generate, methods=["POST"])

    @app.post("/abort_request")
    async def abort(request: Request):
        body = await request.json()
        app.state.aborts.append((body, request.headers.get("authorization")))
        aborted.set()
        return {"success": True, "aborted": 1}

    return app


class HangUpWorker:
    """A TCP listener that reads each request and closes the connection without answering (a
    worker killed by the request); counts the generation requests it got."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.generates, self.stop = 0, False
        self.thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    head = conn.recv(65536)
                except OSError:
                    head = b""
                if head.startswith(b"POST /generate"):
                    self.generates += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join(5)
        self.sock.close()


def router(*urls, **kw):
    kw.setdefault("health_check_interval_secs", 60)
    return RouterThread(RouterConfig(worker_urls=tuple(urls), port=0, **kw))


def test_body_cap_is_the_servers_and_answers_413_naming_the_limit():
    assert RouterConfig().max_request_bytes == ServerConfig().max_request_bytes
    with pytest.raises(InvalidRequestError, match="max_request_bytes"):
        RouterConfig(max_request_bytes=10)
    app = scripted_worker()
    with Worker(app) as w, router(w.url, max_request_bytes=4096) as r:
        big = {"text": "x" * 8192}
        resp = httpx.post(r.url + "/generate", json=big, timeout=10)
        assert resp.status_code == 413
        err = resp.json()["error"]
        assert "4096" in err["message"] and err["param"] == "body"
        assert app.state.calls == []
        assert httpx.post(r.url + "/generate", json={"text": "x" * 1000}, timeout=10).status_code == 200


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"model": "m", "messages": 5}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": [5]}, "messages.0"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "nobody", "content": "x"}]}, "messages.0.role"),
    ("/v1/completions", {"model": "m", "prompt": {"a": 1}}, "prompt"),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {"text": "hi", "rid": 7}, "rid"),
    ("/generate", {"text": "hi", "stream": [1]}, "stream"),
    ("/generate", [1, 2], "body"),
])
def test_malformed_bodies_are_400_naming_the_field(path, body, param):
    app = scripted_worker()
    with Worker(app) as w, router(w.url) as r:
        resp = httpx.post(r.url + path, json=body, timeout=10)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == param and param.split(".")[0] in err["message"]
        assert app.state.calls == []  # refused at the router


def test_non_json_body_is_400_and_an_internal_error_is_500_with_an_error_id_only():
    app = scripted_worker()
    with Worker(app) as w, router(w.url) as r:
        resp = httpx.post(r.url + "/generate", content=b"{not json", timeout=10)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "body"

        def boom(*a, **k):
            raise RuntimeError("secret detail /etc/some/path")
        r.router.policy.select = boom
        resp = httpx.post(r.url + "/generate", json={"text": "hi"}, timeout=10)
        assert resp.status_code == 500
        assert "secret" not in resp.text and "/etc" not in resp.text and "Traceback" not in resp.text
        assert len(resp.json()["error_id"]) == 16


def test_a_non_streamed_client_that_disconnects_aborts_its_request_on_the_worker():
    app = scripted_worker(slow_secs=20)
    with Worker(app) as w, router(w.url) as r:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(r.url + "/generate", json={"text": "hi"}, timeout=httpx.Timeout(10, read=0.5),
                       headers={"Authorization": "Bearer k"})
        wait_for(lambda: app.state.aborts, 10, "the abort on the worker")
        rid = app.state.calls[0]["rid"]  # the router gave the request a rid
        assert isinstance(rid, str) and rid
        assert app.state.aborts == [({"rid": rid}, "Bearer k")]
        wait_for(lambda: r.router.loads == [0], 10, "the router releasing the request's load")  # after the abort
        # a client's own rid is kept
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(r.url + "/v1/chat/completions", json={**CHAT, "rid": "mine"},
                       timeout=httpx.Timeout(10, read=0.5))
        wait_for(lambda: len(app.state.aborts) == 2, 10, "the second abort")
        assert app.state.calls[1]["rid"] == "mine" and app.state.aborts[1][0] == {"rid": "mine"}


def test_abort_request_is_forwarded_and_abort_all_needs_the_admin_key():
    a, b = scripted_worker("a"), scripted_worker("b")
    with Worker(a) as wa, Worker(b) as wb, router(wa.url, wb.url, admin_api_key="adm") as r:
        resp = httpx.post(r.url + "/abort_request", json={"rid": "x1"}, headers={"Authorization": "Bearer user"})
        assert resp.status_code == 200 and resp.json()["success"] is True
        assert a.state.aborts == b.state.aborts == [({"rid": "x1"}, "Bearer user")]
        resp = httpx.post(r.url + "/abort_request", json={"abort_all": True}, headers={"Authorization": "Bearer user"})
        assert resp.status_code == 401 and resp.json()["error"]["param"] == "abort_all"
        assert len(a.state.aborts) == 1
        resp = httpx.post(r.url + "/abort_request", json={"abort_all": True}, headers={"Authorization": "Bearer adm"})
        assert resp.status_code == 200 and resp.json()["aborted"] == 2
        assert a.state.aborts[-1] == ({"abort_all": True}, "Bearer adm")
        resp = httpx.post(r.url + "/abort_request", json={})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "rid"
        resp = httpx.post(r.url + "/abort_request", json={"rid": 5})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "rid"
        # the router's other operator route: POST only, and behind the admin key
        assert httpx.get(r.url + "/flush_cache", headers={"Authorization": "Bearer adm"}).status_code == 405
        assert httpx.post(r.url + "/flush_cache", headers={"Authorization": "Bearer adm"}).status_code != 401
        assert httpx.post(r.url + "/flush_cache", headers={"Authorization": "Bearer user"}).status_code == 401


def test_the_routers_flush_cache_refuses_cross_site_requests():
    """Without an admin key, a web page's text/plain or foreign-Origin POST reached /flush_cache."""
    with Worker(scripted_worker()) as w, router(w.url) as r:
        resp = httpx.post(r.url + "/flush_cache", headers={"Content-Type": "text/plain"}, timeout=10)
        assert resp.status_code == 415 and resp.json()["error"]["param"] == "content-type"
        resp = httpx.post(r.url + "/flush_cache", headers={"Origin": "http://evil.example"}, timeout=10)
        assert resp.status_code == 403 and resp.json()["error"]["param"] == "origin"
        assert httpx.post(r.url + "/flush_cache", timeout=10).status_code not in (403, 415)


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions"])
def test_a_worker_dying_mid_stream_ends_the_stream_with_an_error_event(path):
    dying, other = scripted_worker("d", die_after_frames=1), scripted_worker("o")
    with Worker(dying) as wd, Worker(other) as wo, router(wd.url, wo.url, policy="round_robin") as r:
        body = {**CHAT, "stream": True} if path.startswith("/v1/chat") else {"text": "hi", "stream": True}
        with httpx.stream("POST", r.url + path, json=body, timeout=10) as resp:
            assert resp.status_code == 200
            frames = [ln for ln in resp.iter_lines() if ln]
        assert frames[0] == 'data: {"text": "d0"}'
        err = json.loads(frames[1][len("data: "):])["error"]
        assert "worker" in err["message"] and err["code"] == 502
        assert frames[2:] == ["data: [DONE]"]
        assert len(dying.state.calls) == 1 and other.state.calls == []  # output was sent: no retry
        assert r.router.healthy == [False, True] and r.router.loads == [0, 0]


@pytest.mark.slow  # waits out a timeout / several hang-ups
def test_a_request_that_kills_its_worker_is_retried_at_most_once():
    with pytest.raises(InvalidRequestError, match="max_retries"):
        RouterConfig(max_retries=2)
    with HangUpWorker() as k1, HangUpWorker() as k2, HangUpWorker() as k3:
        with router(k1.url, k2.url, k3.url, policy="round_robin") as r:
            resp = httpx.post(r.url + "/generate", json={"text": "hi"}, timeout=10)
            assert resp.status_code == 503 and "no worker could serve" in resp.json()["error"]["message"]
            assert k1.generates + k2.generates + k3.generates == 2
            assert r.router.loads == [0, 0, 0]


def test_the_plain_router_forwards_authorization_to_workers_with_an_api_key():
    from sglite.server.runner import ServerThread
    from sglite.server.testing import FakeEngine

    server = ServerThread(FakeEngine(), ServerConfig(port=0, api_key="k")).start()
    try:
        with router(server.url) as r:
            body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
            assert httpx.post(r.url + "/generate", json=body, timeout=10).status_code == 401
            ok = httpx.post(r.url + "/generate", json=body, headers={"Authorization": "Bearer k"}, timeout=10)
            assert ok.status_code == 200 and "text" in ok.json()
            assert httpx.get(r.url + "/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
            resp = httpx.post(r.url + "/abort_request", json={"rid": "nothing"}, headers={"Authorization": "Bearer k"})
            assert resp.status_code == 200
            assert httpx.post(r.url + "/abort_request", json={"rid": "nothing"}).status_code == 401
    finally:
        server.stop()


def test_the_routers_own_api_key_guards_every_route_but_health():
    app = scripted_worker()
    with Worker(app) as w, router(w.url, api_key="rk") as r:
        assert httpx.get(r.url + "/health").status_code == 200
        resp = httpx.post(r.url + "/generate", json={"text": "hi"}, timeout=10)
        assert resp.status_code == 401 and resp.json()["error"]["param"] == "authorization"
        assert httpx.get(r.url + "/get_server_info").status_code == 401
        assert app.state.calls == []
        ok = httpx.post(r.url + "/generate", json={"text": "hi"}, headers={"Authorization": "Bearer rk"}, timeout=10)
        assert ok.status_code == 200 and app.state.headers[0]["authorization"] == "Bearer rk"


@pytest.mark.slow  # waits out a timeout / several hang-ups
def test_a_request_past_the_timeout_is_504_naming_the_flag_and_aborted_on_its_worker():
    app = scripted_worker(slow_secs=20)
    with Worker(app) as w, router(w.url, request_timeout_secs=0.5) as r:
        resp = httpx.post(r.url + "/generate", json={"text": "hi", "rid": "late"}, timeout=10)
        assert resp.status_code == 504 and "request_timeout_secs" in resp.json()["error"]["message"]
        assert app.state.aborts == [({"rid": "late"}, None)]
        wait_for(lambda: r.router.loads == [0], 10, "the router releasing the request's load")
        assert r.router.healthy == [True]


def busy_worker():
    """Every generation answers 503 with ``Retry-After: 3`` (its waiting queue is full)."""
    app = FastAPI()
    app.state.calls = 0

    @app.get("/health")
    async def health():
        return {}

    @app.post("/generate")
    async def generate():
        app.state.calls += 1
        return JSONResponse({"error": {"message": "server busy"}}, status_code=503, headers={"Retry-After": "3"})

    return app


def test_a_busy_worker_is_not_marked_down_and_its_retry_after_reaches_the_client():
    with Worker(busy_worker()) as b1, Worker(busy_worker()) as b2:
        with router(b1.url, b2.url, policy="round_robin") as r:
            resp = httpx.post(r.url + "/generate", json={"text": "hi"}, timeout=10)
            assert resp.status_code == 503 and resp.headers["retry-after"] == "3"
            assert "busy" in resp.json()["error"]["message"]
            assert b1.app.state.calls + b2.app.state.calls == 2  # each tried once
            assert r.router.healthy == [True, True]
