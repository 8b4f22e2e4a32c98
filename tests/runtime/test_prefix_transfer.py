"""Prefix KV transfer (the engine side of prefill/decode disaggregation): ``Engine.export_prefix`` /
``import_prefix`` / ``kv_layout`` and the ``KVManager`` methods they run on the loop thread."""
import pytest
import torch

from sglite.runtime.kv_manager import KVManager
from sglite.runtime.kv_pool import ReqToTokenPool, TokenToKVPool
from sglite.runtime.kv_quant import make_pool

L, H, D = 2, 2, 4


def _manager(tokens=64, page_size=4, disabled=False) -> KVManager:
    pool = TokenToKVPool(tokens, page_size, L, H, D, torch.float32)
    return KVManager(ReqToTokenPool(4, 64), pool, page_size, disable_radix_cache=disabled)


def _kv(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, n, H, D, generator=g), torch.randn(L, n, H, D, generator=g)


def test_write_then_read_gives_the_same_kv_whole_pages_only():
    kvm = _manager()
    ids = list(range(100, 111))  # 11 tokens: two whole pages of 4
    k, v = _kv(len(ids))
    assert kvm.write_prefix(ids, k, v) == 8
    got, k2, v2 = kvm.read_prefix(ids)
    assert got == ids[:8] and k2.dtype == v2.dtype == torch.float32
    assert torch.equal(k2, k[:, :8]) and torch.equal(v2, v[:, :8])
    assert kvm.kv_layout() == (torch.float32, (L, H, D))
    kvm.check_invariants([])


def test_a_cached_part_is_kept_and_only_the_rest_written():
    kvm = _manager()
    ids = list(range(1, 13))
    k, v = _kv(12)
    assert kvm.write_prefix(ids[:4], k[:, :4], v[:, :4]) == 4
    other_k, other_v = _kv(12, seed=1)
    other_k[:, 4:], other_v[:, 4:] = k[:, 4:], v[:, 4:]
    assert kvm.write_prefix(ids, other_k, other_v) == 12  # the first page stays as it was
    _, k2, v2 = kvm.read_prefix(ids)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert kvm.write_prefix(ids, other_k, other_v) == 12  # all cached: nothing written
    kvm.check_invariants([])


def test_a_short_pool_evicts_lru_entries_then_keeps_what_fits():
    kvm = _manager(tokens=8)  # two pages
    a, b = list(range(1, 9)), list(range(50, 58))
    assert kvm.write_prefix(a, *_kv(8)) == 8
    assert kvm.write_prefix(b, *_kv(8, seed=2)) == 8  # a evicted
    assert kvm.evicted_tokens == 8 and kvm.read_prefix(a)[0] == []
    kvm.check_invariants([])


def test_nothing_is_written_without_a_radix_cache_or_a_whole_page():
    assert _manager(disabled=True).write_prefix(list(range(8)), *_kv(8)) == 0
    kvm = _manager()
    assert kvm.write_prefix([1, 2, 3], *_kv(3)) == 0
    assert kvm.read_prefix([1, 2, 3])[0] == [] and kvm.free_tokens() == 64


def test_wrong_shapes_and_quantized_pools_are_refused():
    kvm = _manager()
    k, v = _kv(8)
    with pytest.raises(ValueError, match=r"k: shape \(2, 8, 2, 4\), expected \(2, 7, 2, 4\)"):
        kvm.write_prefix(list(range(7)), k, v)
    with pytest.raises(ValueError, match="v: shape"):
        kvm.write_prefix(list(range(8)), k, v[:1])
    pool = make_pool("fp8_e4m3", 64, 4, L, H, D, torch.float32, "cpu", 16, 4)
    quant = KVManager(ReqToTokenPool(4, 64), pool, 4)
    for call in (quant.kv_layout, lambda: quant.read_prefix([1]), lambda: quant.write_prefix(list(range(8)), k, v)):
        with pytest.raises(ValueError, match="kv_cache_dtype auto or bfloat16"):
            call()


def test_engine_round_trip_serves_the_prompt_from_the_imported_kv(tiny_model_dir):
    """Export a prefilled prompt's KV, flush the cache, import it back: the same K/V, and the next
    request reuses it (every prompt token but the last cached) with the same greedy output."""
    from sglite import Engine

    sp = {"max_new_tokens": 4, "temperature": 0}
    with Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=1024, log_level="warning") as e:
        ids = e.tokenizer.encode("Once upon a time, in a small village,")
        want = e.generate(input_ids=ids, sampling_params=sp)["output_ids"]
        e.cache_prefix(input_ids=ids)
        got, k, v = e.export_prefix(ids)
        dtype, (layers, heads, dim) = e.kv_layout()
        assert got == ids and k.shape == v.shape == (layers, len(ids), heads, dim) == (2, len(ids), 2, 16)
        assert k.dtype == v.dtype == dtype == torch.float32 and k.device.type == "cpu"
        assert e.flush_cache() and e.export_prefix(ids)[0] == []
        assert e.import_prefix(got, k, v) == len(ids)
        got2, k2, v2 = e.export_prefix(ids)
        assert got2 == ids and torch.equal(k2, k) and torch.equal(v2, v)
        out = e.generate(input_ids=ids, sampling_params=sp)
        assert out["meta_info"]["cached_tokens"] == len(ids) - 1 and out["output_ids"] == want
        with pytest.raises(ValueError, match="expected"):
            e.import_prefix(ids[:-1], k, v)
        e.check_invariants()
