"""The per-step fast paths of batch decoding: numpy argmax rows, greedy sampling with a grammar
mask (unmasked winner checked first), the sampler's greedy batch, logits left unwritten."""
import pytest
import torch

from sglite import kernels
from sglite.kernels import reference as R
from sglite.runtime.logprob_options import NO_LOGPROBS
from sglite.runtime.req import Req
from sglite.runtime.sampler import Sampler
from sglite.sampling_params import SamplingParams


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [B, V] -> int32 [B, ceil(V/32)] bitmask (bit t % 32 of word t // 32 = token t)."""
    B, V = allowed.shape
    W = (V + 31) // 32
    padded = torch.zeros(B, W * 32, dtype=torch.int64)
    padded[:, :V] = allowed.long()
    words = (padded.view(B, W, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def masked_argmax(logits, bitmask):
    """What kernels.reference.sample computes for greedy rows."""
    return (logits.float() + R.bitmask_to_additive(bitmask, logits.shape[1])).argmax(dim=-1)


@pytest.mark.parametrize("B,V,dtype", [(1, 49152, torch.float32), (7, 1000, torch.float32), (3, 333, torch.bfloat16)])
def test_argmax_rows_is_torch_argmax_with_first_index_on_ties(B, V, dtype):
    gen = torch.Generator().manual_seed(B * V)
    x = torch.randint(0, 5, (B, V), generator=gen).to(dtype)  # many ties: the first maximum wins
    assert torch.equal(R.argmax_rows(x), x.argmax(dim=-1))
    strided = torch.randn(V, B, generator=gen).to(dtype).t()  # a non-contiguous [B, V] view
    assert torch.equal(R.argmax_rows(strided), strided.argmax(dim=-1))
    with torch.inference_mode():
        y = torch.randn(B, V, generator=gen).to(dtype)
        assert torch.equal(R.argmax_rows(y), y.argmax(dim=-1))


@pytest.mark.parametrize("density", [0.0005, 0.3, 0.97])
def test_greedy_with_bitmask_equals_the_masked_argmax(density):
    gen = torch.Generator().manual_seed(int(density * 1e4))
    B, V = 16, 5000
    logits = torch.randint(0, 40, (B, V), generator=gen).float()  # ties inside and outside the mask
    allowed = torch.rand(B, V, generator=gen) < density
    allowed[0] = False  # a row with nothing allowed: argmax of all -inf is token 0
    allowed[1] = True  # a row with everything allowed
    top = logits.argmax(dim=-1)
    allowed[2, top[2]] = True  # a row whose unmasked winner is allowed
    allowed[3, top[3]] = False  # ... and one whose winner is not
    bitmask = pack(allowed)
    before = logits.clone()
    got = kernels.greedy(logits, bitmask)
    assert torch.equal(got, masked_argmax(logits, bitmask))
    assert torch.equal(logits, before)  # not mutated
    assert torch.equal(kernels.greedy(logits), logits.argmax(dim=-1))
    t = torch.zeros(B)
    same = kernels.sample(logits, t, torch.ones(B), torch.zeros(B, dtype=torch.int64), t,
                          torch.zeros(B, dtype=torch.int64), torch.arange(B), bitmask)
    assert torch.equal(got, same)


def make_req(temperature=0.0, **sp):
    return Req(rid="r", input_ids=[1, 2], params=SamplingParams(max_new_tokens=8, temperature=temperature, **sp),
               sink=lambda ev: None, seed=7, logprobs=NO_LOGPROBS)


def test_sampler_greedy_batch_matches_the_sampling_kernel_and_leaves_logits_alone():
    V = 300
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=gen)
    reqs = [make_req() for _ in range(4)]
    reqs[1].params = SamplingParams(max_new_tokens=8, temperature=0, logit_bias={5: 100.0})
    reqs[2].output_ids = [int(logits[2].argmax())]
    reqs[2].params = SamplingParams(max_new_tokens=8, temperature=0, repetition_penalty=1e6)
    allowed = torch.ones(4, V, dtype=torch.bool)
    allowed[3, logits[3].argmax()] = False
    before = logits.clone()
    s = Sampler(V, frozenset({0}))
    out = s.sample(logits, reqs, pack(allowed)).next_ids
    assert torch.equal(logits, before)  # penalties go to a copy
    assert out[1] == 5 and out[2] != reqs[2].output_ids[0] and out[3] != int(before[3].argmax())
    x = before.clone()
    s._penalize(x, reqs)
    assert out == masked_argmax(x, pack(allowed)).tolist()


def test_changes_logits_says_when_penalize_writes_a_row():
    assert not Sampler.changes_logits(make_req())
    assert not Sampler.changes_logits(make_req(frequency_penalty=0.5))  # no output yet
    r = make_req(frequency_penalty=0.5)
    r.output_ids = [3]
    assert Sampler.changes_logits(r)
    assert Sampler.changes_logits(make_req(min_new_tokens=2))
    assert Sampler.changes_logits(make_req(logit_bias={1: 1.0}))
    for r in (make_req(), make_req(frequency_penalty=0.5)):  # rows it calls unchanged stay unchanged
        x = torch.randn(1, 50)
        y = x.clone()
        Sampler(50, frozenset({0}))._penalize(y, [r])
        assert torch.equal(x, y)


def test_select_rows_views_consecutive_rows_and_copies_others():
    from sglite.runtime.sampler import select_rows

    x = torch.arange(20.0).view(5, 4)
    assert select_rows(x, [0, 1, 2, 3, 4]) is x
    view = select_rows(x, [1, 2])
    assert torch.equal(view, x[1:3]) and view.data_ptr() == x[1].data_ptr()  # no copy
    gathered = select_rows(x, [3, 0])
    assert torch.equal(gathered, x[[3, 0]]) and gathered.data_ptr() != x.data_ptr()
