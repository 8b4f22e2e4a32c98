"""The turn's grammar from tools, response_format and reasoning (issue 34): constrained "auto"
calls by default (off with ``--disable-tool-call-constraint``), "auto" + response_format as one
union, a forced tool with response_format accepted (the OpenAI Agents SDK's pair), and the
reasoning gate. Oracles: the sampling params the fake engine receives, compiled with sglite's own
grammar backend over a byte vocabulary and checked against hand-written outputs."""
from __future__ import annotations

import json

import openai
import pytest

from sglite.bench.grammar_coverage import accepts, byte_backend
from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig
from sglite.server.testing import FakeEngine
from sglite.server.tool_calls import ToolPlan, plan_tools
from sglite.server.tool_constraint import apply_constraint, reasoning_end_marker
from sglite.server.tool_parsers.formats import get_format

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def grammar():
    return byte_backend(json_schema_strict=True)


def _serve(**cfg):
    engine = FakeEngine(reply="Hello there.", context_length=4096)
    return engine, ServerThread(engine, ServerConfig(port=0, **cfg))


def _last_sp(engine) -> dict:
    sp = engine.calls[-1]["sampling_params"]
    return sp[0] if isinstance(sp, list) else sp


def _compile(grammar, sp):
    kinds = [k for k in ("structural_tag", "json_schema", "regex", "ebnf") if k in sp]
    assert len(kinds) == 1, sp
    return grammar.compile(kinds[0], sp[kinds[0]])


def test_over_http_auto_union_forced_and_the_flag(grammar):
    engine, srv = _serve()
    with srv:
        cl = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=20)
        r = cl.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER], max_tokens=50, temperature=0)
        assert r.choices[0].message.content == "Hello there."  # free text stays free
        g = _compile(grammar, _last_sp(engine))
        for text, ok in [("Hello there.", True), ("Let me see. " + CALL, True),
                         ('<tool_call>\n{"name": "get_weather", "arguments": {"town":"Paris"}}\n</tool_call>', False)]:
            assert accepts(g, text.encode()) == ok, text
        # auto + response_format: tool calls, or text that follows the schema
        cl.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER], max_tokens=50,
                                   response_format=ANSWER)
        g = _compile(grammar, _last_sp(engine))
        for text, ok in [('{"answer":"sunny"}', True), (CALL, True), ("Hello there.", False), ('{"x":1}', False)]:
            assert accepts(g, text.encode()) == ok, text
        # forced tool + response_format: accepted (was a 400); the call is the constraint
        r = cl.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER], max_tokens=80,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       response_format=ANSWER)
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
        sp = _last_sp(engine)
        # in the family's own markup (what the template renders next turn), that tool only, nothing else
        assert "json_schema" not in sp
        g = _compile(grammar, sp)
        for text, ok in [(CALL, True), ('{"name": "get_weather", "arguments": {"city":"Paris"}}', False),
                         ("Hello there.", False), ('{"answer":"sunny"}', False)]:
            assert accepts(g, text.encode()) == ok, text
    engine, srv = _serve(disable_tool_call_constraint=True)
    with srv:
        cl = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=20)
        cl.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER], max_tokens=50, temperature=0)
        assert not {"structural_tag", "json_schema"} & set(_last_sp(engine))


def test_reasoning_gate_wraps_every_constraint(grammar):
    end = reasoning_end_marker("qwen3")
    assert end == "</think>" and reasoning_end_marker(None) is None
    with pytest.raises(ValueError, match="known"):
        reasoning_end_marker("nope")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [({"json_schema": json.dumps(schema)}, ToolPlan("none"), '{"a":1}', '{"a":"x"}'),
             ({"regex": "[0-9]+"}, ToolPlan("none"), "42", "4x"),
             ({}, plan_tools(None, None), None, None),
             ({}, ToolPlan("auto", [WEATHER]), CALL, '<tool_call>\n{"name": "x"'),
             ({"json_schema": json.dumps(schema)}, ToolPlan("forced", [WEATHER], {"type": "object", "properties": {
                 "name": {"const": "get_weather"}}, "required": ["name"]}), CALL, '{"a":1}')]
    for sp, plan, good, bad in cases:
        sp, rename = dict(sp), {}
        apply_constraint(sp, rename, plan, reasoning_end=end, prompt="<|im_start|>assistant\n")
        if good is None:
            assert sp == {}
            continue
        g = _compile(grammar, sp)
        thinking = '<think>\nIt says {"a": "x"}, 4x, <tool_call> ... fine.\n</think>\n\n'
        assert accepts(g, (thinking + good).encode()) and not accepts(g, (thinking + bad).encode())
        assert not accepts(g, good.encode())  # the thinking comes first
    # thinking switched off by the template (the prompt ends with the marker): no gate
    sp = {"regex": "[0-9]+"}
    apply_constraint(sp, {}, ToolPlan("none"), reasoning_end=end, prompt="assistant\n<think>\n\n</think>\n\n")
    assert sp == {"regex": "[0-9]+"}


@pytest.mark.parametrize("name,token,after", [
    ("llama3", "<|python_tag|>", '{"name": "get_weather", "parameters": {"city":"P"}}'),
    ("mistral", "[TOOL_CALLS]", ' [{"name": "get_weather", "arguments": {"city":"P"}}]'),
    ("granite", "<|tool_call|>", '[{"name": "get_weather", "arguments": {"city":"P"}}]'),
])
def test_special_token_openers_trigger_on_the_token(grammar, name, token, after):
    """A special-token opener is constrained from the token id on: the grammar's vocabulary gives
    it the bytes NUL + its text (TokenizerInfo), the trigger is written the same way; the call
    that follows must be a tool's, and the token is never allowed inside the JSON."""
    from sglite.constrained.tokenizer_info import special_trigger

    class Tok:
        def __init__(self, content, special):
            self.content, self.special = content, special

    engine = type("E", (), {"tokenizer": type("T", (), {"hf": type("H", (), {
        "added_tokens_decoder": {5: Tok(token, True), 6: Tok("<tool_call>", False)}})()})()})()
    sp: dict = {}
    apply_constraint(sp, {}, ToolPlan("auto", [WEATHER]), fmt=get_format(name), engine=engine)
    g = _compile(grammar, sp)
    mark = special_trigger(token)
    assert accepts(g, ("Let me look. " + mark + after).encode()) and accepts(g, b"plain text")
    assert not accepts(g, (mark + after.replace('"city"', '"town"')).encode())
    assert not accepts(g, (mark + after.replace('"P"', '"' + mark + '"')).encode())
    # the opener spelled out as text is free text (the parser reads it; the grammar does not)
    assert accepts(g, (token + " not a call").encode())
    sp = {}
    apply_constraint(sp, {}, ToolPlan("auto", [WEATHER]), fmt=get_format("qwen25"), engine=engine)
    assert "structural_tag" in sp
    sp = {}
    apply_constraint(sp, {}, ToolPlan("auto", [WEATHER]), fmt=get_format("pythonic"))
    assert sp == {}
    # an external grammar backend without structural tags: auto stays free, no reasoning gate
    engine.config = type("C", (), {"grammar_backend": "xgrammar"})()
    sp = {"regex": "a+"}
    apply_constraint(sp, {}, ToolPlan("auto", [WEATHER]), engine=engine, reasoning_end="</think>")
    assert sp == {"regex": "a+"}


@pytest.mark.parametrize("name,text", [
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city":"P"}}, '
                '{"name": "get_weather", "arguments": {"city":"Q"}}]'),
    ("granite", 'ok <|tool_call|>[{"name": "get_weather", "arguments": {"city":"P"}}]'),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city":"P"}}; '
               '{"name": "get_weather", "parameters": {"city":"Q"}}'),
])
def test_other_families_shapes(grammar, name, text):
    sp: dict = {}
    apply_constraint(sp, {}, ToolPlan("auto", [WEATHER]), fmt=get_format(name))
    g = _compile(grammar, sp)
    assert accepts(g, text.encode()) and accepts(g, b"plain text")
    assert not accepts(g, text.replace('"city"', '"town"').encode())
