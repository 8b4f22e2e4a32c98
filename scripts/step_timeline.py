"""Step timeline of one workload: what each scheduler step cost and what lay between the steps.

Wraps the engine's ``Scheduler.schedule`` / ``step`` and ``runner.forward`` (instance attributes,
nothing in sglite changes) and records, per step: kind (``prefill`` / ``mixed`` / ``decode``), rows
(requests in the step), new prompt tokens, cached tokens of the requests admitted in it, requests
running and waiting, wall ms of the step and of its forward, CPU ms of the step
(``time.process_time``: every thread of the process, the kernels' pool included) and of the engine
thread alone (``time.thread_time``, also inside the forward: the engine thread's wall time outside
the forward minus its CPU time there is waiting, e.g. for the GIL while an HTTP server streams), and
the gap since the previous step ended (the engine loop, the inbox, waiting for work). The run's wall
time is then split into steps' forward, steps' rest, gaps, and the time before the first step /
after the last one.

Workloads: ``shared-prefix`` (64 requests at once, 4 groups of a ~550-token system prompt plus a
question, 64 new tokens each; ``sglite bench serving --dataset shared-prefix``'s prompts) and
``offline`` (``benchmarks/vllm_cpu/sglite_offline.py``'s 48 prompts x 64 tokens). Modes:
``inproc`` (one ``Engine.generate`` of all prompts) and ``http`` (a server in this process, the
prompts sent at once by ``sglite bench serving``'s client in a second process).

    python scripts/step_timeline.py --workload shared-prefix --mode inproc [--steps] [--json OUT]
    python scripts/step_timeline.py --workload offline --mode http -- --max-running-requests 48
    python scripts/step_timeline.py --mode http --client bench   # the issue's client, streaming

Arguments after ``--`` are engine flags (``sglite serve``'s spelling). The machine's load moves
wall times: compare runs A/B interleaved and read the CPU columns beside the wall ones.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Timeline:
    """Per-step records of one engine (wrappers on its scheduler and runner)."""

    def __init__(self, engine):
        self.rows: list[dict] = []
        self.on = False
        s, runner = engine.scheduler, engine.scheduler.runner
        step0, sched0, fwd0 = s.step, s.schedule, runner.forward
        cur: dict = {}
        last_end = [None]

        def schedule():
            plan = sched0()
            if plan is not None:
                chunks = [e for e in plan.entries if e.req.prefilling]
                cur.update(rows=len(plan.entries), prefill_rows=len(chunks),
                           new=sum(e.n for e in chunks),
                           cached=sum(e.start for e in chunks if e.start == e.req.cached_tokens),
                           decode_rows=len(plan.entries) - len(chunks),
                           running=len(s.running), waiting=len(s.waiting))
            return plan

        def forward(batch):
            t, tc = time.perf_counter(), time.thread_time()
            out = fwd0(batch)
            cur["fwd_ms"] = (time.perf_counter() - t) * 1e3
            cur["fwd_thread_cpu_ms"] = (time.thread_time() - tc) * 1e3
            return out

        def step():
            cur.clear()
            t, c, tc = time.perf_counter(), time.process_time(), time.thread_time()
            ran = step0()
            t1 = time.perf_counter()
            if ran and self.on:
                kind = "decode" if not cur["prefill_rows"] else ("mixed" if cur["decode_rows"] else "prefill")
                self.rows.append({"kind": kind, **cur, "t0": t, "t1": t1, "wall_ms": (t1 - t) * 1e3,
                                  "cpu_ms": (time.process_time() - c) * 1e3,
                                  "thread_cpu_ms": (time.thread_time() - tc) * 1e3,
                                  "gap_ms": (t - last_end[0]) * 1e3 if last_end[0] is not None else 0.0})
            if ran:
                last_end[0] = t1
            return ran

        s.schedule, s.step, runner.forward = schedule, step, forward


def summary(rows: list[dict], t_start: float, t_end: float) -> dict:
    """Split ``[t_start, t_end]`` (wall) into the steps' parts and the time between them."""
    if not rows:
        return {"wall_s": t_end - t_start, "steps": 0}
    out = {"wall_s": t_end - t_start, "steps": len(rows),
           "before_first_ms": (rows[0]["t0"] - t_start) * 1e3, "after_last_ms": (t_end - rows[-1]["t1"]) * 1e3,
           "gaps_ms": sum(r["gap_ms"] for r in rows[1:])}
    for kind in ("prefill", "mixed", "decode"):
        ks = [r for r in rows if r["kind"] == kind]
        out[kind] = {"steps": len(ks), "wall_ms": sum(r["wall_ms"] for r in ks),
                     "fwd_ms": sum(r.get("fwd_ms", 0.0) for r in ks), "cpu_ms": sum(r["cpu_ms"] for r in ks),
                     # outside the forward: the engine thread's wall time and its own CPU time (the
                     # difference is waiting: for the GIL, under HTTP, while the server streams)
                     "rest_ms": sum(r["wall_ms"] - r.get("fwd_ms", 0.0) for r in ks),
                     "rest_thread_cpu_ms": sum(r["thread_cpu_ms"] - r.get("fwd_thread_cpu_ms", 0.0) for r in ks),
                     "new_tokens": sum(r["new"] for r in ks), "cached_tokens": sum(r["cached"] for r in ks),
                     "rows_mean": sum(r["rows"] for r in ks) / len(ks) if ks else 0.0}
    return out


def prompts(workload: str) -> tuple[list[str], list[str]]:
    """(timed prompts, warm-up prompts) of a workload."""
    if workload == "offline":
        sys.path.insert(0, str(ROOT / "benchmarks" / "vllm_cpu"))
        from offline import prompts as offline_prompts
        ps = offline_prompts(0)
        return ps, ps[:2]
    from sglite.bench.workloads import build_workload
    return ([s.turns[0].text for s in build_workload("shared-prefix", 64, seed=0)],
            [s.turns[0].text for s in build_workload("shared-prefix", 4, seed=2)])


def run_inproc(engine, tl: Timeline, ps: list[str], warm: list[str]) -> tuple[float, float, float]:
    sp = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    engine.generate(warm, sp)
    engine.flush_cache()
    tl.on = True
    t, c = time.perf_counter(), time.process_time()
    engine.generate(ps, sp)
    return t, time.perf_counter(), time.process_time() - c


def serve(engine, port: int):
    """``engine``'s HTTP app on 127.0.0.1:``port`` in a thread of this process, started."""
    from sglite.server.app import create_app
    from sglite.server.runner import UvicornThread, bind_listener
    from sglite.server.settings import ServerConfig

    app = create_app(engine, ServerConfig(port=port))
    return UvicornThread(app, bind_listener("127.0.0.1", port), "step-timeline-server").start()


def run_http(engine, tl: Timeline, ps: list[str], warm: list[str], port: int) -> tuple[float, float, float]:
    """Serve ``engine`` on ``port`` in this process; a client process sends ``ps`` at once."""
    server = serve(engine, port)
    client = (
        "import asyncio, json, sys, time\n"
        "import httpx\n"
        "ps, warm, url = json.load(sys.stdin)\n"
        "async def one(c, p):\n"
        "    body = {'text': p, 'sampling_params': {'max_new_tokens': 64, 'temperature': 0, 'ignore_eos': True}}\n"
        "    r = await c.post(url + '/generate', json=body)\n"
        "    assert r.status_code == 200, r.text\n"
        "async def main():\n"
        "    lim = httpx.Limits(max_connections=256, max_keepalive_connections=256)\n"
        "    async with httpx.AsyncClient(timeout=600, limits=lim) as c:\n"
        "        await asyncio.gather(*(one(c, p) for p in warm))\n"
        "        (await c.post(url + '/flush_cache')).raise_for_status()\n"
        "        print('GO', flush=True)\n"
        "        t = time.perf_counter()\n"
        "        await asyncio.gather(*(one(c, p) for p in ps))\n"
        "        print('DONE', time.perf_counter() - t, flush=True)\n"
        "asyncio.run(main())\n")
    proc = subprocess.Popen([sys.executable, "-c", client], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    proc.stdin.write(json.dumps([ps, warm, f"http://127.0.0.1:{port}"]))
    proc.stdin.close()
    assert proc.stdout.readline().strip() == "GO"
    tl.on = True
    t, c = time.perf_counter(), time.process_time()
    line = proc.stdout.readline()
    t1, cpu = time.perf_counter(), time.process_time() - c
    proc.wait()
    server.stop()
    if not line.startswith("DONE"):
        raise SystemExit(f"client failed: {line!r}")
    return t, t1, cpu


def run_bench_client(engine, tl: Timeline, port: int) -> tuple[float, float, float]:
    """Serve ``engine`` on ``port``; ``sglite bench serving --dataset shared-prefix`` (streaming,
    as the issue's measurement) is the client, in a second process. The timeline starts at the
    client's ``/flush_cache`` (after its warm-up request)."""
    import resource

    flush0, marks = engine.flush_cache, {}

    def flush():
        ok = flush0()
        tl.rows.clear()
        tl.on = True
        marks["t"], marks["c"] = time.perf_counter(), time.process_time()
        return ok

    engine.flush_cache = flush
    server = serve(engine, port)
    u0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-m", "sglite.cli", "bench", "serving", "--base-url",
                          f"http://127.0.0.1:{port}", "--dataset", "shared-prefix", "--disable-tqdm"],
                         capture_output=True, text=True)
    t1, cpu = time.perf_counter(), time.process_time() - marks.get("c", 0.0)
    u1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    server.stop()
    if out.returncode != 0 or "t" not in marks:
        raise SystemExit(f"client failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")
    print("\n".join(line for line in out.stdout.splitlines() if "req/s" in line or "Request throughput" in line
                    or "TTFT" in line or "hit" in line.lower()))
    print(f"client process CPU (warm-up included): {u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime:.2f} s")
    return marks["t"], t1, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=("shared-prefix", "offline"), default="shared-prefix")
    ap.add_argument("--mode", choices=("inproc", "http"), default="inproc")
    ap.add_argument("--port", type=int, default=30377)
    ap.add_argument("--client", choices=("burst", "bench"), default="burst",
                    help="http mode: one /generate per prompt, all at once (burst), or `sglite bench serving "
                         "--dataset shared-prefix` (bench: streaming, its own prompts and warm-up)")
    ap.add_argument("--steps", action="store_true", help="print every step, not only the summary")
    ap.add_argument("--json", default=None, help="write the rows and the summary here")
    ap.add_argument("engine_args", nargs="*", help="engine flags after --, e.g. -- --schedule-policy lpm")
    a = ap.parse_args()
    from sglite.flags import engine_kwargs
    from sglite.runtime.engine import Engine
    from sglite.server.settings import build_parser

    kwargs = engine_kwargs(build_parser().parse_args(a.engine_args)) if a.engine_args else {}
    engine = Engine(**kwargs)
    tl = Timeline(engine)
    ps, warm = prompts(a.workload)
    try:
        if a.mode == "http" and a.client == "bench":
            t0, t1, cpu = run_bench_client(engine, tl, a.port)
        elif a.mode == "http":
            t0, t1, cpu = run_http(engine, tl, ps, warm, a.port)
        else:
            t0, t1, cpu = run_inproc(engine, tl, ps, warm)
        tl.on = False
        stats = engine.get_server_info()
    finally:
        engine.shutdown()
    rows = tl.rows
    s = summary(rows, t0, t1)
    s["process_cpu_s"] = cpu
    if a.steps:
        print(f"{'#':>3} {'kind':7} {'rows':>4} {'new':>5} {'cached':>6} {'run':>3} {'wait':>4} "
              f"{'gap':>6} {'wall':>7} {'fwd':>7} {'cpu':>7} {'thr':>7}  (ms)")
        for i, r in enumerate(rows):
            print(f"{i:3d} {r['kind']:7} {r['rows']:4d} {r['new']:5d} {r['cached']:6d} {r['running']:3d} "
                  f"{r['waiting']:4d} {r['gap_ms']:6.1f} {r['wall_ms']:7.1f} {r.get('fwd_ms', 0):7.1f} "
                  f"{r['cpu_ms']:7.1f} {r['thread_cpu_ms']:7.1f}")
    n = len(ps)
    print(f"{a.workload} {a.mode} {' '.join(a.engine_args)}: {s['wall_s']:.2f} s wall ({n / s['wall_s']:.2f} req/s, "
          f"{n * 64 / s['wall_s']:.0f} tok/s), process CPU {cpu:.2f} s, {s['steps']} steps; "
          f"before first step {s.get('before_first_ms', 0):.0f} ms, gaps {s.get('gaps_ms', 0):.0f} ms, "
          f"after last {s.get('after_last_ms', 0):.0f} ms; cache hit {stats.get('cache_hit_rate', '?')}")
    for kind in ("prefill", "mixed", "decode"):
        k = s.get(kind)
        if k and k["steps"]:
            print(f"  {kind:7}: {k['steps']:3d} steps, wall {k['wall_ms']:7.0f} ms (forward {k['fwd_ms']:7.0f}), "
                  f"CPU {k['cpu_ms']:7.0f} ms, new tokens {k['new_tokens']}, cached {k['cached_tokens']}, "
                  f"mean rows {k['rows_mean']:.1f}; outside the forward {k['rest_ms']:5.0f} ms, engine thread "
                  f"CPU {k['rest_thread_cpu_ms']:5.0f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": s, "rows": rows}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("SGLITE_LOG_LEVEL", "WARNING")
    main()
