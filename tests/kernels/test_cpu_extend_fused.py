"""The AMX extend path's fused tasks (csrc/cpu_extend_attention.cpp's run_fused_amx): a request of
2 to 16 query blocks (a short extend over a long cached prefix, e.g. an agent's late turn) packs
each 256-key block once into its thread's scratch and runs all its query blocks over it. Bitwise
the same as the call-wide packing (``fuse=False``) and as every task packing its own keys
(``pack_kv=False``), whatever the thread count (which picks 16, 8, 4 or 2 blocks a fused task), and
within the bf16 tolerance of the torch reference; prefixes 0, 1, 15, 16, 17 and 1,100, extends 1,
16, 70 and 512, scattered (paged) slots, windows and soft-caps."""

import pytest
import torch

from tests.kernels.builds import amx_extend_ops
from tests.kernels.test_cpu_extend_attention import make_case
from sglite.kernels import cpu_attention, reference


@pytest.fixture(scope="module")
def ops():
    return amx_extend_ops()


@pytest.fixture
def threads():
    """Restores torch's thread count after a test that sets it."""
    n = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(n)


def three_ways(case, window=0, softcap=0.0):
    fused = cpu_attention.extend_attention(*case, window, softcap, amx=True)
    call_wide = cpu_attention.extend_attention(*case, window, softcap, amx=True, fuse=False)
    per_task = cpu_attention.extend_attention(*case, window, softcap, amx=True, pack_kv=False)
    return fused, call_wide, per_task


LENS = [  # (prefix, extend) per request; with 9/3 heads a query block is 21 tokens
    [(1100, 70), (0, 16), (1, 70), (15, 1), (16, 70), (17, 16)],
    [(1100, 70)],  # one request: fused tasks of 2 blocks at 2 threads, 4 at 1
    [(1100, 512), (17, 70), (16, 168)],  # 512: 25 blocks (call-wide packing) beside fused requests; 168: 8 blocks
    [(1100, 300), (5, 200), (600, 336)],  # 15, 10 and 16 blocks
]


@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("lens", LENS)
def test_fused_tasks_give_the_packed_bits(ops, threads, lens, nthreads):
    threads(nthreads)
    case = make_case(lens, 9, 3, 64, torch.bfloat16, True, seed=len(lens) + nthreads)
    fused, call_wide, per_task = three_ways(case)
    assert torch.equal(fused, call_wide) and torch.equal(fused, per_task), lens
    ref = reference.extend_attention(*case).double()
    torch.testing.assert_close(fused.double(), ref, atol=4e-2, rtol=4e-2)


@pytest.mark.parametrize("window,softcap", [(0, 7.5), (37, 0.0), (300, 30.0), (1000, 0.0)])
def test_fused_tasks_with_windows_and_softcaps(ops, threads, window, softcap):
    """Windows that start mid-block, so a fused task's later query blocks skip blocks its first
    one reads; random GQA ratios and head dims; q in bf16 and float32."""
    g = torch.Generator().manual_seed(window + int(softcap))
    for trial in range(2):
        threads(1 + trial)
        Hkv = int(torch.randint(1, 3, (1,), generator=g))
        G = int(torch.randint(2, 9, (1,), generator=g))
        D = [64, 80, 128][int(torch.randint(0, 3, (1,), generator=g))]
        qb = 64 // G
        lens = [(int(torch.randint(0, 700, (1,), generator=g)), int(torch.randint(2 * qb, 8 * qb + 1, (1,), generator=g)))
                for _ in range(2)]
        case = make_case(lens, G * Hkv, Hkv, D, torch.bfloat16, trial == 0, seed=trial)
        if trial == 1:
            case = (case[0].float(),) + case[1:]
        fused, call_wide, per_task = three_ways(case, window, softcap)
        assert torch.equal(fused, call_wide) and torch.equal(fused, per_task), (lens, G, Hkv, D)
        ref = reference.extend_attention(*case, window=window, softcap=softcap).double()
        torch.testing.assert_close(fused.double(), ref, atol=4e-2, rtol=4e-2)


@pytest.mark.parametrize("lens,Hq,Hkv,D", [([(300, 5), (17, 8)], 40, 1, 64),  # G = 40: one token a block
                                             ([(1100, 16), (16, 70)], 16, 2, 128),  # G = 8, D = 128
                                             ([(600, 100)], 4, 1, 256)])  # Gemma 3's heads: 16 tokens a block
def test_fused_tasks_other_head_shapes(ops, threads, lens, Hq, Hkv, D):
    threads(1)
    case = make_case(lens, Hq, Hkv, D, torch.bfloat16, True, seed=Hq + D)
    fused, call_wide, per_task = three_ways(case)
    assert torch.equal(fused, call_wide) and torch.equal(fused, per_task), lens
    torch.testing.assert_close(fused.double(), reference.extend_attention(*case).double(), atol=4e-2, rtol=4e-2)


def test_fused_task_refuses_a_slot_outside_the_pool(ops):
    q, k, v, rt, rows, pre, ext, scale = make_case([(300, 70)], 9, 3, 64, torch.bfloat16, True, seed=4)
    rt[rows[0], 200] = k.shape[0]
    with pytest.raises(IndexError, match="outside the pool"):
        cpu_attention.extend_attention(q, k, v, rt, rows, pre, ext, scale, amx=True)
