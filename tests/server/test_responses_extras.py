"""``/v1/responses`` extras on FakeEngine servers: output-text logprobs (``include`` /
``top_logprobs``), ``truncation: "auto"``, and ``background`` responses (poll, cancel, bounded by
the store)."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig
from sglite.server.testing import FakeEngine

LP = "message.output_text.logprobs"


@pytest.fixture(scope="module")
def srv():
    with ServerThread(FakeEngine(context_length=512), ServerConfig(port=0, responses_store_size=3)) as s:
        yield s


@pytest.fixture()
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)


def _post(srv, **body):
    return httpx.post(srv.url + "/v1/responses", json={"model": "fake-model", **body}, timeout=30)


def test_output_text_logprobs_streamed_and_not(client):
    r = client.responses.create(model="fake-model", input="hi", include=[LP], top_logprobs=2, max_output_tokens=8,
                                temperature=0)
    part = r.output[0].content[0]
    assert len(part.logprobs) == r.usage.output_tokens == 8
    assert "".join(e.token for e in part.logprobs) == part.text
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in part.logprobs)
    with client.responses.stream(model="fake-model", input="hi", include=[LP], top_logprobs=2, max_output_tokens=8,
                                 temperature=0) as s:
        events = list(s)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [lp for e in deltas for lp in e.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in part.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert len(done.logprobs) == 8
    plain = client.responses.create(model="fake-model", input="hi", max_output_tokens=8)
    assert plain.output[0].content[0].logprobs == []


def test_truncation_auto_drops_the_oldest_items(srv):
    big = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " + "x" * 90} for i in range(8)]
    body = dict(input=big + [{"role": "user", "content": "last question"}], instructions="be brief",
                max_output_tokens=16, store=False)
    r = _post(srv, **body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = _post(srv, truncation="auto", **body)
    assert r.status_code == 200, r.text
    prompt = srv.engine.calls[-1]["text"]
    assert "be brief" in prompt and "last question" in prompt and "message 0 " not in prompt
    kept = [i for i in range(8) if f"message {i} " in prompt]
    assert kept and kept == list(range(kept[0], 8))  # the newest ones, in order
    assert r.json()["usage"]["input_tokens"] + 16 <= 512 and r.json()["truncation"] == "auto"


def _poll(client, rid, until=("completed", "incomplete", "failed", "cancelled"), timeout=20.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        r = client.responses.retrieve(rid)
        if r.status in until:
            return r
        time.sleep(0.02)
    raise AssertionError(f"{rid} still {r.status}")


def _wait(cond, timeout=5.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.02)


def test_background_polls_to_the_same_result(client):
    fg = client.responses.create(model="fake-model", input="hi", max_output_tokens=6, temperature=0)
    bg = client.responses.create(model="fake-model", input="hi", max_output_tokens=6, temperature=0, background=True)
    assert bg.status in ("queued", "in_progress") and bg.background and bg.output == []
    done = _poll(client, bg.id)
    assert done.status == "incomplete" and done.output_text == fg.output_text and done.background


def test_background_cancel_and_eviction_abort_the_engine_request(srv, client):
    srv.engine.step_delay = 0.05
    try:
        n_aborted = len(srv.engine.aborted)
        bg = client.responses.create(model="fake-model", input="hi", max_output_tokens=200, background=True)
        _poll(client, bg.id, until=("in_progress",))
        r = httpx.post(f"{srv.url}/v1/responses/{bg.id}/cancel", timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        assert _poll(client, bg.id).status == "cancelled" and client.responses.retrieve(bg.id).output == []
        _wait(lambda: len(srv.engine.aborted) > n_aborted)  # the engine request was aborted
        n_aborted = len(srv.engine.aborted)
        # a running background response evicted from the bounded store (size 3) is cancelled too
        victim = client.responses.create(model="fake-model", input="hi", max_output_tokens=200, background=True)
        for _ in range(3):
            client.responses.create(model="fake-model", input="x", max_output_tokens=1)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(victim.id)
        _wait(lambda: len(srv.engine.aborted) > n_aborted)
    finally:
        srv.engine.step_delay = 0.0
    fg = client.responses.create(model="fake-model", input="hi", max_output_tokens=2)
    r = httpx.post(f"{srv.url}/v1/responses/{fg.id}/cancel", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
    assert httpx.post(f"{srv.url}/v1/responses/resp_nope/cancel", timeout=30).status_code == 404


def _abort_soon(srv, rid, **body):
    """POST /v1/responses with ``rid`` while /abort_request stops it once it runs; the answer."""
    import threading

    def abort():
        time.sleep(0.3)  # the request is running by then (200 tokens at 20 ms a step)
        httpx.post(srv.url + "/abort_request", json={"rid": rid}, timeout=30)
    t = threading.Thread(target=abort)
    t.start()
    try:
        return httpx.post(srv.url + "/v1/responses", timeout=30,
                          json={"model": "fake-model", "input": "story", "max_output_tokens": 200, "rid": rid, **body})
    finally:
        t.join()


def test_an_aborted_response_is_incomplete_and_a_background_one_cancelled(srv, client):
    """An abort was reported as ``completed`` (only ``length`` made a response incomplete)."""
    srv.engine.step_delay = 0.02
    try:
        r = _abort_soon(srv, "nb1").json()
        assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "aborted"}
        assert r["output"][-1]["type"] == "message" and r["output"][-1]["status"] == "incomplete"
        assert r["completed_at"] is not None
        # a follow-up on the aborted response continues from its stored (partial) output
        follow = client.responses.create(model="fake-model", input="go on", max_output_tokens=2,
                                         previous_response_id=r["id"])
        assert follow.status in ("completed", "incomplete") and follow.previous_response_id == r["id"]
        # streamed: the last event is response.incomplete, the message item closed incomplete
        r = _abort_soon(srv, "nb2", stream=True)
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["type"] == "response.incomplete"
        assert events[-1]["response"]["incomplete_details"] == {"reason": "aborted"}
        done = [e for e in events if e["type"] == "response.output_item.done"]
        assert done[-1]["item"]["status"] == "incomplete"
        # background, stopped by /abort_request: cancelled (as by POST .../cancel), its partial output kept
        bg = client.responses.create(model="fake-model", input="story", max_output_tokens=200, background=True,
                                     extra_body={"rid": "nb3"})
        _poll(client, bg.id, until=("in_progress",))
        time.sleep(0.15)
        httpx.post(srv.url + "/abort_request", json={"rid": "nb3"}, timeout=30)
        got = _poll(client, bg.id)
        assert got.status == "cancelled" and got.incomplete_details is None
        assert got.output and got.output[-1].status == "incomplete"
    finally:
        srv.engine.step_delay = 0.0
