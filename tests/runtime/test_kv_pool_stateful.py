"""The KV pool's page allocator (sglite/runtime/kv_pool.py) against a model of it: random
interleavings of allocations (single and batched, pages of 1 and of several slots, requests that
grow into the rest of their last page) and frees, checked after every step: no page is owned twice
or lost, ``num_free_pages()`` / ``free_page_set()`` match the model, each allocation takes the
lowest free pages in ascending order, and a page freed twice or never handed out is refused."""
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sglite.runtime.kv_pool import TokenToKVPool


def pool(tokens, page):
    return TokenToKVPool(tokens, page, num_layers=1, n_kv_heads=1, head_dim=2, dtype=torch.float32)


class PoolModel(RuleBasedStateMachine):
    """Requests are lists of slots; the model's free pages are a plain set."""

    @initialize(page_size=st.sampled_from([1, 2, 4]), pages=st.integers(1, 12))
    def start(self, page_size, pages):
        self.ps, self.pool = page_size, pool(pages * page_size, page_size)
        self.free_model = set(range(1, pages + 1))
        self.reqs: list = []

    def _check_taken(self, slots, fresh_pages):
        """``fresh_pages`` (in the order they were first used) are the lowest free ones, ascending."""
        want = sorted(self.free_model)[:len(fresh_pages)]
        assert fresh_pages == want, (fresh_pages, want)
        self.free_model -= set(fresh_pages)

    def _fresh(self, slots, old_pages):
        seen, out = set(old_pages), []
        for s in slots:
            pg = s // self.ps
            if pg not in seen:
                seen.add(pg)
                out.append(pg)
        return out

    @rule(data=st.data())
    def alloc(self, data):
        """New requests and extensions of existing ones, in one batched call."""
        items, owners = [], []
        for _ in range(data.draw(st.integers(1, 3))):
            n = data.draw(st.integers(1, 3 * self.ps + 1))
            grow = [i for i in range(len(self.reqs)) if i not in owners]
            if grow and data.draw(st.booleans()):
                i = data.draw(st.sampled_from(grow))
                items.append((self.reqs[i][-1], len(self.reqs[i]), n))
                owners.append(i)
            else:
                items.append((None, 0, n))
                owners.append(None)
        need = sum(self.pool.tokens_needed(s, n) for _, s, n in items) // self.ps
        before = self.pool.num_free_pages()
        out = self.pool.alloc_extend_many(items)
        if need > len(self.free_model):
            assert out is None and self.pool.num_free_pages() == before
            return
        assert out is not None and len(out) == sum(n for _, _, n in items)
        assert len(set(out)) == len(out)
        self._check_taken(out, self._fresh(out, {s // self.ps for i in owners if i is not None for s in self.reqs[i]}))
        k = 0
        for (_, _, n), i in zip(items, owners):
            part = out[k:k + n]
            k += n
            if i is None:
                self.reqs.append(part)
            else:
                assert part[0] == self.reqs[i][-1] + 1 or self.reqs[i][-1] % self.ps == self.ps - 1
                self.reqs[i].extend(part)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        i = data.draw(st.integers(0, len(self.reqs) - 1))
        slots = self.reqs.pop(i)
        self.pool.free(torch.tensor(slots, dtype=torch.int64))
        self.free_model |= {s // self.ps for s in slots}
        with pytest.raises(ValueError, match="already free"):  # a second free changes nothing
            self.pool.free(torch.tensor(slots[:1], dtype=torch.int64))

    @precondition(lambda self: self.free_model)
    @rule(data=st.data())
    def free_a_free_page(self, data):
        pg = data.draw(st.sampled_from(sorted(self.free_model)))
        with pytest.raises(ValueError, match="already free"):
            self.pool.free(torch.tensor([pg * self.ps], dtype=torch.int64))

    @invariant()
    def accounting(self):
        owned = [s // self.ps for r in self.reqs for s in r]
        by_req = [{s // self.ps for s in r} for r in self.reqs]
        assert sum(len(p) for p in by_req) == len(set(owned))  # no page held by two requests
        assert self.pool.free_page_set() == self.free_model
        assert self.pool.num_free_pages() == len(self.free_model)
        assert not (set(owned) & self.free_model)
        assert len(self.free_model) + len(set(owned)) == self.pool.num_pages  # nothing lost
        assert self.pool.free_tokens() == len(self.free_model) * self.ps


PoolModel.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
test_pool_against_model = PoolModel.TestCase


def test_freeing_a_page_twice_or_never_given_out_raises_and_changes_nothing():
    p = pool(10, 1)
    a = p.alloc_extend(None, 0, 3)  # pages 1, 2, 3
    with pytest.raises(ValueError, match="already free"):
        p.free(torch.tensor([7]))  # never handed out: was queued again and handed out twice
    p.free(a)
    with pytest.raises(ValueError, match="already free"):
        p.free(torch.tensor([2, 3]))
    assert p.num_free_pages() == 10 and len(p.free_page_set()) == 10
    assert p.alloc_extend(None, 0, 10).tolist() == list(range(1, 11))  # each page once
    for bad in ([11], [-1], [5, 40]):
        with pytest.raises(ValueError, match="outside the pool"):
            p.free(torch.tensor(bad))
    assert p.num_free_pages() == 0


def test_pages_of_several_slots_refuse_a_second_free_of_any_slot():
    p = pool(16, 4)  # pages 1..4
    a = p.alloc_extend(None, 0, 6)  # pages 1, 2
    p.free(a[:4])
    with pytest.raises(ValueError, match=r"\[1\]"):
        p.free(a)  # page 1 again (with page 2): nothing freed
    assert p.num_free_pages() == 3
    p.free(a[4:])
    assert p.free_page_set() == {1, 2, 3, 4}


@pytest.mark.parametrize("page_size", [1, 4])
def test_engine_returns_every_page_after_a_mixed_workload(tiny_model_dir, page_size):
    """Shared prefixes, parallel samples and a pool a few times the longest request (eviction):
    afterwards free + evictable is the capacity, and once the radix cache is flushed every page is
    free exactly once and a fresh allocation starts again at page 1."""
    import random

    from sglite import Engine

    rng = random.Random(page_size)
    shared = [[rng.randrange(100, 5000) for _ in range(rng.randint(5, 30))] for _ in range(3)]
    work = [(rng.choice(shared) if rng.random() < 0.6 else []) + [rng.randrange(100, 5000) for _ in range(rng.randint(1, 20))]
            for _ in range(24)]
    params = [{"max_new_tokens": rng.randint(1, 8), "temperature": 0, "ignore_eos": True, "n": rng.choice([1, 2])}
              for _ in work]
    with Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=3 * 64, page_size=page_size,
                max_running_requests=8, chunked_prefill_size=16, check_invariants=True) as e:
        e.generate(input_ids=work, sampling_params=params)
        info = e.get_server_info()
        assert info["evicted_tokens"] > 0, "nothing was evicted"
        assert info["available_tokens"] == info["max_total_tokens"]
        assert e.flush_cache() is True
        pool_ = e.scheduler.kv.kv_pool
        free, n, pages = e._loop.call(lambda: (pool_.free_page_set(), pool_.num_free_pages(), pool_.num_pages))
        assert free == set(range(1, pages + 1)) and n == pages
        first = e._loop.call(lambda: pool_.alloc_extend(None, 0, page_size))
        assert first.tolist() == list(range(page_size, 2 * page_size))  # page 1: the lowest
        e._loop.call(lambda: pool_.free(first))
