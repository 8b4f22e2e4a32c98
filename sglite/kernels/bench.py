"""Kernel benchmark: achieved memory bandwidth of every op against the device's copy bandwidth.

For each op and implementation (``triton`` on CUDA, ``torch`` reference anywhere) it times the
op through the dispatcher and reports time, bytes moved / time (GB/s, the minimum traffic: each
input read once, each output written once) and that bandwidth as a fraction of a plain
device-to-device copy measured in the same run (``dst.copy_(src)``, read + write bytes). The
headline rows are decode attention at batch 64 x 4k context and masked sampling of 64 x 49k.

Usage (one short script on a GPU machine; smaller sizes on CPU for a smoke test)::

    python -m sglite.kernels.bench                   # cuda if available, else cpu
    python -m sglite.kernels.bench --device cpu --quick --json out.json

Timing: CUDA events around ``reps`` back-to-back calls after warm-up (median of 5 such
windows); on CPU, ``time.perf_counter`` likewise. Small inputs (sampling: 12.6 MB of logits)
stay in the GPU's L2 across repetitions, so their bandwidth can exceed the copy bandwidth.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from . import device, dispatch


@dataclass
class BenchConfig:
    """What to run. ``quick`` shrinks sizes (CPU smoke test); ``impls`` None = all usable ones."""
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    quick: bool = False
    impls: Optional[List[str]] = None
    reps: int = 20
    seed: int = 0


@dataclass
class Case:
    """One benchmark row: a thunk per implementation, bytes moved per call, optional FLOPs."""
    op: str
    shape: str
    run: Dict[str, Callable[[], object]]
    bytes_moved: int
    flops: float = 0.0
    note: str = ""
    results: Dict[str, float] = field(default_factory=dict)  # impl -> seconds per call


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], device: str, reps: int, windows: int = 5) -> float:
    """Median seconds per call of ``fn`` over ``windows`` windows of ``reps`` calls each."""
    fn()
    _sync(device)
    fn()
    _sync(device)
    out = []
    for _ in range(windows):
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3 / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out.append((time.perf_counter() - t0) / reps)
    return statistics.median(out)


def copy_bandwidth(device: str, nbytes: int, reps: int) -> float:
    """Bytes per second of ``dst.copy_(src)`` for ``nbytes`` buffers (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = time_call(lambda: dst.copy_(src), device, reps)
    return 2 * src.numel() * 4 / t


def _pool(total_tokens: int, hkv: int, d: int, dtype, device, gen):
    S = total_tokens + 1
    kb = torch.randn(S, hkv, d, dtype=dtype, device=device, generator=gen)
    vb = torch.randn(S, hkv, d, dtype=dtype, device=device, generator=gen)
    return kb, vb


def _page_table(lens: List[int], device, gen):
    """req_to_token [B, max_len] int32 over a random permutation of slots 1..sum(lens)."""
    total, lmax = sum(lens), max(lens)
    perm = (torch.randperm(total, device=device, generator=gen) + 1).to(torch.int32)
    r2t = torch.zeros(len(lens), lmax, dtype=torch.int32, device=device)
    o = 0
    for i, n in enumerate(lens):
        r2t[i, :n] = perm[o:o + n]
        o += n
    return r2t


def build_cases(cfg: BenchConfig, impls: List[str]) -> List[Case]:
    """The benchmark rows for ``cfg`` (sizes: full on GPU, shrunk with ``quick``)."""
    dev, dt = cfg.device, cfg.dtype
    gen = torch.Generator(device=dev).manual_seed(cfg.seed)
    el = torch.finfo(dt).bits // 8
    cases: List[Case] = []

    def bind(op_name, *args):
        op = getattr(dispatch, op_name)
        return {impl: (lambda impl=impl: op(*args, impl=impl)) for impl in impls}

    # store_kv
    n_tok, hkv, d = (512, 3, 64) if cfg.quick else (4096, 8, 128)
    kb, vb = _pool(4 * n_tok, hkv, d, dt, dev, gen)
    loc = torch.randperm(4 * n_tok, device=dev, generator=gen)[:n_tok] + 1
    k = torch.randn(n_tok, hkv, d, dtype=dt, device=dev, generator=gen)
    v = torch.randn_like(k)
    cases.append(Case("store_kv", f"N={n_tok} Hkv={hkv} D={d}", bind("store_kv", kb, vb, loc, k, v),
                      bytes_moved=2 * 2 * n_tok * hkv * d * el + n_tok * 8))

    # decode attention: the headline (Llama-3-8B heads) and SmolLM2-135M heads
    shapes = [(8, 512, 9, 3, 64)] if cfg.quick else [(64, 4096, 32, 8, 128), (64, 4096, 9, 3, 64)]
    for B, ctx, hq, hkv, d in shapes:
        lens = [ctx] * B
        kb, vb = _pool(sum(lens), hkv, d, dt, dev, gen)
        r2t = _page_table(lens, dev, gen)
        rows = torch.arange(B, device=dev)
        seq = torch.tensor(lens, device=dev)
        q = torch.randn(B, hq, d, dtype=dt, device=dev, generator=gen)
        kv_bytes = 2 * sum(lens) * hkv * d * el
        cases.append(Case("decode_attention", f"B={B} ctx={ctx} Hq={hq} Hkv={hkv} D={d}",
                          bind("decode_attention", q, kb, vb, r2t, rows, seq, d ** -0.5),
                          bytes_moved=kv_bytes + 4 * sum(lens) + 2 * B * hq * d * el,
                          flops=4.0 * sum(lens) * hq * d))

    # extend attention (compute-bound: TFLOP/s is the figure of merit)
    B, pre, ext, hq, hkv, d = (2, 128, 128, 9, 3, 64) if cfg.quick else (4, 1024, 1024, 32, 8, 128)
    lens = [pre + ext] * B
    kb, vb = _pool(sum(lens), hkv, d, dt, dev, gen)
    r2t = _page_table(lens, dev, gen)
    q = torch.randn(B * ext, hq, d, dtype=dt, device=dev, generator=gen)
    p_t = torch.full((B,), pre, device=dev)
    e_t = torch.full((B,), ext, device=dev)
    causal_pairs = B * (ext * pre + ext * (ext + 1) / 2)
    cases.append(Case("extend_attention", f"B={B} prefix={pre} new={ext} Hq={hq} Hkv={hkv} D={d}",
                      bind("extend_attention", q, kb, vb, r2t, torch.arange(B, device=dev), p_t, e_t,
                           d ** -0.5),
                      bytes_moved=2 * sum(lens) * hkv * d * el + 2 * q.numel() * el + 4 * sum(lens),
                      flops=4.0 * causal_pairs * hq * d))

    # bitmask and sampling over a 49k vocabulary (float32 logits, as the LM head emits)
    B, V = (16, 49152) if cfg.quick else (64, 49152)
    W = (V + 31) // 32
    logits = torch.randn(B, V, device=dev, generator=gen) * 3
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (B, W), dtype=torch.int32, device=dev, generator=gen)
    scratch = logits.clone()
    cases.append(Case("apply_token_bitmask", f"B={B} V={V}", bind("apply_token_bitmask", scratch, mask),
                      bytes_moved=2 * B * V * 4 + B * W * 4, note="in place, read + write"))

    def sampling_args(temp, top_p, top_k, min_p):
        f = lambda x, t: torch.full((B,), x, dtype=t, device=dev)  # noqa: E731
        return (f(temp, torch.float32), f(top_p, torch.float32), f(top_k, torch.int64),
                f(min_p, torch.float32), torch.arange(B, device=dev), torch.zeros(B, dtype=torch.int64, device=dev))

    read = B * V * 4 + B * W * 4
    for label, sargs, note in [
            ("masked sampling", sampling_args(0.8, 1.0, 0, 0.0), "temperature 0.8 + grammar mask (headline)"),
            ("masked greedy", sampling_args(0.0, 1.0, 0, 0.0), "argmax + grammar mask"),
            ("masked top-k/top-p", sampling_args(0.8, 0.9, 50, 0.05),
             "top-k 50, top-p 0.9, min-p 0.05 (Triton: 16-ary threshold search)")]:
        cases.append(Case(f"sample ({label})", f"B={B} V={V}",
                          bind("sample", logits, *sargs, mask), bytes_moved=read, note=note))
    return cases


def run(cfg: BenchConfig) -> dict:
    """Run every case; returns ``{"device", "copy_GBps", "rows": [...]}`` (also printed as a table)."""
    triton_ok = cfg.device.startswith("cuda") and device.triton_available()
    impls = cfg.impls or (["triton", "torch"] if triton_ok else ["torch"])
    name = torch.cuda.get_device_name() if cfg.device.startswith("cuda") else "cpu"
    copy_bytes = (64 << 20) if cfg.quick else (1 << 30 if cfg.device.startswith("cuda") else 256 << 20)
    bw = copy_bandwidth(cfg.device, copy_bytes, max(3, cfg.reps // 2))
    rows = []
    for case in build_cases(cfg, impls):
        for impl, fn in case.run.items():
            reps = cfg.reps if not (impl == "torch" and case.op.startswith("sample")) else max(2, cfg.reps // 4)
            try:
                t = time_call(fn, cfg.device, reps)
            except Exception as exc:  # report, keep going: one failing op must not hide the rest
                rows.append({"op": case.op, "shape": case.shape, "impl": impl, "error": repr(exc)[:200]})
                continue
            gbps = case.bytes_moved / t / 1e9
            rows.append({"op": case.op, "shape": case.shape, "impl": impl, "us": t * 1e6,
                         "GBps": gbps, "frac_copy": case.bytes_moved / t / bw,
                         "TFLOPs": case.flops / t / 1e12 if case.flops else None, "note": case.note})
    result = {"device": name, "dtype": str(cfg.dtype).replace("torch.", ""), "copy_GBps": bw / 1e9,
              "rows": rows, "torch": torch.__version__, "cpu_threads": torch.get_num_threads()}
    print(format_table(result))
    return result


def format_table(result: dict) -> str:
    """Markdown table of a :func:`run` result."""
    lines = [f"device: {result['device']}, KV dtype {result['dtype']}, torch {result['torch']} "
             f"({result['cpu_threads']} CPU threads), copy bandwidth {result['copy_GBps']:.0f} GB/s "
             "(read + write)", "",
             "| op | shape | impl | time (µs) | GB/s | of copy BW | TFLOP/s | note |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['shape']} | {r['impl']} | error | | | | {r['error']} |")
            continue
        tf = f"{r['TFLOPs']:.1f}" if r["TFLOPs"] else ""
        lines.append(f"| {r['op']} | {r['shape']} | {r['impl']} | {r['us']:.1f} | {r['GBps']:.0f} | "
                     f"{100 * r['frac_copy']:.0f}% | {tf} | {r['note']} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--quick", action="store_true", help="small sizes (default on CPU)")
    p.add_argument("--impl", action="append", choices=list(dispatch.IMPLS), help="repeatable")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", help="also write the result as JSON to this path")
    a = p.parse_args(argv)
    cfg = BenchConfig(device=a.device, dtype=getattr(torch, a.dtype),
                      quick=a.quick or not a.device.startswith("cuda"), impls=a.impl,
                      reps=a.reps if a.device.startswith("cuda") else min(a.reps, 5))
    result = run(cfg)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1, default=lambda o: None if isinstance(o, float) and math.isnan(o) else o)
    return result


if __name__ == "__main__":
    main()
