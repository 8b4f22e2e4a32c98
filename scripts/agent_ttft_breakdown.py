"""Break down ``sglite bench agent``'s TTFT per turn into server stages (in-process server, default model).

    python scripts/agent_ttft_breakdown.py --n 8 --turns 10 --modes previous full

Stamps (monkeypatched timers, nothing changed in sglite): HTTP handler entry (_new_turn), the
preparation pool's start/end of prepare() with its stages (render: template + splice + token
count; sampling: params + grammar), Req construction (engine arrival), the first scheduler step
that includes the request, the first token; the client's TTFT comes from the bench itself."""
import argparse, asyncio, collections, json, statistics, sys, threading, time
ap = argparse.ArgumentParser(); ap.add_argument("--n", type=int, default=8); ap.add_argument("--turns", type=int, default=10)
ap.add_argument("--modes", nargs="+", default=["previous", "full"]); ap.add_argument("--max-total-tokens", type=int, default=16384)
a = ap.parse_args()
from sglite import Engine
from sglite.bench import agent as bench
from sglite.runtime import scheduler as S
from sglite.server import request_pipeline as RP, responses_api as RA
from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig

REC = {}   # rid -> dict of stamps
LOCK = threading.Lock()
local = threading.local()

def stage(mod, name):
    f = getattr(mod, name)
    def g(*x, **k):
        t0 = time.perf_counter()
        try: return f(*x, **k)
        finally:
            d = getattr(local, "d", None)
            if d is not None: d[name] = d.get(name, 0.0) + time.perf_counter() - t0
    setattr(mod, name, g)
for n in ("validate", "plan_output", "render", "sampling", "_render_spliced", "_render_text", "render_prompt"):
    stage(RP, n)
from sglite.server import engine_client as EC
_count = EC.EngineClient.count_tokens
def count(self, text):
    t0 = time.perf_counter(); out = _count(self, text)
    d = getattr(local, "d", None)
    if d is not None: d["count_tokens"] = d.get("count_tokens", 0.0) + time.perf_counter() - t0
    return out
EC.EngineClient.count_tokens = count

_new_turn = RA._new_turn
def new_turn(store, req):
    t0 = time.perf_counter(); turn = _new_turn(store, req); turn._t_http = t0; turn._t_turn = time.perf_counter() - t0
    return turn
RA._new_turn = new_turn
_prep = RA._prepare
def prep(ctx, turn):
    local.d = d = {"t_http": turn._t_http, "new_turn": turn._t_turn, "t_prep0": time.perf_counter()}
    items = list(turn.history) + list(turn.input_items)
    d["turn"] = 1 + sum(1 for it in items if it.get("type") == "function_call_output")
    out = _prep(ctx, turn)
    d["t_prep1"] = time.perf_counter(); d["prompt_tokens"] = out.prompt_tokens if hasattr(out, "prompt_tokens") else None
    with LOCK: REC[out.call.rid] = d
    local.d = None
    return out
RA._prepare = prep

_sched = S.Scheduler.schedule
def schedule(self):
    plan = _sched(self)
    if plan is not None:
        now = time.perf_counter()
        for e in plan.entries:
            if getattr(e.req, "_t_sched", None) is None: e.req._t_sched = now
    return plan
S.Scheduler.schedule = schedule
_finish = S.Scheduler._finish
def finish(self, req, reason):
    with LOCK:
        d = REC.get(req.rid)
        if d is not None:
            d.update(t_arrival=req.arrival, t_sched=getattr(req, "_t_sched", None), t_first=req.first_token_time,
                     input=len(req.input_ids), cached=req.cached_tokens)
    return _finish(self, req, reason)
S.Scheduler._finish = finish

eng = Engine(max_total_tokens=a.max_total_tokens)
with ServerThread(eng, ServerConfig(port=0)) as srv:
    asyncio.run(bench.run_mode(srv.url, "full", 2, 2, None, 64))  # warm-up: kernels, grammar compile
    for mode in a.modes:
        REC.clear()
        res = asyncio.run(bench.run_mode(srv.url, mode, a.n, a.turns, None, 64))
        bench.print_table(res)
        by = collections.defaultdict(list)
        for d in REC.values():
            if "t_first" not in d or d["t_first"] is None: continue
            by[d["turn"]].append({
                "handler->pool": d["t_prep0"] - d["t_http"],
                "prepare": d["t_prep1"] - d["t_prep0"],
                "render": d.get("render", 0), "spliced": d.get("_render_spliced", 0), "text": d.get("_render_text", 0),
                "templates": d.get("render_prompt", 0), "count_tok": d.get("count_tokens", 0), "sampling": d.get("sampling", 0),
                "pool->engine": d["t_arrival"] - d["t_prep1"], "queue": d["t_sched"] - d["t_arrival"],
                "first step": d["t_first"] - d["t_sched"], "engine ttft": d["t_first"] - d["t_arrival"],
                "server ttft": d["t_first"] - d["t_http"], "input": d["input"], "cached": d["cached"]})
        keys = ["handler->pool", "prepare", "render", "spliced", "text", "templates", "count_tok", "sampling",
                "pool->engine", "queue", "first step", "engine ttft", "server ttft", "input", "cached"]
        print("turn " + " ".join(f"{k[:12]:>12}" for k in keys) + "   (medians; seconds, tokens)")
        for t in sorted(by):
            print(f"{t:4d} " + " ".join(f"{statistics.median(r[k] for r in by[t]):12.4f}" for k in keys))
eng.shutdown()
