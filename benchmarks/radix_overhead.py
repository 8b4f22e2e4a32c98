"""Benchmark: what the radix cache costs when nothing can be reused (issue 3, part (d)), controlled.

    python benchmarks/radix_overhead.py [--requests 32] [--input-len 128] [--output-len 32] [--repeats 4]

Both engines (radix cache on, ``disable_radix_cache=True``) are built and warmed first, then the same
random prompts run on each, the order alternating every repeat; the forward passes are timed apart
from the scheduler steps, so the cache's own cost (tree match / insert / eviction bookkeeping) shows
as (step − forward) differences. Prints one JSON line per engine and the slowdown of the sums.
``sglite bench offline --parts d`` measures the same thing end to end, but there each engine
instance carries its own few-percent speed offset (memory placement), as large as the effect.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import time

import sglite


def instrument(engine, acc: dict) -> None:
    """Accumulate forward seconds/counts (extend vs decode-only) and step seconds into ``acc``."""
    fwd, step = engine.runner.forward, engine.scheduler.step

    def timed_forward(fb):
        t = time.perf_counter()
        out = fwd(fb)
        kind = "extend" if fb.num_extend_tokens else "decode"
        acc[kind + "_forward_s"] += time.perf_counter() - t
        acc[kind + "_steps"] += 1
        return out

    def timed_step():
        t = time.perf_counter()
        r = step()
        acc["step_s"] += time.perf_counter() - t
        return r

    engine.runner.forward, engine.scheduler.step = timed_forward, timed_step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(a.input_len)] for _ in range(a.requests)]
    params = {"max_new_tokens": a.output_len, "temperature": 0, "ignore_eos": True}
    engines = {k: sglite.Engine(dtype=a.dtype, max_total_tokens=32768, disable_radix_cache=(k == "off"))
               for k in ("on", "off")}
    acc = {k: collections.defaultdict(float) for k in engines}
    try:
        for k, e in engines.items():
            e.generate(input_ids=prompts[:2], sampling_params=params)  # warm-up
            instrument(e, acc[k])
        for i in range(a.repeats):
            for k in (("on", "off") if i % 2 == 0 else ("off", "on")):
                engines[k].flush_cache()
                t = time.perf_counter()
                engines[k].generate(input_ids=prompts, sampling_params=params)
                acc[k]["wall_s"] += time.perf_counter() - t
    finally:
        for e in engines.values():
            e.shutdown()
    for k in engines:
        print(json.dumps({"radix_cache": k, **{n: round(v, 3) for n, v in sorted(acc[k].items())}}))
    print(json.dumps({"slowdown_with_cache": round(acc["on"]["wall_s"] / acc["off"]["wall_s"] - 1, 4),
                      "scheduler_overhead_s": {k: round(acc[k]["step_s"] - acc[k]["extend_forward_s"]
                                                        - acc[k]["decode_forward_s"], 3) for k in engines}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
