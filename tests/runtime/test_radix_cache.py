"""RadixCache and KV pool units: match/insert/split, locking, LRU eviction, pages, policies."""
import pytest
import torch

from sglite.runtime.kv_pool import ReqToTokenPool, TokenToKVPool
from sglite.runtime.radix_cache import RadixCache


def _pool(tokens=64, page=1):
    return TokenToKVPool(tokens, page, num_layers=1, n_kv_heads=1, head_dim=2, dtype=torch.float32)


def _put(cache, pool, ids, own_prefix=0):
    slots = pool.alloc_extend(None, 0, len(ids))
    already = cache.insert(ids, slots)
    pool.free(slots[own_prefix:already])
    return slots


def test_match_splits_and_reuses_slots():
    pool = _pool()
    c = RadixCache(pool)
    s1 = _put(c, pool, [1, 2, 3, 4, 5])
    m, node = c.match_prefix([1, 2, 3, 9])
    assert m.tolist() == s1[:3].tolist()
    assert node.key == [1, 2, 3]  # split at the divergence
    c.check_invariants()
    s2 = _put(c, pool, [1, 2, 3, 7, 8])
    assert c.total_size() == 7
    assert pool.free_tokens() == 64 - 7
    assert s2.numel() == 5
    c.check_invariants()


def test_lru_eviction_skips_locked_and_prefers_old():
    pool = _pool(16)
    c = RadixCache(pool)
    _put(c, pool, [1, 1, 1, 1])
    _put(c, pool, [2, 2, 2, 2])
    _put(c, pool, [3, 3, 3, 3])
    _, n2 = c.match_prefix([2, 2, 2, 2])  # touch 2: most recent
    _, n3 = c.match_prefix([3, 3, 3, 3])
    c.inc_lock_ref(n3)
    assert c.evictable_size == 8 and c.protected_size == 4
    freed = c.evict(4)
    assert freed == 4
    assert c.match_prefix([1, 1, 1, 1])[0].numel() == 0, "the least recently used leaf goes first"
    assert c.match_prefix([2, 2, 2, 2])[0].numel() == 4
    assert c.evict(100) == 4  # only the unlocked one can go
    assert c.match_prefix([3, 3, 3, 3])[0].numel() == 4
    c.dec_lock_ref(n3)
    c.check_invariants()
    assert c.evictable_size == 4


def test_paged_match_is_whole_pages():
    pool = _pool(64, page=4)
    c = RadixCache(pool, page_size=4)
    ids = list(range(10, 22))  # 12 tokens = 3 pages
    slots = pool.alloc_extend(None, 0, 12)
    assert c.insert(ids, slots) == 0
    m, _ = c.match_prefix(ids[:6] + [99, 99])
    assert m.numel() == 4, "a partial page must not match"
    m, _ = c.match_prefix(ids + [5])
    assert m.tolist() == slots.tolist()
    c.check_invariants()
    with pytest.raises(AssertionError):
        c.insert(ids[:5], slots[:5])


def test_page_allocator_fills_last_page_first():
    pool = _pool(32, page=4)
    a = pool.alloc_extend(None, 0, 6)  # 2 pages
    assert (a // 4).unique().numel() == 2
    b = pool.alloc_extend(int(a[-1]), 6, 3)  # 2 fit in the second page, 1 needs a new page
    assert b[:2].tolist() == [int(a[-1]) + 1, int(a[-1]) + 2]
    assert pool.tokens_needed(6, 3) == 4
    assert pool.free_tokens() == 32 - 12


def test_disabled_cache_never_matches():
    pool = _pool()
    c = RadixCache(pool, disabled=True)
    s = pool.alloc_extend(None, 0, 4)
    assert c.insert([1, 2, 3, 4], s) == 4
    assert c.match_prefix([1, 2, 3, 4])[0].numel() == 0


def test_req_to_token_pool_rows():
    p = ReqToTokenPool(2, 8)
    a, b = p.alloc(), p.alloc()
    assert {a, b} == {0, 1} and p.alloc() is None
    p.free(a)
    with pytest.raises(AssertionError):
        p.free(a)


def test_policies_order_by_prefix():
    from sglite.runtime.req import Req
    from sglite.runtime.schedule_policy import order_waiting
    from sglite.sampling_params import SamplingParams

    pool = _pool(64)
    c = RadixCache(pool)
    _put(c, pool, [7] * 10)
    mk = lambda rid, ids: Req(rid=rid, input_ids=ids, params=SamplingParams(), sink=None, seed=0)
    reqs = [mk("none", [1, 2, 3]), mk("short", [7, 7, 1]), mk("long", [7] * 8 + [2]), mk("none2", [5, 5])]
    assert [r.rid for r in order_waiting("fcfs", reqs, c)] == ["none", "short", "long", "none2"]
    assert [r.rid for r in order_waiting("lpm", reqs, c)] == ["long", "short", "none", "none2"]
    dfs = [r.rid for r in order_waiting("dfs-weight", reqs, c)]
    assert sorted(dfs) == sorted(r.rid for r in reqs)
    assert abs(dfs.index("long") - dfs.index("short")) == 1, "requests sharing a subtree run back to back"
    with pytest.raises(ValueError, match="known"):
        order_waiting("nope", reqs, c)
