"""Per-step cost of sampling at temperature > 0 with top_p, in process (default model).

B of the shared-prefix workload's prompts decode ``--tokens`` tokens at ``--temperature`` and
``--top-p``; sglite's profiler (``Engine.start_profile``) gives the phase table of those steps, and
this prints the sampling phase and the whole step in ms per step. ``--reference`` runs the torch
reference sampler (a sort of each ranked row's whole vocabulary; torch's own thread count) in
place of the CPU path (:mod:`sglite.kernels.cpu_sampling`), as every CPU step ran before
2026-12-07.

    .venv/bin/python scripts/sampling_cost.py --batch 16,64 [--reference]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="16,64")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--reference", action="store_true", help="the torch reference sampler instead")
    a = ap.parse_args()
    import sglite.kernels as K
    from sglite.kernels import reference
    from sglite.runtime.engine import Engine
    from step_timeline import prompts

    if a.reference:
        K.sample = lambda *args, **kw: reference.sample(*args, **{k: v for k, v in kw.items() if k != "impl"})
    eng = Engine()
    ps, _ = prompts("shared-prefix")
    sp = {"max_new_tokens": a.tokens, "temperature": a.temperature, "top_p": a.top_p, "ignore_eos": True}
    try:
        for b in (int(x) for x in a.batch.split(",")):
            batch = ps[:b]
            eng.generate(batch, {"max_new_tokens": 1, "temperature": 0})  # prompts cached: the steps are decode
            eng.generate(batch, sp)  # warm-up
            eng.start_profile()
            eng.generate(batch, sp)
            ph = eng.stop_profile()["phases"]
            print(f"batch {b} ({'reference' if a.reference else 'cpu_sampling'}): sampling "
                  f"{ph['sampling']['us_per_step'] / 1e3:.1f} ms / step of {ph['step total']['us_per_step'] / 1e3:.1f} ms")
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
