"""Speculative decoding (issue 29): block verification (Sun et al. 2024) is exact.

Oracles: the paper's worked example (11/9 kept tokens against token verification's 10/9), an
exact enumeration of the token sequences a block verifier emits over repeated steps against the
target's joint probabilities (with a negative control that drops the block weight and fails), the
chi-square tests that guard token verification run on :func:`verify_block`, and end to end the
plain engine (greedy identical; seeded output unchanged; unseeded sampled requests verified by
blocks).
"""
import itertools

import pytest
import torch

from sglite import Engine
from sglite.errors import InvalidRequestError
from sglite.runtime.speculative.block import stop_chances, verify_block
from sglite.runtime.speculative.verify import target_probs
from sglite.sampling_params import SamplingParams
from tests.speculative.prompts import COPY_PROMPTS
from tests.speculative.test_exact_sampling import CASES, LOGITS, chi_square_p



pytestmark = pytest.mark.usefixtures("one_thread")  # tests/speculative/conftest.py

def _kept_mean(p_rows, q_rows):
    """Expected kept draft tokens of one block step, exactly (drafts enumerated)."""
    k, V = q_rows.shape[0], q_rows.shape[1]
    mean = 0.0
    for d in itertools.product(range(V), repeat=k):
        pr = float(torch.prod(torch.stack([q_rows[i, t] for i, t in enumerate(d)])))
        h, _ = stop_chances(p_rows, q_rows, list(d))
        for i in range(k + 1):
            mean += pr * i * h[i] * float(torch.prod(torch.tensor([1 - h[j] for j in range(i + 1, k + 1)] or [1.0], dtype=torch.float64)))
    return mean


def test_the_papers_example_keeps_eleven_ninths():
    """Binary vocabulary, target (1/3, 2/3), draft (2/3, 1/3), blocks of 2 (Sun et al. §1):
    token verification keeps 10/9 tokens a step, block verification 11/9."""
    p = torch.tensor([[1 / 3, 2 / 3]] * 3, dtype=torch.float64)
    q = torch.tensor([[2 / 3, 1 / 3]] * 2, dtype=torch.float64)
    assert _kept_mean(p, q) == pytest.approx(11 / 9, abs=1e-12)
    beta = float(torch.minimum(p[0], q[0]).sum())
    assert beta + beta ** 2 == pytest.approx(10 / 9)  # token verification, for comparison


def _models(V=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(torch.randn(V + 1, V, generator=g, dtype=torch.float64) * 1.5, dim=-1)  # row V: start
    Q = torch.softmax(torch.randn(V + 1, V, generator=g, dtype=torch.float64) * 1.5, dim=-1)
    return P, Q


def _emitted(P, Q, k, L, prev, chances=stop_chances):
    """Distribution of the next L tokens emitted by repeated block steps from context ``prev``
    (first-order models: row ``prev`` of P / Q is the next-token distribution)."""
    V = P.shape[1]
    out: dict = {}
    for d in itertools.product(range(V), repeat=k):
        ctx = [prev] + list(d)
        pr = 1.0
        for i, t in enumerate(d):
            pr *= float(Q[ctx[i], t])
        p_rows, q_rows = P[ctx], Q[ctx[:k]]
        h, res = chances(p_rows, q_rows, list(d))
        for tau in range(k + 1):
            pt = h[tau] * float(torch.prod(torch.tensor([1 - h[j] for j in range(tau + 1, k + 1)] or [1.0], dtype=torch.float64)))
            if pt == 0:
                continue
            dist = p_rows[k] if tau == k else res[tau] / res[tau].sum()
            for y in range(V):
                w = pr * pt * float(dist[y])
                if w == 0:
                    continue
                s = list(d[:tau]) + [y]
                if len(s) >= L:
                    out[tuple(s[:L])] = out.get(tuple(s[:L]), 0.0) + w
                else:
                    for rest, w2 in _emitted(P, Q, k, L - len(s), s[-1], chances).items():
                        out[tuple(s) + rest] = out.get(tuple(s) + rest, 0.0) + w * w2
    return out


def _target(P, L, prev):
    V = P.shape[1]
    return {s: float(torch.prod(torch.stack([P[c, t] for c, t in zip((prev,) + s[:-1], s)])))
            for s in itertools.product(range(V), repeat=L)}


@pytest.mark.parametrize("k,seed", [(2, 0), (3, 1)])
def test_block_verification_emits_the_target_joint_distribution_exactly(k, seed):
    P, Q = _models(seed=seed)
    got, want = _emitted(P, Q, k, 3, 3), _target(P, 3, 3)
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-12)
    assert max(abs(got.get(s, 0.0) - w) for s, w in want.items()) < 1e-12
    # and it keeps at least as many tokens as token verification (sum over i of prod beta_j)
    p_rows, q_rows = P[[3] * (k + 1)], Q[[3] * k]
    beta = float(torch.minimum(p_rows[0], q_rows[0]).sum())
    assert _kept_mean(p_rows, q_rows) >= sum(beta ** i for i in range(1, k + 1)) - 1e-12


def test_enumeration_catches_a_verifier_without_the_block_weight():
    """Negative control: stop chances computed as if every weight were 1 (no carried weight)."""
    def unweighted(p, q, draft):
        h, res = stop_chances(p, q, draft)
        r = [float((p[i] - q[i]).clamp_min(0).sum()) for i in range(len(draft))]
        return [1.0] + [min(1.0, x) for x in r[1:]] + [h[-1]], [(p[i] - q[i]).clamp_min(0) for i in range(len(draft))]

    P, Q = _models(seed=0)
    got, want = _emitted(P, Q, 2, 3, 3, unweighted), _target(P, 3, 3)
    assert max(abs(got.get(s, 0.0) - w) for s, w in want.items()) > 1e-3


def _run_block(params, draft, n, draft_probs=None, seed=0, sample_draft=None):
    gen = torch.Generator().manual_seed(seed)
    V = LOGITS.shape[1]
    first, second, n_second, kept = [0] * V, [0] * V, 0, 0
    for _ in range(n):
        d = sample_draft(gen) if sample_draft else draft
        toks, a = verify_block(LOGITS, d, params, gen, draft_probs)
        assert len(toks) == a + 1 and toks[:a] == list(d[:a])
        kept += a
        first[toks[0]] += 1
        if toks[0] == d[0]:
            second[toks[1]] += 1
            n_second += 1
    return first, second, n_second, kept / n


@pytest.mark.parametrize("temp,top_k,top_p,min_p", CASES[1:2] + CASES[3:4] + CASES[5:])
def test_block_verification_matches_the_target_distribution(temp, top_k, top_p, min_p):
    """Point-mass drafts (what every proposer here gives): token 1 ~ p_0, token 2 | d_1 ~ p_1."""
    params = SamplingParams(max_new_tokens=8, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    p = target_probs(LOGITS, params)
    first, second, n_second, _ = _run_block(params, [1, 3], 4000)
    assert 0 < first[1] < 4000
    assert chi_square_p(first, p[0].tolist(), 4000) > 1e-3
    assert chi_square_p(second, p[1].tolist(), n_second) > 1e-3


def test_block_verification_with_sampled_drafts_is_exact_and_keeps_more():
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    p = target_probs(LOGITS, params)
    q = torch.softmax(LOGITS.roll(1, dims=1)[:2] * 0.8, dim=-1)  # [2, V], off the target

    def draft(gen):
        return [int(torch.multinomial(q[0], 1, generator=gen)), int(torch.multinomial(q[1], 1, generator=gen))]

    n = 4000
    first, second, n_second, kept = _run_block(params, None, n, q, seed=4, sample_draft=draft)
    assert chi_square_p(first, p[0].tolist(), n) > 1e-3
    # kept tokens a step: the exact expectation (enumerated), which beats token verification's
    want = _kept_mean(p.double(), q.double())
    beta0 = float(torch.minimum(p[0], q[0]).sum())
    assert want > beta0 * (1 + float(torch.minimum(p[1], q[1]).sum())) * 0.99
    assert abs(kept - want) < 4 * (2.0 / n) ** 0.5, (kept, want)


def test_forced_tokens_are_kept_and_never_stopped_before():
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    x = torch.zeros(4, 12)
    x[:, 9] = 12.0  # the target says 9 everywhere; the draft's second token is forced text
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        toks, a = verify_block(x, [9, 4, 9], params, gen, forced={1})
        assert a != 1  # nothing is drawn right before the forced token
        assert toks[:a] == [9, 4, 9][:a]


# ---------------------------------------------------------------------- engine
KW = dict(dtype="float32", device="cpu", max_total_tokens=4096, check_invariants=True)


def test_block_mode_in_the_engine(tiny_model_dir):
    prompts = COPY_PROMPTS[:3]
    greedy = {"max_new_tokens": 24, "temperature": 0}
    seeded = {"max_new_tokens": 24, "temperature": 0.7, "sampling_seed": 42}
    base = Engine(str(tiny_model_dir), **KW)
    try:
        want_g = [o["output_ids"] for o in base.generate(prompts, greedy)]
        want_s = [o["output_ids"] for o in base.generate(prompts, seeded)]
    finally:
        base.shutdown()
    e = Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", speculative_verify="block",
               speculative_disable_by_batch_size=64, **KW)
    e.scheduler.kv.borrow_rows = lambda n: []  # chains only: block verification sees every draft
    try:
        assert [o["output_ids"] for o in e.generate(prompts, greedy)] == want_g
        assert [o["output_ids"] for o in e.generate(prompts, seeded)] == want_s  # seeded: token rule
        assert e.scheduler.spec.stats["spec_block_steps"] == 0
        out = e.generate(prompts * 2, {"max_new_tokens": 24, "temperature": 0.3})
        assert all(len(o["output_ids"]) > 0 for o in out)
        st = e.scheduler.spec.stats
        assert st["spec_block_steps"] > 0 and st["spec_accepted_tokens"] > 0, st
    finally:
        e.shutdown()


def test_bad_verify_mode_is_refused_naming_the_field(tiny_model_dir):
    with pytest.raises(InvalidRequestError, match="speculative_verify"):
        Engine(str(tiny_model_dir), speculative_algorithm="NGRAM", speculative_verify="joint", **KW)

