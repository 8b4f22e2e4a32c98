"""``lora_path`` in programs (issue 30): ``gen(..., lora_path=)`` and ``run(lora_path=)`` reach the
engine's adapter (the in-process engine backend on the tiny model); the HTTP and OpenAI backends
send it as ``lora_path`` / ``model``."""
import pytest

import sglite
from sglite.frontend.backend import logprob_kwargs
from sglite.frontend.testing import FakeBackend
from tests.server.test_lora_server import tiny_adapter

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    from sglite import Engine

    a = tiny_adapter(tmp_path_factory.mktemp("prog_lora") / "a", 1)
    with Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=4096, lora_paths={"a": str(a)}) as e:
        yield e


def test_gen_and_run_lora_path(engine):
    want = engine.generate(prompt="The sea is", sampling_params=GREEDY, lora_path="a")["text"]
    base = engine.generate(prompt="The sea is", sampling_params=GREEDY)["text"]
    assert want != base

    @sglite.function
    def per_call(s):
        s += "The sea is"
        s += sglite.gen("x", max_tokens=6, temperature=0, ignore_eos=True, lora_path="a")

    @sglite.function
    def plain(s):
        s += "The sea is"
        s += sglite.gen("x", max_tokens=6, temperature=0, ignore_eos=True)

    assert per_call.run(backend=engine)["x"] == want
    assert plain.run(backend=engine, lora_path="a")["x"] == want
    assert plain.run(backend=engine)["x"] == base
    with pytest.raises(KeyError, match="lora_path: no adapter"):  # the program's gen failed on it
        plain.run(backend=engine, lora_path="nope")["x"]


def test_backends_send_lora_path():
    assert logprob_kwargs(lora_path="a") == {"lora_path": "a"} and logprob_kwargs() == {}
    from sglite.frontend.openai_backend import OpenAI

    be = OpenAI.__new__(OpenAI)
    be.model_name, be.extra_body = "base", "sglang"
    assert be._body({"max_new_tokens": 3}, {"lora_path": "a"}, False)["model"] == "a"
    assert be._body({"max_new_tokens": 3}, {}, False)["model"] == "base"


def test_select_lora_path_reaches_the_backend_and_is_checked():
    be = FakeBackend()

    @sglite.function
    def prog(s):
        s += "Q:"
        s += sglite.select("c", choices=["x", "y"])
        s += sglite.select("d", choices=["x", "y"], lora_path="b")

    prog.run(backend=be, lora_path="a")
    assert [r.get("lora_path") for r in be.requests if r["kind"] == "score"] == ["a", "b"]
    prog.run(backend=be)
    assert [r.get("lora_path") for r in be.requests if r["kind"] == "score"][2:] == [None, "b"]
    with pytest.raises(sglite.InvalidRequestError, match="lora_path"):
        sglite.select("c", choices=["x"], lora_path=["a"])


def test_select_scores_with_the_adapter(engine):
    choices = [" calm", " wild", " blue"]
    want = engine.score("The sea is", choices, lora_path="a")
    base = engine.score("The sea is", choices)
    assert [r["logprobs"] for r in want] != [r["logprobs"] for r in base]

    @sglite.function
    def prog(s):
        s += "The sea is"
        s += sglite.select("c", choices=choices)

    for kw, ref in (({"lora_path": "a"}, want), ({}, base)):
        meta = prog.run(backend=engine, **kw).get_meta_info("c")
        assert [[e[0] for e in c] for c in meta["input_token_logprobs"]] == [r["logprobs"] for r in ref]
    with pytest.raises(sglite.InvalidRequestError) as ei:  # refused before anything is scheduled
        engine.score("The sea is", choices, lora_path="nope")
    assert ei.value.field == "lora_path"
