"""The HTTP server over the real Engine on a tiny random-weight model (fast, CPU)."""
import importlib.util
import json

import httpx
import jsonschema
import openai
import pytest

from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig

MSG = [{"role": "user", "content": "Tell me about the sea."}]
BOUNDED = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
           "required": ["ok", "color"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from sglite import Engine

    eng = Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=4096)
    with ServerThread(eng, ServerConfig(port=0, enable_metrics=True)) as srv:
        yield srv
    eng.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_chat_stream_equals_non_stream_greedy(client, model):
    kw = dict(model=model, messages=MSG, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and len(text) > 0
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens > 5


def test_completion_stop_trimmed_with_matched_stop(client, model):
    base = client.completions.create(model=model, prompt="The sea is", max_tokens=16, temperature=0)
    text = base.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    r = client.completions.create(model=model, prompt="The sea is", max_tokens=16, temperature=0, stop=[stop])
    c = r.choices[0]
    assert c.text == text[:text.index(stop)] and c.finish_reason == "stop"
    assert c.model_extra["matched_stop"] == stop


def test_logprobs_and_cached_tokens(client, model):
    kw = dict(model=model, messages=MSG, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    client.chat.completions.create(**kw)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert r.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 1


def test_n3_and_seed(client, model):
    r = client.completions.create(model=model, prompt="Once upon", n=3, max_tokens=6, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1
    again = client.completions.create(model=model, prompt="Once upon", n=3, max_tokens=6, temperature=1.0, seed=3)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_json_schema_and_json_object(client, model):
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=80, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": BOUNDED}})
    jsonschema.validate(json.loads(r.choices[0].message.content), BOUNDED)


def test_regex_extra(client, model):
    r = client.completions.create(model=model, prompt="Answer:", max_tokens=10, extra_body={"regex": "(yes|no)!"})
    assert r.choices[0].text in ("yes!", "no!")


@pytest.mark.skipif(importlib.util.find_spec("sglite.constrained.ebnf") is None, reason="EBNF backend not built yet")
def test_ebnf_extra(client, model):
    r = client.completions.create(model=model, prompt="Answer:", max_tokens=10,
                                  extra_body={"ebnf": 'root ::= "yes" | "no"'})
    assert r.choices[0].text in ("yes", "no")


def test_forced_tool_call_validates(client, model):
    tool = {"type": "function", "function": {"name": "paint", "parameters": BOUNDED}}
    r = client.chat.completions.create(model=model, messages=MSG, tools=[tool], max_tokens=80,
                                       tool_choice={"type": "function", "function": {"name": "paint"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), BOUNDED)


def test_bad_inputs_are_400(server, model):
    for body, field in [({"model": model, "prompt": "x", "regex": "("}, "regex"),
                        ({"model": model, "prompt": "x", "json_schema": {"type": "object", "properties": 5}},
                         "json_schema"),
                        ({"model": model, "prompt": "word " * 3000}, "prompt"),
                        ({"model": model, "prompt": "x", "max_tokens": 2048}, "max_tokens")]:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert field in r.json()["error"]["message"] or field == r.json()["error"]["param"], r.text
    assert httpx.get(server.url + "/health").status_code == 200


def test_disconnect_frees_kv(server, model):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": "Go on and on", "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        got = [ln for ln, _ in zip(lines, range(8))]
        assert any(ln.startswith("data: {") for ln in got)
    for _ in range(200):
        info = httpx.get(server.url + "/get_server_info").json()
        if info["running_requests"] == 0 and info["waiting_requests"] == 0:
            break
    assert info["available_tokens"] == info["max_total_tokens"]


def test_native_generate_and_metrics(server):
    r = httpx.post(server.url + "/generate", timeout=30, json={
        "text": ["Hello", "Bye"], "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True, "top_logprobs_num": 1}).json()
    assert [x["meta_info"]["completion_tokens"] for x in r] == [4, 4]
    assert all(len(x["meta_info"]["output_token_logprobs"]) == 4 for x in r)
    text = httpx.get(server.url + "/metrics").text
    assert "sglite_time_to_first_token_seconds_count" in text and "sglite_kv_usage" in text


def _stream_call(client, model, max_tokens, choice):
    tool = {"type": "function", "function": {"name": "paint", "parameters": BOUNDED}}
    kw = dict(model=model, messages=MSG, tools=[tool], max_tokens=max_tokens, temperature=0, tool_choice=choice)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    tcs = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert all(len(c.choices[0].delta.tool_calls or []) <= 1 for c in chunks if c.choices)  # one entry a chunk
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    fr = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    full = client.chat.completions.create(**kw).choices[0]
    return tcs, text, fr, full


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "paint"}}, "required"])
def test_forced_tool_call_streams_arguments_and_cut_by_length(client, model, choice):
    tcs, text, fr, full = _stream_call(client, model, 80, choice)
    assert text == "" and fr == ["tool_calls"] and full.finish_reason == "tool_calls"
    assert tcs[0].id and tcs[0].function.name == "paint" and len(tcs) > 2
    # forced calls may be parallel (parallel_tool_calls defaults to true): the first call's arguments
    whole = "".join(t.function.arguments or "" for t in tcs if t.index == 0)
    assert json.loads(whole) == json.loads(full.message.tool_calls[0].function.arguments)
    jsonschema.validate(json.loads(whole), BOUNDED)
    # greedy: the same tokens, cut mid-arguments (after the markup's `<tool_call>\n{"name": "paint", "arguments": `)
    tcs, text, fr, cut = _stream_call(client, model, 24, choice)
    partial = "".join(t.function.arguments or "" for t in tcs)
    assert text == "" and fr == ["length"] and cut.finish_reason == "length" and cut.message.content is None
    assert 0 < len(partial) < len(whole) and whole.startswith(partial), (partial, whole)
    assert cut.message.tool_calls[0].function.name == "paint"
    assert cut.message.tool_calls[0].function.arguments == partial
