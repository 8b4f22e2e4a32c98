"""Benchmark: JSON-Schema-constrained decoding end to end on the default model, side by side in one run.

    python benchmarks/constrained_e2e.py [--batch 16] [--max-new-tokens 256] [--dtype float32]

Three runs of the same batch of prompts (a warm-up batch first on each engine):

* ``unconstrained``: no grammar, ``ignore_eos``, each request as many tokens as its JSON run produced
  (decode throughput baseline with the same batch-size profile);
* ``json`` without jump-forward: every token sampled under the schema's bitmask, twice: the first
  batch after compiling (``json_no_jump_cold``: each grammar state's mask is computed on first
  use, a vocabulary walk of 1-5 ms) and the same batch again (``json_no_jump``: masks cached, the
  steady state of a schema in use);
* ``json`` with jump-forward (the default): forced strings appended in one extend step (cold and
  warm, as above; the ratios use the warm runs, the ``first_batch_cold`` ones the cold runs).

Prints one JSON line per run (wall seconds, completion tokens, decode tokens/s, forward steps) and a
summary with the two ratios the constrained-decoding issue targets: constrained/unconstrained
throughput (no jump-forward, so it measures the mask cost alone; target >= 0.95) and jump-forward
latency / no-jump latency on the JSON workload (target <= 0.7: the batch's wall time, and the mean
per-request latency; texts may differ between the two runs, since jumped tokens are the canonical
tokenization, so a run where one request degenerates to ``max_new_tokens`` dominates the wall
time: ``finish`` shows that). Each mode uses its own engine
(``enable_jump_forward`` is an engine option); engines are created one after the other.
"""
from __future__ import annotations

import argparse
import json
import time

import sglite

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "occupation", "status", "skills", "address", "verified"],
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "occupation": {"enum": ["engineer", "teacher", "doctor", "artist", "farmer", "student"]},
        "status": {"enum": ["active", "inactive", "pending"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "additionalProperties": False, "required": ["street", "city", "country"],
                    "properties": {"street": {"type": "string", "maxLength": 40},
                                   "city": {"type": "string", "maxLength": 24},
                                   "country": {"type": "string", "maxLength": 24}}},
        "verified": {"type": "boolean"}}}
PEOPLE = ["a nurse from Lyon", "a retired sailor", "a young painter in Oslo", "a chemistry teacher", "a farmer in Kenya",
          "a software engineer in Austin", "a student of music", "a surgeon in Madrid", "a baker in Vienna",
          "a pilot from Chile", "a librarian in Boston", "a potter in Kyoto", "a journalist in Cairo",
          "a carpenter in Quebec", "a violinist from Prague", "an astronomer in Hawaii"]


def prompts(n: int) -> list[str]:
    return [f"Describe {PEOPLE[i % len(PEOPLE)]} (person #{i}) as a JSON object with name, age, occupation, "
            f"status, skills, address and verified.\nJSON: " for i in range(n)]


def run(engine, ps, params) -> dict:
    before = engine.get_server_info()["steps"]
    t0 = time.perf_counter()
    outs = engine.generate(ps, params)
    wall = time.perf_counter() - t0
    toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
    finish = {}
    for o in outs:
        k = o["meta_info"]["finish_reason"]["type"]
        finish[k] = finish.get(k, 0) + 1
    valid = 0
    for o in outs:
        try:
            json.loads(o["text"])
            valid += 1
        except ValueError:
            pass
    lat = [o["meta_info"]["e2e_latency"] for o in outs]
    return {"wall_s": round(wall, 3), "mean_latency_s": round(sum(lat) / len(lat), 3), "completion_tokens": toks,
            "tok_per_s": round(toks / wall, 1),
            "steps": engine.get_server_info()["steps"] - before, "finish": finish, "json_parses": valid,
            "texts": [o["text"] for o in outs], "per_request": [o["meta_info"]["completion_tokens"] for o in outs]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-total-tokens", type=int, default=16384)
    args = p.parse_args(argv)
    ps = prompts(args.batch)
    json_params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "json_schema": SCHEMA}
    results = {}
    for jf in (False, True):
        engine = sglite.Engine(dtype=args.dtype, max_total_tokens=args.max_total_tokens, enable_jump_forward=jf)
        try:
            engine.generate(prompts(2), dict(json_params, max_new_tokens=24))  # warm-up + grammar compile
            if not jf:
                # unconstrained baseline: each request decodes exactly as many tokens as its JSON run
                # did, so both runs have the same batch-size profile over time
                json_run = run(engine, ps, json_params)  # cold: every grammar state's mask computed now
                results["unconstrained"] = run(engine, ps, [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
                                                            for n in json_run["per_request"]])
                results["json_no_jump_cold"] = json_run
                results["json_no_jump"] = run(engine, ps, json_params)  # warm: the schema's masks cached
            else:
                results["json_jump_cold"] = run(engine, ps, json_params)
                results["json_jump"] = run(engine, ps, json_params)
        finally:
            engine.shutdown()
    for name, r in results.items():
        print(json.dumps({"run": name, **{k: v for k, v in r.items() if k not in ("texts", "per_request")}}),
              flush=True)
    same = sum(a == b for a, b in zip(results["json_jump"]["texts"], results["json_no_jump"]["texts"]))
    summary = {
        "batch": args.batch,
        "throughput_ratio_constrained_vs_unconstrained": round(
            results["json_no_jump"]["tok_per_s"] / results["unconstrained"]["tok_per_s"], 3),
        "throughput_ratio_first_batch_cold_masks": round(
            results["json_no_jump_cold"]["tok_per_s"] / results["unconstrained"]["tok_per_s"], 3),
        "latency_ratio_jump_vs_no_jump": round(results["json_jump"]["wall_s"] / results["json_no_jump"]["wall_s"], 3),
        "mean_request_latency_ratio_jump_vs_no_jump": round(
            results["json_jump"]["mean_latency_s"] / results["json_no_jump"]["mean_latency_s"], 3),
        "first_batch_cold_masks_latency_ratio_jump_vs_no_jump": round(
            results["json_jump_cold"]["wall_s"] / results["json_no_jump_cold"]["wall_s"], 3),
        "steps_jump_vs_no_jump": [results["json_jump"]["steps"], results["json_no_jump"]["steps"]],
        "identical_texts_jump_vs_no_jump": f"{same}/{args.batch}",
    }
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
