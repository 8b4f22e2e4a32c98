"""Bad requests get OpenAI-shaped 400s naming the field; disconnects abort; API key; body cap."""
import json
import time

import httpx
import openai
import pytest

from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig
from sglite.server.testing import FakeEngine

MSG = [{"role": "user", "content": "hi"}]
CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"

BAD = [  # (route, body, field that must be named)
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {}, "messages"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": -3}, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 10 ** 7}, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": -1}, "max_completion_tokens"),
    (COMP, {"prompt": "hi", "max_tokens": 511}, "max_tokens"),  # prompt + max_tokens past context
    (CHAT, {"messages": MSG, "n": 0}, "n"),
    (CHAT, {"messages": MSG, "temperature": -0.5}, "temperature"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": MSG, "temperature": "inf"}, "temperature"),
    (CHAT, {"messages": MSG, "top_p": 0}, "top_p"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, "top_p"),
    (CHAT, {"messages": MSG, "regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf"),
    (CHAT, {"messages": MSG, "regex": "a+", "response_format": {"type": "json_object"}}, "response_format"),
    (COMP, {"prompt": "x", "json_schema": {"type": "object"}, "response_format": {"type": "json_object"}},
     "json_schema"),
    (CHAT, {"messages": MSG, "stop": [""]}, "stop"),
    (CHAT, {"messages": MSG, "stop": ""}, "stop"),
    (CHAT, {"messages": MSG, "regex": "(unclosed"}, "regex"),
    (COMP, {"prompt": "x", "json_schema": "{not json"}, "json_schema"),
    (COMP, {"prompt": "x", "ebnf": "no rules here"}, "ebnf"),
    (COMP, {"prompt": "x" * 600}, "prompt"),
    (COMP, {"prompt": [], "max_tokens": 2}, "prompt"),
    (COMP, {"prompt": [1, 2, 99999]}, "prompt"),
    (COMP, {"prompt": "x", "logprobs": 50}, "logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 600}]}, "messages"),
    (CHAT, {"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, "response_format.type"),
    (CHAT, {"messages": MSG, "logit_bias": {"5": 500}}, "logit_bias"),
    (GEN, {"sampling_params": {}}, "text"),
    (GEN, {"text": "x", "input_ids": [1]}, "text"),
    (GEN, {"text": "x", "sampling_params": {"temprature": 1}}, "temprature"),
    (GEN, {"text": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    (GEN, {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    (GEN, {"input_ids": [1, -4]}, "input_ids"),
    (GEN, {"text": []}, "text"),
    ("/abort_request", {}, "rid"),
]


@pytest.fixture(scope="module")
def server():
    with ServerThread(FakeEngine(context_length=512, step_delay=0.002)) as srv:
        yield srv


def test_unknown_model_is_404_model_not_found(server):  # OpenAI's status and code (issue 13)
    r = httpx.post(server.url + CHAT, json={"model": "gpt-9", "messages": MSG}, timeout=10)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-9" in err["message"]
    assert "fake-model" in err["message"] and "/models" not in err["message"]  # served names, no path


@pytest.mark.parametrize("route,body,field", BAD, ids=[f"{r}:{f}" for r, _, f in BAD])
def test_bad_request_is_400_naming_field(server, route, body, field):
    r = httpx.post(server.url + route, json=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"], err
    assert err["param"] is not None and field.split(".")[0] in err["param"], err
    assert err["type"] == "invalid_request_error"


def test_malformed_json_and_wrong_content(server):
    r = httpx.post(server.url + CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + GEN, content=b"[1, 2", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.get(server.url + "/nope")
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_server_healthy_after_bad_requests(server):
    for route, body, _ in BAD[:10]:
        httpx.post(server.url + route, json=body)
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(server.url + CHAT, json={"messages": MSG, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    info = httpx.get(server.url + "/get_server_info").json()
    assert info["available_tokens"] == info["max_total_tokens"]


def test_openai_client_sees_bad_request(server):
    cl = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        cl.chat.completions.create(model="fake-model", messages=MSG, temperature=-1)
    assert "temperature" in str(e.value)


def _wait(pred, timeout=3.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.005)
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("route,body", [
    (CHAT, {"messages": MSG, "max_tokens": 400, "ignore_eos": True, "stream": True, "rid": "gone-chat"}),
    (GEN, {"text": "x", "stream": True, "rid": "gone-gen", "sampling_params": {"max_new_tokens": 400,
                                                                               "ignore_eos": True}}),
])
def test_stream_disconnect_aborts_within_a_step(route, body):
    eng = FakeEngine(step_delay=0.02)
    with ServerThread(eng) as srv:
        with httpx.stream("POST", srv.url + route, json=body) as r:
            lines = r.iter_lines()
            got = [ln for ln, _ in zip(lines, range(6))]
            assert any(ln.startswith("data: {") for ln in got)
            assert len(eng._held) == 1
            t_close = time.monotonic()
        _wait(lambda: eng.aborted)
        assert time.monotonic() - t_close < 0.5  # a few 20 ms steps at most
        assert eng.aborted[0].startswith(body["rid"])
        _wait(lambda: eng.get_server_info()["available_tokens"] == eng.max_total_tokens)


def test_non_stream_disconnect_aborts():
    eng = FakeEngine(step_delay=0.02)
    with ServerThread(eng) as srv:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.url + COMP, json={"prompt": "x", "max_tokens": 400, "ignore_eos": True, "rid": "nst"},
                       timeout=0.3)
        _wait(lambda: eng.aborted)
        assert eng.aborted[0].startswith("nst")
        _wait(lambda: not eng._held)


def test_api_key_required():
    with ServerThread(FakeEngine(), ServerConfig(port=0, api_key="sekret")) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.get(srv.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(srv.url + GEN, json={"text": "x"}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model="fake-model", prompt="x", max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(srv.url + "/get_server_info", headers={"Authorization": "Bearer sekret"}).json()[
            "api_key"] == "***"


def test_body_size_capped():
    with ServerThread(FakeEngine(), ServerConfig(port=0, max_request_bytes=4096)) as srv:
        big = {"prompt": "x" * 8000, "max_tokens": 1}
        r = httpx.post(srv.url + COMP, json=big)
        assert r.status_code == 413 and "4096" in r.json()["error"]["message"]

        def chunks():  # no content-length: chunked transfer
            data = json.dumps(big).encode()
            for i in range(0, len(data), 1000):
                yield data[i:i + 1000]
        r = httpx.post(srv.url + COMP, content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert httpx.post(srv.url + COMP, json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_engine_crash_is_500_and_connection_survives():
    eng = FakeEngine()

    async def boom(*a, **k):
        raise RuntimeError("kaput")
    eng.async_generate = boom
    with ServerThread(eng, ServerConfig(port=0, enable_metrics=True)) as srv, httpx.Client(base_url=srv.url) as c:
        r = c.post(GEN, json={"text": "x"})
        body = r.json()
        assert r.status_code == 500 and len(body["error_id"]) == 16 and body["error_id"] in body["error"]["message"]
        assert "kaput" not in r.text and "RuntimeError" not in r.text  # the details stay in the log
        assert c.get("/health").status_code == 200  # same keep-alive connection
        assert 'status="500"' in c.get("/metrics").text


def test_rid_lists_are_tracked_per_prompt():
    """``rid`` as a list (one id per prompt, SGLang's batch form) is served, also for a single
    prompt, and aborting one of the ids finds it (a list rid used to be a 500: unhashable)."""
    from fastapi.testclient import TestClient

    from sglite.server.app import create_app
    from sglite.server.testing import FakeEngine

    engine = FakeEngine(context_length=96, max_total_tokens=4096)
    c = TestClient(create_app(engine))
    r = c.post("/generate", json={"text": "hello", "rid": [""], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    r = c.post("/generate", json={"text": ["a b", "c d"], "rid": ["x1", "x2"], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and len(r.json()) == 2, r.text
    r = c.post("/generate", json={"text": ["a b", "c d"], "rid": ["only-one"]})
    assert r.status_code == 400 and "rid" in r.text
    info = engine.get_server_info()
    assert info["available_tokens"] == info["max_total_tokens"]


def test_4xx_name_the_field_the_route_was_sent():
    """The engine's field names leaked: /v1/completions said text (it has prompt), /generate said
    prompt (it has text / input_ids); /detokenize took true as id 1."""
    from fastapi.testclient import TestClient

    from sglite.server.app import create_app
    from sglite.server.settings import ServerConfig
    from sglite.server.testing import FakeEngine

    with TestClient(create_app(FakeEngine(context_length=64), ServerConfig())) as c:
        r = c.post("/v1/completions", json={"model": "fake-model", "prompt": "", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert r.json()["error"]["message"].startswith("prompt:")
        r = c.post("/generate", json={"text": "a " * 300})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        r = c.post("/generate", json={"input_ids": [5] * 300})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids", r.text
        r = c.post("/detokenize", json={"tokens": [True]})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("tokens"), r.text
