"""Cost of one prefill, in-process: CPU and wall time per prompt, and the per-phase table.

Runs ``--prompts`` single prompts of ``--prompt-len`` random tokens (greedy, one new token, so the
request is its prefill and one logits row) one after another on an engine of ``--threads``
threads with ``--chunked-prefill-size`` (default: the engine's), after one warm-up prompt. Prints
each prompt's wall time and process CPU time (``time.process_time``: the pool workers' spin
included), their medians and minima (the minimum is the steadier figure on a shared machine), and
with ``--profile`` the per-phase table of ``Engine.start_profile`` over them (its summary file's
path too).

Used for a serving prefill (issue 27: about a third of a 16-client run's CPU) and for the
time-to-first-token of one long prompt (issue 33).

Usage::

    .venv/bin/python scripts/prefill_cost.py --model-path G [--prompt-len 200] [--profile]
    .venv/bin/python scripts/prefill_cost.py --prompt-len 2048 --threads 2 --prompts 3 [--chunked-prefill-size 512] --profile
"""
from __future__ import annotations

import argparse
import json
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the default model")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunked-prefill-size", type=int, default=None, help="default: the engine's")
    ap.add_argument("--profile", action="store_true", help="also the profiler's per-phase table")
    ap.add_argument("--kv-cache-dtype", default=None, help="default: the engine's (auto)")
    ap.add_argument("--output-dir", default=None, help="profile output folder (default: the profiler's)")
    a = ap.parse_args()

    from sglite import Engine

    kw = {} if a.chunked_prefill_size is None else {"chunked_prefill_size": a.chunked_prefill_size}
    if a.kv_cache_dtype:
        kw["kv_cache_dtype"] = a.kv_cache_dtype
    e = Engine(model_path=a.model_path, num_threads=a.threads, log_level="warning", **kw)
    rng = random.Random(1)
    vocab = e.runner.model.lm_head.shape[0]
    prompts = [[rng.randrange(1000, vocab) for _ in range(a.prompt_len)] for _ in range(a.prompts + 1)]
    sp = {"max_new_tokens": 1, "temperature": 0}
    e.generate(input_ids=prompts[0], sampling_params=sp)  # warm-up: kernel loads, first-call allocations
    if a.profile:
        e.start_profile(output_dir=a.output_dir)
    walls, cpus = [], []
    for p in prompts[1:]:
        t, c = time.perf_counter(), time.process_time()
        e.generate(input_ids=p, sampling_params=sp)
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
    print(f"{a.prompt_len}-token prefill, {a.threads} thread(s), chunk {a.chunked_prefill_size or 'default'}: "
          f"wall ms {[round(x * 1e3) for x in walls]} (median {med(walls):.0f}, min {min(walls) * 1e3:.0f}), "
          f"process CPU ms {[round(x * 1e3) for x in cpus]} (median {med(cpus):.1f}, min {min(cpus) * 1e3:.0f})")
    if a.profile:
        prof = e.stop_profile()
        print(json.dumps({k: round(v["us_per_step"]) for k, v in prof["phases"].items()}))
        print(open(prof["summary"]).read().split("\n\nper-op")[0])
        print("summary:", prof["summary"])
    e.shutdown()


if __name__ == "__main__":
    main()
