"""Stress: 300 requests against a KV pool ~3x the longest request, so eviction and retraction happen.

Every request that was not aborted must finish with exactly the tokens it produces alone (greedy),
``check_invariants()`` holds after every step (engine option), and at the end free plus evictable
tokens equal the capacity.
"""
import random
import threading
import time

import pytest


def _workload(tok, n, seed):
    rng = random.Random(seed)
    shared = [tok.encode(" ".join(rng.choice(["red", "green", "blue", "sky"]) for _ in range(60)))[:48]
              for _ in range(4)]
    reqs = []
    for i in range(n):
        own = [rng.randrange(100, 5000) for _ in range(rng.randint(1, 40))]
        ids = (rng.choice(shared) if rng.random() < 0.6 else []) + own
        reqs.append({"ids": ids, "max_new": rng.randint(1, 24), "n": rng.choice([1, 1, 1, 2]),
                     "abort": rng.random() < 0.1})
    return reqs


@pytest.mark.slow  # 300 requests through two engines
@pytest.mark.parametrize("page_size", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_stress_eviction_retraction_abort(tiny_model_dir, page_size):
    from sglite import Engine
    from sglite.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    work = _workload(tok, 300, seed=page_size)
    longest = max(len(w["ids"]) + w["max_new"] for w in work)
    greedy = lambda w: {"max_new_tokens": w["max_new"], "temperature": 0, "ignore_eos": True, "n": w["n"]}

    with Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=200_000,
                disable_radix_cache=True) as ref_engine:
        ref = ref_engine.generate(input_ids=[w["ids"] for w in work],
                                  sampling_params=[dict(greedy(w), n=1) for w in work])
    with Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=3 * longest,
                page_size=page_size, max_running_requests=32, chunked_prefill_size=32,
                check_invariants=True) as e:
        results = [None] * len(work)

        def run(i, w):
            results[i] = e.generate(input_ids=w["ids"], sampling_params=greedy(w), rid=f"r{i}")

        threads = [threading.Thread(target=run, args=(i, w)) for i, w in enumerate(work)]
        for t in threads:
            t.start()
        time.sleep(0.05)
        for i, w in enumerate(work):
            if w["abort"]:
                e.abort(f"r{i}")
                e.abort(f"r{i}-0")
                e.abort(f"r{i}-1")
        for t in threads:
            t.join(timeout=600)
        info = e.get_server_info()
        e.check_invariants()
    assert info["retractions"] > 0, "the pool was never short: retraction untested"
    assert info["evicted_tokens"] > 0, "nothing was evicted"
    assert info["available_tokens"] == info["max_total_tokens"]
    checked = 0
    for i, (w, res) in enumerate(zip(work, results)):
        outs = res if isinstance(res, list) else [res]
        assert len(outs) == w["n"]
        for o in outs:
            if o["meta_info"]["finish_reason"]["type"] == "abort":
                assert w["abort"], f"request {i} aborted without being asked"
                continue
            assert o["output_ids"] == ref[i]["output_ids"], f"request {i} differs from its solo run"
            checked += 1
    assert checked > 250
