"""Forced tool calls in the family's own markup keep multi-turn prompts token-exact (issue 34):
with the default model's tokenizer and chat template (tiny random model, CPU), turn N's forced
call is generated as ``<tool_call>\\n{...}\\n</tool_call>``, exactly what the template renders for
the assistant's call on turn N+1, so turn N+1's prompt token ids start with turn N's prompt ids +
output ids. Oracle: the radix cache's ``cached_tokens`` of turn N+1 (prompt and output of turn N
are cached), and the ids rendered directly by the tokenizer. Also: the bare-JSON fallback where
structural tags are not available."""
import json

import openai
import pytest

from sglite.server.openai_params import chat_messages
from sglite.server.protocol import ChatCompletionRequest, NamedToolChoice
from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig
from sglite.server.tool_calls import ToolPlan, plan_tools, render_prompt
from sglite.server.tool_constraint import apply_constraint
from sglite.server.tool_parsers.formats import get_format

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from sglite import Engine

    eng = Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=4096)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_next_turn_prompt_extends_prompt_and_forced_output(engine, choice):
    engine.flush_cache()
    with ServerThread(engine, ServerConfig(port=0, served_model_name="x")) as srv:
        cl = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        kw = dict(model="x", tools=[WEATHER, TIME], tool_choice=choice, temperature=0, max_tokens=60,
                  parallel_tool_calls=False)
        r1 = cl.chat.completions.create(messages=USER, logprobs=True, **kw)
        c = r1.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)
        turn2 = USER + [c.message.model_dump(exclude_none=True, exclude={"logprobs"}),
                        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        r2 = cl.chat.completions.create(messages=turn2, **{**kw, "max_tokens": 4})  # the same tools shown
        # the same call streamed reads back the same
        chunks = list(cl.chat.completions.create(messages=USER, stream=True, **kw))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    # (a random model's near-ties may pick another enum value on another run: valid, not equal)
    assert deltas[0].function.name in ("get_weather", "get_time") and len({d.index for d in deltas}) == 1
    assert set(json.loads("".join(d.function.arguments or "" for d in deltas)).values()) <= {"Paris", "Oslo", "UTC", "CET"}
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]
    out_text = "".join(t.token for t in c.logprobs.content)
    assert out_text.startswith("<tool_call>\n{") and out_text.endswith("}\n</tool_call>")  # the family's markup
    # the prompts as the server renders them (render_prompt, the engine's tokenizer and template)
    req = ChatCompletionRequest(model="x", messages=turn2)
    plan = plan_tools(ChatCompletionRequest(model="x", messages=USER, tools=[WEATHER, TIME], tool_choice=choice).tools,
                      choice if isinstance(choice, str) else NamedToolChoice(**choice), parallel=False)
    p1 = render_prompt(engine, USER, plan)
    p2 = render_prompt(engine, chat_messages(req), plan)
    assert p2.startswith(p1 + out_text), (p1 + out_text, p2)
    tok = engine.tokenizer
    ids1, out_ids, ids2 = tok.encode(p1), tok.encode(out_text), tok.encode(p2)
    assert len(ids1) == r1.usage.prompt_tokens
    # token for token: turn 2's ids start with turn 1's prompt ids + the output's ids (as a trained
    # model writes them; a random model may split the same text into other tokens)
    assert ids2[:len(ids1) + len(out_ids)] == ids1 + out_ids
    cached = r2.usage.prompt_tokens_details.cached_tokens
    print(f"turn 1: prompt {len(ids1)} + output {r1.usage.completion_tokens} ({len(out_ids)} as re-tokenized); "
          f"turn 2: prompt {r2.usage.prompt_tokens}, cached {cached}")
    assert cached > len(ids1)  # part of the output's tokens too (all, where the model split them canonically)


def test_forced_falls_back_to_bare_json_without_structural_tags():
    class _Cfg:
        grammar_backend = "xgrammar"

    class _Eng:
        config = _Cfg()

    plan = ToolPlan("forced", [WEATHER], {"type": "object"}, fmt=get_format("qwen25"))
    sp, rename = {}, {}
    apply_constraint(sp, rename, plan, engine=_Eng(), fmt=plan.fmt)
    assert set(sp) == {"json_schema"} and rename["json_schema"] == "tools"
    sp = {}
    apply_constraint(sp, {}, plan, fmt=plan.fmt)  # sglite's backend: the family's markup
    fmt = json.loads(sp["structural_tag"])["format"]
    assert fmt["type"] == "tags_with_separator" and fmt["stop_after_first"] is False  # parallel by default
    assert fmt["tags"][0]["begin"].startswith("<tool_call>\n")
