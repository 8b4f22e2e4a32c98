"""Streamed tool calls as OpenAI clients accumulate them: the id/name first, then the arguments
text in deltas; a forced call cut by ``max_tokens`` comes back as ``tool_calls`` with its partial
arguments and finish_reason ``length`` (streamed and not), never as ``content``."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from sglite.server.runner import ServerThread
from sglite.server.testing import FakeEngine
from sglite.server.tool_calls import ToolPlan, parse_tool_calls
from sglite.server.tool_stream import ToolCallStreamer, chunk_entries, merge_tool_call_deltas, truncated_tool_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                         "days": {"type": "integer"}},
                                          "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ARGS = '{"city": "Pa\\"ris {x}", "days": [2, {"a": 1}]}'
CALL = '{"name": "get_weather", "arguments": ' + ARGS + '}'


def _stream(plan: ToolPlan, text: str, finish: str, step: int = 1):
    """Feed ``text`` in ``step``-character pieces; return (content, deltas, streamer)."""
    s, content, deltas = ToolCallStreamer(plan), "", []
    for j in range(step, len(text), step):
        c, d = s.feed(text[:j])
        content, deltas = content + c, deltas + d
    c, d = s.finish(text, finish)
    return content + c, deltas + d, s


def _check_shape(deltas, names):
    heads = [d for d in deltas if "id" in d]
    assert [h["index"] for h in heads] == list(range(len(heads)))
    for h in heads:
        assert h["id"].startswith("call_") and h["type"] == "function"
        assert h["function"]["name"] in names and h["function"]["arguments"] == ""
    for d in deltas:
        if "id" not in d:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} and d["function"]["arguments"]
    first = {}
    for k, d in enumerate(deltas):
        first.setdefault(d["index"], k)
    assert all("id" in deltas[k] for k in first.values())  # a call's first entry names it


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_forced_call_streams_arguments_text(step):
    plan = ToolPlan("forced", [WEATHER, TIME])
    content, deltas, s = _stream(plan, "  " + CALL, "stop", step)
    _check_shape(deltas, ["get_weather"])
    assert content == "" and s.called and not s.incomplete
    (call,) = merge_tool_call_deltas(deltas)
    assert call["function"]["arguments"] == ARGS  # the raw arguments text, no wrapper
    assert json.loads(ARGS) == json.loads(parse_tool_calls(CALL, plan)[1][0]["function"]["arguments"])
    if step == 1:
        assert len(deltas) == 1 + len(ARGS)  # one delta per new character: as generated


def test_forced_call_cut_at_every_length_streamed_and_not():
    plan = ToolPlan("forced", [WEATHER, TIME])
    start = CALL.index(ARGS)
    for cut in range(len('{"name": "get_w'), len(CALL)):
        text = CALL[:cut]
        content, deltas, s = _stream(plan, text, "length")
        assert content == "" and s.called, cut
        (call,) = merge_tool_call_deltas(deltas)
        assert call["function"]["name"] == "get_weather"
        partial = call["function"]["arguments"]
        assert partial == CALL[start:min(cut, start + len(ARGS))].lstrip(), cut
        assert s.incomplete == (cut < start + len(ARGS)), cut
        c2, calls = truncated_tool_calls(text, plan)
        assert c2 is None and calls[0]["function"]["arguments"] == partial and calls[0]["function"]["name"] == "get_weather"


def test_forced_cut_inside_an_ambiguous_name_is_not_a_call():
    plan = ToolPlan("forced", [WEATHER, {"type": "function", "function": {"name": "get_wind"}}])
    content, deltas, s = _stream(plan, '{"name": "get_w', "length")
    assert deltas == [] and not s.called and content == '{"name": "get_w'
    named = ToolPlan("forced", [WEATHER])  # one tool: the name is known before it is generated
    _, deltas, _ = _stream(named, '{"na', "length")
    assert merge_tool_call_deltas(deltas)[0]["function"] == {"name": "get_weather", "arguments": ""}


def test_auto_streams_content_then_each_call():
    text = ('Let me check. <tool_call>\n' + CALL + '\n</tool_call>\n<tool_call>{"name": "get_time", '
            '"arguments": {"tz": "UTC"}}</tool_call>')
    content, deltas, s = _stream(ToolPlan("auto", [WEATHER, TIME]), text, "stop")
    _check_shape(deltas, ["get_weather", "get_time"])
    calls = merge_tool_call_deltas(deltas)
    assert content == "Let me check. " and [c["function"]["arguments"] for c in calls] == [ARGS, '{"tz": "UTC"}']
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    _, deltas, _ = _stream(ToolPlan("auto", [WEATHER, TIME], parallel=False), text, "stop")
    assert [c["function"]["name"] for c in merge_tool_call_deltas(deltas)] == ["get_weather"]
    # a bare call; a call cut mid-arguments; a call whose keys come in another order (parsed at the end)
    _, deltas, _ = _stream(ToolPlan("auto", [WEATHER]), CALL, "stop")
    assert merge_tool_call_deltas(deltas)[0]["function"]["arguments"] == ARGS
    content, deltas, s = _stream(ToolPlan("auto", [WEATHER]), "Hi <tool_call>" + CALL[:50], "length")
    assert content == "Hi " and s.incomplete and merge_tool_call_deltas(deltas)[0]["function"]["arguments"] == CALL[37:50]
    swapped = '<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call>'
    content, deltas, _ = _stream(ToolPlan("auto", [TIME]), swapped, "stop")
    assert content == "" and json.loads(merge_tool_call_deltas(deltas)[0]["function"]["arguments"]) == {"tz": "UTC"}
    content, deltas, _ = _stream(ToolPlan("auto", [TIME]), "No call here {ok}.", "stop")
    assert content == "No call here {ok}." and deltas == []


# ---------------------------------------------------------------- over HTTP with the openai client
@pytest.fixture(scope="module")
def client():
    with ServerThread(FakeEngine(reply="Hello there.", context_length=4096)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=20)


def _full_args(client, choice):
    r = client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER, TIME], tool_choice=choice,
                                       max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls"
    return r.choices[0].message.tool_calls[0].function.arguments


def _streamed(client, choice, max_tokens):
    """The openai client's streaming helper accumulates the tool_calls deltas."""
    with client.chat.completions.stream(model="fake-model", messages=USER, tools=[WEATHER, TIME],
                                        tool_choice=choice, max_tokens=max_tokens) as st:
        events = list(st)
        try:
            final = st.get_final_completion()
        except openai.LengthFinishReasonError as e:  # the helper's way to report a cut completion
            final = e.completion
    chunks = [e.chunk for e in events if e.type == "chunk"]
    arg_deltas = [e.arguments_delta for e in events if e.type == "tool_calls.function.arguments.delta"]
    return chunks, arg_deltas, final.choices[0]


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_streamed_forced_call_with_openai_client(client, choice):
    full = _full_args(client, choice)
    chunks, arg_deltas, c = _streamed(client, choice, 200)
    assert len(arg_deltas) > 5  # the arguments arrive as they are generated, not in one piece
    tcs = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert all(len(ch.choices[0].delta.tool_calls or []) <= 1 for ch in chunks if ch.choices)  # one entry a chunk
    assert tcs[0].id and tcs[0].type == "function" and tcs[0].function.name == "get_weather"
    assert tcs[0].function.arguments == "" and all(t.id is None and t.function.name is None for t in tcs[1:])
    assert c.finish_reason == "tool_calls" and not c.message.content
    (call,) = c.message.tool_calls
    assert call.id == tcs[0].id and call.function.name == "get_weather"
    assert "".join(arg_deltas) == call.function.arguments and json.loads(call.function.arguments) == json.loads(full)
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_forced_call_cut_by_max_tokens(client, choice):
    full = _full_args(client, choice)
    # forced calls are written in the family's markup (hermes for the fake's ChatML template)
    wrapper = len('<tool_call>\n{"name": "get_weather", "arguments": ')
    for max_tokens in (wrapper + 1, wrapper + len(full) // 2, wrapper + len(full) - 1):
        chunks, arg_deltas, c = _streamed(client, choice, max_tokens)
        assert c.finish_reason == "length" and not c.message.content, max_tokens
        assert all(not (ch.choices[0].delta.content or "") for ch in chunks if ch.choices)
        partial = c.message.tool_calls[0].function.arguments
        assert partial == "".join(arg_deltas) == full[:max_tokens - wrapper], max_tokens
        r = client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER, TIME],
                                           tool_choice=choice, max_tokens=max_tokens)
        m = r.choices[0]
        assert m.finish_reason == "length" and m.message.content is None
        assert m.message.tool_calls[0].function.name == "get_weather"
        assert m.message.tool_calls[0].function.arguments == partial
    # cut exactly at the end of the arguments: the call is whole
    chunks, _, c = _streamed(client, choice, wrapper + len(full))
    assert c.finish_reason == "tool_calls" and json.loads(c.message.tool_calls[0].function.arguments) == json.loads(full)


def test_named_call_cut_before_its_arguments(client):
    for max_tokens in (1, 12):
        _, arg_deltas, c = _streamed(client, NAMED, max_tokens)
        assert c.finish_reason == "length" and not c.message.content and "".join(arg_deltas) == ""
        assert c.message.tool_calls[0].function.name == "get_weather"
        assert c.message.tool_calls[0].function.arguments == ""


def test_n_choices_each_stream_their_call(client):
    chunks = list(client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER], n=2,
                                                 tool_choice=NAMED, max_tokens=200, stream=True, temperature=1))
    args = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                args[c.index] += tc.function.arguments or ""
    assert all(json.loads(a)["city"] for a in args.values())


def test_chunk_entries_one_per_chunk_header_alone():
    head = {"index": 0, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": ""}}
    piece = lambda i, t: {"index": i, "function": {"arguments": t}}  # noqa: E731
    head1 = dict(head, index=1, id="call_y")
    out = chunk_entries([head, piece(0, '{"a'), piece(0, '": 1}'), head1, piece(1, "{}")])
    assert out == [head, piece(0, '{"a": 1}'), head1, piece(1, "{}")]
    assert merge_tool_call_deltas(out) == merge_tool_call_deltas([head, piece(0, '{"a'), piece(0, '": 1}'), head1,
                                                                  piece(1, "{}")])


def test_instructor_tools_mode_streaming_gets_objects(client):
    """instructor (TOOLS, streamed) reads ``delta.tool_calls[0].function.arguments`` of each chunk."""
    instructor = pytest.importorskip("instructor")
    import pydantic

    class Address(pydantic.BaseModel):
        city: str

    class User(pydantic.BaseModel):
        name: str
        age: int
        address: Address

    cl = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    kw = dict(model="fake-model", messages=USER, max_retries=0)
    users = list(cl.chat.completions.create_iterable(response_model=User, max_tokens=300, **kw))
    assert users and all(u.name and u.address.city for u in users)
    partials = list(cl.chat.completions.create_partial(response_model=User, max_tokens=300, **kw))
    assert len(partials) > 3 and partials[-1] == users[0]


@pytest.mark.parametrize("finish", ["length", "stop"])
@pytest.mark.parametrize("mode", ["forced", "auto"])
def test_a_cut_call_reads_the_same_streamed_and_not(finish, mode):
    """Two calls in the family markup, cut at every character by ``max_tokens`` (``length``) or a
    stop string (``stop``): the non-streamed answer (``parse_output``) has the same calls, the
    same content and the same finish reason as the streamed one read by ``OutputStreamer``
    (found by a break-it pass: non-streamed dropped a cut second call and said ``tool_calls``;
    a stop string inside a forced call gave raw markup as content there and ``tool_calls``
    with non-JSON arguments streamed)."""
    from sglite.server.request_pipeline import OutputPlan, OutputStreamer, parse_output

    plan = OutputPlan(ToolPlan(mode, [WEATHER, TIME]))
    text = ('<tool_call>\n' + CALL + '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}'
            '\n</tool_call>')
    second = text.index('{"tz"')
    first = text.index(ARGS)
    for cut in list(range(second - 30, len(text) + 1)) + [first + 5, first + len(ARGS) - 1]:
        out = parse_output(text[:cut], finish, plan)
        st, content, deltas = OutputStreamer(plan), "", []
        for j in range(0, cut, 7):
            _, c, d = st.step(text[j:min(j + 7, cut)], None if j + 7 < cut else finish)
            content, deltas = content + c, deltas + d
        calls = merge_tool_call_deltas(deltas)
        assert [c["function"]["name"] for c in out.tool_calls] == [c["function"]["name"] for c in calls], cut
        assert [c["function"]["arguments"] for c in out.tool_calls] == [c["function"]["arguments"] for c in calls], cut
        assert (out.content or "") == content.strip(), cut
        assert out.finish_reason == st.finish_reason(finish), cut
        in_args = [(first - 1, first + len(ARGS)), (second - 1, second + len('{"tz": "UTC"}'))]
        cut_inside = any(a <= cut < b for a, b in in_args)
        assert out.finish_reason == (finish if cut_inside else "tool_calls"), cut
        if cut_inside:  # the cut call is returned last, with its partial arguments as generated
            start = first if cut < second - 30 else second
            assert out.tool_calls[-1]["function"]["arguments"] == text[start:cut].lstrip(), cut
