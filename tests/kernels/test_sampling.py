"""Token bitmask and sampling: Triton kernels (interpreted on CPU) and the torch reference.

``TRITON_INTERPRET=1`` is set before triton is imported; if triton was imported earlier in this
pytest process, the file re-runs itself in a fresh subprocess (see test_attention.py).
"""
import os

DEVICE = os.environ.get("SGLITE_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed on this platform")

from sglite.kernels import reference as R  # noqa: E402
from sglite.kernels import triton_ops as T  # noqa: E402

from sglite.testing import rerun_in_triton_interpreter  # noqa: E402

pytestmark = pytest.mark.triton
IN_PROCESS = DEVICE != "cpu" or T.INTERPRETED
IMPLS = {"torch": R, "triton": T}


if not IN_PROCESS:  # the other tests of this file skip (tests/conftest.py) and run in a subprocess
    @pytest.mark.slow  # 7-14 s of the fast tier's worker time; make test-all (CI) runs it
    def test_file_in_fresh_interpreter():
        r = rerun_in_triton_interpreter(__file__)
        assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]


def random_bitmask(rows, V, gen, density=0.5):
    """Packed int32 [rows, ceil(V/32)] mask and its bool [rows, V] unpacking (True = allowed)."""
    allowed = torch.rand(rows, V, generator=gen) < density
    allowed[:, 0] |= ~allowed.any(1)  # at least one allowed token per row
    W = (V + 31) // 32
    padded = torch.zeros(rows, W * 32, dtype=torch.int64)
    padded[:, :V] = allowed.long()
    words = (padded.view(rows, W, 32) << torch.arange(32)).sum(-1)  # [rows, W] in [0, 2^32)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.to(DEVICE), allowed.to(DEVICE)


def params(B, temp=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=1234, positions=None):
    f = lambda v, dt: torch.full((B,), v, dtype=dt, device=DEVICE)  # noqa: E731
    pos = torch.arange(B, device=DEVICE) if positions is None else positions
    return (f(temp, torch.float32), f(top_p, torch.float32), f(top_k, torch.int64),
            f(min_p, torch.float32), f(seed, torch.int64), pos)


# ---------------------------------------------------------------------------------------------
# bitmask
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("V,dtype", [(1000, torch.float32), (49152, torch.float32), (333, torch.bfloat16)])
def test_apply_token_bitmask_matches_reference_and_unpacking(V, dtype):
    gen = torch.Generator().manual_seed(V)
    B = 4
    mask, allowed = random_bitmask(B, V, gen)
    logits = torch.randn(B, V, generator=gen).to(dtype).to(DEVICE)
    a, b = logits.clone(), logits.clone()
    T.apply_token_bitmask(a, mask)
    R.apply_token_bitmask(b, mask)
    assert torch.equal(a, b)
    assert torch.equal(torch.isneginf(a), ~allowed)
    assert torch.equal(a[allowed], logits[allowed])
    assert torch.equal(R.bitmask_to_bool(mask, V), allowed)


def test_apply_token_bitmask_with_indices_touches_only_those_rows():
    gen = torch.Generator().manual_seed(5)
    V = 500
    mask, allowed = random_bitmask(2, V, gen)
    logits = torch.randn(6, V, generator=gen).to(DEVICE)
    idx = torch.tensor([4, 1], device=DEVICE)
    a, b = logits.clone(), logits.clone()
    T.apply_token_bitmask(a, mask, idx)
    R.apply_token_bitmask(b, mask, idx)
    assert torch.equal(a, b)
    assert torch.equal(a[[0, 2, 3, 5]], logits[[0, 2, 3, 5]])
    assert torch.equal(torch.isneginf(a[4]), ~allowed[0])


def test_apply_token_bitmask_rejects_bad_masks():
    logits = torch.zeros(2, 100, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        T.apply_token_bitmask(logits, torch.zeros(2, 4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="ceil"):
        T.apply_token_bitmask(logits, torch.zeros(2, 3, dtype=torch.int32, device=DEVICE))


# ---------------------------------------------------------------------------------------------
# greedy
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("V,dtype,masked", [(777, torch.float32, False), (49152, torch.float32, True),
                                            (5000, torch.bfloat16, True)])
def test_greedy_rows_are_argmax(impl, V, dtype, masked):
    gen = torch.Generator().manual_seed(V + masked)
    B = 5
    logits = torch.randn(B, V, generator=gen).to(dtype).to(DEVICE)  # bf16: many ties, first wins
    mask, allowed = random_bitmask(B, V, gen) if masked else (None, None)
    out = torch.full((B,), -1, dtype=torch.int64, device=DEVICE)
    extra = {"out": out} if impl == "triton" else {}
    got = IMPLS[impl].sample(logits, *params(B), bitmask=mask, **extra)
    x = logits.float()
    if masked:
        x = x.masked_fill(~allowed, float("-inf"))
    assert torch.equal(got, x.argmax(-1))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_mixed_batch_greedy_rows_match_argmax(impl):
    gen = torch.Generator().manual_seed(9)
    B, V = 8, 300
    logits = (3 * torch.randn(B, V, generator=gen)).to(DEVICE)
    temp, top_p, top_k, min_p, seed, pos = params(B, temp=1.0, top_p=0.9, top_k=20, min_p=0.01)
    temp[::2] = 0.0
    got = IMPLS[impl].sample(logits, temp, top_p, top_k, min_p, seed, pos)
    assert torch.equal(got[::2], logits[::2].argmax(-1))
    assert ((got >= 0) & (got < V)).all()


# ---------------------------------------------------------------------------------------------
# stochastic rows: distribution after truncation (chi-square), masks, determinism
# ---------------------------------------------------------------------------------------------

PROBS = [0.3, 0.2, 0.15, 0.12, 0.08, 0.06, 0.04, 0.03, 0.015, 0.005]


def expected_distribution(probs, temp, top_k, top_p, min_p, allowed):
    """Spec, written independently: mask -> temperature -> top-k / top-p / min-p -> renormalise."""
    w = [p ** (1.0 / temp) if a else 0.0 for p, a in zip(probs, allowed)]
    z = sum(w)
    q = [x / z for x in w]
    order = sorted(range(len(q)), key=lambda i: -q[i])
    keep, before = [False] * len(q), 0.0
    for rank, i in enumerate(order):
        ok = q[i] > 0 and (top_k <= 0 or rank < top_k) and before < top_p and q[i] >= min_p * q[order[0]]
        keep[i] = ok or rank == 0
        before += q[i]
    kept = sum(q[i] for i in range(len(q)) if keep[i])
    return [q[i] / kept if keep[i] else 0.0 for i in range(len(q))]


def chi_square_p(counts, expected_p, n):
    idx = [i for i, p in enumerate(expected_p) if p > 0]
    stat = sum((counts[i] - n * expected_p[i]) ** 2 / (n * expected_p[i]) for i in idx)
    df = len(idx) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


# (temperature, top_k, top_p, min_p, masked tokens)
SAMPLING_CASES = [
    (1.0, 0, 1.0, 0.0, ()),
    (0.7, 4, 1.0, 0.0, ()),
    (1.3, 0, 0.8, 0.0, ()),
    (1.0, 0, 1.0, 0.25, ()),
    (0.9, 6, 0.85, 0.1, (1, 4)),  # all truncations + a grammar mask (fused masked sampling)
]


# the Triton kernel under the interpreter draws slowly: its chi-square runs in the slow tier
@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
@pytest.mark.parametrize("temp,top_k,top_p,min_p,banned", SAMPLING_CASES)
def test_sampled_distribution_chi_square(impl, temp, top_k, top_p, min_p, banned):
    n, V = 20000, len(PROBS)
    allowed = [i not in banned for i in range(V)]
    logits = torch.tensor(PROBS).log()[None].repeat(n, 1).to(DEVICE)
    mask = None
    if banned:
        word = sum(1 << i for i in range(V) if allowed[i])
        mask = torch.full((n, 1), word, dtype=torch.int32, device=DEVICE)
    got = IMPLS[impl].sample(logits, *params(n, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
                                             seed=4321), bitmask=mask)
    counts = torch.bincount(got.cpu(), minlength=V).tolist()
    exp = expected_distribution(PROBS, temp, top_k, top_p, min_p, allowed)
    assert all(counts[i] == 0 for i in range(V) if exp[i] == 0), (counts, exp)  # truncated/masked
    assert sum(e > 0 for e in exp) >= 3  # the case really samples
    assert chi_square_p(counts, exp, n) > 1e-3, (counts, exp)


def test_chi_square_detects_a_wrong_distribution():
    """The statistical check can fail: untruncated draws against the truncated spec."""
    n = 20000
    logits = torch.tensor(PROBS).log()[None].repeat(n, 1).to(DEVICE)
    got = T.sample(logits, *params(n, temp=1.0))
    counts = torch.bincount(got.cpu(), minlength=len(PROBS)).tolist()
    shifted = expected_distribution(PROBS, 0.8, 0, 1.0, 0.0, [True] * len(PROBS))
    assert chi_square_p(counts, shifted, n) < 1e-3


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_masked_tokens_never_drawn_large_vocab(impl):
    gen = torch.Generator().manual_seed(11)
    B, V = 6, 4099
    logits = (2 * torch.randn(B, V, generator=gen)).to(DEVICE)
    logits[:, 7] = 30.0  # the favourite token is banned everywhere
    mask, allowed = random_bitmask(B, V, gen, density=0.3)
    mask[:, 0] &= ~(1 << 7)
    allowed[:, 7] = False
    temp, top_p, top_k, min_p, seed, pos = params(B, temp=1.5)
    top_k[1], top_p[2], min_p[3] = 50, 0.9, 0.05
    for step in range(3):
        got = IMPLS[impl].sample(logits, temp, top_p, top_k, min_p, seed, pos + 100 * step,
                                 bitmask=mask)
        assert allowed[torch.arange(B, device=DEVICE), got].all()


def test_triton_sampling_is_deterministic_and_batch_invariant():
    gen = torch.Generator().manual_seed(12)
    B, V = 9, 300
    logits = torch.randn(B, V, generator=gen).to(DEVICE)
    temp, top_p, top_k, min_p, seed, pos = params(B, temp=1.0)
    seed = torch.arange(B, device=DEVICE) * 17
    top_k[::3] = 40
    top_p[1::3] = 0.7
    a = T.sample(logits, temp, top_p, top_k, min_p, seed, pos)
    b = T.sample(logits, temp, top_p, top_k, min_p, seed, pos)
    assert torch.equal(a, b)
    perm = torch.randperm(B, generator=gen).to(DEVICE)
    c = T.sample(logits[perm], temp[perm], top_p[perm], top_k[perm], min_p[perm], seed[perm], pos[perm],
                 rows_per_program=4, block_v=128)
    assert torch.equal(c, a[perm])
    d = T.sample(logits, temp, top_p, top_k, min_p, seed, pos + 1)
    assert not torch.equal(d, a)  # the position advances the random stream


def test_top_k_one_and_tiny_top_p_reduce_to_argmax():
    gen = torch.Generator().manual_seed(13)
    B, V = 6, 2000
    logits = torch.randn(B, V, generator=gen).to(DEVICE)
    temp, top_p, top_k, min_p, seed, pos = params(B, temp=2.0)
    top_k[:3] = 1
    top_p[3:] = 1e-6
    for impl in ("torch", "triton"):
        assert torch.equal(IMPLS[impl].sample(logits, temp, top_p, top_k, min_p, seed, pos),
                           logits.argmax(-1))


def test_sample_rejects_bad_parameter_shapes():
    logits = torch.zeros(3, 10, device=DEVICE)
    temp, top_p, top_k, min_p, seed, pos = params(3)
    with pytest.raises(ValueError, match="top_ks"):
        T.sample(logits, temp, top_p, top_k[:2], min_p, seed, pos)
    with pytest.raises(ValueError, match="bitmask rows"):
        T.sample(logits, temp, top_p, top_k, min_p, seed, pos,
                 bitmask=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_truncation_sets_on_a_large_vocab(impl):
    """Draws stay inside the top-k set, the top-p nucleus and the min-p set of a 3000-token row."""
    gen = torch.Generator().manual_seed(14)
    V, n = 3000, 16
    row = 2.5 * torch.randn(V, generator=gen)
    logits = row[None].repeat(3 * n, 1).to(DEVICE)
    temp, top_p, top_k, min_p, seed, pos = params(3 * n, temp=1.0)
    top_k[:n], top_p[n:2 * n], min_p[2 * n:] = 5, 0.5, 0.3
    got = IMPLS[impl].sample(logits, temp, top_p, top_k, min_p, seed, pos).cpu()
    probs = torch.softmax(row, 0)
    sp, si = probs.sort(descending=True)
    top5 = set(si[:5].tolist())
    nucleus = set(si[(sp.cumsum(0) - sp) < 0.5].tolist())
    minp = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    assert 3 <= len(nucleus) < 200 and 2 <= len(minp) < len(nucleus)
    for part, allowed_set in ((got[:n], top5), (got[n:2 * n], nucleus), (got[2 * n:], minp)):
        drawn = set(part.tolist())
        assert drawn <= allowed_set
        assert len(drawn) >= 2  # really random, not collapsed to the argmax


def test_dispatcher_routes_cpu_tensors_to_interpreted_triton():
    from sglite import kernels

    gen = torch.Generator().manual_seed(15)
    logits = torch.randn(4, 100, generator=gen).to(DEVICE)
    mask, allowed = random_bitmask(4, 100, gen)
    args = params(4, temp=0.7, top_k=10)
    assert torch.equal(kernels.sample(logits, *args, bitmask=mask, impl="triton"),
                       T.sample(logits, *args, bitmask=mask))
    a, b = logits.clone(), logits.clone()
    kernels.apply_token_bitmask(a, mask, impl="triton")
    R.apply_token_bitmask(b, mask)
    assert torch.equal(a, b)
