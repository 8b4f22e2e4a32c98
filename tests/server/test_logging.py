"""Server logs (FakeEngine, in process): ``--log-requests`` summaries, one info line per 4xx,
``/metrics`` off unless ``enable_metrics``."""
import logging

import httpx
import pytest

from sglite.server.request_log import shorten
from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig
from sglite.server.testing import FakeEngine

REPLY = "The quick brown fox jumps over the lazy dog, again and again and again."


@pytest.fixture
def info_logs(caplog):
    caplog.set_level(logging.INFO, logger="sglite")
    return caplog


def _lines(caplog, logger_prefix, needle):
    return [r.getMessage() for r in caplog.records if r.name.startswith(logger_prefix) and needle in r.getMessage()]


def test_log_requests_summaries(info_logs):
    cfg = ServerConfig(port=0, log_requests=True, log_requests_max_chars=20)
    with ServerThread(FakeEngine(reply=REPLY), cfg) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/generate", json={"text": "A prompt that is longer than twenty characters", "rid": "req-one",
                                      "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        assert r.status_code == 200
        out = r.json()
        r = c.post("/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 5, "stream": True})
        assert r.status_code == 200
    recv = _lines(info_logs, "sglite.server.requests", "Receive: rid=req-one")
    assert len(recv) == 1
    assert "prompts=1" in recv[0] and "'max_new_tokens': 8" in recv[0]
    assert repr("A prompt that is lon") + "…" in recv[0]  # cut to 20 characters
    fin = _lines(info_logs, "sglite.server.requests", "Finish: rid=req-one")
    assert len(fin) == 1
    m = out["meta_info"]
    for part in (f"prompt_tokens={m['prompt_tokens']}", f"completion_tokens={m['completion_tokens']}",
                 f"finish_reason={m['finish_reason']['type']}", "e2e_latency=",
                 f"text={shorten(out['text'], 20)}"):
        assert part in fin[0], (part, fin[0])
    # the streamed OpenAI request is logged too; its text is not (the stream sends deltas)
    streamed = _lines(info_logs, "sglite.server.requests", "completion_tokens=5")
    assert any("text=(streamed)" in x for x in streamed), streamed


def test_no_request_log_by_default(info_logs):
    with ServerThread(FakeEngine(), ServerConfig(port=0)) as srv:
        assert httpx.post(srv.url + "/generate", json={"text": "x"}, timeout=30).status_code == 200
    assert not _lines(info_logs, "sglite.server.requests", "Receive:")


def test_every_4xx_reason_is_logged(info_logs):
    cfg = ServerConfig(port=0, api_key="k", max_request_bytes=2048)
    auth = {"Authorization": "Bearer k"}
    with ServerThread(FakeEngine(), cfg) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        cases = [
            (c.post("/generate", json={"text": "x", "sampling_params": {"temperature": -1}}, headers=auth),
             "POST /generate", "param=sampling_params.temperature"),
            (c.post("/v1/completions", json={"model": "default", "prompt": "x", "max_tokens": -2}, headers=auth),
             "POST /v1/completions", "param=max_tokens"),
            (c.post("/generate", json={"text": "x"}), "POST /generate", "param=authorization"),
            (c.post("/generate", content=b"x" * 5000, headers=auth), "POST /generate", "param=body"),
            (c.get("/no/such/route", headers=auth), "GET /no/such/route", "param=None"),
        ]
    for resp, where, param in cases:
        assert 400 <= resp.status_code < 500
        lines = [x for x in _lines(info_logs, "sglite.server", f"HTTP {resp.status_code} {where} ") if param in x]
        assert len(lines) == 1, (resp.status_code, where, param, info_logs.text[-3000:])
        assert resp.json()["error"]["message"][:60] in lines[0]


def test_metrics_route_only_with_enable_metrics():
    with ServerThread(FakeEngine(), ServerConfig(port=0)) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 404
    with ServerThread(FakeEngine(), ServerConfig(port=0, enable_metrics=True)) as srv:
        r = httpx.get(srv.url + "/metrics")
        assert r.status_code == 200 and "sglite_num_running_reqs" in r.text
