"""Prefill / decode step times of the default model for docs/scaling.md: python scripts/pd_step_times.py"""
import json, statistics, time
from sglite import Engine
from sglite.bench.workloads import random_words
import random

def main():
    e = Engine(dtype="bfloat16", log_level="warning")
    rng = random.Random(0)
    out = {}
    e.generate("warm up " * 20, {"max_new_tokens": 4, "temperature": 0})
    for n in (512, 1500):
        ts = []
        for _ in range(2):
            e.flush_cache()
            p = random_words(rng, n)
            t = time.perf_counter(); r = e.generate(p, {"max_new_tokens": 1, "temperature": 0}); ts.append(time.perf_counter() - t)
        out[f"prefill_{r['meta_info']['prompt_tokens']}_tok_s"] = min(ts)
    for b in (1, 8, 32):
        e.flush_cache()
        rs = e.generate([random_words(rng, 32) for _ in range(b)], {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True})
        tpot = statistics.median((r["meta_info"]["e2e_latency"] - r["meta_info"]["ttft"]) / 47 for r in rs)
        out[f"decode_step_batch{b}_s"] = tpot
    print(json.dumps(out, indent=1))
    e.shutdown()

if __name__ == "__main__":
    main()
