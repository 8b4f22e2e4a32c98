"""Few-row bf16 matmul (GEMV, 1 to 8 rows) on CPU with AVX-512-BF16, reading the weights near
memory bandwidth; a batch-invariant matmul (bf16 and fp32, any row count) and SwiGLU activation for
deterministic inference. Source: ``csrc/cpu_gemv.cpp``.

``gemv(x, w, bias=None)`` computes ``F.linear(x, w, bias)`` for a few rows:
    x     [M, K] bfloat16, 1 <= M <= :data:`MAX_ROWS` (any layout; made contiguous)
    w     [N, K] bfloat16, contiguous
    bias  [N] bfloat16 or None
    y     [M, N] bfloat16: each output is the float32 sum of bf16 x bf16 products (+ bias in
          float32), rounded once to bf16 (round to nearest even), as oneDNN's bf16 matmul does;
          only the summation order differs.

Why: on AVX-512-BF16 CPUs without AVX-512-FP16 (AMD Zen 4), oneDNN's one-row bf16 GEMV streams
the weights at about a quarter of one core's read bandwidth (measured: ~8 GB/s vs ~31 GB/s for a
float32 ``sum``). Batch-1 decoding is such GEMVs against every weight matrix, so it is bound by
how fast the weights stream.

Kernel: each thread walks its rows in memory order, one row at a time: per 64 values of K two
``VDPBF16PS`` (``_mm512_dpbf16_ps``: 16 float32 lanes, each += two bf16 x bf16 products, the
products exact in float32) into two independent accumulators, then one horizontal sum per row.
The K tail (K % 32, odd K included) uses zero-masked 16-bit loads, so padding lanes add 0. Rows
split across threads with ``at::parallel_for`` (honours ``torch.set_num_threads``). Measured on
Zen 4 (one thread, the SmolLM2-135M matrices): a single in-order stream beats interleaving several
rows per K slice (one stream per row: 12 vs 20 GB/s) and software prefetch (slower at every
distance tried); what limits it then is the 4 KiB page walk, hence huge-page weights
(:func:`sglite.kernels.host_memory.hugepage_copies`, 20 -> 23-32 GB/s). With M > 1 rows of x
each weight slice is loaded once and folded into M pairs of accumulators, so the weights still stream once (measured, SmolLM2 matrices + LM head,
one thread, huge pages: M=1 9 ms, M=2 9-11, M=4 11, M=8 20; oneDNN bf16 33, 33, 37, 41 ms).
Lane semantics per Intel's SDM entry for VDPBF16PS: bf16 denormal inputs
count as zero, float32 rounding is round-to-nearest-even.

Batch invariance (``linear_invariant(x, w, bias)``, x [M, K] bf16|fp32 for any M >= 0, w [N, K] of
x's dtype): every output runs the per-row code of the M <= 8 kernel (``dot_row_multi<Mb>``, or
``dot_rows2_multi<Mb>`` for two weight rows at once: the same two chains, the same tail and the same
final horizontal sum for every block size Mb), bf16 rows in groups of 4 and fp32 rows in groups of
8 against L2-sized blocks of weight rows (~256 KiB, split across threads), so a row's bits do not
depend on M, on its position in the batch or on the thread split; fp32 weights use the float32
twin (FMA chains over 16-wide slices). The M = 1 kernel of ``gemv_bf16`` uses the same order, so
the few-row GEMV is batch-invariant for 1 <= M <= 8 too. Why a kernel of our own rather than
oneDNN in fixed-size blocks: oneDNN picks its kernel and blocking by M (measured: 14 of 257 rows
of a [M, 1536] x [96, 1536] bf16 product and every row of fp32 ones differ from the M = 1 result
at some M in 1..257), and its choice is not ours to pin. Measured (one thread, best of 5, bf16,
SmolLM2 shapes; invariant vs oneDNN): gate_up [3072, 576] M=1 0.06 vs 0.15 ms, M=64 2.1 vs 1.7,
M=512 11.3 vs 10.2; down [576, 1536] M=64 0.68 vs 0.62, M=512 4.9 vs 4.3; LM head [49152, 576]
M=1 4.6 vs 9.9, M=64 37 vs 27, M=512 222 vs 185 ms: within 1.1-1.35x of oneDNN at batch sizes,
faster at one row. bf16 groups of 4 x rows meet 2 weight rows per pass (12 loads per 16
VDPBF16PS instead of 18 with 8 x rows against 1). End to end: ``docs/benchmarks.md``.

``gelu_tanh_mul(g, u)`` = ``gelu_tanh(g) * u`` (GeGLU: Gemma's MLP) with the same loop, the tanh
from the same exp (``tanh(|y|) = (1 - e) / (1 + e)``, ``e = exp(-2|y|)``); torch's bf16
``F.gelu(g, approximate="tanh")`` takes ~0.9 ms for a 200 x 2048 prefill block on one thread.

``silu_mul(g, u)`` = ``silu(g) * u`` (bf16|fp32, any shape): every element runs the same AVX-512
code (a degree-6 polynomial exp, the tail masked), because torch's ``F.silu`` computes the
vectorised body with Sleef's exp and the tail with ``std::exp``, so an element's bits depend on
where the batch puts it (measured: 104 of 257 rows differ at row length 37, fp32).

Build: :func:`.cpu_build.load_cpp` with ``-O3 -mavx512f -mavx512bw -mavx512vl -mavx512dq
-mavx512bf16 -ffp-contract=off`` (DQ: silu's VREDUCEPS; every AVX-512 BF16 CPU has it) (no compiler-fused multiply-adds: the code computes what it says),
only when ``/proc/cpuinfo`` lists ``avx512f``, ``avx512bw`` and ``avx512_bf16``; otherwise (or when
the build fails) :func:`load` returns None and :func:`gemv` runs ``F.linear``.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from .cpu_build import load_cpp, read_source
from .device import cpu_flags

MAX_ROWS = 8  # rows of x the kernel takes (register budget: two float32 accumulators per row)
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-ffp-contract=off")


@functools.lru_cache(maxsize=None)
def load():
    """The compiled module (built once per process, reused across processes), or None when the
    CPU lacks any of :data:`REQUIRED_FLAGS` or the build failed (one warning logged)."""
    if not all(f in cpu_flags() for f in REQUIRED_FLAGS):
        return None
    return load_cpp("sglite_cpu_gemv", read_source("cpu_gemv.cpp"), CFLAGS,
                    functions=["gemv_bf16", "linear_invariant", "silu_mul", "gelu_tanh_mul"])


def available() -> bool:
    """True when the kernel compiled and loaded on this CPU."""
    return load() is not None


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`gemv` runs the kernel (not ``F.linear``) for these inputs: CPU, bf16, x
    [M, K] with 1 <= M <= :data:`MAX_ROWS`, contiguous [N, K] ``w``, and the kernel loaded."""
    return (x.device.type == "cpu" and w.device.type == "cpu" and x.dtype == torch.bfloat16
            and w.dtype == torch.bfloat16 and x.dim() == 2 and w.dim() == 2 and w.is_contiguous()
            and x.shape[1] == w.shape[1] and 1 <= x.shape[0] <= MAX_ROWS and available())


def gemv(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for x [M, K] bf16 (M <= :data:`MAX_ROWS`), w [N, K] bf16
    (contiguous), bias [N] bf16 or None -> [M, N] bf16 through the AVX-512-BF16 kernel; other
    inputs, or no kernel, run ``F.linear`` itself (same result up to summation order)."""
    if supports(x, w):
        return load().gemv_bf16(x, w, bias)
    return F.linear(x, w, bias)


def supports_invariant(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`linear_invariant` runs the kernel: CPU, x [M, K] and contiguous w [N, K] both
    bf16 or both fp32, and the kernel loaded."""
    return (x.device.type == "cpu" and w.device.type == "cpu" and x.dtype == w.dtype
            and x.dtype in (torch.bfloat16, torch.float32) and x.dim() == 2 and w.dim() == 2
            and w.is_contiguous() and x.shape[1] == w.shape[1] and available())


def linear_invariant(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Batch-invariant ``F.linear(x, w, bias)``: x [M, K], w [N, K] (contiguous), bias [N] or None,
    all bf16 or all fp32 -> [M, N]; row i's bits depend only on ``x[i]``, ``w`` and ``bias``.

    Without the kernel (or for other inputs) each row runs ``F.linear`` on its own ([1, K]: one
    kernel choice for every row; invariant, but the weights stream once per row).
    """
    if supports_invariant(x, w):
        return load().linear_invariant(x, w, bias)
    if x.shape[0] == 0:
        return F.linear(x, w, bias)
    return torch.cat([F.linear(x[i:i + 1], w, bias) for i in range(x.shape[0])])


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Position-invariant ``F.silu(g) * u`` (same shape and dtype, bf16 or fp32, CPU) through the
    kernel; without it, one row (last dim) at a time through torch (rows of one length share
    one vector/tail split)."""
    if (available() and g.device.type == "cpu" and g.dtype in (torch.bfloat16, torch.float32)
            and u.dtype == g.dtype and g.shape == u.shape):
        return load().silu_mul(g, u)
    if g.dim() < 2:
        return F.silu(g) * u
    return torch.stack([F.silu(g[i]) * u[i] for i in range(g.shape[0])]) if g.shape[0] else F.silu(g) * u


def gelu_tanh_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``F.gelu(g, approximate="tanh") * u`` (same shape and dtype, bf16 or fp32, CPU) through the
    kernel (float32 tanh within ~1e-7 of torch's, each bf16 result within one rounding step of
    torch's); without it, torch's ops."""
    if (available() and g.device.type == "cpu" and g.dtype in (torch.bfloat16, torch.float32)
            and u.dtype == g.dtype and g.shape == u.shape):
        return load().gelu_tanh_mul(g, u)
    return F.gelu(g, approximate="tanh") * u
