"""Sliding-window KV (sglite/runtime/swa_pool.py, the KV manager's window rules) on a tiny random
Gemma 3 (window 8, one local and one global layer): a request of 4x the window holds fewer KV
slots than the same request on full attention, out-of-window local slots go back to the pool while
it runs, prefix matches are cut where the window's local K/V was freed (outputs still HF's), and
every slot comes back at the end."""
import pytest
import torch

from sglite.runtime.swa_pool import SWATokenToKVPool, SWAView, swa_pool_tokens
from tests.runtime.family_parity import GREEDY, engine
from tests.runtime.test_families_gemma import FAMILIES

WINDOW = 8


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, real_checkpoint):
    """(model dir, one prompt of 4x the window + 6 tokens, the same model on full attention only)."""
    from sglite.runtime.tokenizer import Tokenizer
    from sglite.testing import make_tiny_family, word_prompts

    model_type, arch, fields = FAMILIES["gemma3"]
    d = make_tiny_family(tmp_path_factory.mktemp("g3"), model_type, arch, seed=3,
                         vocab_from=real_checkpoint.model_dir, **fields)
    full = dict(fields, layer_types=["full_attention", "full_attention"])
    d_full = make_tiny_family(tmp_path_factory.mktemp("g3full"), model_type, arch, seed=3,
                              vocab_from=real_checkpoint.model_dir, **full)
    prompt = word_prompts(Tokenizer.from_dir(d), 1, 4 * WINDOW + 6, 4 * WINDOW + 6, seed=11, exact=True)[0]
    return d, prompt, d_full


def held_per_step(e):
    """Record (full slots used, local slots used) at every forward of engine ``e``."""
    pool = e.runner.token_to_kv_pool
    rec, real = [], pool.begin_step

    def spy(fb):
        real(fb)
        local = pool.swa_used_tokens() if isinstance(pool, SWATokenToKVPool) else None
        rec.append((pool.capacity - pool.free_page_set().__len__() * pool.page_size, local))
    pool.begin_step = spy
    return rec


@pytest.mark.parametrize("radix", [False, True])
def test_window_request_holds_fewer_slots_than_full_attention(gemma3, radix):
    """Step by step: the same full slots as full attention, at most ~2 windows of local slots
    (radix cache on: the chunks the request put in the tree lose theirs too, except the window at
    the tree prefix's end); everything back at the end."""
    d, prompt, d_full = gemma3
    params = dict(GREEDY, max_new_tokens=6)
    with engine(d, disable_radix_cache=not radix, chunked_prefill_size=WINDOW, context_length=128) as e:
        pool = e.runner.token_to_kv_pool
        assert isinstance(pool, SWATokenToKVPool) and pool.local_layers == (True, False)
        assert pool.swa_capacity < pool.capacity and pool.saved_bytes > 0
        rec = held_per_step(e)
        out = e.generate(input_ids=prompt, sampling_params=params)["output_ids"]
        e.check_invariants()
        if radix:
            assert 0 < pool.swa_used_tokens() <= 2 * WINDOW + 1  # the tree keeps a window at each end
            assert e.flush_cache()
        assert pool.swa_used_tokens() == 0 and pool.free_tokens() == pool.swa_capacity  # nothing leaked
        assert len(pool.free_page_set()) == pool.num_pages
    with engine(d_full, disable_radix_cache=not radix, chunked_prefill_size=WINDOW, context_length=128) as e:
        full_pool = e.runner.token_to_kv_pool
        assert not isinstance(full_pool, SWATokenToKVPool)
        rec_full = held_per_step(e)
        e.generate(input_ids=prompt, sampling_params=params)
    assert len(rec) == len(rec_full) and len(prompt) >= 4 * WINDOW
    # same full slots step by step; the local layer never holds more than ~2 windows of slots
    assert [f for f, _ in rec] == [f for f, _ in rec_full]
    assert max(s for _, s in rec) <= 2 * WINDOW + 1
    last_full, last_local = rec[-1]
    assert last_full >= len(prompt) + 4 and last_local <= 2 * WINDOW + 1
    # bytes held at the last step: global layer on every position, local layer on its window only
    held = last_full * pool.global_bytes_per_token + last_local * pool.local_bytes_per_token
    assert held < last_full * full_pool.bytes_per_token
    assert len(out) == 6


def test_prefix_match_cut_where_the_window_was_freed(gemma3):
    """A cached prompt whose middle lost its local K/V: a request sharing only that middle part
    reuses less than the tree holds, and still gives HF's tokens."""
    from sglite.testing import hf_greedy

    d, prompt, _ = gemma3
    other = prompt[:3 * WINDOW] + prompt[-5:][::-1]
    (ref_other,), _ = hf_greedy(d, [other], GREEDY["max_new_tokens"])
    with engine(d, chunked_prefill_size=-1) as e:
        e.generate(input_ids=prompt, sampling_params=GREEDY)
        kvm = e.scheduler.kv
        tree_slots, _ = kvm.cache.match_prefix(other[:-1])
        usable, _ = kvm.match_prefix(other[:-1])
        assert len(tree_slots) >= 3 * WINDOW > len(usable)  # the window before 3*WINDOW was freed
        r = e.generate(input_ids=other, sampling_params=GREEDY)
        assert r["output_ids"] == ref_other
        assert r["meta_info"]["cached_tokens"] == len(usable)
        again = e.generate(input_ids=prompt, sampling_params=GREEDY)  # its own tail window is held
        assert again["meta_info"]["cached_tokens"] == len(prompt) - 1
        e.check_invariants()
        assert e.flush_cache()
        pool = e.runner.token_to_kv_pool
        assert pool.swa_used_tokens() == 0 and len(pool.free_page_set()) == pool.num_pages


def test_pool_slot_accounting_unit():
    """alloc gives a local slot per token; free_swa / adopt_swa / free keep the books; begin_step
    translates a step's slots."""
    pool = SWATokenToKVPool(64, 20, 4, (True, False, True), 8, 1, 4, torch.float32)
    assert len(pool.k_buffers) == 3 and pool.k_buffers[0].shape[0] == 21 and pool.k_buffers[1].shape[0] == 68
    a = pool.alloc_extend(None, 0, 10)
    assert a is not None and pool.swa_used_tokens() == 10 and bool(pool.held_mask(a).all())
    pool.free_swa(a[:6])
    assert pool.swa_used_tokens() == 4 and pool.held_mask(a).tolist() == [False] * 6 + [True] * 4
    b = pool.alloc_extend(None, 0, 6)
    pool.free_swa(b[4:])
    pool.adopt_swa(b[4:], a[8:])  # b's last two take a's local slots
    assert bool(pool.held_mask(b).all()) and pool.held_mask(a[8:]).tolist() == [False, False]
    assert pool.alloc_extend(int(b[-1]), 6, 20) is None  # local slots short: nothing allocated
    assert pool.swa_used_tokens() == 8
    pool.check_swa()
    req_to_token = torch.zeros(2, 16, dtype=torch.int32)
    req_to_token[1, :10] = a.to(torch.int32)

    class FB:
        ext_req_pool_indices = torch.tensor([1])
        dec_req_pool_indices = torch.tensor([], dtype=torch.int64)
        positions = torch.arange(7, 10)
        out_cache_loc = a[7:10]
    fb = FB()
    fb.req_to_token = req_to_token
    pool.begin_step(fb)
    assert isinstance(fb.swa, SWAView) and fb.swa.req_to_token.shape == (1, 10)
    assert fb.swa.req_to_token[0, :6].tolist() == [0] * 6 and bool((fb.swa.req_to_token[0, 6:8] > 0).all())
    assert fb.swa.out_cache_loc.tolist() == pool.full_to_swa[a[7:10]].tolist()
    pool.free(a)
    pool.free(b)
    assert pool.swa_used_tokens() == 0 and len(pool.free_page_set()) == pool.num_pages
    pool.check_swa()
    assert swa_pool_tokens(10_000, 8, 4, 100, 1) == 4 * 18 + 200 and swa_pool_tokens(50, 8, 4, 100, 1) == 50


@pytest.mark.slow
def test_small_local_pool_evicts_and_stays_exact(gemma3, monkeypatch):
    """Local slots for only a few windows: the radix tree is evicted (and requests retracted) to
    make room, outputs stay HF's and nothing leaks."""
    from sglite.runtime import swa_pool
    from sglite.testing import hf_greedy

    d, prompt, _ = gemma3
    prompts = [prompt, prompt[:30] + prompt[5:12], prompt[3:] + prompt[:4], prompt[::-1][:33]]
    refs, _ = hf_greedy(d, prompts, GREEDY["max_new_tokens"])
    monkeypatch.setattr(swa_pool, "swa_pool_tokens", lambda full, *a: 6 * WINDOW + len(prompt) + 16)
    with engine(d, chunked_prefill_size=WINDOW) as e:
        pool = e.runner.token_to_kv_pool
        assert pool.swa_capacity == 6 * WINDOW + len(prompt) + 16
        for _ in range(2):
            out = e.generate(input_ids=prompts, sampling_params=GREEDY)
            assert [r["output_ids"] for r in out] == refs
        assert e.scheduler.kv.evicted_tokens > 0  # the local slots ran short: the tree gave them back
        e.check_invariants()
        assert e.flush_cache()
        assert pool.swa_used_tokens() == 0 and len(pool.free_page_set()) == pool.num_pages


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(speculative_algorithm="NGRAM"), dict(enable_deterministic_inference=True),
                                dict(page_size=4), dict(page_size=4, chunked_prefill_size=-1)])
def test_speculative_and_deterministic_on_the_hybrid_pool(gemma3, kw):
    """NGRAM drafts (slots reserved past the window, rejected ones trimmed), the batch-invariant
    path and pages of 4 tokens on the hybrid pool: HF's tokens (twice: the second from the radix
    cache), nothing leaked."""
    from sglite.testing import hf_greedy

    d, prompt, _ = gemma3
    prompts = [prompt, prompt[:20] * 2]
    refs, _ = hf_greedy(d, prompts, GREEDY["max_new_tokens"])
    with engine(d, **{"chunked_prefill_size": WINDOW, **kw}) as e:
        for _ in range(2):
            out = e.generate(input_ids=prompts, sampling_params=GREEDY)
            assert [r["output_ids"] for r in out] == refs
        e.check_invariants()
        assert e.flush_cache()
        pool = e.runner.token_to_kv_pool
        assert pool.swa_used_tokens() == 0 and len(pool.free_page_set()) == pool.num_pages


def test_kv_manager_window_rules_unit():
    """KVManager on a hybrid pool, no model: commit frees the request's own out-of-window local
    slots; a chunk that duplicates cached slots whose local K/V is gone hands its own to them
    (adopt) so its window survives; a prefix match is cut to where the window is held."""
    from sglite.runtime.kv_manager import KVManager
    from sglite.runtime.kv_pool import ReqToTokenPool

    class Req:
        def __init__(self, rid, ids):
            self.rid, self.ids, self.kv = rid, ids, None

        def tokens(self, a, b):
            return self.ids[a:b]

    pool = SWATokenToKVPool(256, 200, 1, (True, False), WINDOW, 1, 4, torch.float32)
    kvm = KVManager(ReqToTokenPool(4, 128), pool, 1)
    x = list(range(100, 148))
    r1, r2 = Req("r1", x), Req("r2", x[:40])
    empty, root = kvm.match_prefix(x)
    assert kvm.admit(r1, empty, root, 48) and kvm.admit(r2, empty, root, 40)  # both before any insert
    kvm.commit(r1, 48)  # frees r1's local slots below 40, then the tree takes all 48 positions
    assert pool.swa_used_tokens() == 8 + 40 and r1.kv.prefix_len == 48
    kvm.commit(r2, 40)  # r2's first 40 duplicate the tree's, whose 32..39 lost their local K/V
    assert r2.kv.prefix_len == 40
    kvm.check_invariants([r1, r2])  # r2's window (33..39) is held, through the tree's slots
    row = kvm.req_to_token[r2.kv.row, :40].long()
    assert pool.held_mask(row).tolist() == [False] * 32 + [True] * 8
    kvm.release(r1)
    kvm.release(r2)
    kvm.check_invariants([])
    slots, _ = kvm.match_prefix(x + [1])
    assert len(slots) == 48  # its own tail window is held
    slots, _ = kvm.match_prefix(x[:36] + [1])
    assert len(slots) == 0  # 29..35 lost their local K/V: nothing before is usable either
    slots, _ = kvm.match_prefix(x[:40] + [1])
    assert len(slots) == 40  # r2's adopted window
    kvm.flush()
    assert pool.swa_used_tokens() == 0 and len(pool.free_page_set()) == pool.num_pages


def test_batch_log_counts_each_slot_space(gemma3, caplog):
    """The scheduler's lines give the full slot space's usage and the local one's beside it; the
    smaller local space is not counted as full-pool use (an idle Gemma 3 270M server logged
    ``token usage: 0.40``: capacity minus the local slots)."""
    d, prompt, _ = gemma3
    with engine(d, disable_radix_cache=True, chunked_prefill_size=WINDOW, context_length=128) as e:
        pool = e.runner.token_to_kv_pool
        assert pool.swa_capacity < pool.capacity
        with caplog.at_level("INFO", logger="sglite.scheduler"):
            e.generate(input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=2))
    first = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Prefill batch."))
    full = -(-WINDOW // pool.page_size) * pool.page_size  # the first chunk's slots, whole pages
    assert f"token usage: {full / pool.capacity:.2f}, swa token usage: {WINDOW / pool.swa_capacity:.2f}," in first
