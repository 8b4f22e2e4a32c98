"""The extend attention's share of an agent's late-turn prefill inside the engine (issue 34): the
rounds of ``scripts/agent_step_cost.py`` (8 conversations, each turn ~62-78 new tokens over its
~900-1,350 cached ones, default model) with every ``sglite.kernels.extend_attention`` call timed in
process CPU time by a wrapper; per round the steps' process CPU, the attention's, its share and
the calls' (prefix, extend) lengths (one call a step in 30).

    .venv/bin/python benchmarks/agent_attention_cost.py [--threads 1] [--rounds 4]
"""
import argparse
import time

import sglite.kernels as kernels
from sglite import Engine

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def text(seed: int, n: int) -> str:
    """n words with digits, deterministic per seed (scripts/agent_step_cost.py's)."""
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] + str(i % 10) for i in range(n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    orig, acc = kernels.extend_attention, {"t": 0.0, "w": 0.0, "n": 0, "shapes": []}

    def timed(*args, **kw):
        t, w = time.process_time(), time.perf_counter()
        out = orig(*args, **kw)
        acc["t"] += time.process_time() - t
        acc["w"] += time.perf_counter() - w
        acc["n"] += 1
        if acc["n"] % 30 == 1:
            acc["shapes"].append(list(zip(args[5].tolist(), args[6].tolist())))
        return out

    kernels.extend_attention = timed  # the models look it up on the package at each call
    eng = Engine(max_total_tokens=32768, num_threads=a.threads)
    sp = {"max_new_tokens": 1, "temperature": 0}
    bases = [text(j, 450) for j in range(8)]
    for b in bases:
        eng.generate(b, sp)  # the cached histories
    for rnd in range(a.rounds):
        turns = [bases[j] + " " + text(100 + rnd * 10 + j, 31) for j in range(8)]
        acc.update(t=0.0, w=0.0, n=0, shapes=[])
        t, w = time.process_time(), time.perf_counter()
        eng.generate(turns, [sp] * 8)
        cpu, wall = time.process_time() - t, time.perf_counter() - w
        print(f"round {rnd}: steps {cpu * 1e3:.0f} ms CPU / {wall * 1e3:.0f} ms wall, extend_attention "
              f"{acc['t'] * 1e3:.1f} ms CPU / {acc['w'] * 1e3:.1f} ms wall in {acc['n']} calls ({acc['t'] / cpu * 100:.0f} % of "
              f"the CPU); (prefix, extend) per call: {acc['shapes']}")
        bases = turns
    eng.shutdown()


if __name__ == "__main__":
    main()
