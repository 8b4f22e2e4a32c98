"""The KV pool's page order (sglite/runtime/kv_pool.py): every allocation takes the lowest free
pages, in ascending order, on a fresh pool and after frees (never-used pages on a stack, freed
ones in a min-heap), so a request's slots form one ascending run and freed pages are reused
before fresh memory is touched."""
import torch

from sglite.runtime.kv_pool import TokenToKVPool


def pool(tokens, page):
    return TokenToKVPool(tokens, page, num_layers=1, n_kv_heads=1, head_dim=2, dtype=torch.float32)


def test_allocations_take_the_lowest_free_pages_in_ascending_order():
    p = pool(10, 1)
    assert p.alloc_extend(None, 0, 6).tolist() == [1, 2, 3, 4, 5, 6]
    p.free(torch.tensor([5, 2, 3]))
    assert p.free_tokens() == 7 and p.free_page_set() == {2, 3, 5, 7, 8, 9, 10}
    assert p.alloc_extend(None, 0, 4).tolist() == [2, 3, 5, 7]  # freed ones first, then fresh, ascending
    p.free(torch.tensor([4, 1]))
    assert p.alloc_extend(None, 0, 3).tolist() == [1, 4, 8]
    assert p.free_tokens() == 2 and p.alloc_extend(None, 0, 3) is None  # nothing taken when short
    assert p.alloc_extend(None, 0, 2).tolist() == [9, 10] and p.free_tokens() == 0


def test_pages_of_several_slots_follow_the_same_order():
    p = pool(16, 4)  # pages 1..4, slots 4..19
    first = p.alloc_extend(None, 0, 6)  # two pages: 1, 2
    assert first.tolist() == [4, 5, 6, 7, 8, 9]
    assert p.alloc_extend(int(first[-1]), 6, 3).tolist() == [10, 11, 12]  # the rest of page 2, then page 3
    p.free(torch.arange(4, 8))  # page 1
    assert p.alloc_extend(None, 0, 8).tolist() == list(range(4, 8)) + list(range(16, 20))  # page 1, then page 4
    assert p.free_tokens() == 0
