"""Wall time of the step kinds of the serving workload (issue 33, TTFT): a decode step of B rows, a
prefill step of one P-token prompt alone, and the mixed step (that prefill beside B decode rows).

In-process engine (default model); steps are timed by wrapping ``Scheduler.step`` and grouped by
what they ran. ``--repeats`` rounds, each: B requests decode, one more request arrives mid-decode
(the mixed step), then, with nothing running, one P-token prompt alone (the prefill-only step).

    .venv/bin/python scripts/mixed_step_cost.py [--batch 15] [--prompt-len 200] [--repeats 4]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=15)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--engine-arg", action="append", default=[], help="k=v passed to Engine (repeatable)")
    a = ap.parse_args()

    import logging

    from sglite import Engine

    kw = {k: (int(v) if v.lstrip("-").isdigit() else v) for k, v in (x.split("=", 1) for x in a.engine_arg)}
    e = Engine(**kw)
    logging.getLogger("sglite").setLevel(logging.WARNING)
    s = e.scheduler
    step0 = s.step
    times: dict = {"decode": [], "prefill": [], "mixed": []}

    def timed():
        pre = sum(r.pending for r in s.running if r.prefilling) + sum(len(r.input_ids) for r in s.waiting)
        dec = sum(1 for r in s.running if not r.prefilling)
        t0 = time.perf_counter()
        out = step0()
        dt = time.perf_counter() - t0
        kind = "mixed" if pre and dec else "prefill" if pre else "decode"
        if dec not in (0, a.batch) or pre not in (0, a.prompt_len):
            return out  # the start-up burst, a finishing batch
        times[kind].append(dt)
        return out

    s.step = timed
    rng = random.Random(0)

    def prompt():
        return [rng.randrange(100, 40000) for _ in range(a.prompt_len)]

    def gen(ids, n):
        e.generate(input_ids=ids, sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True})

    gen([prompt()], 2)  # warm
    for _ in range(a.repeats):
        th = threading.Thread(target=gen, args=([prompt() for _ in range(a.batch)], 40))
        th.start()
        while len(times["decode"]) < 4 * (_ + 1):
            time.sleep(0.002)
        gen([prompt()], 1)  # arrives while B requests decode
        th.join()
        gen([prompt()], 1)  # alone
    e.shutdown()
    med = {k: round(statistics.median(v) * 1e3, 1) for k, v in times.items() if v}
    print(json.dumps({"batch": a.batch, "prompt_len": a.prompt_len, "engine_args": kw, "median_ms": med,
                      "n": {k: len(v) for k, v in times.items()}, "load": os.getloadavg()}))


if __name__ == "__main__":
    main()
