"""Tool-call parsers per family (``--tool-call-parser``): golden outputs written as each family's
chat template instructs (plain, parallel, with content before), parsed whole and streamed for
EVERY split point (and character by character); malformed outputs come back as text."""
from __future__ import annotations

import json
import random

import pytest

from sglite.server.tool_calls import ToolPlan, parse_tool_calls, plan_tools
from sglite.server.tool_parsers import FORMATS, detect_format, get_format, tool_call_parser_names
from sglite.server.tool_stream import ToolCallStreamer, merge_tool_call_deltas

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}
W = {"city": "Paris \"centre\" {x}", "days": 2}
T = {"tz": "Europe/Paris"}

# Golden texts in each family's own format (the shape its chat template's instructions show).
GOLDEN = {
    "qwen25": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"centre\\" {x}", "days": 2}}\n</tool_call>',
         None, [("get_weather", W)]),
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"centre\\" {x}", '
         '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
         "Let me check.", [("get_weather", W), ("get_time", T)]),
        ('{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}', None, [("get_time", T)]),
    ],
    "llama3": [
        ('<|python_tag|>{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}', None, [("get_time", T)]),
        ('{"name": "get_weather", "parameters": {"city": "Paris \\"centre\\" {x}", "days": 2}}', None,
         [("get_weather", W)]),  # <|python_tag|> is a special token: skipped by the detokenizer
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris \\"centre\\" {x}", "days": 2}}; '
         '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}', None, [("get_weather", W), ("get_time", T)]),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris \\"centre\\" {x}", "days": 2}}, '
         '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]', None, [("get_weather", W), ("get_time", T)]),
        ('[{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]', None, [("get_time", T)]),
        ('Checking. [TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]', "Checking.",
         [("get_time", T)]),
        # the newer form (tokenizer v11+): `[TOOL_CALLS]name[ARGS]{...}` per call, an optional [CALL_ID]
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris \\"centre\\" {x}", "days": 2}'
         '[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris"}', None, [("get_weather", W), ("get_time", T)]),
        ('Checking.[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"tz": "Europe/Paris"}', "Checking.",
         [("get_time", T)]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris \\"centre\\" {x}", days=2), get_time(tz=\'Europe/Paris\')]', None,
         [("get_weather", W), ("get_time", T)]),
        ('I will look it up. [get_time(tz="Europe/Paris")]', "I will look it up.", [("get_time", T)]),
        ('[get_weather(city="Paris \\"centre\\" {x}", days=2)]', None, [("get_weather", W)]),
    ],
    "granite": [
        ('<|tool_call|>[{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}, '
         '{"arguments": {"city": "Paris \\"centre\\" {x}", "days": 2}, "name": "get_weather"}]', None,
         [("get_time", T), ("get_weather", W)]),  # keys in another order: held, parsed whole at the end
        ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris \\"centre\\" {x}", "days": 2}}]', None,
         [("get_weather", W)]),
        ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris \\"centre\\" {x}", "days": 2}}, '
         '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]', None, [("get_weather", W), ("get_time", T)]),
        ('Sure.<|tool_call|>[{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]', "Sure.", [("get_time", T)]),
    ],
}

MALFORMED = {
    "qwen25": ['<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "<tool_call>not json</tool_call>",
               'Text <tool_call>{"arguments": {"tz": 1}, "name": "get_tim"}</tool_call>', "<tool_call>", "{", "[1, 2]"],
    "llama3": ['<|python_tag|>{"name": "nope", "parameters": {}}', "<|python_tag|>print(1)", '{"answer": 42}', "{"],
    "mistral": ['[TOOL_CALLS] [{"name": "nope", "arguments": {}}]', "[TOOL_CALLS] oops", "[1, 2, 3]", "[",
                '[TOOL_CALLS]nope[ARGS]{"a": 1}', "[TOOL_CALLS]get_time[ARGS][1]", "[TOOL_CALLS]get_time[ARGS]x",
                "[TOOL_CALLS]get_time"],
    "pythonic": ["[get_time('Europe/Paris')]", "[nope(a=1)]", "[get_time(tz=x)]", "[get_time(tz='a'",
                 "See [1] and [get_time(tz=1) + 2]", "[get_time(**kw)]", "a [ b"],
    "granite": ['<|tool_call|>[{"name": "nope", "arguments": {}}]', "<|tool_call|>[{", "<|tool_call|>hello"],
}


def _plan(name: str, parallel: bool = True) -> ToolPlan:
    return ToolPlan("auto", [WEATHER, TIME], parallel=parallel, fmt=get_format(name))


def _norm(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _stream_pieces(plan, pieces, finish="stop"):
    s, content, deltas, text = ToolCallStreamer(plan), "", [], ""
    for p in pieces[:-1]:
        text += p
        c, d = s.feed(text)
        content, deltas = content + c, deltas + d
    text += pieces[-1]
    c, d = s.finish(text, finish)
    return content + c, deltas + d


def _is_call_id(cid):
    """Ours (``call_`` + hex) or the model's own (mistral's ``[CALL_ID]``, 9 characters)."""
    return cid.startswith("call_") or (len(cid) == 9 and cid.isalnum())


def _check_deltas(deltas):
    first = {}
    for k, d in enumerate(deltas):
        first.setdefault(d["index"], k)
    assert sorted(first) == list(range(len(first)))
    for i, k in first.items():  # each call's first entry carries its id and name, arguments ""
        assert _is_call_id(deltas[k]["id"]) and deltas[k]["function"]["arguments"] == ""
    assert all("id" not in d for k, d in enumerate(deltas) if k not in first.values())


CASES = [(fmt, text, content, calls) for fmt, rows in GOLDEN.items() for text, content, calls in rows]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_golden_non_stream(fmt, text, content, calls):
    got_content, got = parse_tool_calls(text, _plan(fmt))
    assert got_content == content and _norm(got) == calls
    assert all(_is_call_id(c["id"]) and c["type"] == "function" for c in got)


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_golden_streamed_at_every_split_point(fmt, text, content, calls):
    plan = _plan(fmt)
    splits = [[text[:k], text[k:]] for k in range(1, len(text))] + [list(text)]
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), 4))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in splits:
        got_content, deltas = _stream_pieces(plan, pieces)
        _check_deltas(deltas)
        assert (got_content.strip() or None) == content, pieces
        assert _norm(merge_tool_call_deltas(deltas)) == calls, pieces


@pytest.mark.parametrize("fmt,text,content,calls", [c for c in CASES if len(c[3]) > 1])
def test_parallel_false_keeps_the_first_call(fmt, text, content, calls):
    plan = _plan(fmt, parallel=False)
    assert _norm(parse_tool_calls(text, plan)[1]) == calls[:1]
    _, deltas = _stream_pieces(plan, list(text))
    assert _norm(merge_tool_call_deltas(deltas)) == calls[:1]


@pytest.mark.parametrize("fmt,text", [(f, t) for f, rows in MALFORMED.items() for t in rows])
def test_malformed_comes_back_as_text(fmt, text):
    plan = _plan(fmt)
    assert parse_tool_calls(text, plan) == (text, [])
    for k in range(1, len(text) + 1):
        content, deltas = _stream_pieces(plan, [text[:k], text[k:]])
        assert content == text and deltas == []


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_render_calls_round_trips(fmt):
    f = FORMATS[fmt]
    calls = [("get_weather", W), ("get_time", T)]
    text = f.render_calls(calls)
    assert _norm(parse_tool_calls(text, _plan(fmt))[1]) == calls
    assert text.startswith(f.opener) and text.endswith(f.closer)


def test_names_aliases_and_unknown():
    assert get_format("hermes").name == "qwen25" and get_format(None).name == "qwen25"
    assert {"qwen25", "hermes", "llama3", "mistral", "pythonic", "granite"} <= set(tool_call_parser_names())
    with pytest.raises(ValueError, match="tool_call_parser: unknown parser 'nope'"):
        get_format("nope")
    assert plan_tools(None, None, parser="mistral").fmt.name == "mistral"


@pytest.mark.parametrize("template,model_type,expect", [
    ("{% for tool in tools %}...<tool_call>\n{\"name\": ...}</tool_call>", None, "qwen25"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama", "llama3"),
    ("{{ '[TOOL_CALLS] [' }}", None, "mistral"),
    ("{{ '<|tool_call|>' }}", None, "granite"),
    ("[func_name1(params_name1=params_value1, params_name2=params_value2...)]", "llama", "pythonic"),
    ("plain {{ messages }}", "granite", "granite"),
    ("plain {{ messages }}", "llama", "qwen25"),  # an architecture, not a tool format (SmolLM2 is "llama")
    ("plain {{ messages }}", None, "qwen25"),
])
def test_detect_format(template, model_type, expect):
    fmt, why = detect_format(template, model_type)
    assert fmt.name == expect and why


def test_start_up_chooses_the_parser_from_the_template_and_logs_it(caplog):
    import logging
    from types import SimpleNamespace

    from sglite.server.app import choose_tool_parser
    from sglite.server.settings import ServerConfig

    engine = SimpleNamespace(tokenizer=SimpleNamespace(hf=SimpleNamespace(chat_template="... [TOOL_CALLS] ...")),
                             checkpoint=SimpleNamespace(hf_config=SimpleNamespace(model_type="llama")))
    with caplog.at_level(logging.INFO, logger="sglite.server"):
        assert choose_tool_parser(engine, ServerConfig()) == "mistral"
        assert choose_tool_parser(engine, ServerConfig(tool_call_parser="hermes")) == "qwen25"
    lines = [r.getMessage() for r in caplog.records]
    assert any("tool-call parser: mistral" in ln and "[TOOL_CALLS]" in ln for ln in lines)
    assert any("tool-call parser: qwen25 (--tool-call-parser)" in ln for ln in lines)


_PIECES = ["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "<|tool_call|>", "{", "}", "[", "]",
           "(", ")", ",", ";", ":", '"', "\\", " ", "\n", '"name"', '"arguments"', '"parameters"', '"get_time"',
           "get_time", "tz=", "'x'", "1", "null", "text"]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_random_output_never_raises(fmt):
    """Outputs built from the formats' own pieces (mostly malformed): parsing, whole and streamed in
    random chunks, never raises; an output whose first call was never streamed matches the whole parse."""
    rng = random.Random(fmt)
    plan = _plan(fmt)
    for _ in range(300):
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 14)))
        content, calls = parse_tool_calls(text, plan)
        assert isinstance(calls, list) and (calls or content == text)
        cuts = sorted(rng.sample(range(1, len(text)), min(3, len(text) - 1))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        s_content, deltas = _stream_pieces(plan, pieces)
        if not deltas:
            assert not calls and s_content == text


def test_fallback_tool_prompt_teaches_the_plan_format():
    from sglite.server.tool_calls import tools_system_prompt

    assert "<tool_call>" in tools_system_prompt([TIME])
    assert "[TOOL_CALLS] [" in tools_system_prompt([TIME], get_format("mistral"))
    assert "[<function-name>(" in tools_system_prompt([TIME], get_format("pythonic"))


def test_mistral_args_form_cut_by_the_limit_is_an_incomplete_call():
    from sglite.server.tool_stream import truncated_tool_calls

    plan = _plan("mistral")
    text = 'Sure.[TOOL_CALLS]get_time[ARGS]{"tz": "Eu'
    content, calls = truncated_tool_calls(text, plan)
    assert content == "Sure." and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("get_time", '{"tz": "Eu')]
    s = ToolCallStreamer(plan)
    s.feed(text[:20])
    s.finish(text, "length")
    assert s.called and s.incomplete


class _ChatML:
    """A fake engine whose template is ChatML; ``shows_tools`` says whether it lists ``tools``."""

    def __init__(self, shows_tools: bool):
        self.shows_tools = shows_tools

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **kw):
        head = ""
        if tools and self.shows_tools:
            head = "<|im_start|>system\nTools: " + ", ".join(t["function"]["name"] for t in tools) + "<|im_end|>\n"
        body = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages)
        return head + body + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@pytest.mark.parametrize("shows_tools", [False, True], ids=["template-drops-tools", "template-lists-tools"])
def test_tools_shown_even_when_the_instructions_name_them(shows_tools):
    """A system message that names the tool ("call get_weather") must not pass for the
    template's tool list: where the template drops ``tools`` the schema section is added (the
    model sees the parameters), and where it lists them it is not added twice."""
    from sglite.server.tool_calls import render_prompt

    plan = ToolPlan("auto", [WEATHER])
    msgs = [{"role": "system", "content": "Call get_weather for every city."},
            {"role": "user", "content": "Weather in Oslo?"}]
    text = render_prompt(_ChatML(shows_tools), msgs, plan)
    schema = json.dumps(WEATHER["function"], ensure_ascii=False)
    assert text.count(schema) == (0 if shows_tools else 1), text
    assert text.count("get_weather") == 2  # the instructions, then the template's list or the schema section
    assert text.startswith("<|im_start|>system\n" + ("Tools: get_weather" if shows_tools else "Call get_weather"))
