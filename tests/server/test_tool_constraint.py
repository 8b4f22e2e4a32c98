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
    sp = {"regex": "a+"}  # pythonic with the request's own constraint: calls left free
    apply_constraint(sp, {}, ToolPlan("auto", [WEATHER]), fmt=get_format("pythonic"))
    assert sp == {"regex": "a+"}
    # an external grammar backend without structural tags: auto stays free, no reasoning gate
    engine.config = type("C", (), {"grammar_backend": "xgrammar"})()
    sp = {"regex": "a+"}
    apply_constraint(sp, {}, ToolPlan("auto", [WEATHER]), engine=engine, reasoning_end="</think>")
    assert sp == {"regex": "a+"}


@pytest.mark.parametrize("name,token,after", [
    ("llama3", "<|python_tag|>", '{"name": "get_weather", "parameters": {"city":"P"}}'),
    ("mistral", "[TOOL_CALLS]", ' [{"name": "get_weather", "arguments": {"city":"P"}}]'),
    ("granite", "<|tool_call|>", '[{"name": "get_weather", "arguments": {"city":"P"}}]'),
])
def test_forced_special_token_openers_are_the_token(grammar, name, token, after):
    """A forced call of a special-token family is the family's markup from the token id on (what
    the model writes natively), not bare JSON; nothing before the opener, nothing after the call."""
    from sglite.constrained.tokenizer_info import special_trigger

    engine = type("E", (), {"tokenizer": type("T", (), {"hf": type("H", (), {
        "added_tokens_decoder": {5: type("K", (), {"content": token, "special": True})()}})()})()})()
    for choice in ("required", "named"):
        tools = [WEATHER, {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]
        plan = ToolPlan("forced", tools if choice == "required" else [WEATHER], {"type": "object"},
                        fmt=get_format(name))
        sp, rename = {"json_schema": "{}"}, {}
        apply_constraint(sp, rename, plan, fmt=plan.fmt, engine=engine)
        assert set(sp) == {"structural_tag"} and rename["grammar"] == "tools"
        g = _compile(grammar, sp)
        mark = special_trigger(token)
        assert accepts(g, (mark + after).encode())
        for bad in (after.strip(), token + after, "Sure. " + mark + after, mark + after + " done",
                    mark + after.replace('"city"', '"town"')):
            assert not accepts(g, bad.encode()), bad


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


PY_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]},
        "hourly": {"type": "boolean"}, "extra": {"type": "object"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"type": ["string", "null"]}, "ts": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]
PY_TYPES = {"string": str, "integer": int, "boolean": bool, "object": dict, "array": list}


@pytest.mark.parametrize("parallel", [True, False])
def test_pythonic_auto_calls_always_parse(grammar, parallel):
    """Pythonic "auto": free text, then from `[<tool>(` on a grammar of Python literals built from
    the schemas. Random walks through the grammar's masks (a byte vocabulary) always end in calls
    that the pythonic parser reads, with only the tool's parameters, the required ones, the right
    top-level types (and enum values)."""
    import random

    import numpy as np
    import torch

    from sglite.server.tool_parsers.pythonic import parse_pythonic_calls

    sp: dict = {}
    apply_constraint(sp, {}, ToolPlan("auto", PY_TOOLS, parallel=parallel), fmt=get_format("pythonic"))
    g = _compile(grammar, sp)
    assert accepts(g, b"See [1] and [2], plain text.")
    assert not accepts(g, b'[get_weather(days=2)]') and not accepts(g, b'[get_time(zone="x")]')
    rng, schemas = random.Random(7), {t["function"]["name"]: t["function"]["parameters"] for t in PY_TOOLS}
    done = 0
    for run in range(12):
        m = g.matcher()
        head = f"Checking. [{rng.choice(list(schemas))}(".encode()
        assert all(m.accept_token(b) for b in head)
        out = list(head)
        while not m.is_terminated() and len(out) < 600:
            mask = torch.zeros(1, 9, dtype=torch.int32)
            m.fill_next_token_bitmask(mask)
            allowed = np.flatnonzero(np.unpackbits(mask[0].numpy().view("uint8"), bitorder="little")[:257])
            # lean towards closing: short values, so walks end
            weights = [8.0 if t == 256 or (t < 256 and t in b')]"0') else 1.0 for t in allowed]
            t = int(rng.choices(list(allowed), weights)[0])
            assert m.accept_token(t)
            if t == 256:
                break
            out.append(t)
        if not m.is_terminated():
            continue  # cut by the length of the walk (a long random literal)
        text = bytes(out).decode("utf-8", errors="replace")  # free text after the list: any bytes
        content, calls = parse_pythonic_calls(text, list(schemas))
        assert content == "Checking." and calls and (parallel or len(calls) == 1), text
        done += 1
        for c in calls:
            params, args = schemas[c["function"]["name"]], json.loads(c["function"]["arguments"])
            assert set(args) <= set(params["properties"]) and set(params.get("required", [])) <= set(args), text
            for k, v in args.items():
                want = params["properties"][k]
                if "enum" in want:
                    assert v in want["enum"]
                for typ in ([want["type"]] if isinstance(want.get("type"), str) else want.get("type") or []):
                    if typ in PY_TYPES and not isinstance(want.get("type"), list):
                        assert isinstance(v, PY_TYPES[typ]) and (typ == "boolean") == isinstance(v, bool), text
    assert done >= 8, f"only {done} of 12 walks ended"
