"""The step's fast paths (issue 33, "a step that costs nothing") change nothing: the batched KV
reservation hands out the slots the per-request loop would, and a whole workload gives the same
batches and outputs with the fast paths on and off (fake runner of test_scheduler_unit)."""
import random

import pytest
import torch

from sglite.runtime.kv_manager import KVManager
from sglite.runtime.kv_pool import ReqToTokenPool, TokenToKVPool
from tests.runtime.test_scheduler_unit import make, oracle, req, run, workload


def _admitted(kv, specs):
    reqs = []
    for i, (ids, n) in enumerate(specs):
        r = req(f"r{i}", ids, 4)
        assert kv.admit(r, *kv.match_prefix([]), n)
        kv.commit(r, n)
        reqs.append(r)
    return reqs


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_extend_all_hands_out_the_slots_of_the_loop(page_size):
    rng = random.Random(page_size)
    specs = [([rng.randrange(1, 27) for _ in range(rng.randint(1, 40))], 0) for _ in range(9)]
    specs = [(ids, len(ids)) for ids, _ in specs]
    kvs = [KVManager(ReqToTokenPool(12, 128), TokenToKVPool(800, page_size, 1, 1, 1, torch.float32),
                     page_size=page_size) for _ in range(2)]
    a, b = _admitted(kvs[0], specs), _admitted(kvs[1], specs)
    for _ in range(5):  # steps of 1-20 tokens: partial pages continued, pages crossed, fresh pages
        steps = [rng.choice([1, 1, 1, rng.randint(2, 20)]) for _ in specs]
        assert kvs[0].extend_all(list(zip(a, steps)))
        for r, n in zip(b, steps):
            assert kvs[1].extend(r, n)
        for r, r2, n in zip(a, b, steps):
            kvs[0].commit(r, n, share=False)
            kvs[1].commit(r2, n, share=False)
        assert torch.equal(kvs[0].req_to_token, kvs[1].req_to_token)
        assert [r.kv.alloc_len for r in a] == [r.kv.alloc_len for r in b]
        assert kvs[0].free_tokens() == kvs[1].free_tokens()


@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_all_declines_what_the_loop_must_do(page_size):
    kv = KVManager(ReqToTokenPool(4, 64), TokenToKVPool(12, page_size, 1, 1, 1, torch.float32), page_size=page_size)
    (r,) = _admitted(kv, [([1] * 5, 5)])
    free, table = kv.free_tokens(), kv.req_to_token.clone()
    # short of pages (the rest of the partial page does not count as free): the loop evicts or retracts
    assert not kv.extend_all([(r, free + (-5) % page_size + 1)])
    assert r.kv.alloc_len == 5 and kv.free_tokens() == free and torch.equal(kv.req_to_token, table)


def _trace(fast: bool, **cfg):
    sched, runner = make(tokens=cfg.pop("tokens", 4096), chunked_prefill_size=16, **cfg)
    if not fast:
        sched.kv.extend_all = lambda wanted: False
    reqs = [req(f"r{i}", ids, n) for i, (ids, n) in enumerate(workload(24, seed=5))]
    run(sched, reqs)
    batches = [(fb.input_ids.tolist(), fb.positions.tolist(), fb.out_cache_loc.tolist()) for fb in runner.batches]
    return [r.output_ids for r in reqs], batches, reqs, sched


@pytest.mark.parametrize("page_size", [1, 4])
def test_workload_identical_with_and_without_fast_paths(page_size):
    out_fast, batches_fast, reqs, _ = _trace(True, page_size=page_size)
    out_slow, batches_slow, _, _ = _trace(False, page_size=page_size)
    assert out_fast == out_slow and batches_fast == batches_slow
    assert out_fast == [oracle(r.input_ids, r.params.max_new_tokens) for r in reqs]


def test_fast_paths_under_memory_pressure_still_match_the_oracle():
    out, _, reqs, sched = _trace(True, tokens=160, max_running_requests=8)
    assert sched.stats["retractions"] + sched.stats["evicted_tokens"] > 0  # the loop's cases happened too
    assert out == [oracle(r.input_ids, r.params.max_new_tokens) for r in reqs]


def test_phase_ranges_cost_one_shared_noop_when_not_profiling():
    from sglite import kernels
    from sglite.runtime.profiler import phase

    assert phase("step") is phase("forward")  # one shared no-op context, nothing recorded
    assert not hasattr(kernels.linear, "__wrapped__")  # no kernel probes outside a profile


def test_phase_summary_rows_add_up_to_the_step():
    from types import SimpleNamespace as E

    from sglite.runtime.profiler import OTHER, phase_summary

    events = [E(name="sglite::step", cpu_time_total=1000.0), E(name="sglite::step", cpu_time_total=1000.0),
              E(name="sglite::gemm", cpu_time_total=900.0), E(name="sglite::attention", cpu_time_total=300.0),
              E(name="sglite::sample", cpu_time_total=100.0), E(name="sglite::schedule", cpu_time_total=50.0),
              E(name="sglite::build_batch", cpu_time_total=30.0), E(name="sglite::process", cpu_time_total=20.0),
              E(name="aten::mm", cpu_time_total=800.0)]
    rows = phase_summary(events, steps=2)
    assert rows["GEMM"] == {"us": 900.0, "us_per_step": 450.0, "percent": 45.0}
    assert rows["scheduling (plan + batch tensors)"]["us"] == 80.0
    assert rows[OTHER]["us"] == 2000 - 900 - 300 - 100 - 80 - 20
    assert rows["step total"]["us_per_step"] == 1000.0
    assert sum(v["us"] for k, v in rows.items() if k != "step total") == 2000.0


def test_profile_counts_the_fused_norm_and_rope_as_elementwise(tmp_path):
    """add_rms_norm and rope_store_kv (the extend path's fused C++ kernels) are probed as
    elementwise while a session runs (they used to fall into Python/other), and unwrapped after."""
    from sglite import kernels
    from sglite.runtime.profiler import ProfileSession, phase

    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.ones(32)
    qk, v = torch.randn(3, 3, 8), torch.randn(3, 1, 8)
    cos, sin = torch.ones(3, 4), torch.zeros(3, 4)
    kb, vb = torch.zeros(5, 1, 8), torch.zeros(5, 1, 8)
    s = ProfileSession(output_dir=str(tmp_path), activities=["CPU"])
    s.start()
    with phase("step"):
        kernels.add_rms_norm(x, r, w, 1e-6)
        kernels.rope_store_kv(qk, v, cos, sin, kb, vb, torch.tensor([0, 2, 4]), 2)
    s.step_done()
    res = s.stop()
    names = [ev.name for ev in s._prof.events()]
    assert names.count("sglite::elementwise") == 2
    assert res.phases["elementwise (norm, activation, RoPE)"]["us"] > 0
    assert not hasattr(kernels.add_rms_norm, "__wrapped__") and not hasattr(kernels.rope_store_kv, "__wrapped__")
