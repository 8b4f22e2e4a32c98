"""``sglite bench quant``: native quantized weights against the dequantized path, side by side in
one process (this machine's speed drifts, so only same-run ratios mean anything).

    sglite bench quant [--model-path P] [--schemes gguf,none] [--dtype bfloat16] [--num-threads 1]
                       [--decode-tokens 64] [--prefill-len 512] [--repeats 3]
                       [--agreement-prompts 64] [--agreement-tokens 32] [--agreement-dtype float32]
                       [--parts speed,agreement] [--llama-bench PATH]

speed (per scheme, ``--dtype`` activations): resident weight bytes
(``LlamaModel.resident_weight_bytes``), batch-1 and batch-16 decode tok/s (the time of
``1 + decode_tokens`` greedy tokens minus the time of 1, so prefill drops out; best of
``--repeats``), prefill tok/s (one ``--prefill-len``-token prompt, radix cache off).
``--llama-bench PATH`` (a ``llama-bench`` binary built from llama.cpp, see docs/benchmarks.md): each
batch-1 repeat first runs ``llama-bench -m <model> -p 0 -n <decode-tokens> -t <threads> -r 1`` on
the same GGUF file, so both are measured side by side in one run under the same load; adds
``llama_cpp_b1_tok_s`` (best) and ``b1_vs_llama_cpp`` (our best / theirs) per scheme.
agreement: greedy tokens of each scheme against ``none`` (the dequantized weights) in
``--agreement-dtype`` activations (default float32) over ``--agreement-prompts`` prompts x ``--agreement-tokens`` tokens: the share of
positions with equal tokens (free running: after a first difference the texts go their own way)
and the share of prompts whose whole continuation is equal.
Output: a table, ``--output-json``.
"""
from __future__ import annotations

import argparse
import json
import random
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

    return Engine(model_path=a.model_path, dtype=dtype, quantization=scheme, num_threads=a.num_threads,
                  log_level="warning", **kw)


def _timed(engine, prompts: list, new_tokens: int) -> float:
    sps = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}
    t = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=sps)
    return time.perf_counter() - t


def llama_bench(a, threads: int) -> float:
    """tok/s of one ``llama-bench`` decode run (``--llama-bench``) on the same GGUF file.

    Raises:
        RuntimeError: the binary failed or printed no result."""
    from sglite.runtime.model_loader import default_model_path

    model = a.model_path or str(default_model_path())
    cmd = [a.llama_bench, "-m", model, "-p", "0", "-n", str(a.decode_tokens), "-t", str(threads), "-r", "1", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    try:
        return float(json.loads(out.stdout)[0]["avg_ts"])
    except (ValueError, IndexError, KeyError) as e:
        raise RuntimeError(f"--llama-bench: {' '.join(cmd)} gave no result (exit {out.returncode}): "
                           f"{out.stderr.strip()[-300:]}") from e


def speed(a, scheme: Optional[str]) -> dict:
    """Resident bytes, decode tok/s at batch 1 and 16, prefill tok/s of one scheme (and llama.cpp's
    batch-1 decode interleaved with ours when ``--llama-bench`` is given)."""
    import torch

    e = _engine(a, scheme, a.dtype, disable_radix_cache=True, max_total_tokens=16 * 1024)
    threads = a.num_threads or torch.get_num_threads()  # the engine's (set from --num-threads)
    rng = random.Random(0)
    vocab = list(range(200, 40000))
    try:
        out = {"scheme": scheme or "none", "impl": e.runner.model.linear_impl,
               "resident_weight_mb": e.runner.model.resident_weight_bytes() / 1e6}
        for batch in (1, 16):
            ps = [[rng.choice(vocab) for _ in range(32)] for _ in range(batch)]
            _timed(e, ps, 4)  # warm-up
            best, theirs = float("inf"), 0.0
            for _ in range(a.repeats):
                if batch == 1 and a.llama_bench:
                    theirs = max(theirs, llama_bench(a, threads))
                t1 = _timed(e, ps, 1)
                tn = _timed(e, ps, 1 + a.decode_tokens)
                best = min(best, max(tn - t1, 1e-9))
            out[f"decode_b{batch}_tok_s"] = batch * a.decode_tokens / best
            if batch == 1 and a.llama_bench:
                out["llama_cpp_b1_tok_s"] = theirs
                out["b1_vs_llama_cpp"] = out["decode_b1_tok_s"] / theirs
        best = float("inf")
        for _ in range(a.repeats):
            p = [rng.choice(vocab) for _ in range(a.prefill_len)]
            best = min(best, _timed(e, [p], 1))
        out["prefill_tok_s"] = a.prefill_len / best
        return out
    finally:
        e.shutdown()


def greedy(a, scheme: Optional[str], prompts: list[str]) -> list[list[int]]:
    e = _engine(a, scheme, a.agreement_dtype, max_total_tokens=16 * 1024)
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


def run(a: argparse.Namespace) -> dict:
    schemes = [None if s == "none" else s for s in a.schemes.split(",")]
    res: dict = {"args": vars(a), "speed": [], "agreement": {}}
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
    p.add_argument("--parts", default="speed,agreement", help="speed and/or agreement")
    p.add_argument("--output-json", default=None, help="write the results here")
    p.add_argument("--llama-bench", default=None,
                   help="a llama-bench binary: run it on the same GGUF, interleaved with the batch-1 decode runs")
    return p


def check_args(a: argparse.Namespace) -> None:
    """Raise ValueError naming the first bad option."""
    for name in ("decode_tokens", "prefill_len", "repeats", "agreement_prompts", "agreement_tokens"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(a, name)}")
    if a.llama_bench and a.model_path and not a.model_path.endswith(".gguf"):
        raise ValueError(f"--llama-bench: needs a .gguf --model-path, got {a.model_path!r}")
    if not set(a.parts.split(",")) <= {"speed", "agreement"}:
        raise ValueError(f"--parts: must be speed and/or agreement, got {a.parts!r}")


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
    for s, ag in res["agreement"].items():
        print(f"greedy agreement {s} vs dequantized ({a.agreement_dtype}, {ag['positions']} positions): "
              f"{100 * ag['positions_equal']:.1f}% of positions, {100 * ag['prompts_equal']:.1f}% of prompts equal")
    if a.output_json:
        write_json(a.output_json, res)
    return 0

