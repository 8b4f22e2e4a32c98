"""``sglite bench offline``: the in-process Engine against baselines measured in the same run.

    sglite bench offline [--model-path P] [--dtype bfloat16] [--parts a,b,c,d]
                         [--num-requests 256] [--min-len 32] [--max-len 512] [--hf-max-batches 4]

This machine's speed drifts up to 2x between sessions, so every comparison is made side by side
in one process (the issue 3 protocol):

(a) batch-1 latency: a ``latency_prompt_len``-token prompt, ``latency_new_tokens`` new tokens;
    TTFT and TPOT (client-side stream timestamps) against HF ``generate`` at the same dtype, and
    as a fraction of the weight-bandwidth floor (weight bytes / read bandwidth measured now).
(b) throughput: ``num_requests`` requests, input and output lengths uniform in
    [min_len, max_len], submitted at once, against HF ``generate`` in static batches of
    ``hf_batch_size`` (left padding, greedy); ``--hf-max-batches`` runs only the first batches.
(c) prefix sharing: a ``prefix_len``-token few-shot prefix + ``num_questions`` distinct
    ``question_len``-token questions, ``prefix_new_tokens`` new tokens each, radix cache on
    against ``disable_radix_cache=True``.
(d) no reuse: random prompts, radix cache on against off (best of ``--repeats`` each, interleaved).

Prompts are token ids (exact lengths). Output: tables, ``--output-json``, ``--plot`` (bars).
"""
from __future__ import annotations

import argparse
import gc
import random
import shlex
import sys
import time
from typing import Optional, Sequence

from .profiling import add_profile_args, engine_profile
from .report import HelpFormatter, at_least, format_table, write_json
from .stats import RequestOutcome, compute_metrics
from .workloads import random_words

PARTS = ("a", "b", "c", "d")
COLUMNS = (("part", "part"), ("metric", "metric"), ("sglite", "sglite"), ("baseline", "baseline"),
           ("baseline_name", "baseline is"), ("ratio", "ratio"), ("target", "target"))


def _log(msg: str) -> None:
    print(f"[bench offline {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _row(part, metric, ours, base=None, name="", ratio=None, target=""):
    return {"part": part, "metric": metric, "sglite": ours, "baseline": base, "baseline_name": name,
            "ratio": ratio, "target": target}


def _engine_run(engine, prompts: Sequence[list], out_lens: Sequence[int]) -> tuple[list, float, float]:
    """Submit all prompts at once; returns (outcomes, wall seconds, server-side cache hit rate)."""
    before = engine.get_server_info()
    sps = [{"max_new_tokens": int(o), "ignore_eos": True, "temperature": 0} for o in out_lens]
    t = time.perf_counter()
    outs = engine.generate(input_ids=[list(p) for p in prompts], sampling_params=sps)
    wall = time.perf_counter() - t
    after = engine.get_server_info()
    d_prompt = after["prompt_tokens"] - before["prompt_tokens"]
    hit = (after["cached_tokens"] - before["cached_tokens"]) / d_prompt if d_prompt else 0.0
    res = []
    for o in outs:
        m = o["meta_info"]
        res.append(RequestOutcome(m["finish_reason"]["type"] != "abort", m["prompt_tokens"], m["completion_tokens"],
                                  m.get("cached_tokens", 0), ttft=m.get("ttft", float("nan")),
                                  e2e=m.get("e2e_latency", float("nan"))))
    return res, wall, hit


def _engine_latency(engine, prompt: list, new_tokens: int) -> dict:
    """Batch-1 stream of one request; client-side TTFT/E2E/TPOT in seconds."""
    t = time.perf_counter()
    times = []
    for _ in engine.generate(input_ids=list(prompt), sampling_params={
            "max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}, stream=True):
        times.append(time.perf_counter())
    ttft, e2e = times[0] - t, times[-1] - t
    return {"ttft_s": ttft, "e2e_s": e2e, "tpot_s": (e2e - ttft) / max(1, new_tokens - 1)}


class Prompts:
    """Token-id prompts from a seed: random ids (non-special) or encoded word text cut to length."""

    def __init__(self, tokenizer, seed: int):
        self.tok, self.rng = tokenizer, random.Random(seed)
        n = min(len(tokenizer.hf), tokenizer.vocab_size)
        self.ids = [i for i in range(n) if i not in tokenizer.special_token_ids]

    def random(self, length: int) -> list[int]:
        return [self.rng.choice(self.ids) for _ in range(length)]

    def text(self, length: int, lead: str = "") -> list[int]:
        ids = self.tok.encode(lead + random_words(self.rng, 2 * length))
        return ids[:length]


def part_a(a, engine, hf, prompts: Prompts, bw: dict) -> tuple[list, dict]:
    ps = [prompts.random(a.latency_prompt_len) for _ in range(a.repeats)]
    _engine_latency(engine, ps[0], 4)  # warm-up
    runs = [_engine_latency(engine, p, a.latency_new_tokens) for p in ps]
    ours = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}
    base = hf.latency(ps, a.latency_new_tokens)
    floor_s = hf.weight_bytes / (bw["read_gbps"] * 1e9)
    res = {"sglite": ours, "hf": base, "weight_bytes": hf.weight_bytes, "bandwidth": bw, "floor_tpot_s": floor_s}
    rows = [_row("a", "TTFT (ms)", ours["ttft_s"] * 1e3, base["ttft_s"] * 1e3, "HF generate",
                 ours["ttft_s"] / base["ttft_s"]),
            _row("a", "TPOT (ms)", ours["tpot_s"] * 1e3, base["tpot_s"] * 1e3, "HF generate",
                 ours["tpot_s"] / base["tpot_s"], "<= 0.4"),
            _row("a", "decode tok/s", 1 / ours["tpot_s"], 1 / base["tpot_s"], "HF generate",
                 base["tpot_s"] / ours["tpot_s"]),
            _row("a", "TPOT vs bandwidth floor (ms)", ours["tpot_s"] * 1e3, floor_s * 1e3,
                 f"floor ({hf.weight_bytes / 1e6:.0f} MB @ {bw['read_gbps']:.1f} GB/s read)",
                 floor_s / ours["tpot_s"], ">= 0.5 (floor/TPOT)")]
    return rows, res


def part_b(a, engine, hf, prompts: Prompts) -> tuple[list, dict]:
    rng = random.Random(a.seed + 1)
    lens = [(rng.randint(a.min_len, a.max_len), rng.randint(a.min_len, a.max_len)) for _ in range(a.num_requests)]
    ps = [prompts.random(i) for i, _ in lens]
    outs = [o for _, o in lens]
    engine.flush_cache()
    _engine_run(engine, ps[:2], [4, 4])  # warm-up
    engine.flush_cache()
    outcomes, wall, _ = _engine_run(engine, ps, outs)
    m = compute_metrics(outcomes, wall)
    base = hf.static_batches(ps, outs, a.hf_batch_size, a.hf_max_batches)
    rows = [_row("b", "output tok/s", m["output_throughput"], base["output_throughput"],
                 f"HF static batch {a.hf_batch_size} ({base['batches']} batches)",
                 m["output_throughput"] / base["output_throughput"], ">= 3"),
            _row("b", "requests/s", m["request_throughput"], base["request_throughput"], "HF static batches",
                 m["request_throughput"] / base["request_throughput"]),
            _row("b", "P50 / P95 TTFT (ms)", f"{m['ttft_ms']['p50']:.0f} / {m['ttft_ms']['p95']:.0f}"),
            _row("b", "P50 / P95 TPOT (ms)", f"{m['tpot_ms']['p50']:.1f} / {m['tpot_ms']['p95']:.1f}")]
    return rows, {"sglite": m, "hf": base, "wall_s": wall}


def part_c(a, on, off, prompts: Prompts) -> tuple[list, dict]:
    prefix = prompts.text(a.prefix_len, "Answer each question briefly, as in these examples.\n")
    qs = [prefix + prompts.text(a.question_len, f"\nQ{i}: ") for i in range(a.num_questions)]
    outs = [a.prefix_new_tokens] * len(qs)
    res = {}
    for name, eng in (("on", on), ("off", off)):
        eng.flush_cache()
        outcomes, wall, hit = _engine_run(eng, qs, outs)
        res[name] = {**compute_metrics(outcomes, wall), "cache_hit_rate": hit}
    r_on, r_off = res["on"], res["off"]
    rows = [_row("c", "requests/s", r_on["request_throughput"], r_off["request_throughput"], "radix cache off",
                 r_on["request_throughput"] / r_off["request_throughput"], ">= 5"),
            _row("c", "cache hit rate", r_on["cache_hit_rate"], r_off["cache_hit_rate"], "radix cache off",
                 None, ">= 0.9"),
            _row("c", "P50 TTFT (ms)", r_on["ttft_ms"]["p50"], r_off["ttft_ms"]["p50"], "radix cache off",
                 r_on["ttft_ms"]["p50"] / r_off["ttft_ms"]["p50"])]
    return rows, res


def part_d(a, on, off, prompts: Prompts) -> tuple[list, dict]:
    ps = [prompts.random(a.noreuse_input_len) for _ in range(a.noreuse_requests)]
    outs = [a.noreuse_output_len] * len(ps)
    walls: dict = {"on": [], "off": []}
    res = {}
    for i in range(a.repeats):
        order = (("on", on), ("off", off)) if i % 2 == 0 else (("off", off), ("on", on))  # cancel drift
        for name, eng in order:
            eng.flush_cache()
            outcomes, wall, hit = _engine_run(eng, ps, outs)
            walls[name].append(wall)
            if wall == min(walls[name]):
                res[name] = {**compute_metrics(outcomes, wall), "cache_hit_rate": hit}
    slower = min(walls["on"]) / min(walls["off"]) - 1
    paired = sorted(x / y - 1 for x, y in zip(walls["on"], walls["off"]))
    res["walls_s"], res["slowdown_with_cache"] = walls, slower
    res["median_paired_slowdown"] = paired[len(paired) // 2]
    rows = [_row("d", "output tok/s (best of %d)" % a.repeats, res["on"]["output_throughput"],
                 res["off"]["output_throughput"], "radix cache off",
                 res["on"]["output_throughput"] / res["off"]["output_throughput"]),
            _row("d", "slowdown with cache on (best of each)", slower, None, "", None, "<= 0.02"),
            _row("d", "slowdown with cache on (median of paired runs)", res["median_paired_slowdown"], None, "", None,
                 "")]
    return rows, res


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglite bench offline", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model-path", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", help="weights/compute dtype of sglite and HF")
    p.add_argument("--parts", default="a,b,c,d", help="comma-separated parts to run (a, b, c, d)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and lengths")
    p.add_argument("--repeats", type=at_least(1), default=3, help="(a) prompts timed, (d) alternating runs")
    p.add_argument("--latency-prompt-len", type=at_least(1), default=100, help="(a) prompt tokens")
    p.add_argument("--latency-new-tokens", type=at_least(1), default=128, help="(a) new tokens")
    p.add_argument("--num-requests", type=at_least(1), default=256, help="(b) requests submitted at once")
    p.add_argument("--min-len", type=at_least(1), default=32, help="(b) shortest input/output length (tokens)")
    p.add_argument("--max-len", type=at_least(1), default=512, help="(b) longest input/output length (tokens)")
    p.add_argument("--hf-batch-size", type=at_least(1), default=16, help="(b) HF static batch size")
    p.add_argument("--hf-max-batches", type=at_least(1), default=None,
                   help="(b) run only the first HF batches (default: all)")
    p.add_argument("--prefix-len", type=at_least(0), default=1000, help="(c) shared few-shot prefix tokens")
    p.add_argument("--num-questions", type=at_least(1), default=64, help="(c) questions after the prefix")
    p.add_argument("--question-len", type=at_least(1), default=40, help="(c) tokens per question")
    p.add_argument("--prefix-new-tokens", type=at_least(1), default=8, help="(c) new tokens per question")
    p.add_argument("--noreuse-requests", type=at_least(1), default=64, help="(d) random prompts")
    p.add_argument("--noreuse-input-len", type=at_least(1), default=256, help="(d) prompt tokens")
    p.add_argument("--noreuse-output-len", type=at_least(1), default=32, help="(d) new tokens")
    p.add_argument("--bandwidth-mib", type=at_least(1), default=512,
                   help="(a) size of the bandwidth probe tensor (MiB)")
    p.add_argument("--max-total-tokens", type=at_least(1), default=131072, help="KV pool of each engine (tokens)")
    p.add_argument("--engine-args", default="", help='more EngineConfig flags, e.g. "--chunked-prefill-size 256"')
    p.add_argument("--output-json", default=None, help="write rows and details here (default: none)")
    p.add_argument("--plot", default=None, help="PNG of bars, sglite vs baseline (default: none)")
    add_profile_args(p)
    return p


def _engine_kwargs(a) -> dict:
    from sglite.launch_server import build_parser as server_parser, engine_kwargs

    kw = engine_kwargs(server_parser().parse_args(shlex.split(a.engine_args)))
    return {"dtype": a.dtype, "max_total_tokens": a.max_total_tokens, **kw, "model_path": a.model_path}


def run(a: argparse.Namespace) -> dict:
    """Run the selected parts; returns ``{"rows": [...], "parts": {part: details}}`` (plus
    ``"profile"``: the trace's paths and phase rows, with ``--profile``)."""
    from sglite.runtime.engine import Engine

    parts = [x.strip() for x in a.parts.split(",") if x.strip()]
    bad = [x for x in parts if x not in PARTS]
    if bad or not parts:
        raise ValueError(f"parts: choose from {PARTS}, got {a.parts!r}")
    kw = _engine_kwargs(a)
    rows, details = [], {}
    engine = Engine(**kw)
    try:
        with engine_profile(a, engine) as prof:
            _run_parts(a, parts, engine, kw, rows, details)
    finally:
        engine.shutdown()
    out = {"rows": rows, "parts": details, "engine": {k: v for k, v in kw.items()}}
    return {**out, "profile": prof} if prof else out


def _run_parts(a, parts, engine, kw, rows, details) -> None:
    """Run ``parts`` on ``engine`` (and a radix-off twin for c, d), appending to ``rows``/``details``."""
    from sglite.runtime.engine import Engine

    prompts = Prompts(engine.tokenizer, a.seed)
    if "a" in parts or "b" in parts:
        from .offline_hf import HFBaseline, measure_read_bandwidth

        hf = HFBaseline(engine.checkpoint.model_dir, engine.runner.dtype,
                        engine.tokenizer.hf.pad_token_id or min(engine.tokenizer.eos_token_ids))
        if "a" in parts:
            _log("part a: batch-1 latency")
            r, details["a"] = part_a(a, engine, hf, prompts, measure_read_bandwidth(a.bandwidth_mib << 20))
            rows += r
        if "b" in parts:
            _log("part b: throughput")
            r, details["b"] = part_b(a, engine, hf, prompts)
            rows += r
        del hf
        gc.collect()
    if "c" in parts or "d" in parts:
        off = Engine(**{**kw, "disable_radix_cache": True})
        try:
            for name, fn in (("c", part_c), ("d", part_d)):
                if name in parts:
                    _log(f"part {name}: radix cache on vs off")
                    r, details[name] = fn(a, engine, off, prompts)
                    rows += r
        finally:
            off.shutdown()


def _plot(rows: list, path) -> None:
    from .plots import plot_bars

    groups = [(f"({r['part']}) {r['metric']}" + (f"\n{r['baseline_name']}" if r["baseline_name"] else ""),
               {"sglite": r["sglite"], "baseline": r["baseline"]})
              for r in rows if isinstance(r["sglite"], float) and isinstance(r["baseline"], float)]
    plot_bars(groups, path, title="sglite bench offline (same run)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``sglite bench offline``."""
    parser = build_parser()
    a = parser.parse_args(argv)
    parts = [x.strip() for x in a.parts.split(",") if x.strip()]
    if not parts or any(x not in PARTS for x in parts):
        parser.error(f"--parts: choose from {','.join(PARTS)}, got {a.parts!r}")
    if a.min_len > a.max_len:
        parser.error(f"--min-len: must be <= --max-len ({a.max_len}), got {a.min_len}")
    out = run(a)
    print(format_table(out["rows"], COLUMNS, digits=3))
    if a.output_json:
        write_json(a.output_json, {"args": vars(a), **out})
    if a.plot:
        _plot(out["rows"], a.plot)
    return 0
