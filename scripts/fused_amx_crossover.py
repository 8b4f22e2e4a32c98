"""Where the fused decode's AMX tiles beat its int8 GEMV, per row count, for the LM head and the layers
(issue 27: the thresholds of ``sglite.kernels.gemm_paths.fused_amx_min``).

Captures one real fused decode step per row count (B prompts of ``--prompt-len`` tokens, greedy,
``ignore_eos``), then times, alternating in one process on one pool thread (CPU time, median of
``--repeats``): the LM head (``FusedDecode.head`` on random rows) and the layers
(``FusedDecode.hidden`` on the captured step), each with the AMX tiles forced off
(``SGLITE_GEMM=vnni``: the int8 GEMV, in blocks of 8 rows past 8) and forced on from one row
(``gemm_paths.AMX_MIN_ROWS = 1``), and the whole step (layers + head) with the dispatcher's
thresholds (``auto``). Needs an AMX-BF16 CPU (the tiles) and a model with tiled quantized weights.

Usage::

    .venv/bin/python scripts/fused_amx_crossover.py --model-path G --rows 1,4,8,9,10,12,14,16
"""
from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the default model")
    ap.add_argument("--rows", default="1,4,8,9,10,12,14,16")
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()

    import torch

    from sglite import Engine
    from sglite.kernels import gemm_paths

    e = Engine(model_path=a.model_path, num_threads=1)
    m = e.runner.model
    fused = m.decode_fused
    if fused is None or not fused.amx_min():
        raise SystemExit("no fused decode on the AMX tiles here (CPU, dtype or weights): nothing to compare")
    steps: dict = {}

    class Capture:
        def forward(self, fb, kb, vb, *args, **kw):
            n = fb.input_ids.shape[0]
            if not fb.num_extend_tokens and n not in steps:
                steps[n] = (fb, kb, vb)
            return fused.forward(fb, kb, vb, *args, **kw)

        def __getattr__(self, k):
            return getattr(fused, k)

    m.decode_fused = Capture()
    rows = [int(r) for r in a.rows.split(",")]
    for b in rows:
        e.generate(input_ids=[[2] + [100 + 7 * i + j for j in range(a.prompt_len)] for i in range(b)],
                   sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    m.decode_fused = fused

    def cpu_ms(f) -> float:
        ts = []
        for _ in range(a.repeats):
            s = time.thread_time()
            f()
            ts.append(time.thread_time() - s)
        return sorted(ts)[len(ts) // 2] * 1e3

    def forced(mode: str):
        os.environ[gemm_paths.ENV] = "vnni" if mode == "gemv" else "auto"
        gemm_paths.AMX_MIN_ROWS = 1 if mode == "amx" else amx_rows

    amx_rows = gemm_paths.AMX_MIN_ROWS
    print(f"thresholds (auto): layers {fused.amx_min()} rows, head {fused.head_amx_min()} rows; "
          f"one thread, CPU time, median of {a.repeats}; ms")
    print("rows | head gemv | head amx | layers gemv | layers amx | step auto")
    for n in rows:
        if n not in steps:
            print(f"{n:4d} | (no step of {n} rows captured)")
            continue
        fb, kb, vb = steps[n]
        h = torch.randn(n, m.lm_head.shape[1], generator=torch.Generator().manual_seed(n))
        r = {}
        for mode in ("gemv", "amx", "auto"):
            forced(mode)
            if mode == "auto":
                r[mode] = cpu_ms(lambda: fused.head(fused.hidden(fb, kb, vb)))
            else:
                r[mode] = (cpu_ms(lambda: fused.head(h)), cpu_ms(lambda: fused.hidden(fb, kb, vb)))
        forced("auto")
        print(f"{n:4d} | {r['gemv'][0]:9.1f} | {r['amx'][0]:8.1f} | {r['gemv'][1]:11.1f} | {r['amx'][1]:10.1f} | "
              f"{r['auto']:9.1f}", flush=True)
    e.shutdown()


if __name__ == "__main__":
    main()
