"""CPU time of a model's layer GEMMs at one row count, on the engine's own (loaded) weights.

Loads the model as ``sglite.Engine`` does (one thread), then times every decoder layer's ``qkv``,
``o``, ``gate_up`` and ``down`` products through ``kernels.linear`` on random bf16 rows, and
``gate_up`` with its SwiGLU (``kernels.linear_silu`` where the weight has the output stage, else the
product then ``silu_mul``): the thread's CPU time (``time.thread_time``), best of ``--repeats``.
Run it from each checkout to compare two builds (A/B, alternated; a checkout without
``linear_silu`` runs the product then ``silu_mul``).

Usage::

    .venv/bin/python scripts/model_gemm_cost.py [--model-path G] [--rows 512] [--repeats 5]
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the default model")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()

    import torch

    from sglite import Engine, kernels

    e = Engine(model_path=a.model_path, num_threads=1, log_level="warning")
    torch.set_num_threads(1)
    layers = e.runner.model.layers
    keys = ("qkv", "o", "gate_up", "down")
    xs = {L[k].shape[1]: None for L in layers for k in keys}
    xs = {k: torch.randn(a.rows, k).bfloat16() for k in xs}

    def products() -> None:
        for L in layers:
            for k in keys:
                kernels.linear(xs[L[k].shape[1]], L[k])

    linear_silu = getattr(kernels, "linear_silu", lambda x, w: None)  # a build without it: product + silu_mul

    def swiglu() -> None:
        for L in layers:
            w = L["gate_up"]
            x = xs[w.shape[1]]
            if linear_silu(x, w) is None:
                g, u = kernels.linear(x, w).chunk(2, dim=-1)
                kernels.silu_mul(g, u)

    def best(f) -> float:
        f()
        b = float("inf")
        for _ in range(a.repeats):
            t = time.thread_time()
            f()
            b = min(b, time.thread_time() - t)
        return b * 1e3

    print(f"{len(layers)} layers at {a.rows} rows, thread CPU ms (best of {a.repeats}): "
          f"qkv/o/gate_up/down {best(products):.1f}; gate_up + SwiGLU {best(swiglu):.1f}")


if __name__ == "__main__":
    main()
