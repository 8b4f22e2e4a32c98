"""Speculative decoding (issue 17): greedy output with speculation is token for token what the
engine without it gives, for NGRAM drafts (batched, penalties, stops, lengths, regex and JSON
schema, paged and chunked KV) and STANDALONE draft models (a tiny unrelated draft, self-speculation,
slow: the default model's quantized GGUF); bf16 with deterministic inference and (slow) the real
model in float32.

Oracle: the same engine without speculation (fp32, or bf16 with batch-invariant kernels), and the
KV manager's invariants after every step (``check_invariants``).
"""
import json

import pytest

from sglite import Engine
from tests.speculative.prompts import COPY_PROMPTS, SOURCE


def _ids(outs):
    return [o["output_ids"] for o in outs]


# ---------------------------------------------------------------------- NGRAM drafts
def test_greedy_identical_batched_plain(ngram_pair):
    base, spec = ngram_pair
    sp = {"max_new_tokens": 48, "temperature": 0}
    want, got = base.generate(COPY_PROMPTS, sp), spec.generate(COPY_PROMPTS, sp)
    assert _ids(got) == _ids(want)
    assert [g["text"] for g in got] == [w["text"] for w in want]
    assert [g["meta_info"]["finish_reason"] for g in got] == [w["meta_info"]["finish_reason"] for w in want]
    metas = [g["meta_info"] for g in got]
    assert sum(m["spec_accepted_tokens"] for m in metas) > 10  # drafts were really kept
    for m in metas:
        assert m["spec_verify_ct"] == sum(m["spec_accept_histogram"])
        assert m["spec_accepted_tokens"] == sum(a * c for a, c in enumerate(m["spec_accept_histogram"]))
    info = spec.get_server_info()
    assert info["spec_accepted_tokens"] > 10 and info["spec_draft_tokens"] >= info["spec_accepted_tokens"]
    assert info["spec_tree_steps"] > 0  # several n-gram candidates were verified as token trees
    # rejected slots went back: nothing but the tree holds KV now (check_invariants ran every step)
    assert info["available_tokens"] == info["max_total_tokens"]


def test_greedy_identical_with_penalties_stops_and_lengths(ngram_pair):
    base, spec = ngram_pair
    sps = [{"max_new_tokens": 30, "temperature": 0, "frequency_penalty": 0.5},
           {"max_new_tokens": 7, "temperature": 0, "repetition_penalty": 1.3},
           {"max_new_tokens": 40, "temperature": 0, "stop": [" lazy"], "min_new_tokens": 3},
           {"max_new_tokens": 2, "temperature": 0}]
    want, got = base.generate(COPY_PROMPTS, sps), spec.generate(COPY_PROMPTS, sps)
    assert _ids(got) == _ids(want)
    assert [g["text"] for g in got] == [w["text"] for w in want]


def test_greedy_identical_regex_and_json_schema(ngram_pair):
    base, spec = ngram_pair
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"enum": ["ab", "abab"]},
                                                        "maxItems": 6}},
              "required": ["name", "tags"], "additionalProperties": False}
    prompts = ["abab abab abab ab", "name tags ab abab ab abab"]
    sps = [{"max_new_tokens": 40, "temperature": 0, "regex": r"(ab ){2,8}(abab|ba)"},
           {"max_new_tokens": 60, "temperature": 0, "json_schema": json.dumps(schema)}]
    want, got = base.generate(prompts, sps), spec.generate(prompts, sps)
    assert _ids(got) == _ids(want)
    assert got[0]["meta_info"]["spec_accepted_tokens"] > 0  # drafts walked through the regex were kept
    if got[1]["meta_info"]["finish_reason"]["type"] == "stop":
        json.loads(got[1]["text"])  # still valid under the schema's grammar


def test_greedy_identical_paged_and_chunked(tiny_model_dir):
    kw = dict(dtype="float32", device="cpu", max_total_tokens=2048, check_invariants=True, page_size=4,
              chunked_prefill_size=16)
    prompts = [p * 2 for p in COPY_PROMPTS]
    sp = {"max_new_tokens": 33, "temperature": 0}
    base = Engine(str(tiny_model_dir), **kw)
    want = base.generate(prompts, sp)
    base.shutdown()
    spec = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", **kw)
    got = spec.generate(prompts, sp)
    info = spec.get_server_info()
    spec.shutdown()
    assert _ids(got) == _ids(want)
    assert info["spec_accepted_tokens"] > 0 and info["available_tokens"] == info["max_total_tokens"]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_greedy_identical_with_a_quantized_kv_cache(tiny_model_dir, kind):
    """int8 / int4 KV (KIVI key groups of 16 here): a group is quantized when a step stores its last
    position, and positions past it overwrite its full-precision residual, so drafts stop short of
    their group's last position. Greedy output is then the plain int KV engine's, token for token,
    over outputs that cross many groups with drafts accepted and rejected."""
    kw = dict(dtype="float32", device="cpu", max_total_tokens=4096, check_invariants=True,
              kv_cache_dtype=kind, kv_cache_quant_group_size=16)
    prompts = [p * 2 for p in COPY_PROMPTS]
    sp = {"max_new_tokens": 70, "temperature": 0}
    base = Engine(str(tiny_model_dir), **kw)
    want = base.generate(prompts, sp)
    base.shutdown()
    spec = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", speculative_num_draft_tokens=6, **kw)
    try:
        assert spec.scheduler.spec.key_group == 16
        got = spec.generate(prompts, sp)
        assert _ids(got) == _ids(want)
        info = spec.get_server_info()
        assert info["spec_accepted_tokens"] > 10 and info["spec_draft_tokens"] > info["spec_accepted_tokens"]
        assert info["available_tokens"] == info["max_total_tokens"]
    finally:
        spec.shutdown()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_start_up_probe_runs_on_a_quantized_kv_cache(tiny_model_dir, kind):
    """The draft policy's start-up probe (tests replace it, tests/conftest.py) writes K/V for
    positions p on slots p + page_size: each position keeps its offset in its page, which an
    int8 / int4 pool's key groups need (slot p + 1 made the quantized decode refuse the step)."""
    from sglite.runtime.speculative.policy import PROBE_CONTEXT, probe_forward

    with Engine(str(tiny_model_dir), dtype="float32", device="cpu", max_total_tokens=4096, kv_cache_dtype=kind,
                kv_cache_quant_group_size=16) as eng:
        kv = eng.scheduler.kv
        fwd = probe_forward(eng.runner, kv, rows=(1, 4, 9), reps=1)
        assert sorted(fwd) == [1, 4, 9] and min(fwd.values()) > 0
        assert kv.req_pool.available() == kv.req_to_token.shape[0] and not kv.req_to_token.any()
        with kv.probe_row(PROBE_CONTEXT) as row:
            assert kv.req_to_token[row, :3].tolist() == [16, 17, 18]
        want = eng.generate("Once upon a time", {"max_new_tokens": 8, "temperature": 0})["output_ids"]
    with Engine(str(tiny_model_dir), dtype="float32", device="cpu", max_total_tokens=4096, kv_cache_dtype=kind,
                kv_cache_quant_group_size=16) as fresh:  # the probe left nothing behind that changes outputs
        assert fresh.generate("Once upon a time", {"max_new_tokens": 8, "temperature": 0})["output_ids"] == want


def test_drafts_stop_short_of_a_key_groups_last_position():
    from types import SimpleNamespace

    from sglite.runtime.speculative.decoder import SpecDecoder

    dec = SpecDecoder.__new__(SpecDecoder)
    dec.kv = SimpleNamespace(req_pool=SimpleNamespace(max_context=4096))
    req = SimpleNamespace(params=SimpleNamespace(max_new_tokens=500), output_ids=[])
    for key_group, start, n, room in [(None, 40, 1, 499), (16, 40, 1, 6), (16, 46, 1, 0), (16, 47, 1, 15),
                                      (16, 44, 2, 1), (128, 0, 1, 126)]:
        dec.key_group = key_group
        assert dec._forced_room(SimpleNamespace(req=req, start=start, n=n)) == room, (key_group, start, n)


# ---------------------------------------------------------------------- bf16, deterministic inference
@pytest.mark.slow
def test_greedy_identical_bf16_deterministic(tiny_model_dir):
    """With ``enable_deterministic_inference`` a verify row is computed exactly as a decode row
    (batch-invariant kernels), so greedy output is identical in bf16 too."""
    kw = dict(dtype="bfloat16", device="cpu", max_total_tokens=2048, enable_deterministic_inference=True)
    sp = {"max_new_tokens": 40, "temperature": 0}
    base = Engine(str(tiny_model_dir), **kw)
    want = _ids(base.generate(COPY_PROMPTS, sp))
    base.shutdown()
    spec = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", **kw)
    try:
        got = spec.generate(COPY_PROMPTS, sp)
        assert _ids(got) == want
        assert spec.get_server_info()["spec_accepted_tokens"] > 0
    finally:
        spec.shutdown()


@pytest.mark.slow
def test_bf16_deterministic_greedy_identical_regex_and_json(tiny_model_dir):
    """bf16 with ``enable_deterministic_inference``: plain, regex and JSON-schema requests batched
    together give the same tokens with and without speculation (text drafts and the lazy grammar
    walk included)."""
    kw = dict(dtype="bfloat16", device="cpu", max_total_tokens=2048, enable_deterministic_inference=True)
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "city"],
              "properties": {"name": {"type": "string", "maxLength": 20}, "city": {"type": "string", "maxLength": 20}}}
    prompts = ["alpha beta gamma delta alpha beta gamma delta alpha beta", "abab abab abab ab",
               SOURCE + ' {"name":"Maria Gonzalez","city":"Seville"} again:']
    sps = [{"max_new_tokens": 30, "temperature": 0},
           {"max_new_tokens": 30, "temperature": 0, "regex": r"(ab ){2,8}(abab|ba)"},
           {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(schema)}]
    base = Engine(str(tiny_model_dir), **kw)
    want = [o["output_ids"] for o in base.generate(prompts, sps)]
    base.shutdown()
    spec = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", **kw)
    try:
        got = spec.generate(prompts, sps)
        assert [o["output_ids"] for o in got] == want
        assert [spec.generate(p, s)["output_ids"] for p, s in zip(prompts, sps)] == want
        assert spec.get_server_info()["spec_accepted_tokens"] > 0
    finally:
        spec.shutdown()


# ---------------------------------------------------------------------- STANDALONE draft model
def test_standalone_draft_model_greedy_identical(tiny_model_dir, tmp_path):
    from sglite.testing import make_tiny_llama

    other = make_tiny_llama(tmp_path / "draft", seed=3, num_hidden_layers=1, vocab_from=tiny_model_dir)
    kw = dict(dtype="float32", device="cpu", max_total_tokens=2048, check_invariants=True)
    sp = {"max_new_tokens": 24, "temperature": 0}
    prompts = COPY_PROMPTS[:3]
    base = Engine(str(tiny_model_dir), **kw)
    want = _ids(base.generate(prompts, sp))
    base.shutdown()
    for draft, min_len in ((tiny_model_dir, 3.0), (other, 1.0)):  # self-speculation, an unrelated draft
        e = Engine(str(tiny_model_dir), speculative_algorithm="STANDALONE", speculative_draft_model_path=str(draft),
                   speculative_num_steps=4, **kw)
        try:
            got = e.generate(prompts, sp)
            assert _ids(got) == want
            assert all(g["meta_info"]["spec_verify_ct"] > 0 for g in got)
            assert min(g["meta_info"]["spec_accept_length"] for g in got) >= min_len
            # retire requests: the draft's KV is freed lazily at the next draft, so run one more
            e.generate(prompts[0], {"max_new_tokens": 3, "temperature": 0})
            d = e.scheduler.spec.draft_model
            held = sum(len(st.slots) for _, st in d.states.values())
            assert d.runner.token_to_kv_pool.free_tokens() + held == d.runner.token_to_kv_pool.capacity
        finally:
            e.shutdown()


@pytest.mark.slow
def test_self_speculation_with_the_quantized_gguf_as_draft(real_checkpoint):
    """STANDALONE self-speculation: the default model's GGUF, kept quantized (Q4/Q8 blocks), drafts
    for the same model dequantized (``quantization="none"``, float32). Greedy output equals the
    target's own (requests with logprobs are never drafted: the same engine's baseline) and the
    quantized copy's drafts are mostly kept."""
    from sglite.kernels.quant_linear import QuantLinearWeight

    e = Engine(dtype="float32", quantization="none", max_total_tokens=8192, check_invariants=True,
               speculative_algorithm="STANDALONE", speculative_draft_model_path=real_checkpoint.source,
               speculative_num_steps=4)
    try:
        draft, target = e.scheduler.spec.draft_model.runner.model, e.runner.model
        assert isinstance(draft.embed, QuantLinearWeight)  # the draft really runs the quantized blocks
        assert not isinstance(target.embed, QuantLinearWeight)
        prompts = [e.apply_chat_template([{"role": "user", "content": m}])
                   for m in ("Why is the sky blue?", "Write a haiku about autumn leaves.")]
        sp = {"max_new_tokens": 32, "temperature": 0}
        want = [e.generate(p, sp, return_logprob=True)["output_ids"] for p in prompts]
        got = e.generate(prompts, sp)
        assert [g["output_ids"] for g in got] == want
        assert min(g["meta_info"]["spec_accept_length"] for g in got) > 1.5
    finally:
        e.shutdown()


# ---------------------------------------------------------------------- the real model (fp32)
@pytest.mark.slow
def test_real_model_greedy_identical(real_engine):
    """SmolLM2-135M in float32: copy-heavy, regex and JSON-schema requests, batched, give the
    same tokens with NGRAM speculation as without; drafts are really kept."""
    from sglite.bench.spec import PARAGRAPH, PERSON_SCHEMA, SENTENCES_SCHEMA, TEXTS

    spec = Engine(dtype="float32", max_total_tokens=16384, speculative_algorithm="NGRAM", check_invariants=True)
    try:
        chat = lambda m: spec.apply_chat_template([{"role": "user", "content": m}])  # noqa: E731
        prompts = [chat("Rewrite this paragraph exactly, changing 'Tuesday' to 'Friday'.\n\n" + PARAGRAPH),
                   chat("Tom Becker lives in Hamburg and works as a bus driver. Reach him at t.becker@example.org. "
                        "Extract his name, email, city and job as JSON."),
                   chat("Give the date of the meeting in the form YYYY-MM-DD: the meeting is on 2024-03-15."),
                   chat("Why is the sky blue?"),
                   chat(TEXTS[1] + "\n\nCopy the first sentence and the last sentence of this text, word for word, "
                        "into JSON.")]
        sps = [{"max_new_tokens": 64, "temperature": 0},
               {"max_new_tokens": 64, "temperature": 0, "json_schema": json.dumps(PERSON_SCHEMA)},
               {"max_new_tokens": 16, "temperature": 0, "regex": r"\d{4}-\d{2}-\d{2}"},
               {"max_new_tokens": 48, "temperature": 0},
               {"max_new_tokens": 80, "temperature": 0, "json_schema": json.dumps(SENTENCES_SCHEMA)}]
        want = real_engine.generate(prompts, sps)
        got = spec.generate(prompts, sps)
        assert _ids(got) == _ids(want)
        assert got[0]["meta_info"]["spec_accept_length"] > 2.0  # copying is drafted well
        assert got[1]["meta_info"]["spec_accepted_tokens"] > 0  # grammar-walked drafts kept
        json.loads(got[1]["text"])
        # copied sentences: after a refused close the copy goes on past word boundaries
        assert got[4]["meta_info"]["spec_accept_length"] > 2.5, got[4]["meta_info"]
        one = [spec.generate(p, s) for p, s in zip(prompts[:2], sps[:2])]  # batch 1 too
        assert _ids(one) == _ids(want[:2])
    finally:
        spec.shutdown()
