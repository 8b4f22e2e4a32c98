"""Torch reference kernels against naive per-request attention (the oracle the Triton kernels inherit)."""
import sys

import pytest
import torch

from sglite.kernels import reference as R


def _naive(q, kb, vb, slots, scale):
    """q: [Hq, D]; slots: [L] → [Hq, D] softmax attention in float64 (GQA by head repetition)."""
    k, v = kb[slots].double(), vb[slots].double()  # [L, Hkv, D]
    g = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [L, Hq, D]
    p = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), k) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", p, v)


@pytest.mark.parametrize("lens,hkv,group,dtype", [([1], 1, 1, torch.float32), ([37], 3, 3, torch.float32),
                                                  ([300], 3, 3, torch.bfloat16), ([5, 1, 64], 2, 4, torch.float32),
                                                  ([1, 129], 3, 3, torch.bfloat16)])
@pytest.mark.parametrize("head_major", [False, True])
def test_decode_attention_matches_naive(lens, hkv, group, dtype, head_major):
    gen = torch.Generator().manual_seed(len(lens) * 7 + hkv)
    D, S = 64, 512
    kb = torch.randn(S, hkv, D, generator=gen).to(dtype)
    vb = torch.randn(S, hkv, D, generator=gen).to(dtype)
    if head_major:  # TokenToKVPool's layout: [Hkv, S, D] storage seen as [S, Hkv, D]
        kb, vb = kb.transpose(0, 1).contiguous().transpose(0, 1), vb.transpose(0, 1).contiguous().transpose(0, 1)
    r2t = torch.zeros(len(lens) + 2, 400, dtype=torch.int32)
    perm = torch.randperm(S - 1, generator=gen) + 1
    rows, start = [], 0
    for i, n in enumerate(lens):  # request i lives in row i + 1, slots scattered
        r2t[i + 1, :n] = perm[start:start + n].int()
        rows.append(i + 1)
        start += n
    q = torch.randn(len(lens), hkv * group, D, generator=gen).to(dtype)
    out = R.decode_attention(q, kb, vb, r2t, torch.tensor(rows), torch.tensor(lens), 0.125)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lens):
        ref = _naive(q[i], kb, vb, r2t[i + 1, :n].long(), 0.125)
        assert (out[i].double() - ref).abs().max() < tol


def test_batch_one_path_equals_batched_path():
    gen = torch.Generator().manual_seed(3)
    kb, vb = torch.randn(64, 2, 16, generator=gen), torch.randn(64, 2, 16, generator=gen)
    r2t = torch.arange(2 * 40, dtype=torch.int32).view(2, 40) % 63 + 1
    q = torch.randn(2, 6, 16, generator=gen)
    both = R.decode_attention(q, kb, vb, r2t, torch.tensor([0, 1]), torch.tensor([40, 17]), 0.25)
    one = R.decode_attention(q[1:], kb, vb, r2t, torch.tensor([1]), torch.tensor([17]), 0.25)
    assert torch.allclose(both[1:], one, atol=1e-6)


@pytest.mark.parametrize("head_major", [False, True])
def test_extend_attention_matches_naive(head_major):
    gen = torch.Generator().manual_seed(11)
    S, hkv, g, D = 256, 2, 3, 32
    kb, vb = torch.randn(S, hkv, D, generator=gen), torch.randn(S, hkv, D, generator=gen)
    if head_major:
        kb, vb = kb.transpose(0, 1).contiguous().transpose(0, 1), vb.transpose(0, 1).contiguous().transpose(0, 1)
    prefix, ext = [0, 7], [5, 9]
    r2t = torch.zeros(3, 64, dtype=torch.int32)
    perm = torch.randperm(S - 1, generator=gen) + 1
    r2t[1, :5], r2t[2, :16] = perm[:5].int(), perm[5:21].int()
    q = torch.randn(sum(ext), hkv * g, D, generator=gen)
    out = R.extend_attention(q, kb, vb, r2t, torch.tensor([1, 2]), torch.tensor(prefix), torch.tensor(ext), 0.2)
    i = 0
    for row, p, e in zip([1, 2], prefix, ext):
        for j in range(e):  # new token j sees prefix + new tokens 0..j
            ref = _naive(q[i], kb, vb, r2t[row, :p + j + 1].long(), 0.2)
            assert (out[i].double() - ref).abs().max() < 1e-5
            i += 1


def test_zeros_untouched_is_aligned_zeroed_and_usable():
    from sglite.kernels.host_memory import HUGE_PAGE, zeros_untouched

    t = zeros_untouched((3, 50000, 64), torch.bfloat16)  # 19 MB: the mmap path
    assert t.shape == (3, 50000, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0 and not t.any()
    t[1, 7] = 1.0
    assert int(t.sum()) == 64
    small = zeros_untouched((4, 4), torch.float32)  # below the threshold: plain zeros
    assert small.shape == (4, 4) and not small.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_zeros_untouched_maps_private_memory():
    """The pool is a private anonymous mapping, the kind the huge-page advice governs
    (``enabled``; a shared one follows ``shmem_enabled`` whatever the advice)."""
    from sglite.kernels.host_memory import zeros_untouched

    t = zeros_untouched((3, 50000, 64), torch.bfloat16)  # 19 MB: the mmap path
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                perms = line.split()[1]
                break
        else:
            raise AssertionError("the buffer is in no mapping")
    assert perms.endswith("p"), f"mapping {perms}: shared, not private"
    del t


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_zeros_untouched_touches_no_page_before_use():
    """A 1 GiB zeroed buffer (a KV pool) is not resident until written: start-up does not pay for
    zeroing the pool."""
    from sglite.kernels.host_memory import zeros_untouched

    before = _resident_bytes()
    t = zeros_untouched((1 << 29,), torch.bfloat16)  # 1 GiB
    grown = _resident_bytes() - before
    assert grown < 64 << 20, f"{grown / 2**20:.0f} MiB resident right after allocation"
    t[: 1 << 20] = 1.0  # 2 MiB written: those pages become resident, the rest stays zero
    assert float(t[(1 << 20) - 1]) == 1.0 and float(t[1 << 20]) == 0.0 and float(t[-1]) == 0.0
    del t
