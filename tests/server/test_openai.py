"""OpenAI-compatible API against the FakeEngine, driven by the official ``openai`` client."""
import json

import jsonschema
import openai
import pytest

from sglite.server.runner import ServerThread
from sglite.server.testing import FakeEngine

REPLY = "Hello world! The quick brown fox jumps over the lazy dog."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                       "required": ["tz"]}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    eng = FakeEngine(reply=REPLY)
    with ServerThread(eng) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=20)


def _last_sp(server):
    return server.engine.calls[-1]["sampling_params"]


def test_models_list_and_get(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["fake-model"]
    assert client.models.retrieve("fake-model").id == "fake-model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_completion_greedy_text_and_usage(client):
    r = client.completions.create(model="fake-model", prompt="Say hi", max_tokens=5, temperature=0)
    assert r.choices[0].text == REPLY[:5]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len("Say hi") and r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_completion_batch_prompts_and_echo(client):
    r = client.completions.create(model="fake-model", prompt=["a", "bb"], max_tokens=3, temperature=0, echo=True)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == ["a" + REPLY[:3], "bb" + REPLY[:3]]
    assert r.usage.prompt_tokens == 3


def test_chat_uses_template_and_defaults_to_remaining_context(server, client):
    r = client.chat.completions.create(model="fake-model", messages=USER, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == REPLY
    assert r.choices[0].finish_reason == "stop"
    prompt = server.engine.calls[-1]["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and USER[0]["content"] in prompt
    assert _last_sp(server)["max_new_tokens"] == server.engine.context_length - len(prompt)


def test_chat_stream_with_usage_equals_non_stream(client):
    kw = dict(model="fake-model", messages=USER, temperature=0, max_tokens=20)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content == REPLY[:20]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_stream_equals_non_stream(client):
    kw = dict(model="fake-model", prompt="x", temperature=0, max_tokens=12)
    full = client.completions.create(**kw).choices[0].text
    parts = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(parts) == full and len(parts) > 1


def test_n3_distinct_choices_share_prefix_and_seeds(server, client):
    from sglite.runtime.engine_protocol import sample_seed

    before = len(server.engine.calls)
    r = client.chat.completions.create(model="fake-model", messages=USER, n=3, temperature=0.8, seed=7,
                                       max_tokens=10)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    calls = server.engine.calls[before:]
    assert len(calls) == 1  # the server passes n through: the engine fans out (and shares the prefill)
    sp = calls[0]["sampling_params"]
    assert (sp["n"], sp["sampling_seed"], sp["max_new_tokens"]) == (3, 7, 10)
    # choice j samples with the engine's seed of sample j, as Engine.generate(n=3) does in Python
    for c in r.choices:
        alone = client.chat.completions.create(model="fake-model", messages=USER, temperature=0.8, max_tokens=10,
                                               seed=sample_seed(7, c.index))
        assert alone.choices[0].message.content == c.message.content
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage.completion_tokens == 30 and r.usage.prompt_tokens == len(calls[0]["prompt"])


def test_n3_streaming(client):
    chunks = list(client.completions.create(model="fake-model", prompt="p", n=3, max_tokens=4, temperature=0,
                                            stream=True))
    texts = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {0: REPLY[:4], 1: REPLY[:4], 2: REPLY[:4]}


def test_completion_logprobs(client):
    r = client.completions.create(model="fake-model", prompt="hi", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.token_logprobs) == 4 and all(x < 0 for x in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset == [0, 1, 2, 3]


def test_chat_logprobs_stream_and_full(client):
    kw = dict(model="fake-model", messages=USER, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 for c in content)
    streamed = [t for ch in client.chat.completions.create(stream=True, **kw) if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [c.token for c in content]


def test_response_format_json_schema(server, client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    r = client.chat.completions.create(model="fake-model", messages=USER, max_tokens=50, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert json.loads(_last_sp(server)["json_schema"]) == schema


def test_json_streams_in_pieces_without_tools(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    chunks = list(client.chat.completions.create(model="fake-model", messages=USER, max_tokens=20, stream=True,
                                                 response_format={"type": "json_schema",
                                                                  "json_schema": {"name": "n", "schema": schema}}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 2 and isinstance(json.loads("".join(pieces)), dict)


def test_response_format_json_object(server, client):
    r = client.chat.completions.create(model="fake-model", messages=USER, max_tokens=20,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert json.loads(_last_sp(server)["json_schema"]) == {"type": "object"}


def test_extras_pass_through(server, client):
    client.chat.completions.create(model="fake-model", messages=USER, max_tokens=5, extra_body={
        "regex": "[0-9]+", "top_k": 5, "min_p": 0.1, "ignore_eos": True, "no_stop_trim": True})
    sp = _last_sp(server)
    assert (sp["regex"], sp["top_k"], sp["min_p"], sp["ignore_eos"], sp["no_stop_trim"]) == ("[0-9]+", 5, 0.1, True, True)
    r = client.completions.create(model="fake-model", prompt="x", max_tokens=5,
                                  extra_body={"ebnf": 'root ::= "yes"'})
    assert r.choices[0].text == "yes" and _last_sp(server)["ebnf"] == 'root ::= "yes"'


def test_stop_trimmed_with_matched_stop(client):
    r = client.completions.create(model="fake-model", prompt="x", max_tokens=40, temperature=0, stop=["quick"])
    c = r.choices[0]
    assert c.text == REPLY[:REPLY.index("quick")] and c.finish_reason == "stop"
    assert c.model_extra["matched_stop"] == "quick"
    r = client.completions.create(model="fake-model", prompt="x", max_tokens=40, temperature=0, stop="quick",
                                  extra_body={"no_stop_trim": True})
    assert r.choices[0].text.endswith("quick")
    r = client.completions.create(model="fake-model", prompt="x", max_tokens=300, temperature=0)
    assert r.choices[0].model_extra["matched_stop"] == 256  # EOS token id


def test_max_completion_tokens_and_cached_tokens(client):
    kw = dict(model="fake-model", messages=[{"role": "user", "content": "cache me " * 5}], temperature=0)
    client.chat.completions.create(max_completion_tokens=3, **kw)
    r = client.chat.completions.create(max_completion_tokens=3, **kw)
    assert r.usage.completion_tokens == 3
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1


def _check_call(call, schema_tool):
    assert call.type == "function" and call.function.name == schema_tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema_tool["function"]["parameters"])


def test_forced_named_tool_call(server, client):
    r = client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER, TIME], max_tokens=80,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    _check_call(c.message.tool_calls[0], WEATHER)
    # the call in the family's markup (hermes for the fake's ChatML template): only the named tool
    (tag,) = _forced_tags(server)
    assert tag["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": ' and tag["end"] == "}\n</tool_call>"
    assert tag["content"]["json_schema"] == WEATHER["function"]["parameters"]


def test_forced_required_tool_call_streamed(server, client):
    chunks = list(client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER, TIME],
                                                 tool_choice="required", max_tokens=80, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and all(d.index == 0 for d in deltas)
    args = json.loads("".join(d.function.arguments for d in deltas))  # the fake answers the first anyOf branch
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert deltas[0].function.name == "get_weather"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [t["begin"].split('"')[3] for t in _forced_tags(server)] == ["get_weather", "get_time"]


def _forced_tags(server) -> list[dict]:
    """The tags of the last request's forced-call structural tag (tags and nothing else)."""
    fmt = json.loads(_last_sp(server)["structural_tag"])["format"]
    assert fmt["type"] == "tags_with_separator" and fmt["at_least_one"]
    return fmt["tags"]


@pytest.mark.parametrize("in_template", [True, False])
def test_auto_tool_call_parsed_stream_and_full(in_template):
    reply = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
    eng = FakeEngine(reply=reply, tools_in_template=in_template, context_length=4096)
    with ServerThread(eng) as srv:
        cl = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        kw = dict(model="fake-model", messages=USER, tools=[WEATHER], temperature=0)
        r = cl.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.content == "Let me check."
        _check_call(r.choices[0].message.tool_calls[0], WEATHER)
        prompt = eng.calls[-1]["prompt"]
        assert ("<tools>" in prompt) == (not in_template) and "get_weather" in prompt
        chunks = list(cl.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.strip() == "Let me check." and "<tool" not in text
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
        assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Paris", "days": 2}
        r = cl.chat.completions.create(tool_choice="none", **kw)
        assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
