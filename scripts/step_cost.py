"""Per-step cost of decode steps at given batch sizes, in-process (issue 33, "a step that costs nothing").

Two measurements per batch size B (B prompts of ``--prompt-len`` random tokens, greedy,
``ignore_eos``, ``--steps`` new tokens each, so every step after the first is a B-row decode step):

* ``noop``: the model's forward replaced by one returning a fixed [B, V] logits tensor, so a step
  is only what is not the model: scheduling, batch tensors, sampling, output processing (detokenize,
  stop checks), the loop. Median and quartiles of ``Scheduler.step`` wall time over decode steps, µs.
* ``profile``: real steps under sglite's profiler (``Engine.start_profile``, started after the
  prefill, ``--profile-steps`` steps): the phase table (GEMM, attention, elementwise, sampling,
  scheduling, output, Python/other), µs per step, and the Chrome trace's path.

Usage::

    .venv/bin/python scripts/step_cost.py --batch 16,48 [--quantization none --dtype bfloat16]
        [--modes noop,profile] [--profile-dir /tmp/sglite_profiles]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--quantization", default="auto", help="auto (GGUF as is) or none (dequantized)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", default="16,48")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48, help="new tokens per request")
    ap.add_argument("--modes", default="noop,profile")
    ap.add_argument("--profile-steps", type=int, default=12)
    ap.add_argument("--profile-dir", default=None)
    ap.add_argument("--repeats", type=int, default=2, help="noop runs per batch size (all steps pooled)")
    a = ap.parse_args()

    import logging

    import torch

    from sglite import Engine

    e = Engine(model_path=a.model_path, quantization=a.quantization, dtype=a.dtype, max_total_tokens=32768,
               max_running_requests=64)
    logging.getLogger("sglite").setLevel(logging.WARNING)
    s, runner = e.scheduler, e.scheduler.runner
    rng = random.Random(0)
    vocab = list(range(100, 40000))
    out: dict = {"engine": {"quantization": a.quantization, "dtype": str(runner.dtype),
                            "linear_impl": getattr(runner, "linear_impl", None)}}
    step0, fwd0 = s.step, runner.forward
    times: list = []

    def timed_step():
        decode = bool(s.running) and not any(r.prefilling for r in s.running) and not s.waiting
        t0 = time.perf_counter()
        r = step0()
        if decode:
            times.append(time.perf_counter() - t0)
        return r

    s.step = timed_step

    def run(b: int, steps: int = a.steps):
        prompts = [[rng.choice(vocab) for _ in range(a.prompt_len)] for _ in range(b)]
        return e.generate(input_ids=prompts, sampling_params={"max_new_tokens": steps, "temperature": 0,
                                                              "ignore_eos": True})

    def profiled(b: int) -> dict:
        times.clear()
        th = threading.Thread(target=run, args=(b,))
        th.start()
        while not times:  # the first decode step is done: the prefill is behind us
            time.sleep(0.001)
        e.start_profile(output_dir=a.profile_dir, num_steps=a.profile_steps)
        th.join()
        prof = e.stop_profile()
        return {"trace": prof["trace"], "summary": prof["summary"], "steps": prof["steps"],
                "us_per_step": {k: v["us_per_step"] for k, v in prof["phases"].items()}}

    for b in [int(x) for x in a.batch.split(",")]:
        res = out.setdefault(f"batch{b}", {})
        run(b, 3)  # warm
        cache: dict = {}

        def noop(fb):
            m = int(fb.logits_indices.shape[0])
            if m not in cache:
                cache[m] = torch.randn(m, runner.vocab_size, generator=torch.Generator().manual_seed(m))
            return cache[m]

        if "noop" in a.modes:
            runner.forward = noop
            try:
                times.clear()
                for _ in range(a.repeats):
                    run(b)
                us = sorted(t * 1e6 for t in times)
                q = statistics.quantiles(us, n=4)
                res["noop_step_us"] = {"median": round(statistics.median(us), 1), "q1": round(q[0], 1),
                                       "q3": round(q[2], 1), "steps": len(us)}
                if "noop-profile" in a.modes.split(","):
                    res["noop_profile"] = profiled(b)
            finally:
                runner.forward = fwd0
        if "profile" in a.modes.split(","):
            res["profile"] = profiled(b)
            res["real_step_us_median"] = round(statistics.median(sorted(t * 1e6 for t in times[1:])), 1)
        print(json.dumps({f"batch{b}": res}), flush=True)
    e.shutdown()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
