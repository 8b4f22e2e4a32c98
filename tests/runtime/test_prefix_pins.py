"""PrefixPins: a pinned prefix survives LRU eviction; the token budget (and half the pool) is
enforced least recently pinned first; unpin / clear give the tokens back to LRU."""
import torch

from sglite.runtime.kv_pool import TokenToKVPool
from sglite.runtime.prefix_pins import PrefixPins
from sglite.runtime.radix_cache import RadixCache


def _cache(tokens=64):
    pool = TokenToKVPool(tokens, 1, num_layers=1, n_kv_heads=1, head_dim=2, dtype=torch.float32)
    return RadixCache(pool), pool


def _put(cache, pool, ids):
    slots = pool.alloc_extend(None, 0, len(ids))
    pool.free(slots[:cache.insert(ids, slots)])


def test_pinned_prefix_survives_eviction_and_unpin_releases_it():
    c, pool = _cache()
    pins = PrefixPins(c)
    _put(c, pool, [1, 2, 3, 4, 5, 6])
    _put(c, pool, [7, 8, 9, 10])
    n, dropped = pins.pin("a", [1, 2, 3, 4, 5, 6, 99], max_tokens=32)  # 99 was never cached
    assert (n, dropped) == (6, []) and pins.tokens == 6 and c.protected_size == 6
    assert c.evict(100) == 4                                           # only the unpinned branch goes
    assert len(c.match_prefix([1, 2, 3, 4, 5, 6])[0]) == 6
    c.check_invariants()
    assert pins.unpin("a") and not pins.unpin("a")
    assert c.protected_size == 0 and c.evict(100) == 6
    c.check_invariants()


def test_budget_unpins_least_recently_pinned_first():
    c, pool = _cache()
    pins = PrefixPins(c)
    for k in range(3):
        _put(c, pool, [10 * k + i for i in range(1, 6)])                 # three 5-token prefixes
    assert pins.pin("k0", [1, 2, 3, 4, 5], 12) == (5, [])
    assert pins.pin("k1", [11, 12, 13, 14, 15], 12) == (5, [])
    assert pins.pin("k2", [21, 22, 23, 24, 25], 12) == (5, ["k0"])
    assert pins.tokens == 10 and c.protected_size == 10 and len(pins) == 2
    assert pins.pin("big", list(range(1, 40)), 4) == (0, [])             # alone over the budget: not pinned
    assert pins.pin("none", [77, 78], 12) == (0, [])                     # nothing cached
    c.check_invariants()
    pins.clear()
    assert pins.tokens == 0 and c.protected_size == 0 and len(pins) == 0


def test_repin_replaces_and_pool_half_caps_budget():
    c, pool = _cache(16)
    pins = PrefixPins(c)
    _put(c, pool, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert pins.pin("a", [1, 2, 3], 100) == (3, [])
    assert pins.pin("a", [1, 2, 3, 4], 100) == (4, [])                   # the old pin of "a" released first
    assert pins.tokens == 4 and c.protected_size == 4
    assert pins.pin("b", list(range(1, 11)), 100) == (0, [])             # 10 > half of the 16-token pool
    c.check_invariants()
