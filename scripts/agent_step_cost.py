"""Where a late agent turn's prefill step goes (issue 34): 8 requests of ~70 new tokens over ~1,100
cached ones each (the shape of `sglite bench agent`'s turn 10), profiled with the engine's own
profiler (per-phase table: GEMM, attention, elementwise, ...), after two unprofiled rounds timed
in process CPU and wall time.

    .venv/bin/python scripts/agent_step_cost.py [--threads 1]
"""
import argparse
import json
import time

from sglite import Engine

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def text(seed: int, n: int) -> str:
    """n words with digits, deterministic per seed (~2 tokens a word)."""
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] + str(i % 10) for i in range(n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: the engine's)")
    ap.add_argument("--profile-dir", default="/tmp/sglite_agent_step", help="where the profile goes")
    a = ap.parse_args()
    eng = Engine(max_total_tokens=32768, num_threads=a.threads)
    sp = {"max_new_tokens": 1, "temperature": 0}
    bases = [text(j, 450) for j in range(8)]
    for b in bases:
        eng.generate(b, sp)  # the cached histories
    res = None
    for rnd in range(3):
        turns = [bases[j] + " " + text(100 + rnd * 10 + j, 31) for j in range(8)]
        if rnd == 2:
            eng.start_profile(output_dir=a.profile_dir)
        t, w = time.process_time(), time.perf_counter()
        outs = eng.generate(turns, [sp] * 8)
        cpu, wall = time.process_time() - t, time.perf_counter() - w
        if rnd == 2:
            res = eng.stop_profile()
        print(f"round {rnd}: wall {wall * 1e3:.0f} ms, process CPU {cpu * 1e3:.0f} ms; prompt / cached tokens of "
              f"the first: {outs[0]['meta_info']['prompt_tokens']} / {outs[0]['meta_info']['cached_tokens']}"
              + (" (profiled)" if rnd == 2 else ""))
        bases = turns
    print(json.dumps(res["phases"], indent=1))
    eng.shutdown()


if __name__ == "__main__":
    main()
