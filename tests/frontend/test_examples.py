"""Smoke tests of examples/*.py on the real default model (shared session engine, short outputs)."""
import importlib.util
import json
import pathlib

import pytest

import sglite

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(sglite, "Engine"), reason="sglite.Engine is still the interface stub"),
]

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_few_shot_select(real_engine):
    mod = load("few_shot_select")
    out = mod.main(real_engine)
    assert list(out) == mod.QUESTIONS and set(out.values()) <= set(mod.CLASSES)


def test_react_agent_steps_are_constrained(real_engine):
    import re

    import jsonschema

    mod = load("react_agent")
    vars_ = mod.main(real_engine)
    assert "answer" in vars_
    actions = [vars_[k] for k in sorted(k for k in vars_ if k.startswith("action"))]
    assert actions and actions[0] == "lookup" and set(actions) <= {"lookup", "calculator", "finish"}
    seen = mod.numbers_in("How tall is the Eiffel Tower in metres, times 2?")
    for key in sorted(k for k in vars_ if k.startswith("thought")):
        assert re.fullmatch(mod.THOUGHT, vars_[key]), vars_[key]
    for key in sorted(k for k in vars_ if k.startswith("args")):
        action, args = vars_["action" + key[4:]], json.loads(vars_[key])
        schema = mod.LOOKUP_SCHEMA if action == "lookup" else mod.calculator_schema(seen)
        jsonschema.validate(args, schema)
        seen += mod.numbers_in(mod.TOOLS[action](**args))
    assert re.fullmatch(mod.answer_regex(seen), vars_["answer"]), vars_["answer"]
    assert mod.calculator("330 * 2") == "660" and mod.calculator("__import__('os')").startswith("error")


def test_tree_of_thought(real_engine):
    approaches, best, cached = load("tree_of_thought").main(real_engine, max_tokens=8)
    assert len(approaches) == 3 and best in ("1", "2", "3")
    assert min(cached) > 10  # every branch found the shared prefix in the cache


def test_multi_turn_chat(real_engine):
    msgs = load("multi_turn_chat").main(real_engine, max_tokens=8)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]


def test_json_extraction(real_engine):
    mod = load("json_extraction")
    objs = mod.main(real_engine, max_tokens=64)
    assert len(objs) == len(mod.TEXTS) and all(set(o) == {"name", "age", "city"} for o in objs)


def test_parallel_batch(real_engine):
    import re

    mod = load("parallel_batch")
    out = mod.main(real_engine, max_tokens=6)
    assert len(out) == len(mod.REVIEWS) and all(s in ("positive", "negative", "neutral") for s, _ in out)
    # the summary regex needs more than 6 tokens at times: then it is a prefix of a match
    assert all(summ[:1].isupper() and re.fullmatch(r"[A-Za-z' .]+", summ) for _, summ in out), out
