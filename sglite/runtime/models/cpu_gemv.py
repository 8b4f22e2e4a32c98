"""Batch-1 decode matmuls (GEMV, one row) on CPU through float16 copies of bfloat16 weights.

Why: on AVX-512-BF16 CPUs without AVX-512-FP16 (e.g. AMD Zen 4), oneDNN's one-row bf16 GEMV
reads weights at about half the bandwidth of its fp16 GEMV (measured here, one thread, the 120
SmolLM2-135M layer matrices: 26 ms bf16 vs 13 ms fp16), while fp16 loses at two rows and more
(23 vs 26 ms at M=2, 178 vs 40 ms at M=16). So rows ``M == 1`` go through fp16 weights, every
other step through the bf16 ones.

Numerics: a bf16 value converts to fp16 exactly when ``6.1e-5 <= |w| <= 65504`` (fp16 has the
wider mantissa); smaller weights become fp16 subnormals (absolute error <= 3e-8). The activation
is converted the same way, the product accumulates in fp32 inside oneDNN in both paths, and the
output is rounded to fp16 then back to bf16 (double rounding differs from a direct bf16 rounding
only at exact bf16 midpoints). An activation or output past fp16's range (65504) becomes inf:
callers check the step's logits and redo it on the bf16 path (:meth:`LlamaModel.forward`).
Costs a second copy of the weights (bytes = the bf16 weights).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

MIN_SPEEDUP = 1.3  # adopt the fp16 path only when the load-time probe finds it this much faster


def fp16_gemv_speedup(weights: list[torch.Tensor], reps: int = 3) -> float:
    """bf16 time / fp16 time of one-row products against every matrix of ``weights`` ([N, K] bf16,
    CPU), best pass of ``reps``. Pass the model's own matrices: the probe must stream them from
    memory as decoding does (one matrix repeated stays in cache, where bf16 wins instead)."""
    w16 = [w.to(torch.float16) for w in weights]
    xs = {w.shape[1]: torch.randn(1, w.shape[1]).to(w.dtype) for w in weights}
    xs16 = {k: v.to(torch.float16) for k, v in xs.items()}

    def best(ws, x) -> float:
        t = float("inf")
        for _ in range(reps):
            s = time.perf_counter()
            for w in ws:
                F.linear(x[w.shape[1]], w)
            t = min(t, time.perf_counter() - s)
        return t

    return best(weights, xs) / best(w16, xs16)


def want_fp16_gemv(mode: str, dtype: torch.dtype, device: str, probe_weights: list[torch.Tensor]) -> bool:
    """Whether to build fp16 GEMV weights: ``mode`` ``fp16`` (on CPU bf16), ``off``, or ``auto``
    (CPU, bf16, and :func:`fp16_gemv_speedup` >= :data:`MIN_SPEEDUP`). Raises ValueError for other modes."""
    if mode not in ("auto", "fp16", "off"):
        raise ValueError(f"cpu_decode_gemv: must be auto|fp16|off, got {mode!r}")
    if mode == "off" or device != "cpu" or dtype != torch.bfloat16:
        return False
    if mode == "fp16":
        return True
    return fp16_gemv_speedup(probe_weights) >= MIN_SPEEDUP


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, weight16=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; one-row ``x`` goes through ``weight16`` (fp16) when given.

    x: [M, K] (bf16); weight: [N, K]; weight16: [N, K] float16 or None. Returns [M, N] in x's dtype.
    """
    if weight16 is not None and x.shape[0] == 1:
        y = F.linear(x.to(torch.float16), weight16)
        y = y.to(x.dtype)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)
