"""Where a served request's time to first token goes, under the random serving workload (issue 33).

Starts an in-process server (default model, the flags below passed to ``Engine``), runs
``sglite bench serving --backend openai --dataset random`` against it in a SUBPROCESS (the client
must not share the server's GIL, as with ``sglite serve``), then prints, per request (medians and
quartiles over the run, ms):

* ``queue``: engine arrival (``Req`` built, after tokenizing) -> start of the first step that runs it;
* ``steps``: steps run between its arrival and its first token (1: its prefill step samples it);
* ``prefill_step``: wall time of the step that sampled its first token;
* ``engine_ttft``: arrival -> first token (``Req.first_token_time``);
* ``client_ttft``: the bench client's TTFT (its own ``--output-json`` median).

and the steps: how many, how many ran prefill tokens, decode-only ones, the median wall time of
a pure decode step and of a step with prefill tokens (ms) and its prefill tokens.

Timers are monkeypatched wrappers (nothing in sglite changes). Usage::

    .venv/bin/python scripts/serving_ttft_breakdown.py [--num-prompts 64] [--engine-arg k=v ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def q(xs: list, scale: float = 1e3) -> str:
    if not xs:
        return "n/a"
    xs = sorted(x * scale for x in xs)
    if len(xs) < 4:
        return f"{statistics.median(xs):.1f}"
    a, m, b = statistics.quantiles(xs, n=4)
    return f"{m:.1f} [{a:.1f}-{b:.1f}]"


def parse_value(v: str):
    for t in (int, float):
        try:
            return t(v)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(v.lower(), v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--engine-arg", action="append", default=[], help="k=v passed to Engine (repeatable)")
    ap.add_argument("--runs", type=int, default=1, help="bench runs against the same server")
    ap.add_argument("--skip-first", type=int, default=0,
                    help="leave out requests that arrive in the first N ms of a run (the start-up burst)")
    a = ap.parse_args()

    import logging

    from sglite import Engine
    from sglite.runtime import scheduler as S
    from sglite.server.runner import ServerThread
    from sglite.server.settings import ServerConfig

    steps: list = []  # (t0, t1, prefill_tokens, prefill_reqs, decode_rows, decode_only, waiting)
    reqs: dict = {}
    sched_fn, step_fn, finish_fn = S.Scheduler.schedule, S.Scheduler.step, S.Scheduler._finish

    def schedule(self):
        plan = sched_fn(self)
        if plan is not None:
            now = time.perf_counter()
            self._plan_info = (sum(e.n for e in plan.entries if e.req.prefilling),
                               sum(1 for e in plan.entries if e.req.prefilling),
                               sum(1 for e in plan.entries if not e.req.prefilling), plan.decode_only,
                               len(self.waiting))
            for e in plan.entries:
                if getattr(e.req, "_t_sched", None) is None:
                    e.req._t_sched, e.req._step_at_arrival = now, None
        return plan

    def step(self):
        t0 = time.perf_counter()
        self._plan_info = None
        out = step_fn(self)
        if self._plan_info is not None:
            steps.append((t0, time.perf_counter(), *self._plan_info))
        return out

    def finish(self, req, reason):
        if getattr(req, "_t_sched", None) is not None and req.first_token_time is not None:
            reqs[req.rid] = (req.arrival, req._t_sched, req.first_token_time, len(req.input_ids))
        return finish_fn(self, req, reason)

    S.Scheduler.schedule, S.Scheduler.step, S.Scheduler._finish = schedule, step, finish
    kw = {k: parse_value(v) for k, v in (x.split("=", 1) for x in a.engine_arg)}
    eng = Engine(**kw)
    logging.getLogger("sglite").setLevel(logging.WARNING)
    http: list = []  # [entry, first text chunk written, rid, prepared] per /v1/completions call
    import contextvars

    from sglite.server import engine_client as EC
    cur = contextvars.ContextVar("rec", default=None)
    prep_fn = EC.EngineClient.prepare

    async def prepare(self, fn, *args, field):
        out = await prep_fn(self, fn, *args, field=field)
        rec = cur.get()
        if rec is not None and isinstance(out, tuple) and hasattr(out[0], "rid"):
            rec[2], rec[3] = out[0].rid, time.perf_counter()
        return out
    EC.EngineClient.prepare = prepare

    class Stamp:  # ASGI middleware: when the call came in, when its first text chunk went out
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope.get("path") != "/v1/completions":
                return await self.app(scope, receive, send)
            rec = [time.perf_counter(), None, None, None]
            cur.set(rec)

            async def send2(msg):
                if rec[1] is None and msg.get("type") == "http.response.body" and b'"text":"' in msg.get("body", b"") \
                        and b'"text":""' not in msg.get("body", b""):
                    rec[1] = time.perf_counter()
                await send(msg)
            await self.app(scope, receive, send2)
            http.append(rec)

    srv = ServerThread(eng, ServerConfig(port=0, log_level="warning"))
    srv.app.add_middleware(Stamp)
    with srv:
        for run in range(a.runs):
            steps.clear()
            reqs.clear()
            http.clear()
            out = os.path.join(tempfile.mkdtemp(), "bench.json")
            t_run = time.perf_counter()
            subprocess.run([sys.executable, "-m", "sglite.cli", "bench", "serving", "--backend", "openai",
                            "--base-url", srv.url, "--dataset", "random", "--input-len", "256", "--output-len", "128",
                            "--range-ratio", "0.5", "--max-concurrency", str(a.max_concurrency), "--num-prompts",
                            str(a.num_prompts), "--disable-tqdm", "--output-json", out],
                           check=True, stdout=subprocess.DEVNULL)
            res = json.load(open(out))
            report(run, kw, res, steps, reqs, http, a.skip_first / 1e3)
    eng.shutdown()


def report(run, kw, res, steps, reqs, http, skip) -> None:
    t_first = min(r[0] for r in reqs.values())
    rows = [r for r in reqs.values() if r[0] - t_first >= skip]
    starts = [s[0] for s in steps]
    import bisect

    n_steps = [bisect.bisect_left(starts, ft) - bisect.bisect_left(starts, arr) for arr, _, ft, _ in rows]
    first_step = []
    for arr, ts, ft, _ in rows:
        i = bisect.bisect_right(starts, ft) - 1
        first_step.append(steps[i][1] - steps[i][0] if i >= 0 else float("nan"))
    pure = [s[1] - s[0] for s in steps if s[2] == 0]
    mixed = [s for s in steps if s[2] > 0]
    print(json.dumps({"run": run, "engine_args": kw, "load": os.getloadavg(),
                      "client": {k: round(res[k], 2) for k in ("output_throughput", "median_ttft_ms",
                                                                 "median_tpot_ms", "mean_ttft_ms")}}))
    print(f"  requests {len(rows)} (of {len(reqs)}); ms: median [q1-q3]")
    print(f"  queue        {q([ts - arr for arr, ts, _, _ in rows])}")
    print(f"  engine_ttft  {q([ft - arr for arr, _, ft, _ in rows])}")
    print(f"  server_ttft  {q([h[1] - h[0] for h in http if h[1] is not None and h[0] - t_first >= skip])} "
          f"(HTTP entry -> first text chunk written); client median {res['median_ttft_ms']:.1f}")
    by_rid = {h[2]: h for h in http if h[2] is not None and h[1] is not None}
    pairs = [(by_rid[rid], reqs[rid]) for rid in reqs if rid in by_rid and reqs[rid][0] - t_first >= skip]
    print(f"  paired {len(pairs)}: http->prepared {q([h[3] - h[0] for h, _ in pairs])}, prepared->arrival "
          f"{q([r[0] - h[3] for h, r in pairs])}, first token->chunk written {q([h[1] - r[2] for h, r in pairs])}")
    print(f"  steps        {q(n_steps, 1)} (steps started between arrival and first token)")
    print(f"  first-token step wall {q(first_step)}")
    print(f"  steps {len(steps)}: decode-only {sum(1 for s in steps if s[5])}, with prefill {len(mixed)}; "
          f"pure decode step {q(pure)}; prefill step {q([s[1] - s[0] for s in mixed])}, "
          f"its prefill tokens {q([s[2] for s in mixed], 1)}, reqs {q([s[3] for s in mixed], 1)}, "
          f"decode rows {q([s[4] for s in mixed], 1)}")


if __name__ == "__main__":
    main()
