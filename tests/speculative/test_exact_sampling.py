"""Speculative decoding (issue 17): verification keeps the target model's output exactly.

Greedy verification is prefix matching; sampled verification (chains and token trees, drafts with
or without their own distribution q) leaves every output token distributed as the target says.
Oracles: verification rules worked by hand, chi-square tests of the sampled distributions against
the target's (tests that can fail: a negative control with a wrong residual is rejected), the
sampler's own draws, and (slow) an engine's sampled tokens against the HF model's probabilities.
"""
import pytest
import torch

from sglite import Engine
from sglite.runtime.speculative import target_probs, verify_chain
from sglite.runtime.speculative.verify import Draws
from sglite.sampling_params import SamplingParams
from sglite.testing import homogeneity_p

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/speculative/conftest.py: tiny tensors in long loops


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
    first = [0] * LOGITS.shape[1]
    second = [0] * LOGITS.shape[1]
    n_second = 0
    for i in range(n):
        toks, a = verify_chain(LOGITS, draft, params, Draws(seed * 1_000_003 + i, 0), draft_probs)
        assert len(toks) == a + 1 and toks[:a] == draft[:a]
        first[toks[0]] += 1
        if toks[0] == draft[0]:
            second[toks[1]] += 1
            n_second += 1
    return first, second, n_second


# temperatures 0.5 and 1.5 alone run the code path of 1.0 and 1.2 (one more scale): slow tier
CHAIN_CASES = [pytest.param(*c, marks=pytest.mark.slow) if c[0] in (0.5, 1.5) else c for c in CASES]


@pytest.mark.parametrize("temp,top_k,top_p,min_p", CHAIN_CASES)
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
    for i in range(n):
        d = [int(torch.multinomial(q[0], 1, generator=gen)), int(torch.multinomial(q[1], 1, generator=gen))]
        toks, _ = verify_chain(LOGITS, d, params, Draws(5_000 + i, 3), draft_probs=q)
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


def test_homogeneity_test_detects_different_samples():
    a = {0: 300, 1: 200, 2: 100}
    assert homogeneity_p(a, {0: 310, 1: 190, 2: 100}) > 0.1
    assert homogeneity_p(a, {0: 200, 1: 200, 2: 200}) < 1e-3


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


# the fast tier keeps the filtered case (top-k and top-p over the same sibling rejection); slow: unfiltered
@pytest.mark.parametrize("temp,top_k,top_p,min_p", [pytest.param(1.0, 0, 1.0, 0.0, marks=pytest.mark.slow),
                                                    (0.7, 5, 0.9, 0.0)])
def test_tree_sampling_matches_the_target_distribution(temp, top_k, top_p, min_p):
    """Sequential rejection among sibling drafts keeps the output distributed as p at every node."""
    from sglite.runtime.speculative.tree import TreeDraft, verify_tree

    params = _params(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    x = _tree_rows()
    p = target_probs(x, params)
    tree = TreeDraft([[1, 3], [0, 2]])
    n, V = 6000, x.shape[1]
    first, after1, after0 = [0] * V, [0] * V, [0] * V
    for i in range(n):
        toks, a, chain = verify_tree(x, tree, params, Draws(2_000 + i, 0))
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


# ---------------------------------------------------------------------- engine: sampled output distribution
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
    from sglite.runtime.speculative.proposer import EntryProposer
    from sglite.testing import martingale_z, oracle_drafter, sampling_oracle

    kw = dict(dtype="float32", device="cpu", max_total_tokens=8192)
    base = Engine(str(tiny_model_dir), **kw)
    spec = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", speculative_disable_by_batch_size=64, **kw)
    try:
        ids = base.tokenizer.encode("alpha beta gamma delta alpha beta")
        greedy = base.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0})["output_ids"]
        spec.scheduler.spec.proposer = EntryProposer(oracle_drafter({tuple(ids): greedy}, 4))
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
