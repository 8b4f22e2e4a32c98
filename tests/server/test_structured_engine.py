"""Issue 13 on the real engine (tiny random model, CPU) through the ``openai`` client: strict JSON
Schema by default for every schema source, tool parameters with ``$defs`` for every
``tool_choice``, chat logprobs that join to the text (raw bytes, no stop-token entry)."""
from __future__ import annotations

import json
from typing import Optional

import jsonschema
import openai
import pydantic
import pytest

from sglite.server.runner import ServerThread

MSG = [{"role": "user", "content": "Describe a unit."}]
OPEN_LOOKING = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9, "minimum": 0}},
                "required": ["ok"]}  # no additionalProperties: closed by default (XGrammar's reading)


class Address(pydantic.BaseModel):  # strings bounded: a random model fills free strings to max_tokens
    city: str = pydantic.Field(max_length=4)


class User(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=4)
    address: Address
    nickname: Optional[str] = pydantic.Field(default=None, max_length=3)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from sglite import Engine

    eng = Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=4096)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    with ServerThread(engine) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_strict_is_the_engine_default(engine):
    assert engine.config.json_schema_strict is True
    assert engine.requests.grammar_backend.json_schema_strict is True


def test_response_format_objects_are_closed(client, model):
    for seed in range(6):
        r = client.chat.completions.create(model=model, messages=MSG, max_tokens=60, temperature=1.0, seed=seed,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "u", "schema": OPEN_LOOKING}})
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        obj = json.loads(c.message.content)
        jsonschema.validate(obj, OPEN_LOOKING)
        assert set(obj) <= {"ok", "n"}, obj  # no invented keys


def test_native_json_schema_and_frontend_path_are_closed(engine):
    import sglite

    for seed in range(4):
        out = engine.generate("Unit:", {"max_new_tokens": 60, "temperature": 1.0, "sampling_seed": seed,
                                        "json_schema": json.dumps(OPEN_LOOKING)})
        assert set(json.loads(out["text"])) <= {"ok", "n"}, out["text"]

    @sglite.function
    def unit(s):
        s += sglite.user("Describe a unit as JSON.")
        s += sglite.assistant(sglite.gen("u", max_tokens=60, json_schema=OPEN_LOOKING))

    for state in unit.run_batch([{}] * 3, backend=engine, temperature=1.0):
        assert set(json.loads(state["u"])) <= {"ok", "n"}, state["u"]


@pytest.mark.parametrize("tool_choice", ["named", "required", "auto"])
def test_pydantic_nested_tool_parameters(client, model, tool_choice):
    params = User.model_json_schema()
    assert "$defs" in params
    tools = [{"type": "function", "function": {"name": "User", "parameters": params}},
             {"type": "function", "function": {"name": "Other", "parameters": Address.model_json_schema()}}]
    choice = {"type": "function", "function": {"name": "User"}} if tool_choice == "named" else tool_choice
    r = client.chat.completions.create(model=model, messages=MSG, tools=tools, tool_choice=choice, max_tokens=120,
                                       temperature=0)
    c = r.choices[0]
    if tool_choice == "auto":
        return  # unconstrained: whatever the random model writes, the request is served
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message.content
    call = c.message.tool_calls[0].function
    schema = params if call.name == "User" else Address.model_json_schema()
    jsonschema.validate(json.loads(call.arguments), schema)
    if tool_choice == "named":
        assert call.name == "User"


def test_chat_logprobs_join_to_the_text_without_the_eos_entry(client, model, engine):
    eos = sorted(engine.tokenizer.eos_token_ids)[0]
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=10, temperature=0, logprobs=True,
                                       top_logprobs=2, logit_bias={str(eos): 100},
                                       extra_body={"regex": "[a-z]{1,12}"})
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.model_extra["matched_stop"] == eos
    entries = c.logprobs.content
    assert entries and b"".join(bytes(e.bytes) for e in entries) == c.message.content.encode()
    assert "".join(e.token for e in entries) == c.message.content


def test_tokenizer_id_to_bytes_keeps_partial_characters(engine):
    tok = engine.tokenizer
    partial = None
    for tid in range(len(tok.hf)):
        raw = tok.id_to_bytes(tid)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            partial = tid
            break
    assert partial is not None
    raw = tok.id_to_bytes(partial)
    assert tok.id_to_text(partial).endswith("\ufffd")  # the text shows a replacement character...
    assert raw != tok.id_to_text(partial).encode()  # ...the bytes are the token's own
    assert tok.id_to_bytes(tok.encode("hello")[0]) == tok.decode(tok.encode("hello")[:1]).encode()


def test_open_reading_when_strict_is_off(engine):
    from sglite.config import EngineConfig
    from sglite.runtime.engine_requests import RequestBuilder

    class _Runner:
        vocab_size = engine.runner.vocab_size

    rb = RequestBuilder(EngineConfig(model_path="x", json_schema_strict=False), engine.tokenizer, _Runner(), None)
    g = rb.grammar_backend.compile("json_schema", json.dumps(OPEN_LOOKING))
    m = g.matcher()
    assert m.accept_string('{"ok":true,"extra":[1]}') and m.is_accepting()
    assert not engine.requests.grammar_backend.compile("json_schema", json.dumps(OPEN_LOOKING)).matcher().accept_string(
        '{"ok":true,"extra":[1]}')
