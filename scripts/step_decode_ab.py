"""Same-process A/B of the fused decode's C++ layer stack (``decode_forward``) at real decode steps.

A = ``csrc/decode_layer.cpp`` of another checkout (``--ref-root``, e.g. a worktree of ``main``),
built under its own extension name; B = this checkout's build. The engine runs the offline
workload's 48 prompts (``benchmarks/vllm_cpu/offline.py``), then decodes them in lockstep; every
decode step of ``--min-rows`` rows or more runs ``FusedDecode.hidden`` with A and with B on the same
batch, alternating which goes first, and the step continues with B's result. Printed per side:
median / first-quartile caller-thread CPU (``time.thread_time``: the critical path's own work),
process CPU (both threads, spin included) and wall per call, and how many steps' hidden states
differ bit for bit between A and B (the K/V written twice are the same values).

Interleaving on one process and one batch is what makes a ~5 % difference readable on a shared
machine whose load moves wall times by 2x within minutes; read the CPU columns first.

    python scripts/step_decode_ab.py --ref-root /path/to/main [--tokens 96] [--min-rows 48]
    python scripts/step_decode_ab.py --ref-root /path/to/main --staggered   # rows 48 -> 2
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def reference_source(root: Path) -> str:
    """``decode_layer.cpp`` of ``root`` with its ``csrc`` headers spliced in (as ``read_source``)."""
    from sglite.kernels import cpu_build

    return cpu_build.read_source("decode_layer.cpp", root / "sglite" / "kernels" / "csrc")


def build_reference(root: Path):
    """The reference checkout's decode module, or SystemExit when it does not build."""
    from sglite.kernels import cpu_build, quant_amx, quant_cpu
    from sglite.kernels.device import cpu_flags

    flags = cpu_flags()
    if not all(f in flags for f in quant_cpu.AVX_FLAGS):
        raise SystemExit("this A/B needs the AVX-512 build (the CPU lacks its flags)")
    cflags = quant_cpu.CFLAGS_AVX + (("-mavx512vnni",) if quant_cpu.VNNI_FLAG in flags else ())
    if all(f in flags for f in quant_amx.REQUIRED_FLAGS):
        cflags += ("-mavx512dq", "-mamx-tile", "-mamx-bf16")
    mod = cpu_build.load_cpp("sglite_decode_layer_ref", reference_source(root), cflags,
                             functions=["decode_forward", "head_q8", "probe_gemvs", "decode_family_forward"])
    if mod is None:
        raise SystemExit(f"the reference decode_layer.cpp of {root} did not build")
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref-root", required=True, help="checkout whose decode_layer.cpp is side A")
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per request (lockstep mode)")
    ap.add_argument("--min-rows", type=int, default=48, help="A/B only steps of at least this many rows")
    ap.add_argument("--staggered", action="store_true",
                    help="request i gets 2 + i new tokens: steps of every row count 48 .. 2 (sets --min-rows 2)")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks" / "vllm_cpu"))
    from offline import prompts

    import torch
    from sglite.kernels import decode_fused
    from sglite.runtime.engine import Engine

    ref, mine = build_reference(Path(a.ref_root)), decode_fused.load(False)
    if mine is None:
        raise SystemExit("this checkout's decode_layer.cpp did not build")
    min_rows = 2 if a.staggered else a.min_rows
    eng = Engine()
    fd = eng.scheduler.runner.model.decode_fused
    if fd is None:
        raise SystemExit("the engine's model does not run the fused decode")
    res: dict = {"A": [], "B": []}
    state = {"on": False, "k": 0, "diff": 0}
    hidden0, load0 = fd.hidden, decode_fused.load

    def hidden(fb, kb, vb):
        if not state["on"] or fb.input_ids.shape[0] < min_rows:
            return hidden0(fb, kb, vb)
        order = ("A", "B") if state["k"] % 2 == 0 else ("B", "A")
        state["k"] += 1
        outs = {}
        try:
            for side in order:
                mod = ref if side == "A" else mine
                decode_fused.load = lambda portable=False, mod=mod: mod  # noqa: E731
                c, w, t = time.process_time(), time.perf_counter(), time.thread_time()
                outs[side] = hidden0(fb, kb, vb)
                res[side].append(((time.thread_time() - t) * 1e6, (time.process_time() - c) * 1e6,
                                  (time.perf_counter() - w) * 1e6))
        finally:
            decode_fused.load = load0
        state["diff"] += not torch.equal(outs["A"], outs["B"])
        return outs["B"]

    fd.hidden = hidden
    ps = prompts(0)
    eng.generate(ps, {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True})  # prefill (cached after)
    state["on"] = True
    sp = ([{"max_new_tokens": 2 + i, "temperature": 0, "ignore_eos": True} for i in range(len(ps))] if a.staggered
          else {"max_new_tokens": a.tokens, "temperature": 0, "ignore_eos": True})
    try:
        eng.generate(ps, sp)
    finally:
        eng.shutdown()
    for side, label in (("A", f"A ({a.ref_root})"), ("B", "B (this checkout)")):
        v = res[side]
        if len(v) < 4:
            raise SystemExit(f"only {len(v)} steps of >= {min_rows} rows ran")
        q1 = [statistics.quantiles([x[i] for x in v], n=4)[0] for i in range(3)]
        med = [statistics.median(x[i] for x in v) for i in range(3)]
        print(f"{label}: {len(v)} steps; caller-thread CPU median {med[0]:.0f} us (q1 {q1[0]:.0f}); process CPU "
              f"median {med[1]:.0f} us; wall median {med[2]:.0f} us (q1 {q1[2]:.0f}, min {min(x[2] for x in v):.0f})")
    print(f"steps whose A and B hidden states differ bit for bit: {state['diff']} of {len(res['B'])}; "
          f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    os.environ.setdefault("SGLITE_LOG_LEVEL", "WARNING")
    main()
