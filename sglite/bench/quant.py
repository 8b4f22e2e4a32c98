"""``sglite bench quant``: native quantized weights against the dequantized path, side by side in
one process (this machine's speed drifts, so only same-run ratios mean anything).

    sglite bench quant [--model-path P] [--schemes gguf,none] [--dtype bfloat16] [--num-threads 1]
                       [--decode-tokens 64] [--prefill-len 512] [--repeats 3]
                       [--agreement-prompts 64] [--agreement-tokens 32] [--agreement-dtype float32]
                       [--parts speed,agreement,gemm] [--gemm-rows 1,8,16,32,48,64] [--llama-bench PATH]

speed (per scheme, ``--dtype`` activations): resident weight bytes
(``LlamaModel.resident_weight_bytes``), batch-1 and batch-16 decode tok/s (the time of
``1 + decode_tokens`` greedy tokens minus the time of 1, so prefill drops out; best of
``--repeats``), prefill tok/s (one ``--prefill-len``-token prompt, radix cache off).
threads (``--parts threads``; on by default with ``--llama-bench``): batch-1 decode tok/s of the
first scheme at every thread count from 1 to the usable CPUs (powers of two, cores - 1 and cores
above 8), one engine per count (``num_threads``); with ``--llama-bench [PATH]`` (a ``llama-bench``
binary built from llama.cpp, see docs/benchmarks.md; no PATH: ``llama-bench`` on ``$PATH``) each
repeat first runs ``llama-bench -m <model> -p 0 -n <decode-tokens> -t <threads> -r 1`` on the same
GGUF file, so both sides are measured at each count under the same load. Reports each side's best
(tok/s and thread count), its scaling (all cores / 1 thread) and ``best_vs_llama_cpp`` (our best /
theirs). Without the binary the sweep runs sglite alone and says why.
agreement: greedy tokens of each scheme against ``none`` (the dequantized weights) in
``--agreement-dtype`` activations (default float32) over ``--agreement-prompts`` prompts x ``--agreement-tokens`` tokens: the share of
positions with equal tokens (free running: after a first difference the texts go their own way)
and the share of prompts whose whole continuation is equal.
gemm (not in the default ``--parts``): a decode-step matmul microbench. Every scheme's engine is
loaded at once (``--dtype`` activations) and ``kernels.linear`` is timed over all of the model's
matrices (every layer's qkv / o / gate_up / down + the LM head) at each ``--gemm-rows`` row count,
the schemes alternating per repeat (best kept): ms per step-worth of matmuls and each scheme's
speed relative to ``none`` (> 1: faster than the dequantized float path). Paths: ``SGLITE_GEMM``.
Output: a table, ``--output-json``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from typing import Optional, Sequence

from .report import HelpFormatter, format_table, write_json

TOPICS = ("the history of Rome", "how a compiler works", "baking bread", "the water cycle", "chess openings",
          "photosynthesis", "the French revolution", "black holes", "learning a language", "sorting algorithms",
          "volcanoes", "the immune system", "jazz music", "electric cars", "the moon landing", "honey bees")
FORMS = ("Explain {} in simple words.", "Write a short poem about {}.", "Give three facts about {}.",
         "What is the most surprising thing about {}?")


def agreement_prompts(n: int) -> list[str]:
    """``n`` fixed chat-style prompts (topics x question forms, in a fixed order)."""
    return [FORMS[i // len(TOPICS) % len(FORMS)].format(TOPICS[i % len(TOPICS)]) for i in range(n)]


def _log(msg: str) -> None:
    print(f"[bench quant {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _engine(a, scheme: Optional[str], dtype: str, **kw):
    from sglite import Engine

    return Engine(model_path=a.model_path, dtype=dtype, quantization=scheme, log_level="warning", **kw)


def _timed(engine, prompts: list, new_tokens: int) -> float:
    sps = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}
    t = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=sps)
    return time.perf_counter() - t


def llama_bench(a, threads: int, binary: str) -> float:
    """tok/s of one ``llama-bench`` decode run (``binary``) on the same GGUF file.

    Raises:
        RuntimeError: the binary failed or printed no result."""
    from sglite.runtime.model_loader import default_model_path

    model = a.model_path or str(default_model_path())
    cmd = [binary, "-m", model, "-p", "0", "-n", str(a.decode_tokens), "-t", str(threads), "-r", "1", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    try:
        return float(json.loads(out.stdout)[0]["avg_ts"])
    except (ValueError, IndexError, KeyError) as e:
        raise RuntimeError(f"--llama-bench: {' '.join(cmd)} gave no result (exit {out.returncode}): "
                           f"{out.stderr.strip()[-300:]}") from e


def decode_tok_s(a, e, batch: int, rng: random.Random, before=None) -> float:
    """Decode tok/s of ``batch`` random 32-token prompts on engine ``e``: best of ``--repeats`` of
    (time of 1 + decode_tokens greedy tokens) - (time of 1); ``before()`` runs before each repeat."""
    vocab = list(range(200, 40000))
    ps = [[rng.choice(vocab) for _ in range(32)] for _ in range(batch)]
    _timed(e, ps, 4)  # warm-up
    best = float("inf")
    for _ in range(a.repeats):
        if before is not None:
            before()
        t1 = _timed(e, ps, 1)
        tn = _timed(e, ps, 1 + a.decode_tokens)
        best = min(best, max(tn - t1, 1e-9))
    return batch * a.decode_tokens / best


def thread_counts(cpus: int) -> list[int]:
    """Every count 1..cpus up to 8 CPUs; above, powers of two, cpus - 1 and cpus."""
    from sglite.kernels.decode_threads import candidates

    return list(range(1, cpus + 1)) if cpus <= 8 else candidates(cpus)


def find_llama_bench(a) -> Optional[str]:
    """The llama-bench binary of ``--llama-bench`` (``auto``: ``llama-bench`` on ``$PATH``), or None
    after a message saying why the sweep runs sglite alone."""
    if not a.llama_bench:
        return None
    if a.llama_bench != "auto":
        return a.llama_bench  # check_args made sure it is an executable file
    found = shutil.which("llama-bench")
    if found is None:
        _log("llama-bench not found on $PATH: sweeping sglite alone (build llama.cpp's llama-bench as "
             "docs/benchmarks.md says and pass --llama-bench PATH)")
    return found


def sweep(a, scheme: Optional[str]) -> dict:
    """Batch-1 decode tok/s per thread count, sglite (one engine per count) and llama.cpp (when its
    llama-bench is there, run before each of our repeats at the same count); best and scaling."""
    from sglite.kernels.decode_threads import usable_cpus

    binary = find_llama_bench(a)
    cpus = usable_cpus()
    rows = []
    for t in thread_counts(cpus):
        _log(f"threads: {scheme or 'none'} at {t} thread(s)" + (" (and llama-bench)" if binary else ""))
        theirs: list = []
        before = (lambda: theirs.append(llama_bench(a, t, binary))) if binary else None
        e = _engine(a, scheme, a.dtype, num_threads=t, disable_radix_cache=True, max_total_tokens=4096)
        try:
            row = {"threads": t, "sglite_b1_tok_s": decode_tok_s(a, e, 1, random.Random(0), before)}
        finally:
            e.shutdown()
        if binary:
            row["llama_cpp_b1_tok_s"] = max(theirs)
        rows.append(row)
    return {"scheme": scheme or "none", "cpus": cpus, "rows": rows, **summarize(rows)}


def summarize(rows: list[dict]) -> dict:
    """Best tok/s and thread count of each side, scaling (most threads / 1 thread), our best / theirs."""
    out: dict = {}
    for side, key in (("sglite", "sglite_b1_tok_s"), ("llama_cpp", "llama_cpp_b1_tok_s")):
        have = [r for r in rows if key in r]
        if not have:
            continue
        best = max(have, key=lambda r: r[key])
        out[f"{side}_best_tok_s"], out[f"{side}_best_threads"] = best[key], best["threads"]
        one = [r[key] for r in have if r["threads"] == 1]
        if one and len(have) > 1:
            out[f"{side}_scaling"] = have[-1][key] / one[0]
    if "llama_cpp_best_tok_s" in out:
        out["best_vs_llama_cpp"] = out["sglite_best_tok_s"] / out["llama_cpp_best_tok_s"]
    return out


def speed(a, scheme: Optional[str]) -> dict:
    """Resident bytes, decode tok/s at batch 1 and 16, prefill tok/s of one scheme."""
    import torch

    e = _engine(a, scheme, a.dtype, num_threads=a.num_threads, disable_radix_cache=True, max_total_tokens=16 * 1024)
    threads = torch.get_num_threads()  # the engine's (--num-threads, or its start-up probe's)
    rng = random.Random(0)
    vocab = list(range(200, 40000))
    try:
        out = {"scheme": scheme or "none", "impl": e.runner.model.linear_impl,
               "resident_weight_mb": e.runner.model.resident_weight_bytes() / 1e6}
        out["threads"] = threads
        for batch in (1, 16):
            out[f"decode_b{batch}_tok_s"] = decode_tok_s(a, e, batch, rng)
        best = float("inf")
        for _ in range(a.repeats):
            p = [rng.choice(vocab) for _ in range(a.prefill_len)]
            best = min(best, _timed(e, [p], 1))
        out["prefill_tok_s"] = a.prefill_len / best
        return out
    finally:
        e.shutdown()


def greedy(a, scheme: Optional[str], prompts: list[str]) -> list[list[int]]:
    e = _engine(a, scheme, a.agreement_dtype, num_threads=a.num_threads, max_total_tokens=16 * 1024)
    try:
        msgs = [e.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        outs = e.generate(msgs, {"max_new_tokens": a.agreement_tokens, "temperature": 0, "ignore_eos": True})
        return [o["output_ids"] for o in outs]
    finally:
        e.shutdown()


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Share of equal positions and of fully equal continuations (``got`` vs ``ref``)."""
    pos = sum(sum(x == y for x, y in zip(r, g)) for r, g in zip(ref, got))
    total = sum(len(r) for r in ref)
    return {"positions_equal": pos / max(total, 1), "prompts_equal": sum(r == g for r, g in zip(ref, got)) / len(ref),
            "positions": total}


def gemm(a, schemes: list) -> list[dict]:
    """ms per pass of ``kernels.linear`` over every matrix of the model, per row count and scheme
    (engines loaded together, timings alternating between them; best of ``--repeats``)."""
    import torch

    from sglite import kernels

    engines = {s or "none": _engine(a, s, a.dtype, max_total_tokens=4096) for s in schemes}
    try:
        ws = {k: e.runner.model.linear_weights() for k, e in engines.items()}
        dt = getattr(torch, a.dtype)
        rows_out = []
        for m in (int(r) for r in a.gemm_rows.split(",")):
            xs = {k: torch.randn(m, k, dtype=dt) for k in {w.shape[1] for v in ws.values() for w in v}}
            best = {k: float("inf") for k in ws}
            for _ in range(a.repeats + 1):  # the first pass warms up (packing, page faults)
                for k, v in ws.items():
                    t = time.perf_counter()
                    for w in v:
                        kernels.linear(xs[w.shape[1]], w)
                    best[k] = min(best[k], time.perf_counter() - t)
            row = {"rows": m, **{f"{k}_ms": 1e3 * t for k, t in best.items()}}
            if "none" in best:
                row.update({f"{k}_vs_none": best["none"] / t for k, t in best.items() if k != "none"})
            rows_out.append(row)
            _log(f"gemm rows={m}: " + ", ".join(f"{k} {1e3 * t:.1f} ms" for k, t in best.items()))
        return rows_out
    finally:
        for e in engines.values():
            e.shutdown()


def run(a: argparse.Namespace) -> dict:
    schemes = [None if s == "none" else s for s in a.schemes.split(",")]
    res: dict = {"args": vars(a), "speed": [], "agreement": {}, "gemm": []}
    if "gemm" in a.parts:
        _log(f"gemm: {', '.join(s or 'none' for s in schemes)} at rows {a.gemm_rows}")
        res["gemm"] = gemm(a, schemes)
    if "threads" in a.parts or a.llama_bench:
        _log(f"threads: {schemes[0] or 'none'}")
        res["threads"] = sweep(a, schemes[0])
    if "speed" in a.parts:
        for s in schemes:
            _log(f"speed: {s or 'none'}")
            res["speed"].append(speed(a, s))
    if "agreement" in a.parts:
        prompts = agreement_prompts(a.agreement_prompts)
        _log(f"agreement: dequantized reference ({a.agreement_dtype})")
        ref = greedy(a, None, prompts)
        for s in schemes:
            if s is not None:
                _log(f"agreement: {s} ({a.agreement_dtype})")
                res["agreement"][s] = agreement(ref, greedy(a, s, prompts))
    return res


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglite bench quant", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model-path", default=None, help="a .gguf file (default: the default model)")
    p.add_argument("--schemes", default="gguf,none", help="comma list of quantization values ('none': dequantized)")
    p.add_argument("--dtype", default="bfloat16", help="activation dtype of the speed runs")
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: the engine's)")
    p.add_argument("--decode-tokens", type=int, default=64, help="decode tokens timed per run")
    p.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the prefill run")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement (best kept)")
    p.add_argument("--agreement-prompts", type=int, default=64, help="prompts of the agreement run")
    p.add_argument("--agreement-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--agreement-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="activation dtype of the agreement runs")
    p.add_argument("--parts", default="speed,agreement",
                   help="comma list of speed, agreement, gemm, threads (the thread sweep)")
    p.add_argument("--gemm-rows", default="1,8,16,32,48,64", help="row counts of the gemm part")
    p.add_argument("--output-json", default=None, help="write the results here")
    p.add_argument("--llama-bench", default=None, nargs="?", const="auto", metavar="PATH",
                   help="sweep threads 1..cores on both sides: this llama-bench binary (no PATH: llama-bench "
                        "on $PATH) on the same GGUF, interleaved with sglite's batch-1 decode runs")
    return p


def check_args(a: argparse.Namespace) -> None:
    """Raise ValueError naming the first bad option."""
    for name in ("decode_tokens", "prefill_len", "repeats", "agreement_prompts", "agreement_tokens"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(a, name)}")
    if a.llama_bench and a.model_path and not a.model_path.endswith(".gguf"):
        raise ValueError(f"--llama-bench: needs a .gguf --model-path, got {a.model_path!r}")
    if not set(a.parts.split(",")) <= {"speed", "agreement", "gemm", "threads"}:
        raise ValueError(f"--parts: must be a comma list of speed, agreement, gemm, threads, got {a.parts!r}")
    rows = a.gemm_rows.split(",")
    if not all(r.strip().isdigit() and int(r) >= 1 for r in rows):
        raise ValueError(f"--gemm-rows: must be a comma list of integers >= 1, got {a.gemm_rows!r}")
    if a.num_threads is not None and a.num_threads < 1:
        raise ValueError(f"--num-threads: must be >= 1, got {a.num_threads}")
    if a.llama_bench not in (None, "auto") and not (os.path.isfile(a.llama_bench) and os.access(a.llama_bench, os.X_OK)):
        raise ValueError(f"--llama-bench: {a.llama_bench!r} is not an executable file (build llama.cpp's llama-bench, "
                         "docs/benchmarks.md)")


def sweep_summary(sw: dict) -> str:
    """One line per side: best tok/s at its thread count, scaling; then our best / theirs."""
    lines = []
    for side, name in (("sglite", "sglite"), ("llama_cpp", "llama.cpp")):
        if f"{side}_best_tok_s" in sw:
            sc = sw.get(f"{side}_scaling")
            lines.append(f"{name} batch-1 best {sw[f'{side}_best_tok_s']:.1f} tok/s at {sw[f'{side}_best_threads']} "
                         f"thread(s)" + (f"; scaling 1 -> {sw['rows'][-1]['threads']} threads {sc:.2f}x" if sc else ""))
    if "best_vs_llama_cpp" in sw:
        lines.append(f"sglite best / llama.cpp best: {sw['best_vs_llama_cpp']:.2f}x")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        check_args(a)
    except ValueError as e:
        p.error(str(e))
    res = run(a)
    rows = [{k: (f"{v:.1f}" if isinstance(v, float) else v) for k, v in r.items()} for r in res["speed"]]
    if rows:
        print(format_table(rows, [(k, k) for k in rows[0]]))
    grows = [{k: (f"{v:.2f}" if isinstance(v, float) else v) for k, v in r.items()} for r in res["gemm"]]
    if grows:
        print(format_table(grows, [(k, k) for k in grows[0]]))
    if "threads" in res:
        print(format_table(res["threads"]["rows"], [(k, k) for k in res["threads"]["rows"][0]]))
        print(sweep_summary(res["threads"]))
    for s, ag in res["agreement"].items():
        print(f"greedy agreement {s} vs dequantized ({a.agreement_dtype}, {ag['positions']} positions): "
              f"{100 * ag['positions_equal']:.1f}% of positions, {100 * ag['prompts_equal']:.1f}% of prompts equal")
    if a.output_json:
        write_json(a.output_json, res)
    return 0

