"""Batch-1 decode matmuls (GEMV, one row) of bf16 models on CPU: a C++ AVX-512-BF16 kernel, float16
weight copies, or oneDNN's bf16 path, chosen at load (``EngineConfig.cpu_decode_gemv``).

Why: on AVX-512-BF16 CPUs without AVX-512-FP16 (e.g. AMD Zen 4), oneDNN's one-row bf16 GEMV reads
weights at about a quarter of one core's bandwidth. Measured here (one thread, the 120
SmolLM2-135M layer matrices + the LM head, 269 MB): oneDNN bf16 33 ms (8 GB/s), oneDNN fp16 on
float16 copies 16 ms (17 GB/s), the C++ kernel of :mod:`sglite.kernels.cpu_gemv` 13 ms on the
weights as loaded (20 GB/s) and 9 ms once they sit in huge pages (30 GB/s). fp16 copies serve
rows ``M == 1`` only (they lose at two rows and more: 23 vs 26 ms at M=2, 178 vs 40 ms at M=16);
the kernel serves up to 8 rows (batch <= 8 decode), still streaming the weights once (M=2 9-11 ms,
M=4 11, M=8 20 vs oneDNN bf16 33-41 ms); larger steps use ``F.linear`` on the bf16 weights.

Modes: ``cpp`` (the kernel; no weight copies, the matrices move into one huge-page buffer),
``fp16`` (float16 copies of the weights: twice the weight memory), ``off`` (oneDNN bf16), and
``auto``, which times the candidates over the model's own matrices (:func:`probe_times`: they
stream from memory as in decoding; one matrix repeated would stay in cache) and keeps the
fastest, fp16 only when at least :data:`MIN_SPEEDUP` faster than ``off``.

Numerics: ``cpp`` sums exact bf16 products in float32 and rounds once to bf16, as oneDNN does
(only the summation order differs). ``fp16``: a bf16 value converts to fp16 exactly when
``6.1e-5 <= |w| <= 65504`` (smaller weights become fp16 subnormals, absolute error <= 3e-8); the
output is rounded to fp16 then bf16 (differs from one rounding only at exact bf16 midpoints). An
activation or output past fp16's range becomes inf: :meth:`LlamaModel.forward` checks the step's
logits and redoes the step on the bf16 path.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from sglite.kernels import cpu_gemv as cpp_kernel
from sglite.kernels.cpu_gemv import MAX_ROWS as CPP_MAX_ROWS

log = logging.getLogger("sglite.models.cpu_gemv")

MODES = ("auto", "cpp", "fp16", "off")
MIN_SPEEDUP = 1.3  # adopt the fp16 copies only when the load-time probe finds them this much faster


def cpp_gemv_fn() -> Optional[Callable]:
    """The C++ kernel's ``(x [1, K] bf16, w [N, K] bf16, bias [N] bf16 | None) -> [1, N] bf16``, or
    None when this CPU lacks AVX-512-BF16 or the build failed (a warning was logged)."""
    mod = cpp_kernel.load()
    return None if mod is None else mod.gemv_bf16


def probe_times(weights: list[torch.Tensor], candidates: tuple[str, ...] = ("off", "fp16", "cpp"),
                reps: int = 3) -> dict[str, float]:
    """Seconds for one-row products against every matrix of ``weights`` ([N, K] bf16, CPU), best
    pass of ``reps``, per candidate path (``off``: ``F.linear`` in bf16; ``fp16``: float16 copies,
    made here and dropped; ``cpp``: the C++ kernel, skipped when unavailable). Pass the model's own
    matrices so they stream from memory as in decoding."""
    xs = {w.shape[1]: torch.randn(1, w.shape[1]).to(w.dtype) for w in weights}
    fn = cpp_gemv_fn()

    def best(ws, x, f) -> float:
        t = float("inf")
        for _ in range(reps):
            s = time.perf_counter()
            for w in ws:
                f(x[w.shape[1]], w)
            t = min(t, time.perf_counter() - s)
        return t

    out = {}
    for c in candidates:
        if c == "off":
            out[c] = best(weights, xs, F.linear)
        elif c == "fp16":
            out[c] = best([w.to(torch.float16) for w in weights],
                          {k: v.to(torch.float16) for k, v in xs.items()}, F.linear)
        elif c == "cpp" and fn is not None:
            out[c] = best(weights, xs, lambda x, w: fn(x, w, None))
    return out


def choose_gemv(mode: str, dtype: torch.dtype, device: str, probe_weights: list[torch.Tensor]) -> str:
    """The one-row matmul path to use: ``"cpp"``, ``"fp16"`` or ``"off"``.

    ``mode``: ``off``; ``fp16`` / ``cpp`` force that path on CPU bf16 models (``cpp`` degrades to
    ``off`` when the kernel is unavailable); ``auto`` on CPU bf16 models picks the fastest of
    :func:`probe_times` over ``probe_weights`` (the model's [N, K] matrices), counting fp16 only
    when >= :data:`MIN_SPEEDUP` x faster than ``off``. Other devices or dtypes: ``off``.
    Raises ValueError for an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"cpu_decode_gemv: must be {'|'.join(MODES)}, got {mode!r}")
    if mode == "off" or device != "cpu" or dtype != torch.bfloat16:
        return "off"
    if mode == "fp16":
        return "fp16"
    if mode == "cpp":
        if cpp_gemv_fn() is None:
            log.warning("cpu_decode_gemv=cpp: the C++ GEMV is unavailable here (needs AVX-512-BF16 and a "
                        "compiler); using oneDNN bf16")
            return "off"
        return "cpp"
    t = probe_times(probe_weights)
    log.info("one-row matmul probe over %d matrices: %s", len(probe_weights),
             ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items()))
    if t["fp16"] * MIN_SPEEDUP > t["off"]:
        del t["fp16"]
    return min(t, key=t.get)


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, weight16=None, cpp=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; x of 1 to :data:`CPP_MAX_ROWS` rows goes through ``cpp``
    (the C++ kernel, from :func:`cpp_gemv_fn`) when given; else a one-row ``x`` goes through
    ``weight16`` (float16 copy) when given.

    x: [M, K] (bf16 when ``cpp``/``weight16`` are given); weight: [N, K] (contiguous for ``cpp``);
    bias: [N] or None; weight16: [N, K] float16 or None. Returns [M, N] in x's dtype.
    """
    if cpp is not None and 1 <= x.shape[0] <= CPP_MAX_ROWS:  # zero rows: a step with nothing to sample
        return cpp(x, weight, bias)
    if weight16 is not None and x.shape[0] == 1:
        y = F.linear(x.to(torch.float16), weight16).to(x.dtype)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)
