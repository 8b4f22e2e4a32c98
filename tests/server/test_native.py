"""SGLang-native routes against the FakeEngine: /generate (single, batch, ids, n, stream,
logprobs), info routes, flush, abort, metrics."""
import json
import time

import httpx
import pytest

from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig
from sglite.server.testing import FakeEngine

REPLY = "Hello world! The quick brown fox jumps over the lazy dog."
GREEDY = {"max_new_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    with ServerThread(FakeEngine(reply=REPLY, step_delay=0.001), ServerConfig(port=0, enable_metrics=True)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=20) as c:
        yield c


def sse_events(resp) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            out.append(line[6:])
    assert out[-1] == "[DONE]"
    return [json.loads(x) for x in out[:-1]]


def test_generate_single_text(http):
    r = http.post("/generate", json={"text": "Hi", "sampling_params": GREEDY}).json()
    assert r["text"] == REPLY[:6] and r["output_ids"] == list(REPLY[:6].encode())
    m = r["meta_info"]
    assert (m["prompt_tokens"], m["completion_tokens"]) == (2, 6)
    assert m["finish_reason"] == {"type": "length", "length": 6} and "cached_tokens" in m


def test_generate_batch_text_and_ids_with_per_item_params(http):
    r = http.post("/generate", json={"text": ["a", "b"], "sampling_params": [
        {"max_new_tokens": 2, "temperature": 0}, {"max_new_tokens": 3, "temperature": 0}]}).json()
    assert [x["text"] for x in r] == [REPLY[:2], REPLY[:3]]
    r = http.post("/generate", json={"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": GREEDY}).json()
    assert [x["meta_info"]["prompt_tokens"] for x in r] == [3, 2]
    r = http.post("/generate", json={"input_ids": [7, 8], "sampling_params": GREEDY}).json()
    assert isinstance(r, dict) and r["meta_info"]["prompt_tokens"] == 2


def test_generate_n_returns_list(http):
    r = http.post("/generate", json={"text": "Hi", "sampling_params": {**GREEDY, "n": 3}}).json()
    assert isinstance(r, list) and len(r) == 3 and {x["text"] for x in r} == {REPLY[:6]}


def test_generate_logprobs_layout(http):
    r = http.post("/generate", json={"text": "Hey", "sampling_params": GREEDY, "return_logprob": True,
                                     "logprob_start_len": 0, "top_logprobs_num": 2}).json()
    m = r["meta_info"]
    out = m["output_token_logprobs"]
    assert [e[1] for e in out] == r["output_ids"] and "".join(e[2] for e in out) == r["text"]
    assert all(len(t) == 2 for t in m["output_top_logprobs"])
    assert m["input_token_logprobs"][0][0] is None and len(m["input_token_logprobs"]) == 3


def test_generate_stream_cumulative_and_done(server):
    with httpx.stream("POST", server.url + "/generate", json={"text": "Hi", "sampling_params": GREEDY,
                                                               "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        evs = sse_events(r)
    texts = [e["text"] for e in evs]
    assert texts[-1] == REPLY[:6] and all(texts[-1].startswith(t) for t in texts) and len(texts) > 1
    assert evs[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in evs[:-1])


def test_generate_stream_batch_has_index(server):
    with httpx.stream("POST", server.url + "/generate", json={"text": ["a", "b"], "sampling_params": GREEDY,
                                                               "stream": True}) as r:
        evs = sse_events(r)
    final = {e["index"]: e["text"] for e in evs if e["meta_info"]["finish_reason"]}
    assert final == {0: REPLY[:6], 1: REPLY[:6]}


def test_model_and_server_info(http):
    info = http.get("/get_model_info").json()
    for key in ("model_path", "role_markers", "end_of_turn", "default_system_prompt", "context_length"):
        assert key in info
    s = http.get("/get_server_info").json()
    assert s["available_tokens"] == s["max_total_tokens"] == 4096
    assert s["api_key"] is None and s["port"] > 0 and "version" in s


def test_flush_cache_and_health(http):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True


def test_flush_cache_refused_while_running():
    eng = FakeEngine(step_delay=0.05)
    with ServerThread(eng) as srv:
        with httpx.stream("POST", srv.url + "/generate", json={"text": "x", "sampling_params": {
                "max_new_tokens": 50, "ignore_eos": True}, "stream": True}) as r:
            lines = r.iter_lines()  # keep the iterator: dropping it closes the connection
            next(lines)
            bad = httpx.post(srv.url + "/flush_cache")
            assert bad.status_code == 400 and "running" in bad.json()["error"]["message"]


def test_abort_request_by_rid(server):
    eng = server.engine
    with httpx.stream("POST", server.url + "/generate", json={
            "text": "x", "rid": "my-req", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}) as r:
        lines = r.iter_lines()
        next(lines)
        ok = httpx.post(server.url + "/abort_request", json={"rid": "my-req"}).json()
        assert ok["success"] and ok["aborted"] == 1
        evs = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert evs[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "my-req" in eng.aborted


def test_metrics_after_requests(http):
    http.post("/generate", json={"text": "Hi", "sampling_params": GREEDY})
    text = http.get("/metrics").text

    def value(name):
        return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(name)))
    for name in ("sglite_num_running_reqs", "sglite_num_queue_reqs", "sglite_kv_usage", "sglite_cache_hit_rate"):
        assert name in text
    assert value("sglite_time_to_first_token_seconds_count") >= 1
    assert value("sglite_e2e_request_latency_seconds_count") >= 1
    assert value("sglite_time_per_output_token_seconds_count") >= 1
    assert value("sglite_generation_tokens_total") >= 6
    assert value("sglite_max_total_tokens") == 4096
    assert 'sglite_http_requests_total{route="/generate",status="200"}' in text


def test_metrics_count_grows(http):
    def gen_count():
        t = http.get("/metrics").text
        return float(next(ln.split()[-1] for ln in t.splitlines() if ln.startswith("sglite_generation_tokens_total")))
    before = gen_count()
    http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    time.sleep(0.01)
    assert gen_count() == before + 4


def test_abort_one_batch_item_by_engine_rid(server):
    """Batch items are named ``<rid>-<i>`` by the engine; aborting one leaves the others running."""
    with httpx.stream("POST", server.url + "/generate", json={
            "text": ["x", "y"], "rid": "bt", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}) as r:
        lines = r.iter_lines()
        next(lines)
        ok = httpx.post(server.url + "/abort_request", json={"rid": "bt-1"}).json()
        assert ok["success"] and ok["aborted"] == 1
        finals = {}
        for x in lines:
            if x.startswith("data: {"):
                ev = json.loads(x[6:])
                if ev["meta_info"]["finish_reason"]:
                    finals[ev["index"]] = ev["meta_info"]["finish_reason"]["type"]
                    if len(finals) == 1:
                        assert finals == {1: "abort"}
                        httpx.post(server.url + "/abort_request", json={"rid": "bt"})
    assert finals == {0: "abort", 1: "abort"}
    assert "bt-1" in server.engine.aborted and server.engine.aborted[-1] == "bt"


def test_non_json_content_type_is_named_in_the_error(server):
    """``curl -d`` without ``-H 'Content-Type: application/json'`` sends a form: the 400 says what
    to send instead of pydantic's "Input should be a valid dictionary"."""
    body = '{"text": "a", "sampling_params": {"max_new_tokens": 2}}'
    for ctype in ("application/x-www-form-urlencoded", "text/plain"):
        r = httpx.post(server.url + "/generate", content=body, headers={"Content-Type": ctype})
        assert r.status_code == 400 and r.json()["param"] == "body"
        assert "Content-Type: application/json" in r.json()["message"] and ctype in r.json()["message"]
    assert httpx.post(server.url + "/generate", content=body, headers={"Content-Type": "application/json"}).status_code == 200


def test_error_param_names_the_field_not_pydantic_union_tags(server):
    """A schema given as a list is refused naming ``response_format.json_schema.schema``, without
    pydantic's union-member tags (``dict[str,any]``) in ``param``."""
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "default", "messages": [{"role": "user", "content": "hi"}],
                         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}}})
    assert r.status_code == 400 and r.json()["param"] == "response_format.json_schema.schema", r.json()


def test_openai_error_message_names_the_top_level_field(server):
    """OpenAI routes name their own fields: ``n``, not the engine's ``sampling_params.n``; the
    native route keeps ``sampling_params.n``."""
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "default", "messages": [{"role": "user", "content": "hi"}], "n": 0})
    assert r.status_code == 400 and r.json()["param"] == "n" and r.json()["message"].startswith("n: "), r.json()
    r = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": {"n": 0}})
    assert r.status_code == 400 and r.json()["message"].startswith("sampling_params.n: "), r.json()
