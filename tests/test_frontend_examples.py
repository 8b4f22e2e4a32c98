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

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_few_shot_select(real_engine):
    mod = load("few_shot_select")
    out = mod.main(real_engine)
    assert list(out) == mod.QUESTIONS and set(out.values()) <= {"yes", "no"}


def test_react_agent_tool_call_is_schema_valid(real_engine):
    import jsonschema

    mod = load("react_agent")
    vars_ = mod.main(real_engine, max_tokens=8)
    assert "answer" in vars_
    for key, value in vars_.items():
        if key.startswith("args"):
            action = vars_["action" + key[4:]]
            jsonschema.validate(json.loads(value), mod.TOOLS[action][1])
    assert mod.calculator("330*2") == "660" and mod.calculator("__import__('os')").startswith("error")


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
    mod = load("parallel_batch")
    out = mod.main(real_engine, max_tokens=6)
    assert len(out) == len(mod.REVIEWS) and all(s in ("positive", "negative", "neutral") for s, _ in out)
