"""Triton attention kernels (store_kv, decode, extend) against the torch reference.

On CPU the kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` is set here before triton
is imported. If another module of this pytest process imported triton first (kernels compiled for
the GPU), this file re-runs itself in a fresh subprocess instead. ``SGLITE_TEST_DEVICE=cuda`` runs
the same checks compiled on a GPU (see ``sglite/kernels/device_check.sh``).
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


if not IN_PROCESS:  # the other tests of this file skip (tests/conftest.py) and run in a subprocess
    def test_file_in_fresh_interpreter():
        r = rerun_in_triton_interpreter(__file__)
        assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (NaN, e.g. from a poisoned unwritten element, gives inf)."""
    d = (out.float() - ref.float()).abs().max()
    if torch.isnan(d):
        return float("inf")
    return float(d / ref.float().abs().max().clamp_min(1e-30))


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def make_pool(lens, hkv, d, dtype, gen, spare_rows=3, spare_slots=40):
    """A pool of one layer with scattered, non-contiguous slots and a shuffled page table.

    Returns k_buffer, v_buffer [S, Hkv, D], req_to_token [R, Lmax] int32 (garbage past each
    length), req_pool_indices [B] int64.
    """
    total = sum(lens)
    S = total + spare_slots + 1
    kb = torch.randn(S, hkv, d, generator=gen).to(dtype)
    vb = torch.randn(S, hkv, d, generator=gen).to(dtype)
    B = len(lens)
    lmax = max(lens) + 5
    R_ = B + spare_rows
    # garbage everywhere (valid slot ids, so a kernel reading past a length gives wrong numbers)
    r2t = torch.randint(1, S, (R_, lmax), generator=gen, dtype=torch.int32)
    slots = torch.randperm(S - 1, generator=gen)[:total] + 1  # slot 0 is padding
    rows = torch.randperm(R_, generator=gen)[:B]
    o = 0
    for i, n in enumerate(lens):
        r2t[rows[i], :n] = slots[o:o + n].to(torch.int32)
        o += n
    dev = torch.device(DEVICE)
    return kb.to(dev), vb.to(dev), r2t.to(dev), rows.long().to(dev)


# (GQA ratio, KV heads, head dim, dtype, sequence lengths, num_splits)
DECODE_CASES = [
    (1, 2, 64, torch.float32, [1, 17, 5], 4),
    (3, 3, 64, torch.float32, [1, 17, 1000, 33], 4),  # SmolLM2-135M head layout, mixed lengths
    (3, 1, 64, torch.bfloat16, [17, 1, 64], 3),
    (8, 1, 128, torch.float32, [1000], 8),
    (8, 2, 128, torch.bfloat16, [1, 17, 129], 1),
    (1, 1, 128, torch.bfloat16, [1000, 2], 4),
]


@pytest.mark.parametrize("group,hkv,d,dtype,lens,splits", DECODE_CASES)
def test_decode_attention_matches_reference(group, hkv, d, dtype, lens, splits):
    gen = torch.Generator().manual_seed(hash((group, hkv, d, tuple(lens))) % 2**31)
    kb, vb, r2t, rows = make_pool(lens, hkv, d, dtype, gen)
    B, hq = len(lens), group * hkv
    q = torch.randn(B, hq, d, generator=gen).to(dtype).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int64, device=DEVICE)
    scale = d ** -0.5
    out = torch.full_like(q, float("nan"))  # poisoned: an unwritten element fails
    ws = (torch.full((B, hq, splits, d), float("nan"), device=DEVICE),
          torch.full((B, hq, splits), float("nan"), device=DEVICE))
    res = T.decode_attention(q, kb, vb, r2t, rows, seq_lens, scale, out=out, num_splits=splits,
                             workspace=ws)
    ref = R.decode_attention(q, kb, vb, r2t, rows, seq_lens, scale)
    assert res is out and res.dtype == dtype and res.shape == (B, hq, d)
    assert rel_err(res, ref) < TOL[dtype]


def test_decode_attention_default_launch_and_errors():
    gen = torch.Generator().manual_seed(1)
    kb, vb, r2t, rows = make_pool([3, 40], 2, 64, torch.float32, gen)
    q = torch.randn(2, 6, 64, generator=gen).to(DEVICE)
    lens = torch.tensor([3, 40], device=DEVICE)
    res = T.decode_attention(q, kb, vb, r2t, rows, lens, 0.125)
    assert rel_err(res, R.decode_attention(q, kb, vb, r2t, rows, lens, 0.125)) < 1e-5
    with pytest.raises(ValueError, match="multiple of KV heads"):
        T.decode_attention(q[:, :5], kb, vb, r2t, rows, lens, 0.125)


# (GQA ratio, KV heads, head dim, dtype, prefix lengths, extend lengths)
EXTEND_CASES = [
    (1, 2, 64, torch.float32, [0, 0, 0], [1, 17, 9]),  # empty cached prefixes
    (3, 3, 64, torch.float32, [5, 0, 30], [17, 1, 40]),
    (3, 1, 64, torch.bfloat16, [0, 17], [17, 1]),
    (8, 1, 128, torch.float32, [20, 0, 3], [17, 1, 33]),
    (8, 1, 128, torch.bfloat16, [0, 64], [40, 17]),
    (1, 1, 64, torch.float32, [0, 983], [1000, 17]),  # 1000 new tokens; a 1000-token context
]


@pytest.mark.parametrize("group,hkv,d,dtype,prefix,ext", EXTEND_CASES)
def test_extend_attention_matches_reference(group, hkv, d, dtype, prefix, ext):
    gen = torch.Generator().manual_seed(hash((group, hkv, d, tuple(prefix), tuple(ext))) % 2**31)
    lens = [p + e for p, e in zip(prefix, ext)]
    kb, vb, r2t, rows = make_pool(lens, hkv, d, dtype, gen)
    hq, n = group * hkv, sum(ext)
    q = torch.randn(n, hq, d, generator=gen).to(dtype).to(DEVICE)
    p_t = torch.tensor(prefix, dtype=torch.int64, device=DEVICE)
    e_t = torch.tensor(ext, dtype=torch.int64, device=DEVICE)
    scale = d ** -0.5
    out = torch.full_like(q, float("nan"))
    big = max(ext) >= 1000
    res = T.extend_attention(q, kb, vb, r2t, rows, p_t, e_t, scale, out=out,
                             block_m=64 if big else None, block_n=64 if big else None)
    ref = R.extend_attention(q, kb, vb, r2t, rows, p_t, e_t, scale)
    assert res is out and res.shape == (n, hq, d)
    assert rel_err(res, ref) < TOL[dtype]


def test_extend_equals_decode_for_single_new_token():
    """A one-token extend over a prefix is a decode step: both kernels must agree."""
    gen = torch.Generator().manual_seed(2)
    lens = [9, 70]
    kb, vb, r2t, rows = make_pool(lens, 2, 64, torch.float32, gen)
    q = torch.randn(2, 4, 64, generator=gen).to(DEVICE)
    seq = torch.tensor(lens, device=DEVICE)
    one = torch.ones(2, dtype=torch.int64, device=DEVICE)
    a = T.extend_attention(q, kb, vb, r2t, rows, seq - 1, one, 0.125)
    b = T.decode_attention(q, kb, vb, r2t, rows, seq, 0.125)
    assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("pool_dtype,src_dtype", [(torch.float32, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16),
                                                  (torch.bfloat16, torch.float32)])
def test_store_kv_matches_reference(pool_dtype, src_dtype):
    gen = torch.Generator().manual_seed(3)
    S, hkv, d, n = 50, 3, 64, 13
    poison = torch.full((S, hkv, d), 7.0).to(pool_dtype).to(DEVICE)
    kb, vb = poison.clone(), poison.clone()
    kr, vr = poison.clone(), poison.clone()
    loc = (torch.randperm(S - 1, generator=gen)[:n] + 1).to(DEVICE)  # scattered slots
    k = torch.randn(n, hkv, d, generator=gen).to(src_dtype).to(DEVICE)
    v = torch.randn(n, hkv, d, generator=gen).to(src_dtype).to(DEVICE)
    T.store_kv(kb, vb, loc, k, v)
    R.store_kv(kr, vr, loc, k, v)
    untouched = torch.ones(S, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert torch.equal(kb[untouched], kr[untouched]) and torch.equal(vb[untouched], vr[untouched])
    if pool_dtype == src_dtype or DEVICE != "cpu":
        assert torch.equal(kb, kr) and torch.equal(vb, vr)
    else:
        # the interpreter converts float32 -> bf16 by truncation, torch rounds: <= 1 bf16 ulp
        assert rel_err(kb, kr) < 2 ** -7 and rel_err(vb, vr) < 2 ** -7


def test_store_kv_rejects_bad_shapes():
    kb = torch.zeros(10, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="store_kv"):
        T.store_kv(kb, kb.clone(), torch.tensor([1, 2], device=DEVICE),
                   torch.zeros(2, 3, 8, device=DEVICE), torch.zeros(2, 3, 8, device=DEVICE))


def test_dispatcher_routes_to_triton_kernels():
    from sglite import kernels

    gen = torch.Generator().manual_seed(4)
    kb, vb, r2t, rows = make_pool([5, 12], 1, 64, torch.float32, gen)
    q = torch.randn(2, 3, 64, generator=gen).to(DEVICE)
    lens = torch.tensor([5, 12], device=DEVICE)
    a = kernels.decode_attention(q, kb, vb, r2t, rows, lens, 0.125, impl="triton")
    b = kernels.decode_attention(q, kb, vb, r2t, rows, lens, 0.125, impl="torch")
    assert rel_err(a, b) < 1e-5


@pytest.mark.slow  # long loops under the Triton interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_batch_invariant_rows(dtype):
    """batch_invariant=True: a row's output is bitwise the same alone and inside batches of other
    lengths and sizes (a fixed number of KV splits, never derived from the batch)."""
    gen = torch.Generator().manual_seed(11)
    lens = [1, 40, 7, 300, 65, 2]
    kb, vb, r2t, rows = make_pool(lens, 2, 64, dtype, gen)
    q = torch.randn(len(lens), 6, 64, generator=gen).to(dtype).to(kb.device)
    sl = torch.tensor(lens, device=kb.device)
    run = lambda idx: T.decode_attention(q[idx], kb, vb, r2t, rows[idx], sl[idx], 0.125, batch_invariant=True)
    alone = [run(torch.tensor([i], device=kb.device)) for i in range(len(lens))]
    for idx in ([0, 1, 2, 3, 4, 5], [3, 1], [5, 3, 0], [2, 4, 1, 0]):
        out = run(torch.tensor(idx, device=kb.device))
        for j, i in enumerate(idx):
            assert torch.equal(out[j], alone[i][0]), (idx, i)
    ref = R.decode_attention(q, kb, vb, r2t, rows, sl, 0.125)
    assert rel_err(run(torch.arange(len(lens), device=kb.device)), ref) < TOL[dtype]
