"""Few-row bf16 matmul (GEMV, 1 to 8 rows) on CPU with AVX-512-BF16, reading the weights near
memory bandwidth.

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
distance tried); what limits it then is the 4 KiB page walk, hence :func:`hugepage_copies`
(20 -> 23-32 GB/s). With M > 1 rows of x each weight slice is loaded once and folded into M
pairs of accumulators, so the weights still stream once (measured, SmolLM2 matrices + LM head,
one thread, huge pages: M=1 9 ms, M=2 9-11, M=4 11, M=8 20; oneDNN bf16 33, 33, 37, 41 ms).
Lane semantics per Intel's SDM entry for VDPBF16PS: bf16 denormal inputs
count as zero, float32 rounding is round-to-nearest-even.

Build: :func:`.cpu_build.load_cpp` with ``-O3 -mavx512f -mavx512bw -mavx512vl -mavx512bf16``,
only when ``/proc/cpuinfo`` lists ``avx512f``, ``avx512bw`` and ``avx512_bf16``; otherwise (or when
the build fails) :func:`load` returns None and :func:`gemv` runs ``F.linear``.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from .cpu_build import cpu_flags, load_cpp

MAX_ROWS = 8  # rows of x the kernel takes (register budget: two float32 accumulators per row)
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstdlib>
#include <sys/mman.h>

namespace {

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// dot(x, w_row) over K bf16 values, float32 accumulation in two independent chains.
inline float dot_row(const uint16_t* x, const uint16_t* w, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    a0 = _mm512_dpbf16_ps(a0, as_bh(_mm512_loadu_si512(w + k)), as_bh(_mm512_loadu_si512(x + k)));
    a1 = _mm512_dpbf16_ps(a1, as_bh(_mm512_loadu_si512(w + k + 32)), as_bh(_mm512_loadu_si512(x + k + 32)));
  }
  if (k + 32 <= K) {
    a0 = _mm512_dpbf16_ps(a0, as_bh(_mm512_loadu_si512(w + k)), as_bh(_mm512_loadu_si512(x + k)));
    k += 32;
  }
  if (k < K) {  // tail: zero-masked loads, padding lanes add 0
    const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
    a1 = _mm512_dpbf16_ps(a1, as_bh(_mm512_maskz_loadu_epi16(m, w + k)), as_bh(_mm512_maskz_loadu_epi16(m, x + k)));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

// M rows of x (M <= 8) against one weight row: the row is loaded once per 32-wide slice and
// folded into M accumulators (one chain per x row); out[m] = dot(x[m], w_row).
template <int M>
inline void dot_row_multi(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, float* out) {
  __m512 a[M], b[M];  // two chains per x row (even / odd 32-wide slices) hide VDPBF16PS latency
  for (int m = 0; m < M; ++m) a[m] = b[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512bh w0 = as_bh(_mm512_loadu_si512(w + k)), w1 = as_bh(_mm512_loadu_si512(w + k + 32));
    for (int m = 0; m < M; ++m) {
      a[m] = _mm512_dpbf16_ps(a[m], w0, as_bh(_mm512_loadu_si512(x + m * ldx + k)));
      b[m] = _mm512_dpbf16_ps(b[m], w1, as_bh(_mm512_loadu_si512(x + m * ldx + k + 32)));
    }
  }
  for (; k < K; k += 32) {  // at most two slices left, the last one possibly partial (masked)
    const __mmask32 msk = K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1ull << (K - k)) - 1);
    const __m512bh wv = as_bh(_mm512_maskz_loadu_epi16(msk, w + k));
    for (int m = 0; m < M; ++m)
      a[m] = _mm512_dpbf16_ps(a[m], wv, as_bh(_mm512_maskz_loadu_epi16(msk, x + m * ldx + k)));
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(a[m], b[m]));
}

template <int M>
void rows_multi(const uint16_t* x, const uint16_t* w, const uint16_t* bp, uint16_t* y, int64_t N, int64_t K) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, K));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    float out[M];
    for (int64_t n = n0; n < n1; ++n) {
      dot_row_multi<M>(x, K, w + n * K, K, out);
      const float b = bp ? static_cast<float>(c10::BFloat16(bp[n], c10::BFloat16::from_bits())) : 0.f;
      for (int m = 0; m < M; ++m) y[m * N + n] = c10::BFloat16(out[m] + b).x;
    }
  });
}

}  // namespace

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv: bf16 only");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "gemv: w must be a contiguous [N, K] matrix");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.size(0) >= 1 && x.size(0) <= 8,
              "gemv: x must be [M, K = ", K, "] with 1 <= M <= 8");
  const int64_t M = x.size(0);
  auto xc = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const uint16_t* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kBFloat16 && bc.numel() == N, "gemv: bias must be [N] bf16");
    bp = reinterpret_cast<const uint16_t*>(bc.data_ptr<at::BFloat16>());
  }
  switch (M) {
    case 1: break;
    case 2: rows_multi<2>(xp, wp, bp, yp, N, K); return y;
    case 3: rows_multi<3>(xp, wp, bp, yp, N, K); return y;
    case 4: rows_multi<4>(xp, wp, bp, yp, N, K); return y;
    case 5: rows_multi<5>(xp, wp, bp, yp, N, K); return y;
    case 6: rows_multi<6>(xp, wp, bp, yp, N, K); return y;
    case 7: rows_multi<7>(xp, wp, bp, yp, N, K); return y;
    default: rows_multi<8>(xp, wp, bp, yp, N, K); return y;
  }
  // rows walk memory in order (one stream per thread): measured faster here than interleaving
  // several rows per K slice (which splits the access into one stream per row) or software prefetch
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, K));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float v = dot_row(xp, wp + n * K, K);
      if (bp) v += static_cast<float>(c10::BFloat16(bp[n], c10::BFloat16::from_bits()));
      yp[n] = c10::BFloat16(v).x;  // round to nearest even, once
    }
  });
  return y;
}

// An uninitialised uint8 buffer of nbytes, 2 MiB aligned and advised for transparent huge pages
// (MADV_HUGEPAGE; best effort, the kernel may still back it with 4 KiB pages). Freed with the tensor.
torch::Tensor hugepage_buffer(int64_t nbytes) {
  TORCH_CHECK(nbytes > 0, "hugepage_buffer: nbytes must be > 0");
  const size_t align = size_t(2) << 20;
  const size_t size = (static_cast<size_t>(nbytes) + align - 1) / align * align;
  void* p = nullptr;
  TORCH_CHECK(posix_memalign(&p, align, size) == 0 && p, "hugepage_buffer: out of memory (", size, " bytes)");
#ifdef MADV_HUGEPAGE
  madvise(p, size, MADV_HUGEPAGE);
#endif
  return torch::from_blob(p, {nbytes}, [](void* q) { free(q); }, torch::dtype(torch::kUInt8));
}
"""


@functools.lru_cache(maxsize=None)
def load():
    """The compiled module (built once per process, reused across processes), or None when the
    CPU lacks any of :data:`REQUIRED_FLAGS` or the build failed (one warning logged)."""
    if not all(f in cpu_flags() for f in REQUIRED_FLAGS):
        return None
    return load_cpp("sglite_cpu_gemv", _SOURCE, CFLAGS, functions=["gemv_bf16", "hugepage_buffer"])


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


def hugepage_copies(tensors: list[torch.Tensor]) -> Optional[list[torch.Tensor]]:
    """Copies of ``tensors`` (CPU, contiguous) packed into one buffer advised for transparent huge
    pages (2 MiB; best effort), each copy 64-byte aligned; None when the kernel is unavailable.

    Why: the GEMV streams each weight once per step; with 4 KiB pages the hardware prefetcher stops
    at every page boundary and the TLB misses every 4 KiB (measured: the SmolLM2 LM head read at
    18 GB/s from 4 KiB pages, 32 GB/s from huge pages). The copies share one storage, so the buffer
    lives while any of them does; release the originals to avoid holding both.
    """
    mod = load()
    if mod is None:
        return None
    offs, total = [], 0
    for t in tensors:
        offs.append(total)
        total += (t.numel() * t.element_size() + 63) // 64 * 64
    buf = mod.hugepage_buffer(max(total, 1))  # [total] uint8
    out = []
    for t, o in zip(tensors, offs):
        n = t.numel() * t.element_size()
        out.append(buf[o:o + n].view(t.dtype).view(t.shape).copy_(t))
    return out
