"""Acceptance length and speed of the EAGLE / MEDUSA heads against plain decoding at batch 1,
greedy, on the held-out open chat questions (``sglite bench spec``'s ``chat`` and
``chat_heldout`` sets: no head was trained on them).

    python scripts/spec_heads_measure.py [--max-new-tokens 96] [--num-prompts 16]
        [--algorithms EAGLE MEDUSA] [--eagle-heads DIR [DIR ...]] [--medusa-heads DIR] [--root-chains]
        [--ungated]
        [--num-steps 4 --eagle-topk 4 --num-draft-tokens 8] [--trees 3,1,3 2,1,2] [--dtype float32]

Per prompt, every engine generates in turn (the order rotating per prompt, so drift of the shared
machine hits all alike; the radix cache emptied before each). Reports per engine: tokens/s
(total tokens over total wall time, ``time.perf_counter``), the ratio to plain, the median of
the per-prompt ratios, the accept length (tokens per verify step, bonus included: SGLang's
``accept_length``) and how many outputs are token-identical to plain. ``--root-chains`` adds an
``EAGLE-root`` engine whose trees keep the chains off the root only (the verify path before
trees branched below it), for A/B; ``--ungated`` adds ``EAGLE-ungated`` / ``MEDUSA-ungated``
engines without the head gate (:mod:`sglite.runtime.speculative.head_gate`: every step drafts, as
before the gate), for A/B. Wall times on a shared machine are noisy: say so beside them.
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    from sglite import Engine
    from sglite.bench.spec import CHAT, heldout

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--num-prompts", type=int, default=16, help="held-out questions (at most 16)")
    p.add_argument("--algorithms", nargs="+", default=["EAGLE", "MEDUSA"], choices=("EAGLE", "MEDUSA"))
    p.add_argument("--eagle-heads", nargs="+", default=None,
                   help="EAGLE head folders (default: the shipped heads); several: one engine each, "
                        "named EAGLE, EAGLE-2, ... in this order")
    p.add_argument("--medusa-heads", default=None, help="MEDUSA head folder (default: the shipped heads)")
    p.add_argument("--root-chains", action="store_true", help="also EAGLE with chains off the root only")
    p.add_argument("--ungated", action="store_true", help="also each algorithm without the head gate (A/B)")
    p.add_argument("--dtype", default=None, help="engine dtype (float32: greedy must match plain token for token)")
    p.add_argument("--num-steps", type=int, default=None)
    p.add_argument("--eagle-topk", type=int, default=None)
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--trees", nargs="+", default=[], metavar="S,K,N",
                   help="more EAGLE engines (the first heads), one per tree: num-steps,eagle-topk,num-draft-tokens")
    a = p.parse_args()
    tree = {k: v for k, v in (("speculative_num_steps", a.num_steps), ("speculative_eagle_topk", a.eagle_topk),
                              ("speculative_num_draft_tokens", a.num_draft_tokens)) if v is not None}
    if a.dtype:
        tree["dtype"] = a.dtype
    engines = {"plain": Engine(log_level="warning", **({"dtype": a.dtype} if a.dtype else {}))}
    for alg in a.algorithms:
        for i, heads in enumerate((a.eagle_heads or [None]) if alg == "EAGLE" else [a.medusa_heads]):
            kw = {"speculative_draft_model_path": heads} if heads else {}
            engines[alg if i == 0 else f"{alg}-{i + 1}"] = Engine(
                log_level="warning", speculative_algorithm=alg, **kw,
                **(tree if alg == "EAGLE" else {"dtype": a.dtype} if a.dtype else {}))
        for t in a.trees if alg == "EAGLE" else []:
            st, tk, nd = (int(v) for v in t.split(","))
            first = (a.eagle_heads or [None])[0]
            engines[f"EAGLE[{t}]"] = Engine(
                log_level="warning", speculative_algorithm=alg, speculative_num_steps=st, speculative_eagle_topk=tk,
                speculative_num_draft_tokens=nd, **({"dtype": a.dtype} if a.dtype else {}),
                **({"speculative_draft_model_path": first} if first else {}))
        if alg == "EAGLE" and a.root_chains:
            first = (a.eagle_heads or [None])[0]  # the first heads, with chains off the root only
            engines["EAGLE-root"] = Engine(log_level="warning", speculative_algorithm=alg, **tree,
                                           **({"speculative_draft_model_path": first} if first else {}))
            engines["EAGLE-root"].scheduler.spec.proposer.branch_below_root = False
    for alg in a.algorithms if a.ungated else []:
        kw = {"speculative_draft_model_path": (a.eagle_heads or [None])[0] if alg == "EAGLE" else a.medusa_heads}
        engines[f"{alg}-ungated"] = Engine(
            log_level="warning", speculative_algorithm=alg, **{k: v for k, v in kw.items() if v},
            **(tree if alg == "EAGLE" else {"dtype": a.dtype} if a.dtype else {}))
        engines[f"{alg}-ungated"].scheduler.spec.gate = None
    base = engines["plain"]
    questions = (CHAT + heldout()["chat"])[:a.num_prompts]
    prompts = [base.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    sp = {"max_new_tokens": a.max_new_tokens, "temperature": 0}
    for e in engines.values():  # warm-up
        e.generate(prompts[0], {"max_new_tokens": 8, "temperature": 0})
    names = list(engines)
    stats = {n: {"tok": 0, "s": 0.0, "steps": 0, "acc": 0, "same": 0, "per": []} for n in names}
    for i, pr in enumerate(prompts):
        outs = {}
        for n in names[i % len(names):] + names[:i % len(names)]:
            e = engines[n]
            e.flush_cache()
            t = time.perf_counter()
            o = e.generate(pr, sp)
            dt = time.perf_counter() - t
            outs[n] = o
            st = stats[n]
            st["tok"] += len(o["output_ids"])
            st["s"] += dt
            st["per"].append(len(o["output_ids"]) / dt)
            st["steps"] += o["meta_info"].get("spec_verify_ct", 0)
            st["acc"] += o["meta_info"].get("spec_accepted_tokens", 0)
        for n in names:
            stats[n]["same"] += outs[n]["output_ids"] == outs["plain"]["output_ids"]
    bt = stats["plain"]["tok"] / stats["plain"]["s"]
    print(f"{len(prompts)} held-out chat prompts x {a.max_new_tokens} tokens, batch 1, greedy "
          f"(wall clock on a shared machine: noisy)")
    for n in names:
        st = stats[n]
        tps = st["tok"] / st["s"]
        ratios = [x / y for x, y in zip(st["per"], stats["plain"]["per"])]
        acc = (st["acc"] + st["steps"]) / st["steps"] if st["steps"] else float("nan")
        print(f"{n:13s} {tps:7.1f} tok/s  x{tps / bt:.2f} (median per prompt x{statistics.median(ratios):.2f})  "
              f"accept length {acc:.2f} ({st['steps']} verify steps)  identical {st['same']}/{len(prompts)}  "
              f"{st['tok']} tokens, {1e3 * st['s'] / st['tok']:.2f} ms/token"
              + (f", {1e3 * st['s'] / st['steps']:.2f} ms/verify step" if st["steps"] else ""))
    for e in engines.values():
        e.shutdown()


if __name__ == "__main__":
    main()
