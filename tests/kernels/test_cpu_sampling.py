"""The CPU sampling path (sglite/kernels/cpu_sampling.py) against the reference, token for token,
and the draws both share (sglite/kernels/reference_sampling.py)."""
import math

import pytest
import torch

from sglite import kernels
from sglite.kernels import cpu_sampling
from sglite.kernels import reference as R


def _args(B, V, gen, *, temp=0.8, top_p=1.0, top_k=0, min_p=0.0, greedy_every=0):
    t = torch.full((B,), temp)
    if greedy_every:
        t[::greedy_every] = 0.0
    return (t, torch.full((B,), top_p), torch.full((B,), top_k, dtype=torch.int64), torch.full((B,), min_p),
            torch.randint(0, 2**31, (B,), generator=gen), torch.randint(0, 5000, (B,), generator=gen))


def _logits(B, V, gen, scale):
    return torch.randn(B, V, generator=gen) * scale  # scale: peaky (large) or flat (small) rows


CASES = [  # (B, V, scale, options): nuclei from a handful of tokens to thousands (K grows 8x past 64)
    (7, 50, 2.0, dict(top_p=0.9)),
    (16, 49152, 4.0, dict(top_p=0.95)),
    (16, 49152, 1.0, dict(top_p=0.95)),  # flat rows: the nucleus passes 64 and 512 candidates
    (9, 3000, 3.0, dict(top_k=40)),
    (9, 3000, 3.0, dict(top_k=2000, top_p=0.99)),
    (12, 3000, 3.0, dict(top_p=0.8, min_p=0.05, greedy_every=3)),
    (8, 3000, 2.0, dict(min_p=0.1)),  # no ranking: the dense form
    (8, 3000, 2.0, dict()),  # temperature only
    (5, 3000, 2.0, dict(temp=1.7, top_k=3000, top_p=1.0)),  # top_k == V: off
]


@pytest.mark.parametrize("B,V,scale,opts", CASES)
def test_cpu_sampling_gives_the_reference_tokens(B, V, scale, opts):
    gen = torch.Generator().manual_seed(B * 131 + V)
    for _ in range(3):
        logits = _logits(B, V, gen, scale)
        args = _args(B, V, gen, **opts)
        assert torch.equal(cpu_sampling.sample(logits, *args), R.sample(logits, *args))
        assert torch.equal(kernels.sample(logits, *args), R.sample(logits, *args))  # the dispatcher's CPU path


def test_cpu_sampling_with_a_grammar_mask_and_mixed_rows():
    gen = torch.Generator().manual_seed(3)
    B, V = 6, 700
    logits = _logits(B, V, gen, 3.0)
    mask = torch.randint(-2**31, 2**31 - 1, (B, (V + 31) // 32), generator=gen, dtype=torch.int64).to(torch.int32)
    t, p, k, m, s, pos = _args(B, V, gen, top_p=0.9, greedy_every=2)
    k[1] = 5
    got = cpu_sampling.sample(logits, t, p, k, m, s, pos, mask)
    assert torch.equal(got, R.sample(logits, t, p, k, m, s, pos, mask))
    allowed = R.bitmask_to_bool(mask, V)
    assert all(bool(allowed[i, int(tok)]) for i, tok in enumerate(got))


def test_a_rows_token_does_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(11)
    logits = _logits(10, 2000, gen, 2.0)
    args = _args(10, 2000, gen, top_p=0.9)
    whole = cpu_sampling.sample(logits, *args)
    for i in (0, 4, 9):
        alone = cpu_sampling.sample(logits[i:i + 1], *(a[i:i + 1] for a in args))
        assert int(alone) == int(whole[i])


def test_exp_noise_of_a_subset_is_that_of_the_whole_row_and_exponential():
    seeds, pos = torch.tensor([7, 7, 123456789]), torch.tensor([0, 1, 42])
    full = R.exp_noise(seeds, pos, torch.arange(50_000).expand(3, 50_000), 50_000)  # [3, V]
    ids = torch.tensor([[5, 49_999, 0], [17, 3, 3], [1000, 2, 7]])
    assert torch.equal(R.exp_noise(seeds, pos, ids, 50_000), full.gather(1, ids))  # any subset: the same draws
    assert not torch.equal(full[0], full[1])  # the position moves the stream
    x = full.flatten().double()  # 150k draws of Exp(1): mean 1, variance 1, P(X > 3) = e^-3
    n = x.numel()
    assert bool((x > 0).all())
    assert abs(x.mean().item() - 1.0) < 5 / math.sqrt(n)
    tail = (x > 3).double().mean().item()
    assert abs(tail - math.exp(-3)) < 5 * math.sqrt(math.exp(-3) * (1 - math.exp(-3)) / n)


def test_cpu_sampling_draws_the_truncated_distribution():
    """Chi-square over 20,000 seeds: the drawn tokens follow the kept tokens' renormalised
    probabilities (top_p 0.9 keeps 4 of 8 here); p > 1e-4 or the draws are biased."""
    probs = torch.tensor([0.35, 0.25, 0.2, 0.12, 0.04, 0.02, 0.01, 0.01])
    logits = probs.log()[None, :].expand(20_000, 8).contiguous()
    n = logits.shape[0]
    args = (torch.ones(n), torch.full((n,), 0.9), torch.zeros(n, dtype=torch.int64), torch.zeros(n),
            torch.arange(n), torch.zeros(n, dtype=torch.int64))
    got = cpu_sampling.sample(logits, *args)
    counts = torch.bincount(got, minlength=8).double()
    assert counts[4:].sum() == 0  # mass before token 4 is 0.92 >= 0.9: outside the nucleus
    kept = probs[:4].double() / probs[:4].sum()
    expected = kept * n
    chi2 = float(((counts[:4] - expected) ** 2 / expected).sum())
    assert chi2 < 21.1  # chi-square, 3 degrees of freedom: P(chi2 > 21.1) ~ 1e-4
