"""Acceptance length and speed of EAGLE / MEDUSA heads against plain decoding, batch 1, greedy.

    python scripts/spec_heads_measure.py [--algorithms EAGLE MEDUSA] [--max-new-tokens 96]
        [--model-path M --heads EAGLE=DIR MEDUSA=DIR] [--engine-kw '{"speculative_eagle_topk": 2}']

Prompts: the open questions of ``sglite bench spec``'s ``chat`` workload (the heads shipped for the
default model were trained on other text: these are held out). Each request runs on every engine
in turn (order rotating per request, so drift of a shared machine spreads over all); reported:
tokens/s over all requests, the ratio to plain, accept length (tokens per verify step, bonus
included) and whether the outputs are identical to plain.
"""
from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    from sglite import Engine
    from sglite.bench.spec import CHAT

    p = argparse.ArgumentParser()
    p.add_argument("--algorithms", nargs="*", default=["EAGLE", "MEDUSA"])
    p.add_argument("--model-path", default=None)
    p.add_argument("--heads", nargs="*", default=[], help="ALG=DIR head folders (default: the shipped ones)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--num-prompts", type=int, default=len(CHAT))
    p.add_argument("--engine-kw", default="{}", help="JSON: extra engine options of the spec engines")
    a = p.parse_args()
    heads = dict(h.split("=", 1) for h in a.heads)
    extra = json.loads(a.engine_kw)
    engines = {"plain": Engine(a.model_path, log_level="warning")}
    for alg in a.algorithms:
        kw = {"speculative_draft_model_path": heads[alg]} if alg in heads else {}
        engines[alg] = Engine(a.model_path, log_level="warning", speculative_algorithm=alg, **kw, **extra)
    names = list(engines)
    prompts = [engines["plain"].apply_chat_template([{"role": "user", "content": m}]) for m in CHAT[:a.num_prompts]]
    sp = {"max_new_tokens": a.max_new_tokens, "temperature": 0}
    for e in engines.values():
        e.generate(prompts[0], {"max_new_tokens": 8, "temperature": 0})  # warm
    stats = {n: {"tokens": 0, "seconds": 0.0, "steps": 0, "accepted": 0, "outs": []} for n in names}
    for i, pr in enumerate(prompts):
        order = names[i % len(names):] + names[:i % len(names)]
        for n in order:
            t = time.perf_counter()
            o = engines[n].generate(pr, sp)
            s = stats[n]
            s["seconds"] += time.perf_counter() - t
            s["tokens"] += len(o["output_ids"])
            s["steps"] += o["meta_info"].get("spec_verify_ct", 0)
            s["accepted"] += o["meta_info"].get("spec_accepted_tokens", 0)
            s["outs"].append(o["output_ids"])
    base = stats["plain"]["tokens"] / stats["plain"]["seconds"]
    for n in names:
        s = stats[n]
        tps = s["tokens"] / s["seconds"]
        acc = (s["accepted"] + s["steps"]) / s["steps"] if s["steps"] else 0.0
        same = sum(x == y for x, y in zip(s["outs"], stats["plain"]["outs"]))
        print(f"{n:7s} {tps:6.1f} tok/s  x{tps / base:.2f}  accept length {acc:.2f}  verify steps {s['steps']:4d}  "
              f"identical {same}/{len(prompts)}", flush=True)
    for e in engines.values():
        e.shutdown()


if __name__ == "__main__":
    main()
