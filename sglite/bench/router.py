"""``sglite bench router``: prefix-cache hit rate of data-parallel routing against one worker.

    sglite bench router --num-prompts 48 --dp-size 2

Starts ``dp_size`` engines (each behind its own HTTP server on 127.0.0.1) and one more engine
alone, all on the same model with the same KV pool size, and sends the same workloads
(``shared-prefix`` and ``multi-turn`` of :mod:`sglite.bench.workloads`) through: the single
worker, the router with ``cache_aware``, the router with ``round_robin``. The hit rate is
``sum(cached_tokens) / sum(prompt_tokens)`` over the workload's responses (``meta_info``); the
caches are flushed before every run. Default model: a tiny random Llama written to a temporary
folder (hit rates depend on the prompts and the routing, not on the weights).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import tempfile
import time

import httpx

from .workloads import WorkloadOptions, build_workload

WORKLOADS = ("shared-prefix", "multi-turn")


def build_parser() -> argparse.ArgumentParser:
    from ..flags import FlagParser

    p = FlagParser(prog="sglite bench router", description="Prefix-cache hit rate: router over N workers vs one.")
    p.add_argument("--model-path", default=None, help="model of every worker (default: none, a tiny random Llama)")
    p.add_argument("--dp-size", type=int, default=2, help="workers behind the router (default: 2)")
    p.add_argument("--num-prompts", type=int, default=48,
                   help="requests of shared-prefix; conversations of multi-turn are a quarter (default: 48)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default: 4)")
    p.add_argument("--max-total-tokens", type=int, default=65536, help="KV pool of each worker (default: 65536)")
    p.add_argument("--output-len", type=int, default=8, help="new tokens per request (default: 8)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--output-file", default=None, help="write the results as JSON here (default: none)")
    return p


def _requests(name: str, n: int, seed: int, output_len: int):
    """Waves of prompt builders: each wave's requests may run concurrently; a multi-turn wave is
    one turn of every conversation (the prompt is the history so far plus the new message)."""
    opts = WorkloadOptions(output_len=output_len, system_len=256, question_len=16, num_turns=4, turn_len=32)
    if name == "shared-prefix":
        return [[s.turns[0].text for s in build_workload(name, n, seed, opts)]]
    sessions = build_workload(name, max(2, n // 4), seed, opts)
    return [[(i, t) for i in range(len(sessions))] for t in range(opts.num_turns)], sessions


def run_workload(url: str, name: str, n: int, seed: int, output_len: int, concurrency: int) -> dict:
    """Send workload ``name`` to ``url`` (/generate, greedy); returns hit rate, tokens, seconds."""
    httpx.post(url + "/flush_cache", timeout=60)
    sp = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    totals = {"prompt_tokens": 0, "cached_tokens": 0, "requests": 0}

    def send(text):
        r = httpx.post(url + "/generate", json={"text": text, "sampling_params": sp}, timeout=600)
        r.raise_for_status()
        return r.json()

    def account(out):
        totals["prompt_tokens"] += out["meta_info"]["prompt_tokens"]
        totals["cached_tokens"] += out["meta_info"]["cached_tokens"]
        totals["requests"] += 1

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        if name == "shared-prefix":
            for out in pool.map(send, _requests(name, n, seed, output_len)[0]):
                account(out)
        else:
            waves, sessions = _requests(name, n, seed, output_len)
            history = ["" for _ in sessions]
            for wave in waves:
                prompts = [history[i] + f"User: {sessions[i].turns[t].text}\nAssistant:" for i, t in wave]
                for (i, _), prompt, out in zip(wave, prompts, pool.map(send, prompts)):
                    account(out)
                    history[i] = prompt + out["text"] + "\n"
    totals["seconds"] = time.perf_counter() - t0
    totals["hit_rate"] = totals["cached_tokens"] / max(1, totals["prompt_tokens"])
    return totals


def main(argv=None) -> int:
    from ..runtime.engine import Engine
    from ..server.runner import ServerThread
    from ..router.app import RouterThread
    from ..router.policy import RouterConfig

    args = build_parser().parse_args(argv)
    model = args.model_path
    tmp = None
    if model is None:
        from ..testing import make_tiny_llama

        tmp = tempfile.TemporaryDirectory()
        model = str(make_tiny_llama(tmp.name, seed=0))
    kw = dict(dtype="float32", max_total_tokens=args.max_total_tokens, log_level="warning")
    engines = [Engine(model, **kw) for _ in range(args.dp_size + 1)]
    servers = [ServerThread(e).start() for e in engines]
    results: dict = {}
    try:
        workers = tuple(s.url for s in servers[1:])
        for wl in WORKLOADS:
            row = {"single": run_workload(servers[0].url, wl, args.num_prompts, args.seed, args.output_len,
                                          args.concurrency)}
            for policy in ("cache_aware", "round_robin"):
                with RouterThread(RouterConfig(worker_urls=workers, port=0, policy=policy)) as r:
                    row[policy] = run_workload(r.url, wl, args.num_prompts, args.seed, args.output_len,
                                               args.concurrency)
                    row[policy]["per_worker"] = r.router.routed
            results[wl] = row
    finally:
        for s in servers:
            s.stop()
        for e in engines:
            e.shutdown()
        if tmp is not None:
            tmp.cleanup()
    print(f"{'workload':<14} {'mode':<12} {'requests':>8} {'prompt tok':>10} {'cached tok':>10} "
          f"{'hit rate':>8} {'vs single':>9} {'seconds':>8}  per worker")
    for wl, row in results.items():
        base = row["single"]["hit_rate"]
        for mode, r in row.items():
            rel = r["hit_rate"] / base if base else float("nan")
            print(f"{wl:<14} {mode:<12} {r['requests']:>8} {r['prompt_tokens']:>10} {r['cached_tokens']:>10} "
                  f"{r['hit_rate']:>8.3f} {rel:>9.3f} {r['seconds']:>8.1f}  {r.get('per_worker', '')}")
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(results, f, indent=2)
    return 0
