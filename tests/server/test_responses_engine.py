"""``/v1/responses`` over the real Engine on a tiny random-weight model (fast, CPU), with the
``openai`` SDK: streamed == non-streamed at temperature 0, ``previous_response_id`` gives the same
tokens as resending the whole history, and a strict ``json_schema`` format parses."""
import json

import jsonschema
import openai
import pytest

from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}
TOOL = {"type": "function", "name": "pick", "parameters": {
    "type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    from sglite import Engine

    eng = Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=4096)
    with ServerThread(eng, ServerConfig(port=0)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        c.model_id = c.models.list().data[0].id
        yield c
    eng.shutdown()


def _items(r):
    return [(o.type, getattr(o, "name", None), getattr(o, "arguments", None),
             o.content[0].text if o.type == "message" else None) for o in r.output]


@pytest.mark.parametrize("kw", [dict(), dict(tools=[TOOL], tool_choice="required")])
def test_stream_equals_non_stream_greedy(client, kw):
    args = dict(model=client.model_id, input="Tell me about the sea.", max_output_tokens=12, temperature=0, **kw)
    full = client.responses.create(**args)
    with client.responses.stream(**args) as s:
        events = list(s)
    final = events[-1].response
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _items(final) == _items(full) and final.status == full.status
    assert final.usage.output_tokens == full.usage.output_tokens
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == (full.output_text or "")


def test_previous_response_id_equals_resending_the_history(client):
    kw = dict(model=client.model_id, max_output_tokens=10, temperature=0)
    first = client.responses.create(input="Tell me about the sea.", instructions="Be short.", **kw)
    assert first.output_text
    chained = client.responses.create(input="And the sky?", previous_response_id=first.id,
                                      instructions="Be short.", **kw)
    history = [{"role": "user", "content": "Tell me about the sea."},
               {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And the sky?"}]
    resent = client.responses.create(input=history, instructions="Be short.", **kw)
    assert chained.output_text == resent.output_text
    assert chained.usage.input_tokens == resent.usage.input_tokens
    assert chained.usage.input_tokens_details.cached_tokens > 0  # the earlier turn's prefix was reused


def test_json_schema_format_and_forced_tool_validate(client):
    r = client.responses.create(model=client.model_id, input="A color as JSON.", max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "c", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    call = client.responses.create(model=client.model_id, input="Pick.", tools=[TOOL], max_output_tokens=40,
                                   tool_choice={"type": "function", "name": "pick"}).output[0]
    assert call.type == "function_call" and call.name == "pick"
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])


@pytest.mark.slow
def test_default_model_agent_turns_through_responses(real_engine):
    """The default model (SmolLM2-135M-Instruct): a forced tool call, its result sent back through
    previous_response_id, then a free answer; streamed == not streamed at temperature 0, and the
    chained turn reuses the first turn's prefix from the radix cache."""
    with ServerThread(real_engine, ServerConfig(port=0)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = c.models.list().data[0].id
        call = c.responses.create(model=model, input="Pick a color.", tools=[TOOL], tool_choice="required",
                                  max_output_tokens=40, temperature=0)
        (fc,) = call.output
        jsonschema.validate(json.loads(fc.arguments), TOOL["parameters"])
        kw = dict(model=model, previous_response_id=call.id, max_output_tokens=16, temperature=0,
                  input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "red it is"}])
        answer = c.responses.create(**kw)
        with c.responses.stream(**kw) as s:
            events = list(s)
        assert _items(events[-1].response) == _items(answer)
        assert answer.usage.input_tokens_details.cached_tokens > 0
