"""Speculative decoding (issue 17): n-gram drafts, exact verification, KV hygiene.

Oracles: greedy output token for token against the same engine without speculation (fp32), the
KV manager's invariants after every step (rejected draft slots freed, never in the tree), and
chi-square tests of the sampled distributions against the target's (tests that can fail: a
negative control with a wrong residual is rejected).
"""
import json

import pytest
import torch

from sglite import Engine
from sglite.errors import InvalidRequestError
from sglite.runtime.speculative import NgramIndex, target_probs, verify_chain
from sglite.sampling_params import SamplingParams
from sglite.testing import homogeneity_p

COPY_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown",
    "alpha beta gamma delta alpha beta gamma delta alpha beta",
    "1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3",
    "Write something new about the sea.",
]


def chi_square_p(counts, expected, n):
    """P-value of Pearson's chi-square test of ``counts`` (n draws) against ``expected``
    probabilities; categories with expected count < 5 are pooled into one."""
    small = [i for i, p in enumerate(expected) if 0 < n * p < 5]
    cats = [([i], expected[i]) for i, p in enumerate(expected) if n * p >= 5]
    if small:
        cats.append((small, sum(expected[i] for i in small)))
    stray = sum(counts[i] for i, p in enumerate(expected) if p == 0)
    assert stray == 0, f"{stray} draws of a token with target probability 0"
    stat = sum((sum(counts[i] for i in ids) - n * p) ** 2 / (n * p) for ids, p in cats)
    df = len(cats) - 1
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


# ---------------------------------------------------------------------- n-gram drafts
def test_ngram_index_proposes_the_latest_longest_match():
    idx = NgramIndex([5, 6, 7, 8, 1, 2, 5, 6, 9, 9, 5, 6])
    # "5 6" occurred twice before: the latest (followed by 9 9) comes first
    assert idx.propose(3, candidates=2) == [[9, 9, 5], [7, 8, 1]]
    idx.extend([7])  # "5 6 7": the 3-gram match wins over the later 1-gram "7"
    assert idx.propose(4) == [[8, 1, 2, 5]]
    assert NgramIndex([1, 2, 3]).propose(4) == []  # nothing repeats
    assert idx.propose(0) == []


def test_ngram_sync_indexes_only_new_tokens():
    seq = [3, 4, 5, 3, 4]
    idx = NgramIndex()
    idx.sync(len(seq), lambda a, b: seq[a:b])
    assert idx.propose(2) == [[5, 3]]
    seq += [5, 3]
    idx.sync(len(seq), lambda a, b: seq[a:b])
    assert idx.seq == seq and idx.propose(1) == [[4]]


# ---------------------------------------------------------------------- verification (unit)
def _params(**kw):
    return SamplingParams(**{"max_new_tokens": 8, **kw})


def test_greedy_verification_is_prefix_matching():
    x = torch.full((4, 10), -5.0)
    for row, tok in enumerate([3, 7, 1, 2]):
        x[row, tok] = 5.0
    assert verify_chain(x, [3, 7, 1], _params(temperature=0)) == ([3, 7, 1, 2], 3)  # all kept + bonus
    assert verify_chain(x, [3, 8, 1], _params(temperature=0)) == ([3, 7], 1)  # correction at row 1
    assert verify_chain(x, [4, 7, 1], _params(temperature=0)) == ([3], 0)


LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.4, -1.0, -2.0, 0.9],
                       [0.1, 1.9, -0.5, 1.2, 0.8, 0.3, 1.4, -1.5, 0.0, -0.2],
                       [1.0, 0.0, 0.5, -1.0, 2.0, 0.2, 0.4, 0.1, -0.3, 0.6]])

CASES = [  # temperature, top_k, top_p, min_p
    (0.5, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (1.5, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.2, 0, 0.8, 0.0),
    (0.8, 6, 0.9, 0.05),
]


def _run_chain(params, draft, n, draft_probs=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    first = [0] * LOGITS.shape[1]
    second = [0] * LOGITS.shape[1]
    n_second = 0
    for _ in range(n):
        toks, a = verify_chain(LOGITS, draft, params, gen, draft_probs)
        assert len(toks) == a + 1 and toks[:a] == draft[:a]
        first[toks[0]] += 1
        if toks[0] == draft[0]:
            second[toks[1]] += 1
            n_second += 1
    return first, second, n_second


@pytest.mark.parametrize("temp,top_k,top_p,min_p", CASES)
def test_speculative_sampling_matches_the_target_distribution(temp, top_k, top_p, min_p):
    """Token 1 is distributed as p_0 and token 2 (given token 1 = d_1) as p_1, whether the
    drafts were kept or resampled (Leviathan et al. 2023, Theorem 1)."""
    params = _params(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    p = target_probs(LOGITS, params)
    draft = [1, 3]  # likely but not top tokens: both acceptance and rejection happen
    n = 6000
    first, second, n_second = _run_chain(params, draft, n)
    assert 0 < first[draft[0]] < n  # both branches were taken
    assert chi_square_p(first, p[0].tolist(), n) > 1e-3, (first, p[0])
    assert chi_square_p(second, p[1].tolist(), n_second) > 1e-3, (second, p[1])


def test_sampled_drafts_use_min_one_p_over_q():
    """A draft drawn from a (wrong) distribution q still yields p (general q, Chen et al. Alg. 2)."""
    params = _params(temperature=1.0)
    p = target_probs(LOGITS, params)
    q = torch.softmax(LOGITS.flip(1)[:2], dim=-1)  # [2, V], far from p
    gen = torch.Generator().manual_seed(5)
    n, counts = 6000, [0] * LOGITS.shape[1]
    for _ in range(n):
        d = [int(torch.multinomial(q[0], 1, generator=gen)), int(torch.multinomial(q[1], 1, generator=gen))]
        toks, _ = verify_chain(LOGITS, d, params, gen, draft_probs=q)
        counts[toks[0]] += 1
    assert chi_square_p(counts, p[0].tolist(), n) > 1e-3


def test_chi_square_detects_a_biased_verifier(monkeypatch):
    """Negative control: resampling from p instead of the residual (p - q)+ after a rejection
    over-weights the draft token, and the test sees it."""
    import sglite.runtime.speculative.verify as V

    params = _params(temperature=1.0)
    p = target_probs(LOGITS, params)

    def biased(x, draft, params, generator=None, draft_probs=None):
        probs = target_probs(x, params)
        if float(torch.rand(1, generator=generator)) < float(probs[0, draft[0]]):
            return [draft[0], int(torch.multinomial(probs[1], 1, generator=generator))], 1
        return [int(torch.multinomial(probs[0], 1, generator=generator))], 0

    monkeypatch.setattr(V, "verify_chain", biased)
    gen = torch.Generator().manual_seed(1)
    n, counts = 6000, [0] * LOGITS.shape[1]
    for _ in range(n):
        counts[V.verify_chain(LOGITS, [1, 3], params, gen)[0][0]] += 1
    assert chi_square_p(counts, p[0].tolist(), n) < 1e-3


@pytest.mark.parametrize("temp,top_k,top_p,min_p", CASES[:3] + CASES[4:])
def test_target_probs_is_the_samplers_distribution(temp, top_k, top_p, min_p):
    """The distribution verification uses is the one ``kernels.sample`` draws from."""
    from sglite import kernels

    n, V = 6000, LOGITS.shape[1]
    params = _params(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    x = LOGITS[:1].repeat(n, 1)
    f = lambda v, dt: torch.full((n,), v, dtype=dt)  # noqa: E731
    got = kernels.sample(x, f(temp, torch.float32), f(top_p, torch.float32), f(top_k, torch.int64),
                         f(min_p, torch.float32), f(7, torch.int64), torch.arange(n), None)
    counts = torch.bincount(got, minlength=V).tolist()
    assert chi_square_p(counts, target_probs(LOGITS[:1], params)[0].tolist(), n) > 1e-3


# ---------------------------------------------------------------------- engine, greedy exactness
def _ids(outs):
    return [o["output_ids"] for o in outs]


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


def test_speculation_off_above_batch_size_and_for_logprobs(tiny_model_dir):
    e = Engine(str(tiny_model_dir), dtype="float32", device="cpu", max_total_tokens=4096,
               speculative_algorithm="NGRAM", speculative_disable_by_batch_size=2)
    try:
        out = e.generate(COPY_PROMPTS[:3], {"max_new_tokens": 12, "temperature": 0})
        assert all("spec_verify_ct" not in o["meta_info"] for o in out)  # 3 decoding > 2: never drafted
        one = e.generate(COPY_PROMPTS[0], {"max_new_tokens": 12, "temperature": 0}, return_logprob=True)
        assert "spec_verify_ct" not in one["meta_info"] and len(one["meta_info"]["output_token_logprobs"]) == 12
        one = e.generate(COPY_PROMPTS[0], {"max_new_tokens": 12, "temperature": 0})
        assert one["meta_info"]["spec_verify_ct"] > 0
    finally:
        e.shutdown()


def test_bad_speculative_options_name_the_field(tmp_path):
    from sglite.config import EngineConfig

    for kw, field in [({"speculative_algorithm": "EAGLE"}, "speculative_algorithm"),
                      ({"speculative_algorithm": "STANDALONE"}, "speculative_draft_model_path"),
                      ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(tmp_path / "x")},
                       "speculative_draft_model_path"),
                      ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens"),
                      ({"speculative_num_steps": 65}, "speculative_num_steps"),
                      ({"speculative_disable_by_batch_size": 0}, "speculative_disable_by_batch_size")]:
        with pytest.raises(InvalidRequestError) as ei:
            EngineConfig(**kw)
        assert ei.value.field == field


# ---------------------------------------------------------------------- KV and grammar units
def test_reserve_more_and_trim_free_rejected_pages():
    from sglite.runtime.kv_manager import KVManager
    from sglite.runtime.kv_pool import ReqToTokenPool, TokenToKVPool

    class R:
        rid, kv = "r", None

        def tokens(self, a, b):
            return list(range(a, b))

    kvm = KVManager(ReqToTokenPool(2, 64), TokenToKVPool(64, 4, 1, 1, 4, torch.float32), 4)
    r = R()
    prefix, node = kvm.match_prefix([])
    assert kvm.admit(r, prefix, node, 6)
    kvm.commit(r, 5, share=False)  # 5 computed, 1 reserved (the pending token)
    free0 = kvm.free_tokens()
    assert kvm.reserve_more(r, 7)  # drafts: alloc 6 -> 13 = pages 0..3
    assert r.kv.alloc_len == 13 and kvm.free_tokens() == free0 - 8
    kvm.commit(r, 3, share=False)  # pending + 2 accepted: kv_len 8
    kvm.trim(r)
    assert r.kv.alloc_len == 8 and kvm.free_tokens() == free0  # the pages of tokens 8..12 freed
    kvm.check_invariants([r])
    assert not kvm.reserve_more(r, 10_000)  # beyond the pool: refused, nothing reserved
    assert r.kv.alloc_len == 8
    kvm.release(r)
    kvm.check_invariants([])


class _Matcher:
    """A grammar allowing only tokens in ``allowed`` (rollback counted)."""

    def __init__(self, allowed):
        self.allowed, self.accepted = set(allowed), []

    def fill_next_token_bitmask(self, bitmask, row=0):
        bitmask[row].zero_()
        for t in self.allowed:
            bitmask[row, t // 32] |= 1 << (t % 32)

    def accept_token(self, t):
        if t not in self.allowed:
            return False
        self.accepted.append(t)
        return True

    def is_terminated(self):
        return False

    def rollback(self, n):
        del self.accepted[len(self.accepted) - n:]


def test_grammar_forbidden_draft_token_ends_the_draft():
    from sglite.runtime.sampler import Sampler
    from sglite.runtime.speculative.decoder import SpecDecoder
    from sglite.runtime.speculative.state import SpecState

    class Cfg:
        speculative_algorithm, speculative_num_draft_tokens, speculative_disable_by_batch_size = "NGRAM", 4, 8
        page_size = 1

    class Req:
        grammar, spec = _Matcher({1, 2, 3}), SpecState()

    dec = SpecDecoder(Cfg, None, Sampler(40, frozenset()), None)
    r = Req()
    chains, masks = dec.grammar_walk.walk(r, [[2, 3, 7, 1], [1, 1], [9]])
    assert chains == [[2, 3], [1, 1], []]  # 7 and 9 are forbidden: each chain ends before them
    assert r.grammar.accepted == []  # rolled back
    assert [m.shape[0] for m in masks] == [1, 2, 2, 0] and int(masks[0][0, 0]) == 0b1110


@pytest.mark.slow
@pytest.mark.parametrize("temp,top_k,top_p", [(0.3, 8, 1.0), (0.5, -1, 0.8)])
def test_engine_sampling_distribution_unchanged_by_speculation(tiny_model_dir, temp, top_k, top_p):
    """End to end on a tiny model: every sampled token, drafted and verified or not, is distributed
    as the model says given the tokens before it. The drafts are the greedy continuation (so they
    are often kept: with sampling, a draft token is kept with its probability); at each of the 4
    output positions the events "the token is the model's rank-r choice" (r = 0, 1) are tested
    against the HF model's probabilities with the request's temperature, top-k and top-p, given the
    realized context: ``sum(x - p) / sqrt(sum p (1 - p))`` ~ N(0, 1) for an exact sampler
    (martingale differences), |z| < 4.5.

    (Before session 5 this compared against a plain engine's outputs for the same seeds with a
    chi-square homogeneity test; samples drawn with shared seeds are not independent, and only 1 of
    ~330 drafts was kept, so it tested little.)"""
    from sglite.testing import martingale_z, oracle_drafter, sampling_oracle

    kw = dict(dtype="float32", device="cpu", max_total_tokens=8192)
    base = Engine(str(tiny_model_dir), **kw)
    spec = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", speculative_disable_by_batch_size=64, **kw)
    try:
        ids = base.tokenizer.encode("alpha beta gamma delta alpha beta")
        greedy = base.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0})["output_ids"]
        spec.scheduler.spec._ngram = oracle_drafter({tuple(ids): greedy}, 4)
        n = 500
        sps = [{"max_new_tokens": 4, "temperature": temp, "top_k": top_k, "top_p": top_p,
                "sampling_seed": 9_001 + i} for i in range(n)]
        outs = [o["output_ids"] for o in spec.generate(input_ids=[ids] * n, sampling_params=sps)]
        info = spec.get_server_info()
        assert info["spec_accepted_tokens"] > 60, {k: v for k, v in info.items() if k.startswith("spec_")}
    finally:
        base.shutdown()
        spec.shutdown()
    probs = sampling_oracle(tiny_model_dir, ids, temperature=temp, top_k=top_k, top_p=top_p)

    def event(o, pos, rank):  # (the drawn token has the rank-r probability, that probability)
        p = probs(tuple(o[:pos]))
        q = float(p.sort(descending=True).values[rank])
        return float(p[o[pos]]) == q, q

    for pos in range(4):
        for rank in (0, 1):
            z = martingale_z(event(o, pos, rank) for o in outs)
            assert abs(z) < 4.5, (pos, rank, z)


def test_homogeneity_test_detects_different_samples():
    a = {0: 300, 1: 200, 2: 100}
    assert homogeneity_p(a, {0: 310, 1: 190, 2: 100}) > 0.1
    assert homogeneity_p(a, {0: 200, 1: 200, 2: 200}) < 1e-3


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


# ---------------------------------------------------------------------- server: meta_info and /metrics
def test_meta_info_and_metrics_report_acceptance(tiny_model_dir):
    import httpx

    from sglite.server.runner import ServerThread
    from sglite.server.settings import ServerConfig

    eng = Engine(str(tiny_model_dir), dtype="float32", device="cpu", max_total_tokens=2048,
                 speculative_algorithm="NGRAM")
    try:
        with ServerThread(eng, ServerConfig(port=0, enable_metrics=True)) as srv:
            out = httpx.post(srv.url + "/generate", timeout=60, json={
                "text": COPY_PROMPTS[0], "sampling_params": {"max_new_tokens": 32, "temperature": 0}}).json()
            meta = out["meta_info"]
            assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] > 1.0
            text = httpx.get(srv.url + "/metrics").text
        counts = {ln.split()[0]: float(ln.split()[-1]) for ln in text.splitlines()
                  if ln.startswith("sglite_spec_accept_length")}
        assert counts["sglite_spec_accept_length_count"] == meta["spec_verify_ct"]
        assert counts["sglite_spec_accept_length_sum"] == meta["spec_verify_ct"] + meta["spec_accepted_tokens"]
        assert counts['sglite_spec_accept_length_bucket{le="1.0"}'] == meta["spec_accept_histogram"][0]
    finally:
        eng.shutdown()


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


# ---------------------------------------------------------------------- token trees
def _tree_rows():
    # root, chain 0 (tokens 1, 3), chain 1 (tokens 0, 2): one logits row per node
    return torch.stack([LOGITS[0], LOGITS[1], LOGITS[2], LOGITS[2].flip(0), LOGITS[1].flip(0)])


def test_tree_greedy_follows_the_argmax_branch():
    from sglite.runtime.speculative.tree import TreeDraft, verify_tree

    x = torch.full((5, 10), -5.0)
    for row, tok in enumerate([0, 4, 9, 2, 6]):
        x[row, tok] = 5.0
    tree = TreeDraft([[1, 3], [0, 2]])
    assert verify_tree(x, tree, _params(temperature=0)) == ([0, 2, 6], 2, 1)  # chain 1 kept whole + bonus
    x[3] = -5.0
    x[3, 5] = 5.0
    assert verify_tree(x, tree, _params(temperature=0)) == ([0, 5], 1, 1)
    assert tree.accepted_order(1, 1) == [2, 0, 1, 3]  # chain 1's first node moves right after the root


@pytest.mark.parametrize("temp,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (0.7, 5, 0.9, 0.0)])
def test_tree_sampling_matches_the_target_distribution(temp, top_k, top_p, min_p):
    """Sequential rejection among sibling drafts keeps the output distributed as p at every node."""
    from sglite.runtime.speculative.tree import TreeDraft, verify_tree

    params = _params(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    x = _tree_rows()
    p = target_probs(x, params)
    tree = TreeDraft([[1, 3], [0, 2]])
    gen = torch.Generator().manual_seed(2)
    n, V = 6000, x.shape[1]
    first, after1, after0 = [0] * V, [0] * V, [0] * V
    for _ in range(n):
        toks, a, chain = verify_tree(x, tree, params, gen)
        assert len(toks) == a + 1 and toks[:a] == tree.chains[chain][:a]
        first[toks[0]] += 1
        if toks[0] == 1:
            after1[toks[1]] += 1
        elif toks[0] == 0:
            after0[toks[1]] += 1
    assert min(first[0], first[1]) > 0 and sum(first) - first[0] - first[1] > 0  # every branch taken
    assert chi_square_p(first, p[0].tolist(), n) > 1e-3
    assert chi_square_p(after1, p[1].tolist(), sum(after1)) > 1e-3
    assert chi_square_p(after0, p[3].tolist(), sum(after0)) > 1e-3


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


def test_speculative_algorithm_is_case_insensitive():
    """``ngram`` / ``--speculative-algorithm standalone`` are SGLang's NGRAM / STANDALONE; unknown
    names are still refused naming the field."""
    import argparse

    from sglite.config import EngineConfig
    from sglite.server.flags import add_engine_args

    assert EngineConfig(speculative_algorithm="ngram").speculative_algorithm == "NGRAM"
    p = add_engine_args(argparse.ArgumentParser())
    assert p.parse_args(["--speculative-algorithm", "Ngram"]).speculative_algorithm == "NGRAM"
    with pytest.raises(ValueError, match="speculative_algorithm"):
        EngineConfig(speculative_algorithm="eagle")
