"""Decode tokens/s of sglite's engine vs HF transformers `generate`, same prompts, same dtype, one run.

    python benchmarks/decode_vs_hf.py [--dtype bfloat16] [--new 64] [--batches 1,16]

Batch B: B prompts of ~40 tokens submitted together, greedy, `ignore_eos`; HF gets them as one
left-padded static batch. Decode tok/s = B * (new - 1) / (end-to-end time - TTFT) for sglite and
B * new / time for HF (whose time includes its prefill, so HF is favoured slightly).
"""
import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batches", default="1,16")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from sglite import Engine

    eng = Engine(dtype=args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(eng.checkpoint.model_dir), dtype=getattr(torch, args.dtype))
    tok = eng.tokenizer.hf
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    print(f"torch threads {torch.get_num_threads()}, dtype {args.dtype}, {args.new} new tokens")
    for bs in [int(b) for b in args.batches.split(",")]:
        prompts = [f"Question {i}: write a short story about a robot who learns to paint number {i}." for i in range(bs)]
        p = {"max_new_tokens": args.new, "temperature": 0, "ignore_eos": True}
        eng.generate(prompts[:1], dict(p, max_new_tokens=4))  # warm-up
        eng.flush_cache()
        t = time.perf_counter()
        outs = eng.generate(prompts, p)
        e2e = time.perf_counter() - t
        ttft = max(o["meta_info"]["ttft"] for o in outs)
        ours = bs * (args.new - 1) / (e2e - ttft)
        enc = tok(prompts, return_tensors="pt", padding=True)
        with torch.no_grad():
            hf.generate(**enc, max_new_tokens=4, do_sample=False)
            t = time.perf_counter()
            hf.generate(**enc, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
            hft = time.perf_counter() - t
        theirs = bs * args.new / hft
        print(f"batch {bs:3d}: sglite {ours:7.1f} tok/s (TPOT {1000 * (e2e - ttft) / (args.new - 1):.1f} ms) | "
              f"HF generate {theirs:7.1f} tok/s (TPOT {1000 * hft / args.new:.1f} ms) | ratio {ours / theirs:.2f}x")
    eng.shutdown()


if __name__ == "__main__":
    main()
