"""ONE contract suite for :class:`sglite.runtime.engine_protocol.EngineProtocol`, run against the
server's FakeEngine and a real Engine on a tiny random Llama (both fast, CPU, no download).

Everything the HTTP layer relies on is asserted here, so the server has no branch for either.
The last tests check point 2 of the architecture issue: the same seeded ``n > 1`` request samples
the same in Python, over native ``/generate`` and over OpenAI ``/v1/completions``.
"""
import asyncio
import threading
import time

import httpx
import pytest

from sglite.errors import CapacityError, InvalidRequestError
from sglite.runtime.engine_protocol import EngineProtocol, sample_rid, sample_seed
from sglite.server.runner import ServerThread
from sglite.server.testing import FakeEngine

PROMPT = "The contract says"
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
SAMPLED = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 11}


@pytest.fixture(scope="module", params=["fake", "real"])
def engine(request):
    if request.param == "fake":
        yield FakeEngine(step_delay=0.001)
        return
    from sglite import Engine

    tiny = request.getfixturevalue("tiny_model_dir")
    e = Engine(model_path=str(tiny), dtype="float32", max_total_tokens=4096, check_invariants=True)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine) as srv:
        yield srv


def _idle(engine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        info = engine.get_server_info()
        if info["running_requests"] == 0 and info["waiting_requests"] == 0 or time.monotonic() > deadline:
            return info
        time.sleep(0.01)


# ----------------------------------------------------------------------------- info
def test_implements_the_protocol(engine):
    assert isinstance(engine, EngineProtocol)


def test_model_info_and_server_info(engine):
    mi = engine.model_info()
    for key in ("model_path", "context_length", "vocab_size", "eos_token_ids", "role_markers", "end_of_turn",
                "default_system_prompt"):
        assert key in mi, key
    assert mi["context_length"] > 0 and mi["vocab_size"] > 0 and mi["eos_token_ids"]
    info = _idle(engine)
    for key in ("max_total_tokens", "free_tokens", "evictable_tokens", "available_tokens", "running_requests",
                "waiting_requests", "cache_hit_rate", "bytes_per_token", "context_length"):
        assert key in info, key
    assert info["available_tokens"] == info["max_total_tokens"]


def test_tokenizer_and_chat_template(engine):
    ids = engine.tokenizer.encode("hello there")
    assert ids and engine.tokenizer.decode(ids) == "hello there"
    text = engine.apply_chat_template([{"role": "user", "content": "what is up"}])
    assert isinstance(text, str) and "what is up" in text


# ----------------------------------------------------------------------------- generate
def test_async_generate_takes_the_protocols_arguments(engine):
    """Every argument the HTTP layer may pass (``lora_path`` included) is one both engines take:
    a fake that lagged behind turned a fuzzed ``lora_path`` into a 500."""
    import inspect

    want = list(inspect.signature(EngineProtocol.async_generate).parameters)[1:]
    for name in ("generate", "async_generate"):
        params = inspect.signature(getattr(engine, name)).parameters
        has_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        missing = [a for a in want if a not in params and not has_kw]
        assert not missing, (name, missing)


def test_lora_path_without_adapters(engine):
    """No ``--lora-paths``: ``""`` and None are the base model; a name is refused naming the field,
    before anything is scheduled."""
    base = engine.generate(PROMPT, GREEDY)["text"]
    assert engine.generate(PROMPT, GREEDY, lora_path="")["text"] == base
    with pytest.raises(InvalidRequestError) as e:
        engine.generate(PROMPT, GREEDY, lora_path="nope")
    assert e.value.field == "lora_path"
    assert _idle(engine)["available_tokens"] == engine.get_server_info()["max_total_tokens"]


def test_lora_path_over_http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        ok = c.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY, "lora_path": ""})
        bad = c.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY, "lora_path": "nope"})
    assert ok.status_code == 200, ok.text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path", bad.text


def test_single_output_shape(engine):
    out = engine.generate(PROMPT, GREEDY)
    assert isinstance(out, dict) and isinstance(out["text"], str)
    m = out["meta_info"]
    assert len(out["output_ids"]) == m["completion_tokens"] == 10
    assert m["prompt_tokens"] == len(engine.tokenizer.encode(PROMPT))
    assert m["finish_reason"] == {"type": "length", "length": 10}
    for key in ("id", "cached_tokens", "e2e_latency", "ttft"):
        assert key in m, key


def test_batch_in_order_and_rids(engine):
    prompts = ["a b c", "a much longer prompt than the first", "mid size"]
    outs = engine.generate(prompts, [dict(GREEDY, max_new_tokens=k) for k in (2, 3, 4)], rid="cb")
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(engine.tokenizer.encode(p)) for p in prompts]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [2, 3, 4]
    assert [o["meta_info"]["id"] for o in outs] == ["cb-0", "cb-1", "cb-2"]


def test_n_samples_ids_and_seeds(engine):
    outs = engine.generate(PROMPT, dict(SAMPLED, n=3), rid="cn")
    assert isinstance(outs, list) and len(outs) == 3
    assert [o["meta_info"]["id"] for o in outs] == [sample_rid("cn", j) for j in range(3)]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    for j, o in enumerate(outs):  # sample j is the single request seeded with sample_seed(seed, j)
        alone = engine.generate(PROMPT, dict(SAMPLED, sampling_seed=sample_seed(SAMPLED["sampling_seed"], j)))
        assert alone["output_ids"] == o["output_ids"] and alone["text"] == o["text"]


def test_stop_string_trimmed(engine):
    text = engine.generate(PROMPT, dict(GREEDY, max_new_tokens=24))["text"]
    stop = text[3:6]
    assert len(stop) == 3
    out = engine.generate(PROMPT, dict(GREEDY, max_new_tokens=24, stop=[stop]))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[:text.index(stop)]


def test_logprob_layout(engine):
    out = engine.generate(PROMPT, GREEDY, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    m = out["meta_info"]
    assert [e[1] for e in m["output_token_logprobs"]] == out["output_ids"]
    assert all(len(e) == 3 and e[0] <= 0 for e in m["output_token_logprobs"])
    assert len(m["input_token_logprobs"]) == m["prompt_tokens"] and m["input_token_logprobs"][0][0] is None
    assert len(m["output_top_logprobs"]) == 10 and all(len(t) == 2 for t in m["output_top_logprobs"])


@pytest.mark.parametrize("n", [1, 2])
def test_streams_cumulative_and_incremental_agree(engine, n):
    p = dict(GREEDY, n=n)
    kw = dict(return_logprob=True, top_logprobs_num=1)
    final = engine.generate(PROMPT, p, **kw)
    finals = final if n > 1 else [final]
    cum = list(engine.generate(PROMPT, p, stream=True, **kw))
    inc = list(engine.generate(PROMPT, p, stream=True, incremental=True, **kw))
    for events in (cum, inc):
        assert ("index" in events[0]) == (n > 1)
        assert sum(e["meta_info"]["finish_reason"] is not None for e in events) == n
    for j in range(n):
        mine = [e for e in cum if e.get("index", 0) == j]
        texts = [e["text"] for e in mine]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "cumulative text went backwards"
        assert mine[-1]["text"] == finals[j]["text"] and mine[-1]["output_ids"] == finals[j]["output_ids"]
        assert mine[-1]["meta_info"]["output_token_logprobs"] == finals[j]["meta_info"]["output_token_logprobs"]
        deltas = [e for e in inc if e.get("index", 0) == j]
        assert "".join(e["text"] for e in deltas) == finals[j]["text"]
        assert [t for e in deltas for t in e["output_ids"]] == finals[j]["output_ids"]
        assert [x for e in deltas for x in e["meta_info"]["output_token_logprobs"]] == \
            finals[j]["meta_info"]["output_token_logprobs"]


def test_async_generate(engine):
    async def main():
        out = await engine.async_generate(PROMPT, GREEDY)
        it = await engine.async_generate(PROMPT, GREEDY, stream=True, incremental=True)
        pieces = [ev["text"] async for ev in it]
        return out, pieces
    out, pieces = asyncio.run(main())
    assert "".join(pieces) == out["text"]


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs,field", [
    (dict(prompt=PROMPT, sampling_params={"temperature": -1}), "temperature"),
    (dict(prompt=PROMPT, sampling_params={"max_new_tokenz": 1}), "max_new_tokenz"),
    (dict(prompt=""), "text"),
    (dict(prompt=PROMPT, input_ids=[1]), "text"),
    (dict(input_ids=[1, 10 ** 9]), "input_ids"),
    (dict(prompt=PROMPT, return_logprob=True, top_logprobs_num=50), "top_logprobs_num"),
    (dict(prompt=["a", "b"], sampling_params=[{}]), "sampling_params"),
    (dict(prompt=["a", "b"], rid=["x"]), "rid"),
])
def test_bad_input_names_the_field(engine, kwargs, field):
    with pytest.raises(ValueError) as ei:
        engine.generate(**kwargs)
    assert field in str(ei.value)


def test_too_long_is_capacity_error(engine):
    ctx = engine.model_info()["context_length"]
    with pytest.raises(CapacityError, match="max_new_tokens"):
        engine.generate(PROMPT, {"max_new_tokens": ctx})


def _long_stream(engine, rid):
    it = engine.generate(PROMPT, {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True},
                         stream=True, rid=rid)
    first = next(it)
    assert first["meta_info"]["finish_reason"] is None
    return it


def test_duplicate_rid_in_flight_refused_and_abort(engine):
    it = _long_stream(engine, "c-dup")
    with pytest.raises(InvalidRequestError, match="rid"):
        engine.generate(PROMPT, GREEDY, rid="c-dup")
    assert engine.flush_cache() is False  # refused while a request runs
    engine.abort("c-dup")
    last = list(it)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 300
    info = _idle(engine)
    assert info["available_tokens"] == info["max_total_tokens"]
    assert engine.flush_cache() is True


def test_abort_reaches_every_sample(engine):
    res = {}
    t = threading.Thread(target=lambda: res.update(out=engine.generate(
        PROMPT, {"max_new_tokens": 300, "ignore_eos": True, "n": 2}, rid="c-n")))
    t.start()
    deadline = time.monotonic() + 20
    while engine.get_server_info()["running_requests"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.abort("c-n")
    t.join(60)
    assert [o["meta_info"]["finish_reason"]["type"] for o in res["out"]] == ["abort", "abort"]
    _idle(engine)


def test_cache_prefix(engine):
    engine.flush_cache()
    prefix = "a shared system prompt that several requests start with, " * 3
    info = engine.cache_prefix(prefix)
    n = len(engine.tokenizer.encode(prefix))
    assert info == {"prompt_tokens": n, "cached_tokens": 0}
    again = engine.cache_prefix(prefix)
    assert again["prompt_tokens"] == n and again["cached_tokens"] == n - 1
    out = engine.generate(prefix + "and then more", GREEDY)
    assert out["meta_info"]["cached_tokens"] >= n - 2  # a merge at the boundary may cost a token
    with pytest.raises(InvalidRequestError):
        engine.cache_prefix(["a", "b"])


# ----------------------------------------------------------------------------- one owner for n > 1
def test_seeded_n_samples_same_in_python_and_over_http(engine, server):
    body_sp = dict(SAMPLED, n=3)
    py = engine.generate(PROMPT, body_sp)
    native = httpx.post(server.url + "/generate", json={"text": PROMPT, "sampling_params": body_sp},
                        timeout=60).json()
    assert [o["output_ids"] for o in native] == [o["output_ids"] for o in py]
    assert [o["text"] for o in native] == [o["text"] for o in py]
    oa = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": PROMPT, "n": 3, "max_tokens": SAMPLED["max_new_tokens"], "temperature": SAMPLED["temperature"],
        "seed": SAMPLED["sampling_seed"], "ignore_eos": True}).json()
    assert [c["text"] for c in sorted(oa["choices"], key=lambda c: c["index"])] == [o["text"] for o in py]
    chat_msgs = [{"role": "user", "content": PROMPT}]
    chat_prompt = engine.apply_chat_template(chat_msgs)
    py_chat = engine.generate(chat_prompt, body_sp)
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": chat_msgs, "n": 3, "max_tokens": SAMPLED["max_new_tokens"],
        "temperature": SAMPLED["temperature"], "seed": SAMPLED["sampling_seed"], "ignore_eos": True}).json()
    assert [c["message"]["content"] for c in sorted(chat["choices"], key=lambda c: c["index"])] == \
        [o["text"] for o in py_chat]


def test_seeded_n_samples_stream_same_as_python(engine, server):
    py = engine.generate(PROMPT, dict(SAMPLED, n=2))
    texts = {}
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "prompt": PROMPT, "n": 2, "max_tokens": SAMPLED["max_new_tokens"], "temperature": 1.0,
            "seed": SAMPLED["sampling_seed"], "ignore_eos": True, "stream": True}) as r:
        import json
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    assert [texts[j] for j in range(2)] == [o["text"] for o in py]
