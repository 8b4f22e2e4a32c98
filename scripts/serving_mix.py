"""A 16-client serving load in-process (issue 27): wall and process CPU time of the whole run, and the
fused decode steps by row count, with no HTTP server or client in the measurement.

``--clients`` threads each send ``--requests`` requests one after another (``Engine.generate``,
greedy, ``ignore_eos``): random prompts of 128-256 tokens, 64-128 new tokens (seeded, so every run
sends the same requests; the shape of ``sglite bench serving --dataset random --input-len 256
--output-len 128 --range-ratio 0.5``). Run it on two checkouts alternately for an A/B.

Usage::

    PYTHONPATH=. .venv/bin/python scripts/serving_mix.py --model-path G [--threads 1]
"""
from __future__ import annotations

import argparse
import collections
import random
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the default model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4, help="per client")
    a = ap.parse_args()

    from sglite import Engine

    e = Engine(model_path=a.model_path, num_threads=a.threads)
    rng = random.Random(0)
    vocab = e.runner.model.lm_head.shape[0]
    jobs = [([rng.randrange(1000, vocab) for _ in range(rng.randint(128, 256))], rng.randint(64, 128))
            for _ in range(a.clients * a.requests)]
    model = e.runner.model
    fused, rows = model.decode_fused, collections.Counter()

    class Count:  # the fused decode's steps by row count (None: the step took the per-op path)
        def forward(self, fb, kb, vb, *args, **kw):
            got = fused.forward(fb, kb, vb, *args, **kw)
            if got is not None:
                rows[fb.input_ids.shape[0]] += 1
            return got

        def __getattr__(self, k):
            return getattr(fused, k)

    if fused is not None:
        model.decode_fused = Count()

    def client(i: int) -> None:
        for ids, n in jobs[i * a.requests:(i + 1) * a.requests]:
            e.generate(input_ids=ids, sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True})

    t0, c0 = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(n for _, n in jobs)
    print(f"{a.clients} clients x {a.requests} requests, {a.threads} thread(s): wall {wall:.1f} s, process CPU "
          f"{cpu:.1f} s, {tokens} tokens, {tokens / wall:.1f} tok/s")
    print("fused decode steps by rows:", sorted(rows.items()))
    e.shutdown()


if __name__ == "__main__":
    main()
