"""CPU cost of one serving prefill, in-process (issue 27: about a third of a 16-client run's CPU).

Runs ``--prompts`` single prompts of ``--prompt-len`` random tokens (greedy, one new token, so each
is one prefill step and its logits row) one after another on an engine of ``--threads`` threads,
after one warm-up prompt; prints the median process CPU time per prompt, and with ``--profile``
the per-phase table of ``Engine.start_profile`` over them (its summary file's path too).

Usage::

    .venv/bin/python scripts/prefill_cost.py --model-path G [--prompt-len 200] [--profile]
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
    ap.add_argument("--profile", action="store_true", help="also the profiler's per-phase table")
    a = ap.parse_args()

    from sglite import Engine

    e = Engine(model_path=a.model_path, num_threads=a.threads)
    rng = random.Random(1)
    vocab = e.runner.model.lm_head.shape[0]
    prompts = [[rng.randrange(1000, vocab) for _ in range(a.prompt_len)] for _ in range(a.prompts + 1)]
    sp = {"max_new_tokens": 1, "temperature": 0}
    e.generate(input_ids=prompts[0], sampling_params=sp)  # warm-up: kernel loads, first-call allocations
    if a.profile:
        e.start_profile()
    ts = []
    for p in prompts[1:]:
        c = time.process_time()
        e.generate(input_ids=p, sampling_params=sp)
        ts.append(time.process_time() - c)
    print(f"{a.prompt_len}-token prefill, {a.threads} thread(s): process CPU median "
          f"{sorted(ts)[len(ts) // 2] * 1e3:.1f} ms over {len(ts)}")
    if a.profile:
        prof = e.stop_profile()
        print(json.dumps({k: round(v["us_per_step"]) for k, v in prof["phases"].items()}))
        print("summary:", prof["summary"])
    e.shutdown()


if __name__ == "__main__":
    main()
