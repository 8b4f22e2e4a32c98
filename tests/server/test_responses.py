"""``/v1/responses`` with the ``openai`` SDK's ``client.responses`` against FakeEngine servers:
create / stream / parse / retrieve / delete / input_items, tools (auto, required, named),
text.format, max_output_tokens, previous_response_id, the bounded store, and 400s for the fields
the server cannot honour."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from sglite.server.responses_store import ResponseStore, StoredResponse
from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig
from sglite.server.testing import FakeEngine

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather.", "parameters": PARAMS}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                                "required": ["tz"]}}
AUTO_REPLY = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'


@pytest.fixture(scope="module")
def srv():
    eng = FakeEngine()
    with ServerThread(eng, ServerConfig(port=0, responses_store_size=50)) as s:
        yield s


@pytest.fixture()
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture()
def engine(srv):
    srv.engine.reply = FakeEngine().reply
    return srv.engine


def _events(client, **kw):
    with client.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response() if events[-1].type == "response.completed" else None
    return events, final


def _check_sequence(events):
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    ids = {e.response.id for e in events if hasattr(e, "response")}
    assert len(ids) == 1


def test_create_with_instructions_and_usage(client, engine):
    r = client.responses.create(model="fake-model", input="Hello there", instructions="Be brief.", temperature=0)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == engine.reply and r.instructions == "Be brief."
    prompt = engine.calls[-1]["prompt"]
    assert prompt.index("Be brief.") < prompt.index("Hello there") and "<|im_start|>system" in prompt
    u = r.usage
    assert u.input_tokens == len(prompt.encode()) and u.total_tokens == u.input_tokens + u.output_tokens
    again = client.responses.create(model="fake-model", input="Hello there", instructions="Be brief.", temperature=0)
    assert again.usage.input_tokens_details.cached_tokens > 0  # the radix-like fake cache hit


def test_item_input_renders_function_calls_and_outputs(client, engine):
    items = [{"role": "developer", "content": "Sys."},
             {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
    r = client.responses.create(model="fake-model", input=items, tools=[WEATHER], temperature=0)
    assert r.status == "completed"
    prompt = engine.calls[-1]["prompt"]
    assert prompt.index("Sys.") < prompt.index("Weather?") < prompt.index("sunny, 21 C")
    assert "<|im_start|>tool\nsunny, 21 C" in prompt


def test_auto_tool_call_parsed_and_streamed_the_same(client, engine):
    engine.reply = AUTO_REPLY
    kw = dict(model="fake-model", input="Weather in Oslo?", tools=[WEATHER, TIME], temperature=0)
    r = client.responses.create(**kw)
    kinds = [o.type for o in r.output]
    assert kinds == ["message", "function_call"] and r.output[0].content[0].text == "Let me check."
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo", "days": 2}
    assert call.call_id.startswith("call_") and call.status == "completed"
    events, final = _events(client, **kw)
    _check_sequence(events)
    types = [e.type for e in events]
    assert types.index("response.output_text.delta") < types.index("response.function_call_arguments.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == json.loads(call.arguments)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == args
    assert [o.type for o in final.output] == kinds and final.output[1].name == "get_weather"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_forced_tool_call_validates(client, engine, choice):
    r = client.responses.create(model="fake-model", input="Now?", tools=[WEATHER, TIME], tool_choice=choice)
    (call,) = r.output
    assert call.type == "function_call"
    tool = {t["name"]: t for t in (WEATHER, TIME)}[call.name]
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    if isinstance(choice, dict):
        assert call.name == "get_time" and r.tool_choice.name == "get_time"


def test_parallel_tool_calls_false_keeps_one(client, engine):
    engine.reply = AUTO_REPLY + AUTO_REPLY[len("Let me check. "):]
    both = client.responses.create(model="fake-model", input="x", tools=[WEATHER], temperature=0)
    one = client.responses.create(model="fake-model", input="x", tools=[WEATHER], temperature=0,
                                  parallel_tool_calls=False)
    assert [o.type for o in both.output].count("function_call") == 2
    assert [o.type for o in one.output].count("function_call") == 1 and one.parallel_tool_calls is False


def test_tool_choice_none_leaves_text(client, engine):
    engine.reply = AUTO_REPLY
    r = client.responses.create(model="fake-model", input="x", tools=[WEATHER], tool_choice="none", temperature=0)
    assert [o.type for o in r.output] == ["message"] and r.output_text == AUTO_REPLY


def test_parse_json_schema_and_json_object(client, engine):
    class Weather(BaseModel):
        city: str
        days: int

    p = client.responses.parse(model="fake-model", input="Oslo weather as JSON", text_format=Weather)
    assert isinstance(p.output_parsed, Weather) and p.text.format.type == "json_schema"
    obj = client.responses.create(model="fake-model", input="JSON please", text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.output_text), dict)


def test_max_output_tokens_makes_it_incomplete(client, engine):
    r = client.responses.create(model="fake-model", input="x", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == engine.reply[:3] and r.output[0].status == "incomplete"
    events, _ = _events(client, model="fake-model", input="x", max_output_tokens=3, temperature=0)
    _check_sequence(events)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == r.output_text
    cut = client.responses.create(model="fake-model", input="x", tools=[WEATHER], tool_choice="required",
                                  max_output_tokens=12)
    assert cut.status == "incomplete" and cut.output[0].type == "function_call"
    assert cut.output[0].status == "incomplete"


@pytest.mark.parametrize("kw", [dict(), dict(tools=[WEATHER], tool_choice="required"),
                                dict(text={"format": {"type": "json_object"}})])
def test_stream_equals_non_stream_at_temperature_0(client, engine, kw):
    args = dict(model="fake-model", input="Tell me a story", temperature=0, **kw)
    full = client.responses.create(**args)
    events, final = _events(client, **args)
    _check_sequence(events)

    def shape(r):
        return [(o.type, getattr(o, "name", None), getattr(o, "arguments", None),
                 o.content[0].text if o.type == "message" else None, o.status) for o in r.output]
    assert shape(final) == shape(full) and final.status == full.status
    assert final.usage.output_tokens == full.usage.output_tokens
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == (full.output_text or "")
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == [o.type for o in full.output]


def test_store_retrieve_input_items_delete(client, engine):
    items = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
             {"role": "user", "content": "three"}]
    r = client.responses.create(model="fake-model", input=items, temperature=0, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"k": "v"}
    listed = client.responses.input_items.list(r.id)
    assert [i.content[0].text if isinstance(i.content, list) else i.content for i in listed.data] == ["three", "two", "one"]
    asc = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert len(asc.data) == 2 and asc.has_more and asc.first_id == asc.data[0].id
    rest = client.responses.input_items.list(r.id, order="asc", after=asc.last_id)
    assert len(rest.data) == 1 and not rest.has_more
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    unstored = client.responses.create(model="fake-model", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="fake-model", input="x", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"


def test_previous_response_id_renders_the_same_prompt_as_the_full_history(client, engine):
    engine.reply = AUTO_REPLY
    first = client.responses.create(model="fake-model", input="Weather in Oslo?", tools=[WEATHER], temperature=0)
    engine.reply = "It is sunny."
    turn2 = [{"type": "function_call_output", "call_id": first.output[1].call_id, "output": "sunny"}]
    chained = client.responses.create(model="fake-model", input=turn2, previous_response_id=first.id,
                                      tools=[WEATHER], temperature=0)
    p_chained = engine.calls[-1]["text"]
    history = [{"role": "user", "content": "Weather in Oslo?"}] + [o.model_dump(exclude_none=True) for o in first.output]
    resent = client.responses.create(model="fake-model", input=history + turn2, tools=[WEATHER], temperature=0)
    assert engine.calls[-1]["text"] == p_chained and "sunny" in p_chained and "Let me check." in p_chained
    assert resent.output_text == chained.output_text and resent.usage.input_tokens == chained.usage.input_tokens
    assert chained.previous_response_id == first.id
    assert [i.type for i in client.responses.input_items.list(chained.id).data] == ["function_call_output"]


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"background": True, "stream": True}, "background"),
    ({"background": True, "store": False}, "background"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"truncation": "middle"}, "truncation"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"max_tool_calls": 1}, "max_tool_calls"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"model": "other"}, "model"),
])
def test_unsupported_or_bad_fields_are_400s_naming_them(srv, body, param):
    r = httpx.post(srv.url + "/v1/responses", json={"input": "hi", **body}, timeout=30)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_store_bounds_through_the_server():
    with ServerThread(FakeEngine(), ServerConfig(port=0, responses_store_size=2)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        ids = [c.responses.create(model="fake-model", input=f"q{i}", max_output_tokens=2).id for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(ids[0])
        assert [c.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


def test_store_evicts_oldest_and_expires():
    t = [0.0]
    st = ResponseStore(max_size=2, ttl=10.0, clock=lambda: t[0])
    e = StoredResponse({"id": "a"}, [], [])
    st.put("a", e)
    st.put("b", e)
    st.put("c", e)
    assert st.get("a") is None and st.get("b") is e and len(st) == 2
    t[0] = 5.0
    st.put("d", e)  # evicts b (the oldest stored)
    t[0] = 10.5    # c (stored at 0) expired, d (at 5) not
    assert st.get("c") is None and st.get("d") is e and len(st) == 1
    assert st.delete("d") and not st.delete("d")
    none = ResponseStore(max_size=0)
    none.put("x", e)
    assert none.get("x") is None
    with pytest.raises(ValueError, match="responses_ttl"):
        ResponseStore(ttl=0)
    with pytest.raises(ValueError, match="responses_store_size"):
        ResponseStore(max_size=-1)


def test_reasoning_item_and_family_parser_streamed_and_not():
    """With --reasoning-parser and --tool-call-parser, the thinking is a reasoning item before the
    answer's items, and the calls are read in the family's format; streamed == not streamed."""
    reply = ('<think>\nTwo cities.\n</think>\n\n[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}, '
             '{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}]')
    cfg = ServerConfig(port=0, tool_call_parser="mistral", reasoning_parser="qwen3")
    with ServerThread(FakeEngine(reply=reply, context_length=4096), cfg) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        kw = dict(model="fake-model", input="Time in Paris and Tokyo?", tools=[TIME], temperature=0)
        r = c.responses.create(**kw)
        assert [o.type for o in r.output] == ["reasoning", "function_call", "function_call"]
        assert r.output[0].content[0].text == "Two cities.\n"
        assert [json.loads(o.arguments)["tz"] for o in r.output[1:]] == ["Europe/Paris", "Asia/Tokyo"]
        events, final = _events(c, **kw)
        _check_sequence(events)
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert thought == r.output[0].content[0].text
        assert [(o.type, getattr(o, "arguments", None)) for o in final.output] == \
            [(o.type, getattr(o, "arguments", None)) for o in r.output]
        # the next turn resends the reasoning item: it is accepted and not shown to the model
        history = [{"role": "user", "content": "Time?"}] + [o.model_dump(exclude_none=True) for o in r.output]
        assert c.responses.create(model="fake-model", input=history, tools=[TIME]).status == "completed"


def test_grammar_of_the_turn_is_shared_with_chat(client, engine):
    """The constraint stage is the pipeline's: "auto" calls are constrained by a structural tag,
    and a forced tool with text.format (the Agents SDK's pair) is accepted, the call deciding the turn."""
    client.responses.create(model="fake-model", input="x", tools=[WEATHER], temperature=0)
    sp = engine.calls[-1]["sampling_params"]
    assert "structural_tag" in sp and "get_weather" in sp["structural_tag"]
    fmt = {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}, "strict": True}}
    r = client.responses.create(model="fake-model", input="x", tools=[WEATHER], tool_choice="required", text=fmt)
    assert [o.type for o in r.output] == ["function_call"]
    jsonschema.validate(json.loads(r.output[0].arguments), PARAMS)


def test_same_conversation_same_engine_call_on_both_apis(srv, client, engine):
    """Both APIs are adapters over one pipeline: the same conversation, tools and format give the
    engine the same prompt and sampling params through /v1/chat/completions and /v1/responses."""
    chat = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    args = '{"city": "Oslo", "days": 1}'
    msgs = [{"role": "system", "content": "Sys."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    items = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Checking."},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    chat.chat.completions.create(model="fake-model", messages=msgs, max_tokens=20, temperature=0.5, top_p=0.9,
                                 tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
                                 response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    via_chat = engine.calls[-1]
    client.responses.create(model="fake-model", input=items, instructions="Sys.", max_output_tokens=20,
                            temperature=0.5, top_p=0.9, tools=[WEATHER],
                            text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    via_responses = engine.calls[-1]
    assert via_responses["prompt"] == via_chat["prompt"]
    assert via_responses["sampling_params"] == via_chat["sampling_params"]
