"""Benchmark: a 5-shot ``select`` workload (64 questions sharing one few-shot prefix), run with
the radix cache + prefix hoisting and with ``disable_radix_cache=True``, side by side in one run.

    python benchmarks/frontend_select.py [--questions 64] [--shots 5] [--threads auto]

Prints the wall time of each mode, the prompt/cached token counts the engine reports, whether
both modes chose the same answers, and the speed-up ratio. The same program and batch run on
two engines that differ only in ``disable_radix_cache``; a warm-up batch runs first on each.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import sglite

SUBJECTS = ["chemistry", "geography", "history", "biology", "physics", "literature", "music", "astronomy"]
FACTS = [("water", "boils at 100 degrees Celsius at sea level"), ("the Nile", "flows north into the Mediterranean"),
         ("the Moon", "orbits the Earth about once every 27 days"), ("iron", "rusts when exposed to oxygen and water"),
         ("Mount Everest", "is the highest mountain above sea level"), ("the heart", "pumps blood through the body"),
         ("Jupiter", "is the largest planet in the solar system"), ("salt", "dissolves in water"),
         ("light", "travels faster than sound"), ("Shakespeare", "wrote Hamlet and Macbeth")]


def few_shot_prefix(shots: int, rng: random.Random) -> str:
    """Instruction + ``shots`` worked examples (each a paragraph, so the prefix is a few hundred tokens)."""
    text = ("The following are multiple choice questions with answers. Read each statement, think about "
            "whether it matches common scientific and historical knowledge, and answer with the letter of "
            "the best option.\n\n")
    for i in range(shots):
        thing, fact = FACTS[i % len(FACTS)]
        subj = SUBJECTS[i % len(SUBJECTS)]
        opts = [f"{thing} {fact}", f"{thing} is made of cheese", f"{thing} does not exist", "none of the above"]
        rng.shuffle(opts)
        ans = "ABCD"[opts.index(f"{thing} {fact}")]
        text += (f"Subject: {subj}\nQuestion: Which statement about {thing} is true?\n"
                 + "".join(f"{'ABCD'[j]}. {o}\n" for j, o in enumerate(opts)) + f"Answer: {ans}\n\n")
    return text


def questions(n: int, rng: random.Random) -> list:
    out = []
    for i in range(n):
        thing, fact = FACTS[(i * 7 + 3) % len(FACTS)]
        opts = [f"{thing} {fact}", f"{thing} is purple", f"{thing} was invented in {1800 + i}", "none of these"]
        rng.shuffle(opts)
        out.append(f"Subject: {SUBJECTS[i % len(SUBJECTS)]}\nQuestion: Which statement about {thing} is true? "
                   f"(item {i})\n" + "".join(f"{'ABCD'[j]}. {o}\n" for j, o in enumerate(opts)))
    return out


@sglite.function
def mcq(s, prefix, question):
    s += prefix + question + "Answer:" + sglite.select("answer", choices=[" A", " B", " C", " D"])


def run_mode(engine, prefix: str, qs: list, threads) -> dict:
    """Warm up, then time one run_batch of ``qs`` on ``engine``; returns timings and engine counters."""
    mcq.run_batch([{"prefix": prefix, "question": q} for q in qs[:2]], backend=engine, num_threads=threads)
    engine.flush_cache()
    before = engine.get_server_info()
    t0 = time.perf_counter()
    states = mcq.run_batch([{"prefix": prefix, "question": q} for q in qs], backend=engine, num_threads=threads)
    wall = time.perf_counter() - t0
    after = engine.get_server_info()
    errors = [repr(s.error()) for s in states if s.error() is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} programs failed, first: {errors[0]}")
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("prompt_tokens", "cached_tokens")
             if isinstance(after.get(k), (int, float))}
    return {"wall_s": wall, "answers": [s["answer"] for s in states], **delta}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--shots", type=int, default=5)
    ap.add_argument("--threads", default="auto")
    ap.add_argument("--model-path", default=None)
    args = ap.parse_args(argv)
    threads = args.threads if args.threads == "auto" else int(args.threads)
    rng = random.Random(0)
    prefix, qs = few_shot_prefix(args.shots, rng), questions(args.questions, rng)
    results = {}
    for name, opts in (("radix+hoist", {}), ("no_radix", {"disable_radix_cache": True})):
        engine = sglite.Engine(args.model_path, **opts)
        try:
            n_prefix = len(engine.tokenizer.encode(prefix))
            results[name] = run_mode(engine, prefix, qs, threads)
        finally:
            engine.shutdown()
    a, b = results["radix+hoist"], results["no_radix"]
    ratio = b["wall_s"] / a["wall_s"]
    same = sum(x == y for x, y in zip(a["answers"], b["answers"]))
    print(f"{args.questions} questions, {args.shots}-shot prefix of {n_prefix} tokens, threads={threads}")
    for name, r in results.items():
        print(f"  {name:12s} {r['wall_s']:7.2f} s   prompt_tokens={r.get('prompt_tokens', '?')}  "
              f"cached_tokens={r.get('cached_tokens', '?')}")
    print(f"  same answers: {same}/{len(qs)}")
    print(f"  speed-up (no_radix / radix+hoist): {ratio:.2f}x")
    summary = {"questions": args.questions, "shots": args.shots, "prefix_tokens": n_prefix, "ratio": ratio,
               "same_answers": same, **{f"{k}_wall_s": v["wall_s"] for k, v in results.items()}}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
