"""Per-step time outside the model forward, old vs new code side by side (session 4).

Two engine processes on the default model, one per checkout (each with its own ``.venv``: its
editable install is the code measured), driven request by request in alternating order, so the
machine's load drift hits both alike. Workloads of ``sglite bench spec`` (4 prompts each, greedy,
128 new tokens): ``chat`` and ``extract_json`` at batch 1, ``chat_batch16`` (16 prompts at once).

Per decode step (no prompt token in the step) a wrapper times ``Scheduler.step`` and
``runner.forward``; outside = step - forward (scheduling, batch build, grammar-mask hand-off,
sampling, output processing, step log). The loop gap is the time between two steps (engine loop).

Usage::

    git worktree add /tmp/stepcost-base 98e949b && (cd /tmp/stepcost-base && make install)
    .venv/bin/python scripts/step_overhead_ab.py --old /tmp/stepcost-base --new . --rounds 2

Prints per workload: the median / quartiles of outside ms per step, mean outside and forward ms
per step, the loop gap, tok/s of each side and the new/old ratio, and whether every request's
output ids were identical on both sides.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

JOBS = [("chat", i) for i in range(4)] + [("extract_json", i) for i in range(4)] + [("chat_batch16", 0)]


def worker() -> None:
    """Engine process: reads "WORKLOAD INDEX" lines, answers one JSON line each."""
    import logging

    from sglite import Engine
    from sglite.bench.spec import workloads

    e = Engine(max_total_tokens=16384, max_running_requests=16)
    logging.getLogger("sglite").setLevel(logging.WARNING)
    s, run = e.scheduler, e.scheduler.runner
    rec = {"steps": 0, "step_s": 0.0, "fwd_s": 0.0, "per": [], "gaps": []}
    cur: dict = {}
    last = [None]
    step0, fwd0, sched0 = s.step, run.forward, s.schedule

    def fwd(b):
        t0 = time.perf_counter()
        x = fwd0(b)
        cur["fwd"] = time.perf_counter() - t0
        return x

    def sched():
        p = sched0()
        cur["decode"] = p is not None and not any(en.req.prefilling for en in p.entries)
        return p

    def step():
        cur.clear()
        t0 = time.perf_counter()
        r = step0()
        t1 = time.perf_counter()
        if cur.get("decode") and "fwd" in cur:
            rec["steps"] += 1
            rec["step_s"] += t1 - t0
            rec["fwd_s"] += cur["fwd"]
            rec["per"].append((t1 - t0 - cur["fwd"]) * 1e3)
            if last[0] is not None and t0 - last[0] < 0.005:
                rec["gaps"].append((t0 - last[0]) * 1e3)
        last[0] = t1
        return r

    s.step, run.forward, s.schedule = step, fwd, sched
    W = workloads(4)

    def job(wl: str, i: int) -> dict:
        items, batch = W[wl]
        sel = items[i * batch:(i + 1) * batch]
        prompts = [e.apply_chat_template([{"role": "user", "content": m}]) for m, _ in sel]
        sps = [{"max_new_tokens": 128, "temperature": 0, **x} for _, x in sel]
        rec.update(steps=0, step_s=0.0, fwd_s=0.0, per=[], gaps=[])
        last[0] = None
        t0 = time.perf_counter()
        outs = e.generate(prompts, sps)
        ids = [o["output_ids"] for o in outs]
        return {**rec, "secs": time.perf_counter() - t0, "tokens": sum(map(len, ids)),
                "md5": hashlib.md5(json.dumps(ids).encode()).hexdigest()}

    for wl in ("chat", "extract_json", "chat_batch16"):
        job(wl, 0)  # warm: kernels, grammar caches, the prompts' shared prefix
    print("READY", flush=True)
    for line in sys.stdin:
        wl, i = line.split()
        print(json.dumps(job(wl, int(i))), flush=True)
    e.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="checkout with a .venv (the baseline)")
    ap.add_argument("--new", required=True, help="checkout with a .venv (the change)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-first", action="store_true", help="start the new side's engine first")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    here = os.path.abspath(__file__)
    sides = {"old": os.path.abspath(a.old), "new": os.path.abspath(a.new)}
    if a.new_first:  # which process starts (and allocates) first can move the forward by a few %
        sides = {"new": sides["new"], "old": sides["old"]}
    procs = {k: subprocess.Popen([os.path.join(d, ".venv/bin/python"), here, "--worker"],
                                 cwd=d, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True) for k, d in sides.items()}
    for p in procs.values():
        while (line := p.stdout.readline()) and not line.startswith("READY"):
            pass
    tot: dict = collections.defaultdict(collections.Counter)
    lists: dict = collections.defaultdict(list)
    md5: dict = collections.defaultdict(set)
    for n, (wl, i) in enumerate(JOBS * a.rounds):
        for k in (("old", "new") if n % 2 == 0 else ("new", "old")):
            procs[k].stdin.write(f"{wl} {i}\n")
            procs[k].stdin.flush()
            res = json.loads(procs[k].stdout.readline())
            md5[(wl, i)].add(res.pop("md5"))
            lists[(k, wl, "per")] += res.pop("per")
            lists[(k, wl, "gaps")] += res.pop("gaps")
            tot[(k, wl)].update(res)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    for wl in dict.fromkeys(w for w, _ in JOBS):
        row = {}
        for k in ("old", "new"):
            t, per, gaps = tot[(k, wl)], lists[(k, wl, "per")], lists[(k, wl, "gaps")]
            q = statistics.quantiles(per, n=4)
            row[k] = (f"outside median {statistics.median(per):.3f} ms (quartiles {q[0]:.3f}-{q[2]:.3f}), "
                      f"mean {(t['step_s'] - t['fwd_s']) / t['steps'] * 1e3:.3f} ms; forward {t['fwd_s'] / t['steps'] * 1e3:.2f} ms; "
                      f"loop gap {statistics.median(gaps) if gaps else float('nan'):.3f} ms; {t['tokens'] / t['secs']:.1f} tok/s")
        ratio = (tot[("new", wl)]["tokens"] / tot[("new", wl)]["secs"]) / (tot[("old", wl)]["tokens"] / tot[("old", wl)]["secs"])
        same = all(len(v) == 1 for (w, _), v in md5.items() if w == wl)
        print(f"{wl} ({tot[('old', wl)]['steps']} / {tot[('new', wl)]['steps']} decode steps)\n  old: {row['old']}\n"
              f"  new: {row['new']}\n  tok/s new/old {ratio:.3f}; identical output ids: {same}")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
