"""Forced tool calls of families whose opener is a special token (issue 34): llama3's
``<|python_tag|>``, mistral's ``[TOOL_CALLS]``, granite's ``<|tool_call|>``. A forced turn
(``tool_choice`` ``"required"`` or a named function) is generated in the family's own markup: the
opener as its special token id (what the model was trained to write), then the constrained call.
Oracles: the output's first token id is the tokenizer's id of the opener (never its text spelled
out of other tokens), the parsers read the call back (non-streamed, streamed, chat completions and
Responses), and the arguments follow the tool's schema. Model: a tiny random Llama whose
tokenizer (SmolLM2's) has the three openers added as special tokens."""
from __future__ import annotations

import json

import openai
import pytest

from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig

OPENERS = {"llama3": "<|python_tag|>", "mistral": "[TOOL_CALLS]", "granite": "<|tool_call|>"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
VALUES = {"get_weather": {"city": {"Paris", "Oslo"}}, "get_time": {"tz": {"UTC", "CET"}}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory, real_checkpoint):
    from transformers import AutoTokenizer

    from sglite import Engine
    from sglite.testing import make_tiny_llama

    vocab = tmp_path_factory.mktemp("special_vocab")
    tok = AutoTokenizer.from_pretrained(str(real_checkpoint.model_dir))
    tok.add_special_tokens({"additional_special_tokens": list(OPENERS.values())})
    tok.save_pretrained(str(vocab))
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny_special"), seed=3, vocab_from=vocab)
    eng = Engine(model_path=str(model_dir), dtype="float32", max_total_tokens=4096)
    yield eng
    eng.shutdown()


def _valid(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == set(VALUES[name]) and all(args[k] in VALUES[name][k] for k in args), (name, args)


@pytest.mark.slow  # ~12 s: a tiny checkpoint with its own vocabulary, an engine, 3 servers
@pytest.mark.parametrize("family", sorted(OPENERS))
def test_forced_calls_open_with_the_special_token(engine, family):
    opener_id = engine.tokenizer.hf.convert_tokens_to_ids(OPENERS[family])
    cfg = ServerConfig(port=0, served_model_name="x", tool_call_parser=family)
    with ServerThread(engine, cfg) as srv:
        cl = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        for choice, tools in ((NAMED, [WEATHER, TIME]), ("required", [WEATHER, TIME])):
            kw = dict(model="x", messages=USER, tools=tools, tool_choice=choice, temperature=0,
                      max_tokens=60, parallel_tool_calls=False)
            r = cl.chat.completions.create(logprobs=True, **kw)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.content is None, c
            (call,) = c.message.tool_calls
            if choice is NAMED:
                assert call.function.name == "get_weather"
            _valid(call.function.name, call.function.arguments)
            # the first output token is the opener's own id (logprobs carry the token text)
            assert c.logprobs.content[0].token == OPENERS[family]
            assert engine.tokenizer.hf.convert_tokens_to_ids(c.logprobs.content[0].token) == opener_id
            # streamed == non-streamed (both without logprobs: logprobs turn jump-forward off, and
            # a random model's near-ties may then pick another enum value)
            (call,) = cl.chat.completions.create(**kw).choices[0].message.tool_calls
            _valid(call.function.name, call.function.arguments)
            chunks = list(cl.chat.completions.create(stream=True, **kw))
            deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
            assert {d.index for d in deltas} == {0} and deltas[0].function.name == call.function.name
            assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(call.function.arguments)
            assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        # Responses API: the same forced call as a function_call item
        tools_flat = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
        resp = cl.responses.create(model="x", input=USER[0]["content"], tools=tools_flat,
                                   tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                   max_output_tokens=60, parallel_tool_calls=False)
        (item,) = [o for o in resp.output if o.type == "function_call"]
        assert item.name == "get_weather" and not [o for o in resp.output if o.type == "message"]
        _valid(item.name, item.arguments)
        stream = list(cl.responses.create(model="x", input=USER[0]["content"], tools=tools_flat, stream=True,
                                          tool_choice="required", temperature=0, max_output_tokens=60,
                                          parallel_tool_calls=False))
        done = [e for e in stream if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1
        final = stream[-1].response
        (item,) = [o for o in final.output if o.type == "function_call"]
        _valid(item.name, item.arguments)
