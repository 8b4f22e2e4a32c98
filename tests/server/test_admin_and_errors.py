"""Operator routes behind ``--admin-api-key``, state-changing routes POST only, 500 bodies that
carry an error id and nothing of the failure, client disconnects logged as info (issue 26 §5, §7)."""
import logging

import pytest
from fastapi.testclient import TestClient

from sglite.server.app import create_app
from sglite.server.settings import ServerConfig
from sglite.server.testing import FakeEngine

USER, ADMIN = {"Authorization": "Bearer user-key"}, {"Authorization": "Bearer admin-key"}


@pytest.fixture()
def client():
    app = create_app(FakeEngine(), ServerConfig(api_key="user-key", admin_api_key="admin-key"))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_flush_cache_needs_the_admin_key(client):
    assert client.post("/flush_cache").status_code == 401
    r = client.post("/flush_cache", headers=USER)
    assert r.status_code == 401 and "admin" in r.json()["error"]["message"]
    assert client.post("/flush_cache", headers=ADMIN).status_code == 200


def test_abort_all_needs_the_admin_key_but_one_rid_does_not(client):
    r = client.post("/abort_request", json={"abort_all": True}, headers=USER)
    assert r.status_code == 401 and r.json()["error"]["param"] == "abort_all"
    assert client.post("/abort_request", json={"abort_all": True}, headers=ADMIN).json()["success"]
    assert client.post("/abort_request", json={"rid": "abc"}, headers=USER).status_code == 200


def test_ordinary_routes_take_either_key_and_info_hides_both(client):
    assert client.get("/v1/models", headers=USER).status_code == 200
    assert client.get("/v1/models", headers=ADMIN).status_code == 200
    assert client.get("/v1/models").status_code == 401
    info = client.get("/get_server_info", headers=USER).json()
    assert info["api_key"] == "***" and info["admin_api_key"] == "***"
    assert "admin-key" not in str(info) and "user-key" not in str(info)


def test_admin_key_alone_guards_only_operator_routes():
    app = create_app(FakeEngine(), ServerConfig(admin_api_key="admin-key"))
    with TestClient(app) as c:
        assert c.get("/v1/models").status_code == 200  # no api_key: ordinary routes stay open
        assert c.post("/flush_cache").status_code == 401
        assert c.post("/flush_cache", headers=ADMIN).status_code == 200


def test_state_changing_routes_refuse_get():
    with TestClient(create_app(FakeEngine(), ServerConfig())) as c:
        assert c.get("/flush_cache").status_code == 405
        assert c.get("/abort_request").status_code == 405
        assert c.post("/flush_cache").status_code == 200


def test_500_carries_an_error_id_only(caplog):
    eng = FakeEngine()

    async def boom(*a, **k):
        raise RuntimeError("secret detail at /home/user/model.gguf")
    eng.async_generate = boom
    with TestClient(create_app(eng, ServerConfig()), raise_server_exceptions=False) as c, \
            caplog.at_level(logging.ERROR, logger="sglite.server"):
        r = c.post("/generate", json={"text": "x"})
    assert r.status_code == 500
    body = r.json()
    assert "secret" not in r.text and "/home" not in r.text and "RuntimeError" not in r.text
    assert body["error_id"] == body["error"]["error_id"] and body["error_id"] in body["error"]["message"]
    assert any(body["error_id"] in rec.getMessage() and rec.exc_info for rec in caplog.records)


@pytest.mark.parametrize("which", ["starlette", "ours"])
def test_client_disconnect_is_an_info_line(caplog, which):
    """Starlette's ClientDisconnect, and ours (a non-streamed call whose client went away; it was
    logged as an internal error with a traceback until 2026-12-06)."""
    from starlette.requests import ClientDisconnect

    from sglite.server.engine_client import ClientDisconnected

    eng = FakeEngine()

    async def gone(*a, **k):
        raise ClientDisconnect() if which == "starlette" else ClientDisconnected()
    eng.async_generate = gone
    with TestClient(create_app(eng, ServerConfig()), raise_server_exceptions=False) as c, \
            caplog.at_level(logging.INFO, logger="sglite.server"):
        c.post("/generate", json={"text": "x"})
    mine = [r for r in caplog.records if r.name == "sglite.server"]
    assert any("client disconnected" in r.getMessage() and r.levelno == logging.INFO for r in mine)
    assert not any(r.levelno >= logging.ERROR for r in mine)


@pytest.mark.parametrize("route,body", [("/generate", {"text": "x"}),
                                        ("/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": 1})])
def test_full_queue_is_503_with_retry_after(route, body):
    from sglite.errors import QueueFullError

    eng = FakeEngine()

    async def busy(*a, **k):
        raise QueueFullError("server busy: 4 requests are waiting, the limit is max_queued_requests=4", retry_after=2)
    eng.async_generate = busy
    with TestClient(create_app(eng, ServerConfig())) as c:
        r = c.post(route, json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert "max_queued_requests=4" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 200


@pytest.mark.parametrize("path", ["/flush_cache", "/start_profile", "/stop_profile", "/abort_request",
                                  "/v1/responses/resp_x/cancel"])
def test_operator_posts_refuse_cross_site_requests(path):
    """With no admin key a web page could send these as body-less "simple" POSTs (text/plain, or no
    body with an Origin): a non-JSON Content-Type is a 415 naming content-type, a foreign Origin a
    403 naming origin. Before, /flush_cache answered 200 to both."""
    with TestClient(create_app(FakeEngine(), ServerConfig())) as c:
        r = c.post(path, headers={"Content-Type": "text/plain"})
        assert r.status_code == 415 and r.json()["error"]["param"] == "content-type"
        r = c.post(path, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["param"] == "origin"
        r = c.post(path, headers={"Origin": "null"})
        assert r.status_code == 403


def test_operator_posts_still_take_curl_and_same_origin_requests():
    with TestClient(create_app(FakeEngine(), ServerConfig())) as c:
        assert c.post("/flush_cache").status_code == 200  # curl -XPOST: no body, no Content-Type
        assert c.post("/flush_cache", json={}).status_code == 200
        assert c.post("/flush_cache", headers={"Content-Type": "application/json; charset=utf-8"}).status_code == 200
        assert c.post("/flush_cache", headers={"Origin": "http://testserver"}).status_code == 200
        assert c.post("/abort_request", json={"rid": "abc"}).status_code == 200
        # the generation routes are unaffected (a non-JSON body there is already a 400 naming body)
        assert c.post("/generate", content='{"text": "hi"}', headers={"Content-Type": "text/plain"}).status_code == 400
