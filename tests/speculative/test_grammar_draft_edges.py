"""Edge cases of speculative decoding with grammar-forced drafts (issue 17 follow-up: jump-forward
text appended to draft chains as ``FORCED`` tokens, copied JSON values closed with ``CLOSE``).

Invariant pinned here: greedy output with speculation is token for token (and text and finish
reason) what the engine without it gives in float32, for request shapes that put forced text in
awkward places: at the very end of the output, inside a stop string, cut by ``max_new_tokens``,
under penalties / ``logit_bias`` / ``min_new_tokens`` / ``ignore_eos``, in batches mixed with plain
and logprob requests, streamed, aborted; and with ``STANDALONE`` draft models (whose chains the
walk cuts or closes: regression of a crash, see ``test_standalone_json_requests_greedy_identical``).

Drafts come from an oracle (the plain run's own next tokens, so every forced and closing token is
verified inside the chains) and from the real n-gram drafter.
"""
import contextlib
import json
import re

import pytest

from sglite import Engine
from sglite.testing import oracle_drafts

S1 = {"type": "object", "additionalProperties": False, "required": ["name", "city"],
      "properties": {"name": {"type": "string", "maxLength": 20}, "city": {"type": "string", "maxLength": 20}}}
NEST = {"type": "object", "required": ["p", "tags", "kind", "v"], "additionalProperties": False,
        "properties": {"p": {"type": "object", "required": ["a", "b"], "additionalProperties": False,
                             "properties": {"a": {"type": "string", "maxLength": 8}, "b": {"type": "integer"}}},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
                       "kind": {"enum": ["alpha beta", "gamma", "delta epsilon zeta"]},
                       "v": {"const": "fixed value here"},
                       "opt": {"type": "string", "maxLength": 5}}}
OPEN = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "maxLength": 10}}}
GRAMMARS = {
    "schema": {"json_schema": json.dumps(S1)},
    "nested": {"json_schema": json.dumps(NEST)},  # nested object, array of strings, enum, const, optional
    "open": {"json_schema": json.dumps(OPEN)},  # additionalProperties open
    "ends_forced": {"regex": r"(yes|no)! (red|blue) and that is the end of the story\."},  # terminates right after forced text
    "ebnf": {"ebnf": 'root ::= "Answer: " ("red" | "blue") " fox jumps over the lazy dog " [a-z]{1,4} " end"'},
}
PROMPTS = ["Tom Becker lives in Hamburg. JSON:", "Maria Gonzalez lives in Seville. JSON:"]
KW = dict(dtype="float32", device="cpu", max_total_tokens=4096, check_invariants=True)


def _summary(outs):
    return [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"]) for o in outs]


def _by_prompt(engine, prompts, outs) -> dict:
    """``{prompt ids: output ids}`` of plain-run outputs, for :func:`sglite.testing.oracle_drafts`."""
    return {tuple(engine.tokenizer.encode(p)): o["output_ids"] for p, o in zip(prompts, outs)}


def _same(base, spec, prompts, sps, oracle=True, **gen_kw):
    """Generate on both engines (``spec`` with oracle drafts when ``oracle``) and assert the same
    ids, text and finish reason; returns the plain outputs."""
    want = base.generate(prompts, sps, **gen_kw)
    if oracle:
        with oracle_drafts(spec, _by_prompt(spec, prompts, want), 6):
            got = spec.generate(prompts, sps, **gen_kw)
    else:
        got = spec.generate(prompts, sps, **gen_kw)
    assert _summary(got) == _summary(want)
    spec.check_invariants()
    return want


# ---------------------------------------------------------------------- grammar shapes x params
@pytest.mark.parametrize("grammar", sorted(GRAMMARS))
@pytest.mark.parametrize("extra", [pytest.param({}, id="plain")] + [  # the sampling params: slow tier
    pytest.param(x, id=i, marks=pytest.mark.slow) for x, i in (
        ({"frequency_penalty": 0.5, "presence_penalty": 0.3}, "freq_pres"), ({"repetition_penalty": 1.3}, "rep"),
        ({"min_new_tokens": 12}, "min_new"), ({"ignore_eos": True}, "ignore_eos"),
        ({"logit_bias": {"90": 5.0, "28": -3.0}}, "bias"))])
def test_grammar_shapes_and_params_greedy_identical(ngram_pair, grammar, extra):
    base, spec = ngram_pair
    for mt in (13, 40):
        sps = [dict(max_new_tokens=mt, temperature=0, **GRAMMARS[grammar], **extra)] * 2
        _same(base, spec, PROMPTS, sps, oracle=True)
        _same(base, spec, PROMPTS, sps, oracle=False)


def test_forced_text_is_verified_at_the_end_of_the_output(ngram_pair):
    """The regex terminates right after the forced sentence: the forced tail is kept as drafts,
    the request stops on grammar termination (no bonus token past the end)."""
    base, spec = ngram_pair
    before = spec.scheduler.spec.stats["spec_forced_tokens"]
    want = _same(base, spec, PROMPTS, [dict(max_new_tokens=40, temperature=0, **GRAMMARS["ends_forced"])] * 2)
    assert all(o["text"].endswith("end of the story.") and o["meta_info"]["finish_reason"]["type"] == "stop"
               for o in want)
    assert spec.scheduler.spec.stats["spec_forced_tokens"] > before


@pytest.mark.parametrize("oracle", [True, False], ids=["oracle", "ngram"])
def test_max_new_tokens_ending_inside_or_right_after_forced_text(ngram_pair, oracle):
    base, spec = ngram_pair
    for mt in range(2, 24):
        _same(base, spec, PROMPTS, [dict(max_new_tokens=mt, temperature=0, **GRAMMARS["nested"])] * 2, oracle)


@pytest.mark.parametrize("stop", ['"city', 'city":', '":"', ',"', "ity"])
def test_stop_strings_inside_forced_text(ngram_pair, stop):
    base, spec = ngram_pair
    for no_trim in (False, True):
        sps = [dict(max_new_tokens=40, temperature=0, stop=[stop], no_stop_trim=no_trim, **GRAMMARS["schema"])] * 2
        want = _same(base, spec, PROMPTS, sps)
        assert all(o["meta_info"]["finish_reason"].get("matched") == stop for o in want)


def test_mixed_batch_grammar_plain_and_logprob(ngram_pair):
    base, spec = ngram_pair
    prompts = PROMPTS + ["hello there, tell a story"]
    sps = [dict(max_new_tokens=30, temperature=0, **GRAMMARS["schema"]), dict(max_new_tokens=30, temperature=0),
           dict(max_new_tokens=30, temperature=0, **GRAMMARS["nested"])]
    _same(base, spec, prompts, sps)
    _same(base, spec, prompts, sps, oracle=False)
    # logprob requests are never drafted and take no jump-forward: same output, logprobs included
    want = base.generate(prompts, sps, return_logprob=True)
    got = spec.generate(prompts, sps, return_logprob=True)
    assert _summary(got) == _summary(want)
    for g, w in zip(got, want):
        gl, wl = g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"]
        assert [x[1] for x in gl] == [x[1] for x in wl]
        assert [x[0] for x in gl] == pytest.approx([x[0] for x in wl], abs=1e-4)


def test_streaming_forced_drafts_end_where_the_plain_run_ends(ngram_pair):
    base, spec = ngram_pair
    sps = [dict(max_new_tokens=40, temperature=0, **GRAMMARS["nested"])] * 2
    want = [o["output_ids"] for o in base.generate(PROMPTS, sps)]
    last = {}
    for chunk in spec.generate(PROMPTS, sps, stream=True):
        last[chunk.get("index", 0)] = chunk
    assert sorted(c["output_ids"] for c in last.values()) == sorted(want)
    spec.check_invariants()


def test_abort_mid_request_frees_everything_and_keeps_serving(ngram_pair):
    base, spec = ngram_pair
    sp = dict(max_new_tokens=60, temperature=0, ignore_eos=True, **GRAMMARS["nested"])
    n = 0
    for chunk in spec.generate(PROMPTS[0], sp, stream=True, rid="brk-abort"):
        n += 1
        if n == 3:
            spec.abort("brk-abort")
    assert chunk["meta_info"]["finish_reason"]["type"] in ("abort", "stop", "length")
    spec.check_invariants()
    _same(base, spec, PROMPTS, [dict(max_new_tokens=30, temperature=0, **GRAMMARS["schema"])] * 2)


def test_bad_grammar_input_then_keeps_serving(ngram_pair):
    from sglite.errors import SgliteError

    base, spec = ngram_pair
    with pytest.raises(SgliteError):
        spec.generate(PROMPTS[0], dict(max_new_tokens=8, json_schema="{not json"))
    _same(base, spec, PROMPTS, [dict(max_new_tokens=24, temperature=0, **GRAMMARS["schema"])] * 2)


# ---------------------------------------------------------------------- STANDALONE draft model
def test_standalone_json_requests_greedy_identical(ngram_pair, tiny_model_dir):
    """Regression: a STANDALONE draft whose chain the grammar walk cut short (closed a copied
    value with ``"`` at a word boundary, or ended before a token that forces text) left the draft
    model's KV covering the token the target then chose (its own draft token, refused only because
    the chain had been changed): the next draft forward had no token to compute and the step
    raised (``torch.cat(): expected a non-empty list``), aborting every request of the batch.
    Fixed in ``DraftModel._rewind`` (the last token of the sequence is always recomputed)."""
    base, _ = ngram_pair
    e = Engine(str(tiny_model_dir), speculative_algorithm="STANDALONE", speculative_draft_model_path=str(tiny_model_dir),
               speculative_num_steps=4, **KW)
    try:
        for g in ("schema", "nested"):
            sps = [dict(max_new_tokens=40, temperature=0, **GRAMMARS[g])] * 2
            want = base.generate(PROMPTS, sps)
            got = e.generate(PROMPTS, sps)
            assert _summary(got) == _summary(want)
            got = [e.generate(p, s) for p, s in zip(PROMPTS, sps)]
            assert _summary(got) == _summary(want)
        assert e.scheduler.spec.stats["spec_forced_tokens"] > 0
        e.check_invariants()
    finally:
        e.shutdown()


# ---------------------------------------------------------------------- engine options
@pytest.mark.slow
@pytest.mark.parametrize("opts", [{"enable_jump_forward": False}, {"page_size": 4}, {"chunked_prefill_size": 8}],
                         ids=["no_jump_forward", "page4", "chunked8"])
def test_engine_options_greedy_identical(tiny_model_dir, opts):
    base = Engine(str(tiny_model_dir), **KW, **opts)
    spec = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", speculative_num_draft_tokens=6, **KW, **opts)
    try:
        for g in sorted(GRAMMARS):
            for extra in ({}, {"frequency_penalty": 0.5}, {"min_new_tokens": 6}):
                for mt in (7, 40):
                    sps = [dict(max_new_tokens=mt, temperature=0, **GRAMMARS[g], **extra)] * 2
                    _same(base, spec, PROMPTS, sps, oracle=True)
                    _same(base, spec, PROMPTS, sps, oracle=False)
        if opts.get("enable_jump_forward") is False:
            assert spec.scheduler.spec.stats["spec_forced_tokens"] == 0
    finally:
        base.shutdown()
        spec.shutdown()


# ---------------------------------------------------------------------- sampling
ENUM_SCHEMA = json.dumps({"type": "object", "required": ["color", "size"], "additionalProperties": False,
                          "properties": {"color": {"enum": ["dark red", "light blue"]},
                                         "size": {"enum": ["very big", "small"]}}})
# the prompt's three examples make NGRAM draft across both values, forced key text included
ENUM_PROMPT = ('{"color":"dark red","size":"small"} {"color":"light blue","size":"very big"} '
               '{"color":"dark red","size":"very big"} ')
ENUM_DECISIONS = (('"color":"', "d"), ('"size":"', "s"))  # (text before the value, first letter of one value)


def _decision_z(model_dir, engine, outs) -> dict:
    from sglite.testing import decision_z

    grammar = engine.requests.grammar_backend.compile("json_schema", ENUM_SCHEMA)
    return decision_z(model_dir, engine.tokenizer, engine.tokenizer.encode(ENUM_PROMPT), outs, ENUM_DECISIONS, grammar)


def _enum_outputs(engine, n: int, seed0: int) -> list:
    sps = [{"max_new_tokens": 30, "temperature": 1.0, "sampling_seed": seed0 + i, "json_schema": ENUM_SCHEMA}
           for i in range(n)]
    return engine.generate([ENUM_PROMPT] * n, sps)


@pytest.mark.slow
def test_sampled_json_enums_match_the_model_with_forced_drafts(tiny_model_dir):
    """Sampled JSON enums under NGRAM with forced-text drafts (a draft runs through a value, its
    closing quote, the forced ``","size":"`` and the bonus token predicts the next value): each
    value's choice is distributed as the model says, given the tokens before it (z-test against the
    HF model, |z| < 4.5: a false failure about once in 150 000 runs).

    History: the fourth pass compared this engine's outputs with a plain engine's for the *same*
    seeds 5..1004 (chi-square homogeneity, p ~1e-5) and turned forced drafts off for sampled
    requests. Against the model's probabilities both engines were ~2.7 sigma off on that seed set,
    in opposite directions, and within noise on six other seed sets: two samples of one seed set
    are not independent draws, so the homogeneity test did not apply."""
    e = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", speculative_disable_by_batch_size=64,
               **dict(KW, max_total_tokens=8192))
    try:
        outs = _enum_outputs(e, 800, seed0=70_001)
        st = e.scheduler.spec.stats
        assert st["spec_forced_tokens"] > 100 and st["spec_accepted_tokens"] > st["spec_forced_tokens"], st
        z = _decision_z(tiny_model_dir, e, outs)
        assert all(abs(v) < 4.5 for v in z.values()), z
        e.check_invariants()
    finally:
        e.shutdown()


@pytest.mark.slow
def test_enum_decision_test_catches_a_biased_verifier(tiny_model_dir, monkeypatch):
    """The z-test above can fail: a verifier with the classic bug (on rejection, resample from
    ``p`` instead of ``p`` without the draft token, so a draft token is kept with probability
    ``p (2 - p)``) is caught on the same requests."""
    import torch

    import sglite.runtime.speculative.decoder as decoder
    from sglite.runtime.speculative.verify import target_probs

    def biased_chain(x, draft, params, draws=None, draft_probs=None, forced=()):
        generator = draws.generator(0, 0)
        p = target_probs(x, params)
        u = torch.rand(len(draft), generator=generator).tolist()
        for i, d in enumerate(draft):
            if i not in forced and u[i] >= float(p[i, d]):
                return list(draft[:i]) + [int(torch.multinomial(p[i], 1, generator=generator))], i
        return list(draft) + [int(torch.multinomial(p[len(draft)], 1, generator=generator))], len(draft)

    monkeypatch.setattr(decoder, "verify_chain", biased_chain)
    e = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", speculative_disable_by_batch_size=64,
               **dict(KW, max_total_tokens=8192))
    e.scheduler.kv.borrow_rows = lambda n: []  # chains only: every draft goes through biased_chain
    try:
        z = _decision_z(tiny_model_dir, e, _enum_outputs(e, 800, seed0=70_001))
        assert max(abs(v) for v in z.values()) > 4.5, z
    finally:
        e.shutdown()


# ---------------------------------------------------------------------- sampled sweep
VALID = {
    "schema": lambda t: set(json.loads(t)) == {"name", "city"},
    "nested": lambda t: (lambda d: d["v"] == "fixed value here" and d["kind"] in NEST["properties"]["kind"]["enum"]
                         and isinstance(d["p"]["b"], int) and len(d["tags"]) <= 3)(json.loads(t)),
    "open": lambda t: "name" in json.loads(t),
    "ends_forced": lambda t: re.fullmatch(GRAMMARS["ends_forced"]["regex"], t) is not None,
    "ebnf": lambda t: re.fullmatch(r"Answer: (red|blue) fox jumps over the lazy dog [a-z]{1,4} end", t) is not None,
}


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"frequency_penalty": 0.5, "presence_penalty": 0.3}, {"repetition_penalty": 1.3},
                                   {"min_new_tokens": 12, "top_p": 0.9}, {"top_k": 5, "logit_bias": {"90": 5.0}}],
                         ids=["plain", "freq_pres", "rep", "min_new_top_p", "top_k_bias"])
def test_sampled_grammar_requests_with_forced_drafts_stay_valid(ngram_pair, extra):
    """Sampled requests (temperature 0.3, seeded) under every grammar shape and sampling option,
    with forced-text drafts (drafts: the plain run's greedy output, often kept at this
    temperature, then the real NGRAM lookup): no step fails, every finished output is valid under
    its grammar, the pool checks hold after each batch, and forced tokens were verified."""
    base, spec = ngram_pair
    dec = spec.scheduler.spec
    before = dec.stats["spec_forced_tokens"]
    for g in sorted(GRAMMARS):
        greedy = base.generate(PROMPTS, [dict(max_new_tokens=80, temperature=0, **GRAMMARS[g], **extra)] * 2)
        sps = [dict(max_new_tokens=80, temperature=0.3, sampling_seed=100 + i, **GRAMMARS[g], **extra) for i in range(6)]
        for drafts in (oracle_drafts(spec, _by_prompt(spec, PROMPTS, greedy), 6), contextlib.nullcontext()):
            with drafts:
                outs = spec.generate(PROMPTS * 3, sps)
            reasons = [o["meta_info"]["finish_reason"]["type"] for o in outs]
            assert "abort" not in reasons, [o["meta_info"]["finish_reason"] for o in outs]
            done = [o["text"] for o, r in zip(outs, reasons) if r == "stop"]
            assert done and all(VALID[g](t) for t in done), (g, done)
            spec.check_invariants()
    assert dec.stats["spec_forced_tokens"] > before
