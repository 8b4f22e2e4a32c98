"""Does a cached prompt prefix alone change greedy bf16 outputs? (docs/benchmarks.md, issue 18)

One colocated engine, the sweep's workload prompts (random, 8 prompts, input 1500, ratio 0.02,
output 48, seed 0), each generated twice, greedy, one at a time: with the prefix cache flushed
(the whole prompt prefilled in chunks) and after ``cache_prefix`` (the prompt's KV cached; the last
token computed alone, as a P/D decode server does). Prints how many texts are equal and where the
first differing token is.
    python scripts/pd_split_check.py [--dtype bfloat16]
"""
import argparse
import json

from sglite import Engine
from sglite.bench.serving import build_parser, workload_options
from sglite.bench.workloads import build_workload


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    wa = build_parser().parse_args(["--dataset", "random", "--num-prompts", "8", "--input-len", "1500",
                                    "--range-ratio", "0.02", "--output-len", "48"])
    sessions = build_workload("random", 8, wa.seed, workload_options(wa))
    e = Engine(dtype=a.dtype, log_level="warning")
    sp = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    rows = []
    for s in sessions:
        text = s.turns[0].text
        e.flush_cache()
        fresh = e.generate(text, sp)["output_ids"]
        e.flush_cache()
        e.cache_prefix(text)
        split = e.generate(text, sp)
        first = next((i for i, (x, y) in enumerate(zip(fresh, split["output_ids"])) if x != y), None)
        rows.append({"prompt_tokens": split["meta_info"]["prompt_tokens"],
                     "cached_tokens": split["meta_info"]["cached_tokens"], "first_difference": first})
    e.shutdown()
    print(json.dumps({"dtype": a.dtype, "equal": sum(r["first_difference"] is None for r in rows),
                      "of": len(rows), "rows": rows}))


if __name__ == "__main__":
    main()
