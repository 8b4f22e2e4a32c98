"""The parsers behind ``/v1/chat/completions``: ``--tool-call-parser`` and ``--reasoning-parser``
on a fake engine whose reply is a reasoning model's output with a family's tool call, through the
openai client, streamed and not; ``chat_template_kwargs`` reaches the chat template."""
from __future__ import annotations

import json

import openai
import pytest

from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig
from sglite.server.testing import FakeEngine

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}
USER = [{"role": "user", "content": "What time is it in Paris and Tokyo?"}]
REPLY = ('<think>\nTwo cities, two calls.\n</think>\n\n[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}, '
         '{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}]')


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(reply=REPLY, context_length=4096)
    cfg = ServerConfig(port=0, tool_call_parser="mistral", reasoning_parser="qwen3")
    with ServerThread(engine, cfg) as srv:
        yield engine, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=20)


def _args(calls):
    return [json.loads(c.function.arguments)["tz"] for c in calls]


def test_non_stream_reasoning_and_parallel_calls(server):
    _, client = server
    r = client.chat.completions.create(model="fake-model", messages=USER, tools=[TIME], max_tokens=400, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.reasoning_content == "Two cities, two calls.\n"
    assert _args(c.message.tool_calls) == ["Europe/Paris", "Asia/Tokyo"]


def test_streamed_reasoning_then_indexed_call_deltas(server):
    _, client = server
    chunks = list(client.chat.completions.create(model="fake-model", messages=USER, tools=[TIME], max_tokens=400, temperature=0,
                                                 stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == "Two cities, two calls.\n"
    assert not "".join(d.content or "" for d in deltas)
    entries = [tc for d in deltas for tc in (d.tool_calls or [])]
    args = {0: "", 1: ""}
    for tc in entries:
        args[tc.index] += tc.function.arguments or ""
    heads = [tc for tc in entries if tc.id]
    assert [h.index for h in heads] == [0, 1] and all(h.function.name == "get_time" for h in heads)
    assert [json.loads(args[i])["tz"] for i in (0, 1)] == ["Europe/Paris", "Asia/Tokyo"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]


def test_enable_thinking_false_reaches_the_template_and_disables_the_split(server):
    engine, client = server
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=400, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == REPLY and getattr(r.choices[0].message, "reasoning_content", None) is None
    prompt = engine.calls[-1]["prompt"]
    assert "<|no_think|>" in (prompt[0] if isinstance(prompt, list) else prompt)


def test_separate_reasoning_false_keeps_the_raw_text(server):
    _, client = server
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=400, temperature=0,
                                       extra_body={"separate_reasoning": False})
    assert r.choices[0].message.content == REPLY


def test_native_generate_separate_reasoning_whole_and_streamed(server):
    import httpx
    _, client = server
    url = str(client.base_url).rstrip("/").removesuffix("/v1")
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 400, "temperature": 0}, "separate_reasoning": True}
    out = httpx.post(url + "/generate", json=body).json()
    assert out["reasoning_text"] == "Two cities, two calls.\n" and out["text"].startswith("[TOOL_CALLS]")
    raw = httpx.post(url + "/generate", json={**body, "separate_reasoning": False}).json()
    assert raw["text"] == REPLY and "reasoning_text" not in raw
    lines = httpx.post(url + "/generate", json={**body, "stream": True}).text.splitlines()
    last = json.loads([ln for ln in lines if ln.startswith("data: {")][-1][len("data: "):])
    assert last["reasoning_text"] == out["reasoning_text"] and last["text"] == out["text"]
    sep = httpx.post(url + "/separate_reasoning", json={"text": REPLY}).json()
    assert sep == {"text": out["text"], "reasoning_text": out["reasoning_text"]}
    bad = httpx.post(url + "/separate_reasoning", json={"text": "x", "reasoning_parser": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_parser"


@pytest.mark.parametrize("key", ["chat_template", "tokenize", "messages", "return_dict", "not an identifier"])
def test_chat_template_kwargs_cannot_set_the_template_call_own_parameters(server, key):
    import httpx
    _, client = server
    url = str(client.base_url).rstrip("/")
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {key: "{{ 7 * 7 }}"}}
    r = httpx.post(url + "/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == f"chat_template_kwargs.{key}"
    r = httpx.post(url.removesuffix("/v1") + "/tokenize", json={k: v for k, v in body.items()})
    assert r.status_code == 400 and r.json()["error"]["param"] == f"chat_template_kwargs.{key}"


@pytest.mark.parametrize("family", ["qwen25", "llama3", "mistral", "pythonic", "granite"])
def test_each_family_through_the_server_streamed_and_not(family):
    from sglite.server.tool_parsers import get_format

    reply = "Checking both. " + get_format(family).render_calls([("get_time", {"tz": "Europe/Paris"}),
                                                                 ("get_time", {"tz": "Asia/Tokyo"})])
    if family == "llama3":
        reply = reply.replace("Checking both. ", "")  # llama3 writes the call as its whole answer
    cfg = ServerConfig(port=0, tool_call_parser=family)
    with ServerThread(FakeEngine(reply=reply, context_length=4096), cfg) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=20)
        kw = dict(model="fake-model", messages=USER, tools=[TIME], max_tokens=400, temperature=0)
        c = client.chat.completions.create(**kw).choices[0]
        assert c.finish_reason == "tool_calls" and _args(c.message.tool_calls) == ["Europe/Paris", "Asia/Tokyo"]
        chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    args: dict = {}
    for tc in [tc for d in deltas for tc in (d.tool_calls or [])]:
        args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
    assert [json.loads(args[i])["tz"] for i in sorted(args)] == ["Europe/Paris", "Asia/Tokyo"]
    assert ("".join(d.content or "" for d in deltas).strip() or None) == c.message.content
