"""OpenAI conventions of issue 13, driven by the official ``openai`` client against the in-process
server over the FakeEngine (byte tokens: a token may hold part of a UTF-8 character)."""
from __future__ import annotations

import logging

import httpx
import openai
import pytest

from sglite.errors import CONTEXT_LENGTH_PREFIX
from sglite.server.runner import ServerThread
from sglite.server.testing import FakeEngine

REPLY = "Crème brûlée, s'il vous plaît."  # multi-byte characters: tokens holding half a character
USER = [{"role": "user", "content": "Dessert?"}]


@pytest.fixture(scope="module")
def server():
    with ServerThread(FakeEngine(reply=REPLY, context_length=256, model_path="/srv/models/fake-model")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=20)


def test_unknown_model_is_404_model_not_found_listing_served_names(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o-mini", messages=USER)
    assert e.value.status_code == 404 and e.value.code == "model_not_found" and e.value.param == "model"
    assert "gpt-4o-mini" in e.value.message and "fake-model" in e.value.message
    assert "/srv" not in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="davinci-002", prompt="x")
    assert e.value.code == "model_not_found" and "/srv" not in e.value.message


def test_models_list_served_names_never_a_path(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["fake-model"]
    for mid in ids:
        card = client.models.retrieve(mid)
        assert "/" not in card.id and "/" not in (card.model_extra.get("root") or "")


def test_unknown_fields_are_accepted_and_named_in_one_warning(client, caplog):
    with caplog.at_level(logging.WARNING, logger="sglite.server"):
        r = client.chat.completions.create(model="fake-model", messages=USER, max_tokens=4, temperature=0,
                                           extra_body={"guided_json": {"type": "object"}, "store": True,
                                                       "metadata": {"k": "v"}})
    assert r.choices[0].message.content == REPLY[:3]  # 4 byte tokens: "Crè"
    lines = [rec.getMessage() for rec in caplog.records if "ignoring request fields" in rec.getMessage()]
    assert len(lines) == 1
    assert all(name in lines[0] for name in ("guided_json", "store", "metadata"))
    with caplog.at_level(logging.WARNING, logger="sglite.server"):
        client.completions.create(model="fake-model", prompt="x", max_tokens=2, extra_body={"frobnicate": 1})
    assert any("frobnicate" in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize("field,value", [("functions", [{"name": "f", "parameters": {}}]),
                                         ("function_call", "auto"), ("modalities", ["text", "audio"]),
                                         ("audio", {"voice": "alloy", "format": "wav"})])
def test_known_fields_that_cannot_be_honoured_are_400(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=USER, extra_body={field: value})
    assert e.value.param == field and field in e.value.message


def test_one_context_length_wording_on_every_route(server, client):
    long_text = "x" * 400
    errors = []
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake-model", prompt=long_text)
    errors.append(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": long_text}])
    errors.append(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake-model", prompt="hello", max_tokens=300)
    errors.append(e.value)
    for err in errors:
        assert CONTEXT_LENGTH_PREFIX in err.message and "256 tokens" in err.message, err.message
        assert err.code == "context_length_exceeded"
    r = httpx.post(server.url + "/generate", json={"text": long_text}, timeout=10)
    assert r.status_code == 400 and CONTEXT_LENGTH_PREFIX in r.json()["error"]["message"]
    r = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 300}}, timeout=10)
    assert r.status_code == 400 and CONTEXT_LENGTH_PREFIX in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_chat_logprob_bytes_are_raw_and_join_to_the_text(client):
    kw = dict(model="fake-model", messages=USER, temperature=0, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == REPLY  # ended by EOS
    content = choice.logprobs.content
    assert len(content) == len(REPLY.encode())  # one entry per byte token, none for EOS
    assert b"".join(bytes(c.bytes) for c in content) == REPLY.encode()
    assert content[2].bytes == [0xC3] and content[3].bytes == [0xA8]  # "è" = C3 A8, one byte per token
    for c in content:
        for t in c.top_logprobs:
            assert len(t.bytes) == 1
    streamed = [t for ch in client.chat.completions.create(stream=True, **kw) if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]
    assert [bytes(t.bytes) for t in streamed] == [bytes(c.bytes) for c in content]


def test_completion_echo_logprobs_and_max_tokens_zero(client):
    r = client.completions.create(model="fake-model", prompt="abc", echo=True, logprobs=1, max_tokens=0)
    c = r.choices[0]
    assert c.text == "abc" and c.logprobs.tokens == ["a", "b", "c"]
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.token_logprobs) == 3
    assert c.logprobs.text_offset == [0, 1, 2] and r.usage.completion_tokens == 0
    r = client.completions.create(model="fake-model", prompt=[[97, 98]], echo=True, logprobs=1, max_tokens=2,
                                  temperature=0)
    c = r.choices[0]
    assert c.text == "ab" + REPLY[:2]
    assert len(c.logprobs.token_logprobs) == 2 + 2 and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.text_offset == [0, 1, 2, 3]
    chunks = list(client.completions.create(model="fake-model", prompt="abc", echo=True, logprobs=1, max_tokens=2,
                                            temperature=0, stream=True))
    toks = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert toks[:3] == ["a", "b", "c"] and len(toks) == 5
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake-model", prompt="abc", max_tokens=0)
    assert e.value.param == "max_tokens"
