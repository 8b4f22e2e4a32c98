"""Engine API on a tiny random model: validation, stopping, sampling, n, scoring, streaming, abort."""
import asyncio

import pytest


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from sglite import Engine

    e = Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=8192, check_invariants=True)
    yield e
    e.shutdown()


@pytest.mark.parametrize("params,field", [
    ({"max_new_tokenz": 3}, "max_new_tokenz"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"regex": "(unclosed"}, "regex"),
    ({"stop": [""]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"top_k": 0}, "top_k"),
    ({"n": 0}, "n"),
    ({"regex": "a", "json_schema": {"type": "string"}}, "json_schema"),
])
def test_bad_sampling_params_raise_before_scheduling(engine, params, field):
    before = engine.get_server_info()["steps"]
    with pytest.raises(ValueError) as ei:
        engine.generate("hello", params)
    assert field in str(ei.value)
    assert engine.get_server_info()["steps"] == before


def test_prompt_longer_than_context_is_rejected(engine):
    from sglite import CapacityError

    with pytest.raises(CapacityError, match="max_new_tokens"):
        engine.generate(input_ids=[5] * 100, sampling_params={"max_new_tokens": 100000})
    with pytest.raises(ValueError, match="input_ids"):
        engine.generate(input_ids=[10**9])


def test_stop_string_trimmed_and_reported(engine):
    base = engine.generate("stop test", {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
    text = base["text"]
    assert len(text) > 6
    stop = text[3:6]
    out = engine.generate("stop test", {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[:text.index(stop)]
    kept = engine.generate("stop test", {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True,
                                         "stop": [stop], "no_stop_trim": True})
    assert kept["text"] == text[:text.index(stop) + len(stop)]


def test_stop_token_ids_and_length(engine):
    base = engine.generate("tok", {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
    assert base["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    t = base["output_ids"][4]
    out = engine.generate("tok", {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True, "stop_token_ids": [t]})
    assert out["output_ids"] == base["output_ids"][:base["output_ids"].index(t) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": t}


def test_max_new_tokens_zero_is_prefill_only(engine):
    out = engine.generate("just prefill this", {"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_sampling_seed_is_batch_invariant(engine):
    p = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 1234, "ignore_eos": True}
    alone = engine.generate("seeded", p)["output_ids"]
    mixed = engine.generate(["other prompt", "seeded", "a third one here"],
                            [{"max_new_tokens": 9, "temperature": 0.7}, p, {"max_new_tokens": 20}])
    assert mixed[1]["output_ids"] == alone
    other = engine.generate("seeded", dict(p, sampling_seed=99))["output_ids"]
    assert other != alone


def test_n_samples_share_one_prefill(engine):
    engine.flush_cache()
    prompt = "sharing the prompt " * 10
    before = engine.get_server_info()
    outs = engine.generate(prompt, {"n": 4, "max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True})
    after = engine.get_server_info()
    assert isinstance(outs, list) and len(outs) == 4
    assert len({tuple(o["output_ids"]) for o in outs}) > 1, "n=4 at temperature 1 gave identical samples"
    plen = outs[0]["meta_info"]["prompt_tokens"]
    for o in outs:
        assert o["meta_info"]["cached_tokens"] == plen - 1
    computed = (after["prompt_tokens"] - before["prompt_tokens"]) - (after["cached_tokens"] - before["cached_tokens"])
    assert computed == plen + 4, "the prompt was prefilled more than once"


def test_logprobs_shapes_and_top(engine):
    out = engine.generate("logprob me", {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=3, token_ids_logprob=[5, 6])
    m = out["meta_info"]
    assert len(m["output_token_logprobs"]) == 5
    assert [e[1] for e in m["output_token_logprobs"]] == out["output_ids"]
    assert len(m["input_token_logprobs"]) == m["prompt_tokens"]
    for top, chosen in zip(m["output_top_logprobs"], m["output_token_logprobs"]):
        assert len(top) == 3 and top[0][0] >= top[1][0] >= top[2][0]
        assert abs(top[0][0] - chosen[0]) < 1e-5  # greedy picks the top token
    assert len(m["output_token_ids_logprobs"][0]) == 2


def test_score_matches_generation_logprobs(engine):
    prompt = "score this:"
    res = engine.score(prompt, ["apple pie", "apple tart", "applesauce", "apple"])
    assert [r["text"] for r in res] == ["apple pie", "apple tart", "applesauce", "apple"]
    for r in res:
        assert len(r["logprobs"]) == len(r["token_ids"]) > 0
        assert all(lp <= 0 for lp in r["logprobs"])
    # the same numbers as scoring one continuation through generate with input logprobs
    full = engine.tokenizer.encode(prompt + "apple pie")
    k = len(full) - len(res[0]["token_ids"])
    g = engine.generate(input_ids=full, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=k)
    assert [e[0] for e in g["meta_info"]["input_token_logprobs"]] == pytest.approx(res[0]["logprobs"], abs=1e-4)


def test_streaming_chunks_join_to_final_text(engine):
    p = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    final = engine.generate("stream me", p)
    events = list(engine.generate("stream me", p, stream=True))
    assert events[-1]["meta_info"]["finish_reason"] is not None
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["text"] == final["text"] and events[-1]["output_ids"] == final["output_ids"]
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "cumulative text went backwards"


@pytest.mark.parametrize("interval", [3, 7])
def test_stream_interval_sends_every_nth_token_and_the_end(tiny_model_dir, interval):
    from sglite import Engine

    p = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    e = Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=2048, stream_interval=interval)
    try:
        final = e.generate("stream me", p)
        events = list(e.generate("stream me", p, stream=True))
    finally:
        e.shutdown()
    counts = [len(ev["output_ids"]) for ev in events]
    assert counts == list(range(interval, 20, interval)) + [20]
    assert events[-1]["text"] == final["text"] and events[-1]["output_ids"] == final["output_ids"]


def test_async_generate_and_abort(engine):
    async def main():
        p = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
        it = await engine.async_generate("abort me", p, stream=True, rid="victim")
        n = 0
        async for ev in it:
            n += 1
            if n == 3:
                engine.abort("victim")
            if ev["meta_info"]["finish_reason"] is not None:
                return ev
        return None

    ev = asyncio.run(main())
    assert ev["meta_info"]["finish_reason"]["type"] == "abort"
    assert ev["meta_info"]["completion_tokens"] < 400
    info = engine.get_server_info()
    assert info["available_tokens"] == info["max_total_tokens"]


def test_flush_cache_empties_tree(engine):
    engine.generate("fill the cache", {"max_new_tokens": 2})
    assert engine.get_server_info()["evictable_tokens"] > 0
    assert engine.flush_cache() is True
    info = engine.get_server_info()
    assert info["evictable_tokens"] == 0 and info["free_tokens"] == info["max_total_tokens"]


def test_flush_cache_refused_while_requests_run(engine):
    it = engine.generate("keep running", {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True},
                         stream=True, rid="long-runner")
    next(it)
    assert engine.flush_cache() is False
    engine.abort("long-runner")
    last = list(it)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.flush_cache() is True


def test_engine_options_are_validated(tiny_model_dir):
    from sglite import Engine

    with pytest.raises(ValueError, match="schedule_policy"):
        Engine(model_path=str(tiny_model_dir), schedule_policy="random-ish")
    with pytest.raises(ValueError, match="unknown engine option"):
        Engine(model_path=str(tiny_model_dir), max_running_requestz=3)
    with pytest.raises(ValueError, match="does not exist"):
        Engine(model_path="/nonexistent/model.gguf")


def test_logit_bias_forces_a_token(engine):
    out = engine.generate("bias", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "logit_bias": {"1234": 100}})
    assert out["output_ids"] == [1234] * 4


def test_min_new_tokens_blocks_eos(engine):
    eos = sorted(engine.tokenizer.eos_token_ids)[0]
    p = {"max_new_tokens": 6, "temperature": 0, "logit_bias": {str(eos): 100}}
    assert engine.generate("eos", p)["output_ids"] == [eos]
    out = engine.generate("eos", dict(p, min_new_tokens=3))
    assert len(out["output_ids"]) == 4 and out["output_ids"][-1] == eos
    assert eos not in out["output_ids"][:3]


def test_penalties_discourage_repeats(engine):
    base = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = engine.generate("repeat repeat repeat", base)["output_ids"]
    pen = engine.generate("repeat repeat repeat", dict(base, frequency_penalty=2.0, presence_penalty=2.0))["output_ids"]
    rep = engine.generate("repeat repeat repeat", dict(base, repetition_penalty=2.0))["output_ids"]
    assert len(set(pen)) > len(set(plain)) and len(set(rep)) >= len(set(plain))
    assert len(set(pen)) == len(pen), "with strong penalties no token repeats"


def test_stop_regex(engine):
    base = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    text = engine.generate("regex stop", base)["text"]
    import re as _re
    target = _re.escape(text[5:8])
    out = engine.generate("regex stop", dict(base, stop_regex=[target]))
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert out["text"] == text[:text.find(text[5:8])]


def test_min_p_and_top_k_one_equal_greedy(engine):
    g = engine.generate("trunc", {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})["output_ids"]
    k1 = engine.generate("trunc", {"max_new_tokens": 8, "temperature": 1.0, "top_k": 1, "ignore_eos": True})["output_ids"]
    m1 = engine.generate("trunc", {"max_new_tokens": 8, "temperature": 0.8, "min_p": 1.0, "ignore_eos": True})["output_ids"]
    assert g == k1 == m1


def test_requests_submitted_together_share_an_uncached_prefix(engine):
    engine.flush_cache()
    prefix = list(range(1000, 1200))
    prompts = [prefix + [3000 + i, 3100 + i, 3200 + i] for i in range(8)]
    before = engine.get_server_info()
    outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    after = engine.get_server_info()
    computed = (after["prompt_tokens"] - before["prompt_tokens"]) - (after["cached_tokens"] - before["cached_tokens"])
    assert computed <= 200 + 8 * 3 + 8, f"the shared prefix was prefilled more than once ({computed} tokens)"
    assert sum(o["meta_info"]["cached_tokens"] >= 200 for o in outs) >= 7
