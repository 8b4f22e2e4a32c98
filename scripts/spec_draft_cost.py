"""Where an EAGLE / MEDUSA run's time goes at batch 1: milliseconds per draft (the proposer's
``propose``: catch-up + tree growth + draft LM head) and per target forward, beside the plain
engine's forward, on ``sglite bench spec``'s held-out open-chat prompts, greedy.

    python scripts/spec_draft_cost.py [--algorithm EAGLE] [--heads DIR] [--num-prompts 4]
        [--max-new-tokens 64] [--fp32-draft]
    python scripts/spec_draft_cost.py --micro [--reps 200]

``--micro``: the shipped EAGLE heads' parts alone, float32 torch (``EagleHead``) against the bf16
GEMV draft (``FastEagle`` / ``FastLMHead``), interleaved A, B, A, B in one process on one thread
(drift of the shared machine hits both alike), median ms of: a catch-up pass (1 row over 160
cached positions), a tree pass (4 rows, tree mask), the draft LM head over 4 rows, and one
draft as the default settings run it (catch-up + 3 tree passes + 4 LM-head calls). Times are
the thread's CPU time (``time.thread_time``): on a loaded machine wall time also counts the
waits for a core, which grow with a call's length.

``--fp32-draft`` runs the draft in float32 torch ops (the path before the bf16 GEMV draft), for
A/B. Timers wrap the proposer's ``propose`` and the runner's ``forward`` (wall clock,
``time.perf_counter``); the machine is shared, so numbers are noisy: the order of the two engines
alternates per prompt.
"""
from __future__ import annotations

import argparse
import statistics
import time


def _timed(obj, name: str, sink: list) -> None:
    f = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        out = f(*a, **k)
        sink.append(time.perf_counter() - t)
        return out
    setattr(obj, name, wrapper)


def micro(reps: int) -> None:
    import torch

    from sglite.runtime.speculative.draft_fast import FastEagle, FastLMHead
    from sglite.runtime.speculative.heads import default_heads_dir, load_heads

    torch.set_num_threads(1)
    module, vocab = load_heads(default_heads_dir("eagle"), 576, 49152, "eagle")
    H, P = 576, 160
    torch.manual_seed(0)
    lm_w = torch.randn(len(vocab), H) * 0.05  # the draft vocabulary's rows of an LM head (shape is what counts)
    ref_lm = lambda f: torch.log_softmax(f @ lm_w.T, -1)  # noqa: E731
    paths = {"fp32 torch": (module, ref_lm), "bf16 GEMV": (FastEagle(module), FastLMHead(lm_w))}
    with torch.no_grad():
        _, past = module(torch.randn(1, P, H), torch.randn(1, P, H), torch.arange(P)[None])
    e1, e4 = torch.randn(1, 1, H), torch.randn(1, 4, H)
    mask = torch.ones(4, P + 4, dtype=torch.bool)
    mask[:, P:] = torch.eye(4, dtype=torch.bool)
    pos1, pos4 = torch.tensor([[P]]), torch.full((1, 4), P + 1)
    parts = {
        "catch-up pass (1 row)": lambda L, lm: L(e1, e1, pos1, past),
        "tree pass (4 rows)": lambda L, lm: L(e4, e4, pos4, past, mask),
        "draft LM head (4 rows)": lambda L, lm: lm(e4[0]),
        "one draft": lambda L, lm: [L(e1, e1, pos1, past)] + [L(e4, e4, pos4, past, mask) for _ in range(3)]
        + [lm(e4[0]) for _ in range(4)],
    }
    with torch.inference_mode():
        for name, f in parts.items():
            times = {k: [] for k in paths}
            for _ in range(reps):
                for k, (L, lm) in paths.items():
                    t = time.thread_time()
                    f(L, lm)
                    times[k].append(time.thread_time() - t)
            print(f"{name:24s} " + "  ".join(f"{k} {1e3 * statistics.median(v):6.3f} ms" for k, v in times.items()))


def main() -> None:
    from sglite import Engine
    from sglite.bench.spec import heldout

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithm", default="EAGLE", choices=("EAGLE", "MEDUSA"))
    p.add_argument("--heads", default=None, help="head folder (default: the shipped heads)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--fp32-draft", action="store_true", help="float32 torch draft (the old path)")
    p.add_argument("--micro", action="store_true", help="time the draft's parts alone, A/B interleaved")
    p.add_argument("--reps", type=int, default=200)
    a = p.parse_args()
    if a.micro:
        return micro(a.reps)
    kw = {"speculative_draft_model_path": a.heads} if a.heads else {}
    base = Engine(log_level="warning")
    spec = Engine(log_level="warning", speculative_algorithm=a.algorithm, **kw)
    prop = spec.scheduler.spec.proposer
    if a.fp32_draft:
        prop.fast = prop.fast_lm = None
    drafts, fwd_spec, fwd_base = [], [], []
    _timed(prop, "propose", drafts)
    _timed(spec.runner, "forward", fwd_spec)
    _timed(base.runner, "forward", fwd_base)
    prompts = [base.apply_chat_template([{"role": "user", "content": m}]) for m in heldout()["chat"][:a.num_prompts]]
    sp = {"max_new_tokens": a.max_new_tokens, "temperature": 0}
    for e in (base, spec):
        e.generate(prompts[0], {"max_new_tokens": 8, "temperature": 0})
    drafts.clear(), fwd_spec.clear(), fwd_base.clear()
    tot = {"base": [0, 0.0], "spec": [0, 0.0]}
    steps = acc = 0
    for i, pr in enumerate(prompts):
        for name, e in (("base", base), ("spec", spec)) if i % 2 == 0 else (("spec", spec), ("base", base)):
            e.flush_cache()
            t = time.perf_counter()
            o = e.generate(pr, sp)
            tot[name][0] += len(o["output_ids"])
            tot[name][1] += time.perf_counter() - t
            if name == "spec":
                steps += o["meta_info"].get("spec_verify_ct", 0)
                acc += o["meta_info"].get("spec_accepted_tokens", 0)
    ms = lambda xs: 1e3 * statistics.mean(xs) if xs else 0.0  # noqa: E731
    med = lambda xs: 1e3 * statistics.median(xs) if xs else 0.0  # noqa: E731
    print(f"draft ({'fp32 torch' if a.fp32_draft else 'default'}): {len(drafts)} calls, mean {ms(drafts):.2f} ms, "
          f"median {med(drafts):.2f} ms")
    print(f"target forward: spec engine mean {ms(fwd_spec):.2f} ms (median {med(fwd_spec):.2f}, {len(fwd_spec)} calls); "
          f"plain engine mean {ms(fwd_base):.2f} ms (median {med(fwd_base):.2f}, {len(fwd_base)} calls)")
    bt, st = tot["base"][0] / tot["base"][1], tot["spec"][0] / tot["spec"][1]
    print(f"tok/s plain {bt:.1f}  {a.algorithm} {st:.1f}  x{st / bt:.2f}  accept length "
          f"{(acc + steps) / max(steps, 1):.2f} ({steps} verify steps)")
    base.shutdown()
    spec.shutdown()


if __name__ == "__main__":
    main()
