"""KV-cache quantization benchmark (issue 16): pool density, accuracy and decode step time per
``kv_cache_dtype``, side by side in one run.

    .venv/bin/python scripts/bench_kv_quant.py accuracy --tokens 4096 --window 1024
    .venv/bin/python scripts/bench_kv_quant.py speed --batch 64 --context 1024
    .venv/bin/python scripts/bench_kv_quant.py prefill --words 700
    .venv/bin/python scripts/bench_kv_quant.py speed --batch 1 --per-op --quant-head \
        --model "$(.venv/bin/python scripts/bench_kv_quant.py random-qwen3 /tmp/qwen3-135m)"

* density: pool bytes per token (scales included) of the allocated tensors, tokens per GiB, ratio
  to the bfloat16 pool.
* accuracy (default model, float32 activations): the first ``--tokens`` tokens of CPython's
  ``pydoc_data.topics`` text (values joined in sorted-key order, as ``sglite eval perplexity``),
  disjoint windows of ``--window`` tokens, scored through prompt logprobs. Reported per dtype:
  perplexity (exp mean NLL over every position but each window's first) and its delta to the
  bfloat16-KV run; greedy agreement: the share of positions whose top-1 next token equals the
  bfloat16-KV run's (teacher forced: both runs see the same text).
* speed: a decode step of ``--batch`` requests with ``--context`` - i tokens (row i; staggered, so
  about one row in a group seals its key group per step, as in steady decoding; pools filled with
  random codes; attention cost does not depend on the values): one engine of model dtype
  ``--dtype``, one pool per KV dtype swapped into its runner, timed in turn for ``--reps`` rounds;
  median ``ModelRunner.forward`` wall time and process CPU time (with one torch thread, the CPU
  time is the step's cost without the waits of a shared machine) per dtype, and their ratios to the
  bfloat16 pool. Two steps are timed: the one where row 0 completes its key group (``--context`` a
  multiple of 128) and the one before it; ``step_ms`` weighs them as steady decoding of fewer than
  128 staggered rows meets them (a sealing row in min(B, 128) / 128 of the steps: at batch 1 one
  step in 128).
  ``--model PATH``: another checkpoint than the default model (e.g. ``random-qwen3 DIR``'s);
  ``--per-op``: each quantized dtype also timed with the fused decode declining its steps
  (``decode_fused.quant_kv = False``: the per-op path, as family models ran before issue 33),
  interleaved with the fused ones in the same rounds; ``--quant-head``: a float LM head (sglite's
  quantized checkpoints keep it in float16) quantized to 8-bit group 32 as the default model's
  (GGUF Q8_0) before timing.
* ``random-qwen3 DIR``: writes (once) a random Qwen3 checkpoint of the default model's shape
  (hidden 576, 30 layers, 9 heads, 3 KV heads, head_dim 64, intermediate 1536, its vocabulary;
  QK-norm), RTN 4-bit group-32 quantized (the default model is GGUF Q4_1), and prints its folder.
* prefill: time to first token of a ~2,300-token prompt (``--words 700``) per KV dtype, an engine
  each, median of ``--reps`` fresh prompts.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

DTYPES = ("bfloat16", "int8", "int4", "fp8_e4m3")


def topics_ids(tokenizer, n: int) -> list[int]:
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    ids = tokenizer.encode(text[: 10 * n], add_special_tokens=False)
    assert len(ids) >= n, "text too short"
    return ids[:n]


def pool_bytes(pool) -> int:
    seen, total = set(), 0
    for layer in pool.k_buffers + pool.v_buffers:
        ts = [layer] if isinstance(layer, torch.Tensor) else [layer.k_data, layer.v_data, layer.k_scale, layer.v_scale]
        for t in ts:
            key = (t.untyped_storage().data_ptr(), t.data_ptr())
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def accuracy(args) -> dict:
    from sglite import Engine

    res = {}
    for kvd in ("auto",) + DTYPES:
        e = Engine(dtype="float32", kv_cache_dtype=kvd, max_total_tokens=args.tokens + 2048,
                   log_level="warning", disable_radix_cache=True)
        ids = topics_ids(e.tokenizer, args.tokens)
        wins = [ids[i:i + args.window] for i in range(0, args.tokens, args.window)]
        t = time.time()
        outs = e.generate(input_ids=wins, sampling_params=[{"max_new_tokens": 1, "temperature": 0}] * len(wins),
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
        lps, top = [], []
        for w, o in zip(wins, outs):
            m = o["meta_info"]
            ent = m["input_token_logprobs"]
            lps += [x[0] for x in ent[1:]]
            tops = m["input_top_logprobs"]  # entry i: top tokens at position i (predicting token i)
            top += [x[0][1] for x in tops[1:]] + [m["output_token_logprobs"][0][1]]
        pool = e.runner.token_to_kv_pool
        res[kvd] = {"nll": -math.fsum(lps) / len(lps), "top1": top, "seconds": time.time() - t,
                    "bytes_per_token": pool.bytes_per_token,
                    "pool_bytes_per_token": pool_bytes(pool) / (pool.capacity + pool.page_size)}
        e.shutdown()
        print(kvd, f"nll {res[kvd]['nll']:.5f}", f"{res[kvd]['seconds']:.1f} s", file=sys.stderr)
    base = res["bfloat16"]
    rows = []
    for kvd, r in res.items():
        agree = sum(a == b for a, b in zip(r["top1"], base["top1"])) / len(base["top1"])
        rows.append({"kv_cache_dtype": kvd, "perplexity": math.exp(r["nll"]),
                     "ppl_delta_vs_bf16_pct": 100 * (math.exp(r["nll"] - base["nll"]) - 1),
                     "greedy_agree_vs_bf16": agree, "positions": len(base["top1"]),
                     "bytes_per_token": r["bytes_per_token"],
                     "allocated_bytes_per_token": round(r["pool_bytes_per_token"], 1),
                     "tokens_per_GiB": (1 << 30) // r["bytes_per_token"],
                     "density_vs_bf16": base["bytes_per_token"] / r["bytes_per_token"]})
    return {"python": sys.version.split()[0], "tokens": args.tokens, "window": args.window, "rows": rows}


def fill_pool(pool, table, B: int, L: int, g: torch.Generator) -> None:
    """Rows 0..B-1 of ``table`` hold L tokens on consecutive pages; the pool random (attention
    cost does not depend on the values)."""
    ps = pool.page_size
    pages_per = -(-L // ps)
    for b in range(B):
        first = 1 + b * pages_per
        table[b, :L] = torch.arange(first * ps, first * ps + L, dtype=torch.int32)
    for layer in pool.k_buffers + (pool.v_buffers if isinstance(pool.v_buffers[0], torch.Tensor) else []):
        if isinstance(layer, torch.Tensor):
            layer.copy_(torch.randn(layer.shape, generator=g).to(layer.dtype) * 0.5)
        elif layer.kind == "fp8_e4m3":
            layer.k_data.copy_(torch.randn(layer.k_data.shape, generator=g).to(layer.k_data.dtype))
            layer.v_data.copy_(torch.randn(layer.v_data.shape, generator=g).to(layer.v_data.dtype))
        else:
            for t in (layer.k_data, layer.v_data):
                t.copy_(torch.randint(0, 255, t.shape, generator=g, dtype=torch.uint8))
            for t in (layer.k_scale, layer.v_scale):
                t.copy_(torch.rand(t.shape, generator=g).half() * 0.01)
            for t in (layer.res_k, layer.res_v):
                t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def speed(args) -> dict:
    """One engine (model dtype ``--dtype``); one pool per KV dtype, swapped into its runner; the
    dtypes are timed in turn, ``--reps`` rounds, so machine drift hits them alike."""
    from sglite import Engine
    from sglite.runtime.forward_batch import ForwardBatch
    from sglite.runtime.kv_quant import make_pool

    B, L = args.batch, args.context
    e = Engine(model_path=args.model, dtype=args.dtype, max_total_tokens=1024, max_running_requests=B,
               log_level="warning")
    r = e.runner
    a = r.arch
    if args.quant_head:
        quant_head(r.model)
    g = torch.Generator().manual_seed(0)
    table = r.req_to_token_pool.req_to_token
    pools = {}
    for kvd in DTYPES:
        pool = make_pool(kvd, B * (L + 256) + 1024, 128, a.num_layers,  # one slot table for all: pages of 128
                         a.num_kv_heads, a.head_dim, r.dtype, r.device, 128, table.shape[0])
        fill_pool(pool, table, B, L, g)
        pools[kvd] = pool
    rows = torch.arange(B)

    def batch(top: int) -> ForwardBatch:
        lens = top - rows  # staggered lengths, one new token each
        return ForwardBatch(input_ids=torch.randint(0, 1000, (B,), generator=g), positions=lens - 1,
                            out_cache_loc=table[rows, lens - 1].long(), req_to_token=table,
                            ext_req_pool_indices=torch.empty(0, dtype=torch.int64),
                            ext_prefix_lens=torch.empty(0, dtype=torch.int64),
                            ext_extend_lens=torch.empty(0, dtype=torch.int64), dec_req_pool_indices=rows,
                            dec_seq_lens=lens, logits_indices=rows)

    # two steps per dtype: row 0 completes its key group (L a multiple of 128: the int pools quantize
    # it in that step), and the step before, where no row does when B < 128
    fbs = {"seal": batch(L), "no_seal": batch(L - 1)}
    fused = r.model.decode_fused
    fused_quant = fused is not None and fused.quant_kv
    # (label, pool, per-op): "<dtype> per-op" declines the fused path over that pool (quant_kv False)
    runs = [(k, k, False) for k in pools] + ([(k + " per-op", k, True) for k in DTYPES[1:]] if args.per_op else [])
    times = {(k, s): [] for k, _, _ in runs for s in fbs}
    cpu = {(k, s): [] for k, _, _ in runs for s in fbs}
    for i in range(args.reps + 1):
        for label, kvd, per_op in runs:
            r.token_to_kv_pool = pools[kvd]
            if fused is not None:
                fused.quant_kv = fused_quant and not per_op
            for s, fb in fbs.items():
                t, c = time.perf_counter(), time.process_time()
                r.forward(fb)
                if i:  # round 0 warms up
                    times[(label, s)].append(time.perf_counter() - t)
                    cpu[(label, s)].append(time.process_time() - c)
    if fused is not None:
        fused.quant_kv = fused_quant
    e.shutdown()
    # steady decoding of B staggered rows: a step has a row that completes its group with
    # probability min(B, G) / G (G = 128)
    p = min(B, 128) / 128

    def steady(d: dict, k: str) -> float:
        if B % 128 and L % 128 == 0:
            return p * statistics.median(d[(k, "seal")]) + (1 - p) * statistics.median(d[(k, "no_seal")])
        return statistics.median(d[(k, "seal")])

    base, base_cpu = steady(times, "bfloat16"), steady(cpu, "bfloat16")
    out = [{"kv_cache_dtype": k, "step_ms": 1000 * steady(times, k), "vs_bf16_pool": steady(times, k) / base,
            "cpu_ms": 1000 * steady(cpu, k), "cpu_vs_bf16_pool": steady(cpu, k) / base_cpu,
            "step_ms_sealing": 1000 * statistics.median(times[(k, "seal")]),
            "step_ms_not_sealing": 1000 * statistics.median(times[(k, "no_seal")]),
            "bytes_per_token": pools[kvd].bytes_per_token} for k, kvd, _ in runs]
    return {"batch": B, "context": L, "dtype": args.dtype, "threads": torch.get_num_threads(),
            "model": args.model or "default", "fused": type(fused).__name__ if fused is not None else None,
            "head": getattr(fused, "head_kind", None),
            "steady_weight_of_sealing_steps": p if (B % 128 and L % 128 == 0) else 1.0, "rows": out}


def quant_head(model) -> None:
    """A float LM head replaced by its RTN 8-bit symmetric group-32 copy (the default model's head is
    GGUF Q8_0; a quantized checkpoint of sglite.quantize keeps it in float16) and the fused decode
    prepared again, so the step's head costs what the default model's does."""
    from sglite import kernels
    from sglite.kernels.quant_linear import QuantLinearWeight
    from sglite.quant.rtn import rtn

    w = model.lm_head
    if isinstance(w, QuantLinearWeight):
        return
    gq = rtn(w.weight if hasattr(w, "weight") else w, 8, 32, sym=True)
    model.lm_head = QuantLinearWeight.from_codes(gq.codes, gq.scales, -gq.zeros.float() * gq.scales, 8, 32)
    model.lm_head.impl = model.layers[0]["qkv"].impl  # the per-op path's kernel of the layers (else: dequantized)
    model.decode_fused = kernels.decode_family.prepare(model)


def random_qwen3(out: str) -> str:
    """Folder of a random Qwen3 checkpoint of the default model's shape, RTN 4-bit group 32 (module
    docstring), written under ``out`` unless there."""
    from pathlib import Path

    from sglite.quant.calibrate import QuantOptions
    from sglite.quantize import quantize
    from sglite.runtime.model_loader import load_checkpoint
    from sglite.testing import make_tiny_family

    root = Path(out)
    if not (root / "rtn4" / "config.json").is_file():
        d = make_tiny_family(root / "hf", "qwen3", "Qwen3ForCausalLM", seed=0, vocab_from=load_checkpoint(None).model_dir,
                             hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                             head_dim=64, intermediate_size=1536, attention_bias=False)
        quantize(str(d), root / "rtn4", QuantOptions(method="rtn", bits=4, group_size=32), n_samples=1, seq_len=16)
    return str(root / "rtn4")


def prefill(args) -> dict:
    """Time to first token of one prompt of about ``--words`` words (~3.3 tokens a word) per KV dtype,
    an engine each (default model, default flags, all loaded at once), after a warm-up request;
    ``--reps`` rounds of a fresh prompt (no cache hit) on each engine in turn, median wall time, and
    its ratio to the first dtype's (the bfloat16 pool's)."""
    from sglite import Engine

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()

    def prompt(seed: int) -> str:
        return " ".join(words[(seed * 7 + i * 3) % 10] + str(i % 97) for i in range(args.words))

    sp = {"max_new_tokens": 1, "temperature": 0}
    dtypes = args.dtypes or DTYPES
    engines = {kvd: Engine(kv_cache_dtype="auto" if kvd == "bfloat16" else kvd, max_total_tokens=16384,
                           log_level="warning") for kvd in dtypes}
    for e in engines.values():
        e.generate(prompt(0)[:2000], sp)
    ts, n = {kvd: [] for kvd in dtypes}, 0
    for r in range(1, args.reps + 1):  # the dtypes alternate, each on a fresh prompt (no cache hit)
        for kvd, e in engines.items():
            t = time.perf_counter()
            n = e.generate(prompt(r), sp)["meta_info"]["prompt_tokens"]
            ts[kvd].append(time.perf_counter() - t)
    for e in engines.values():
        e.shutdown()
    rows = [{"kv_cache_dtype": kvd, "prompt_tokens": n, "ttft_ms": 1000 * statistics.median(ts[kvd]),
             "runs_ms": [round(1000 * x, 1) for x in ts[kvd]]} for kvd in dtypes]
    for r in rows:
        r["vs_bf16_pool"] = r["ttft_ms"] / rows[0]["ttft_ms"]
    return {"words": args.words, "threads": torch.get_num_threads(), "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("accuracy")
    a.add_argument("--tokens", type=int, default=4096)
    a.add_argument("--window", type=int, default=1024)
    s = sub.add_parser("speed")
    s.add_argument("--batch", type=int, default=64)
    s.add_argument("--context", type=int, default=1024)
    s.add_argument("--reps", type=int, default=5)
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    s.add_argument("--per-op", action="store_true", help="also time each quantized pool on the per-op path")
    s.add_argument("--quant-head", action="store_true", help="a float LM head quantized as the default model's (Q8_0)")
    q = sub.add_parser("random-qwen3")
    q.add_argument("dir")
    f = sub.add_parser("prefill")
    f.add_argument("--words", type=int, default=700)
    f.add_argument("--reps", type=int, default=3)
    f.add_argument("--dtypes", nargs="+", default=None, help="KV dtypes (default: all; bfloat16 first, the ratios' base)")
    args = p.parse_args()
    if args.cmd == "random-qwen3":
        print(random_qwen3(args.dir))
        return 0
    print(json.dumps({"accuracy": accuracy, "speed": speed, "prefill": prefill}[args.cmd](args), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
