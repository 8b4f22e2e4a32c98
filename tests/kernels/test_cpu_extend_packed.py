"""The AMX extend path's once-per-call K/V packing (csrc/cpu_extend_attention.cpp's plan_pack,
csrc/amx_attention.h's pack_to / walk_packed): bit-identical to every task packing its own keys
(``pack_kv=False``) on random ragged shapes, GQA ratios, head dims, windows and soft-caps, and
it still refuses a slot outside the pool."""

import pytest
import torch

from tests.kernels.builds import amx_extend_ops
from tests.kernels.test_cpu_extend_attention import make_case
from sglite.kernels import cpu_attention


@pytest.fixture(scope="module")
def ops():
    return amx_extend_ops()


def both(case, window=0, softcap=0.0):
    packed = cpu_attention.extend_attention(*case, window, softcap, amx=True)
    per_task = cpu_attention.extend_attention(*case, window, softcap, amx=True, pack_kv=False)
    return packed, per_task


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (0, 7.5), (37, 0.0), (300, 30.0)])
def test_packed_keys_give_the_per_task_bits(ops, window, softcap):
    """Requests with several tasks per head (packed) beside single-task ones (not packed), prefixes
    on and off the 256-key block edges, q in bf16 and float32."""
    g = torch.Generator().manual_seed(window * 7 + int(softcap) + 3)
    for trial in range(3):
        B = int(torch.randint(1, 4, (1,), generator=g))
        Hkv = int(torch.randint(1, 3, (1,), generator=g))
        G = int(torch.randint(1, 9, (1,), generator=g))
        D = [16, 64, 80, 128, 256][int(torch.randint(0, 5, (1,), generator=g))]
        lens = [(int(torch.randint(0, 600, (1,), generator=g)), int(torch.randint(1, 200, (1,), generator=g)))
                for _ in range(B)]
        lens[0] = (lens[0][0], max(lens[0][1], 70))  # at least one request with several tasks
        case = make_case(lens, G * Hkv, Hkv, D, torch.bfloat16, trial % 2 == 0, seed=trial)
        if trial == 2:
            case = (case[0].float(),) + case[1:]
        packed, per_task = both(case, window, softcap)
        assert torch.equal(packed, per_task), (lens, G, Hkv, D)
        assert not torch.isnan(packed).any()


def test_packed_edges(ops):
    """Extends ending exactly on and one past a 256-key block, a 512-token chunk over 256 cached
    keys with a window that starts mid-block, and G = 80 > 64 rows (one token per task)."""
    for lens, Hq, Hkv, D, window in [([(0, 256), (255, 66)], 9, 3, 64, 0), ([(256, 512)], 9, 3, 64, 100),
                                     ([(1, 257)], 4, 1, 128, 0), ([(3, 5), (10, 3)], 80, 1, 8, 0)]:
        case = make_case(lens, Hq, Hkv, D, torch.bfloat16, True, seed=len(lens) + D)
        packed, per_task = both(case, window)
        assert torch.equal(packed, per_task), lens


def test_packed_path_refuses_a_slot_outside_the_pool(ops):
    q, k, v, rt, rows, pre, ext, scale = make_case([(40, 90)], 6, 2, 64, torch.bfloat16, True, seed=5)
    rt[rows[0], 100] = k.shape[0]
    with pytest.raises(IndexError, match="outside the pool"):
        cpu_attention.extend_attention(q, k, v, rt, rows, pre, ext, scale, amx=True)
