// Few-row bf16 GEMV, batch-invariant bf16 / fp32 matmul and SwiGLU activation on CPU (AVX-512).
// Contracts, measurements and reasons: sglite/kernels/cpu_gemv.py. Built with -ffp-contract=off:
// every float operation below is the one written, in every lane and every tail.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "thread_pool.h"
#include <immintrin.h>
#include "avx512_math.h"
#include <algorithm>
#include <cstdint>

namespace {

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// dot(x, w_row) over K bf16 values, float32 accumulation in two independent chains: 32-wide
// slice pairs alternate between a0 (even) and a1 (odd); the rest (< 64 values: at most one full
// slice, then a zero-masked partial one) all go into a0; then one horizontal sum of a0 + a1.
// dot_row_multi<M> below does exactly this per x row, so a row's result never depends on M.
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
    a0 = _mm512_dpbf16_ps(a0, as_bh(_mm512_maskz_loadu_epi16(m, w + k)), as_bh(_mm512_maskz_loadu_epi16(m, x + k)));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

// M rows of x (M <= 8) against one weight row: the row is loaded once per 32-wide slice and
// folded into M accumulators (one chain per x row); out[m] = dot(x[m], w_row), same order as dot_row.
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

// Two weight rows at once against M <= 4 rows of x (each x slice loaded once for both rows, each
// weight slice once for all M): per output exactly dot_row_multi's chains and final sum.
template <int M>
inline void dot_rows2_multi(const uint16_t* x, int64_t ldx, const uint16_t* w0, const uint16_t* w1, int64_t K,
                            float* out0, float* out1) {
  __m512 a0[M], b0[M], a1[M], b1[M];
  for (int m = 0; m < M; ++m) a0[m] = b0[m] = a1[m] = b1[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512bh p0 = as_bh(_mm512_loadu_si512(w0 + k)), p1 = as_bh(_mm512_loadu_si512(w0 + k + 32));
    const __m512bh q0 = as_bh(_mm512_loadu_si512(w1 + k)), q1 = as_bh(_mm512_loadu_si512(w1 + k + 32));
    for (int m = 0; m < M; ++m) {
      const __m512bh x0 = as_bh(_mm512_loadu_si512(x + m * ldx + k)), x1 = as_bh(_mm512_loadu_si512(x + m * ldx + k + 32));
      a0[m] = _mm512_dpbf16_ps(a0[m], p0, x0);
      b0[m] = _mm512_dpbf16_ps(b0[m], p1, x1);
      a1[m] = _mm512_dpbf16_ps(a1[m], q0, x0);
      b1[m] = _mm512_dpbf16_ps(b1[m], q1, x1);
    }
  }
  for (; k < K; k += 32) {
    const __mmask32 msk = K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1ull << (K - k)) - 1);
    const __m512bh p = as_bh(_mm512_maskz_loadu_epi16(msk, w0 + k)), q = as_bh(_mm512_maskz_loadu_epi16(msk, w1 + k));
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = as_bh(_mm512_maskz_loadu_epi16(msk, x + m * ldx + k));
      a0[m] = _mm512_dpbf16_ps(a0[m], p, xv);
      a1[m] = _mm512_dpbf16_ps(a1[m], q, xv);
    }
  }
  for (int m = 0; m < M; ++m) {
    out0[m] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], b0[m]));
    out1[m] = _mm512_reduce_add_ps(_mm512_add_ps(a1[m], b1[m]));
  }
}

// float32 twin of dot_row_multi: 16-wide slice pairs alternate between a (even) and b (odd), the
// rest (< 32 values: one full slice, then a zero-masked partial one) into a, then sum(a + b).
template <int M>
inline void dot_row_multi_f32(const float* x, int64_t ldx, const float* w, int64_t K, float* out) {
  __m512 a[M], b[M];
  for (int m = 0; m < M; ++m) a[m] = b[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + k + 16);
    for (int m = 0; m < M; ++m) {
      a[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * ldx + k), a[m]);
      b[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * ldx + k + 16), b[m]);
    }
  }
  for (; k < K; k += 16) {
    const __mmask16 msk = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    const __m512 wv = _mm512_maskz_loadu_ps(msk, w + k);
    for (int m = 0; m < M; ++m)
      a[m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(msk, x + m * ldx + k), a[m]);
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(a[m], b[m]));
}

inline float bf16_to_float(uint16_t v) { return static_cast<float>(c10::BFloat16(v, c10::BFloat16::from_bits())); }

// y[m0 + i, n] for i < M, n in [n0, n1): x rows m0.. against weight rows n0..n1-1.
template <int M>
void tile_bf16(const uint16_t* x, int64_t m0, const uint16_t* w, const uint16_t* bp, uint16_t* y,
               int64_t n0, int64_t n1, int64_t N, int64_t K) {
  float out[M];
  for (int64_t n = n0; n < n1; ++n) {
    dot_row_multi<M>(x + m0 * K, K, w + n * K, K, out);
    const float b = bp ? bf16_to_float(bp[n]) : 0.f;
    for (int m = 0; m < M; ++m) y[(m0 + m) * N + n] = c10::BFloat16(out[m] + b).x;  // one rounding
  }
}

// As tile_bf16 for M <= 4 x rows, two weight rows per pass (dot_rows2_multi), the last odd one alone.
template <int M>
void tile2_bf16(const uint16_t* x, int64_t m0, const uint16_t* w, const uint16_t* bp, uint16_t* y,
                int64_t n0, int64_t n1, int64_t N, int64_t K) {
  float o0[M], o1[M];
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    dot_rows2_multi<M>(x + m0 * K, K, w + n * K, w + (n + 1) * K, K, o0, o1);
    const float b0 = bp ? bf16_to_float(bp[n]) : 0.f, b1 = bp ? bf16_to_float(bp[n + 1]) : 0.f;
    for (int m = 0; m < M; ++m) {
      y[(m0 + m) * N + n] = c10::BFloat16(o0[m] + b0).x;
      y[(m0 + m) * N + n + 1] = c10::BFloat16(o1[m] + b1).x;
    }
  }
  if (n < n1) tile_bf16<M>(x, m0, w, bp, y, n, n1, N, K);
}

template <int M>
void tile_f32(const float* x, int64_t m0, const float* w, const float* bp, float* y,
              int64_t n0, int64_t n1, int64_t N, int64_t K) {
  float out[M];
  for (int64_t n = n0; n < n1; ++n) {
    dot_row_multi_f32<M>(x + m0 * K, K, w + n * K, K, out);
    const float b = bp ? bp[n] : 0.f;
    for (int m = 0; m < M; ++m) y[(m0 + m) * N + n] = out[m] + b;
  }
}

template <typename T, typename Tile>
void dispatch_rows(int64_t rows, Tile&& tile) {
  switch (rows) {
    case 1: tile(std::integral_constant<int, 1>{}); break;
    case 2: tile(std::integral_constant<int, 2>{}); break;
    case 3: tile(std::integral_constant<int, 3>{}); break;
    case 4: tile(std::integral_constant<int, 4>{}); break;
    case 5: tile(std::integral_constant<int, 5>{}); break;
    case 6: tile(std::integral_constant<int, 6>{}); break;
    case 7: tile(std::integral_constant<int, 7>{}); break;
    default: tile(std::integral_constant<int, 8>{}); break;
  }
}

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

at::Tensor checked_bias(const c10::optional<torch::Tensor>& bias, int64_t N, at::ScalarType dt, const char* who) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  auto bc = bias->contiguous();
  TORCH_CHECK(bc.scalar_type() == dt && bc.numel() == N, who, ": bias must be [N = ", N, "] of the weight's dtype");
  return bc;
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
  const uint16_t* xp = bits(xc);
  const uint16_t* wp = bits(w);
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::Tensor bc = checked_bias(bias, N, at::kBFloat16, "gemv");
  const uint16_t* bp = bc.defined() ? bits(bc) : nullptr;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, K));
  if (M == 1) {
    // rows walk memory in order (one stream per thread): measured faster here than interleaving
    // several rows per K slice (which splits the access into one stream per row) or software prefetch
    sglite_pool::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        float v = dot_row(xp, wp + n * K, K);
        if (bp) v += bf16_to_float(bp[n]);
        yp[n] = c10::BFloat16(v).x;  // round to nearest even, once
      }
    });
    return y;
  }
  sglite_pool::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    dispatch_rows<uint16_t>(M, [&](auto c) { tile_bf16<decltype(c)::value>(xp, 0, wp, bp, yp, n0, n1, N, K); });
  });
  return y;
}

// Batch-invariant y = x w^T (+ bias) for any M: each output is computed by dot_row_multi (bf16) or
// dot_row_multi_f32 (fp32) in the same order whatever M, the row's position or the thread split.
// Weight rows split into blocks of ~256 KiB (L2-resident) across threads; each block meets all
// x rows in groups (bf16: 4 rows against 2 weight rows per pass, fewer loads per VDPBF16PS; fp32:
// 8 rows against 1), so the weights stream from memory once per call.
torch::Tensor linear_invariant(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  const auto dt = w.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat, "linear_invariant: bf16 or fp32 weights only");
  TORCH_CHECK(x.scalar_type() == dt, "linear_invariant: x and w dtypes differ");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "linear_invariant: w must be a contiguous [N, K] matrix");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "linear_invariant: x must be [M, K = ", K, "]");
  const int64_t M = x.size(0);
  auto xc = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  at::Tensor bc = checked_bias(bias, N, dt, "linear_invariant");
  const int64_t esz = dt == at::kBFloat16 ? 2 : 4;
  const int64_t nb = std::max<int64_t>(1, (int64_t(256) << 10) / std::max<int64_t>(1, K * esz));
  const int64_t blocks = (N + nb - 1) / nb;
  sglite_pool::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * nb, n1 = std::min(N, n0 + nb);
      for (int64_t m0 = 0; m0 < M; m0 += (dt == at::kBFloat16 ? 4 : 8)) {
        if (dt == at::kBFloat16) {
          const uint16_t* bb = bc.defined() ? bits(bc) : nullptr;
          uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
          switch (std::min<int64_t>(4, M - m0)) {
            case 1: tile_bf16<1>(bits(xc), m0, bits(w), bb, yp, n0, n1, N, K); break;  // one stream (decode)
            case 2: tile2_bf16<2>(bits(xc), m0, bits(w), bb, yp, n0, n1, N, K); break;
            case 3: tile2_bf16<3>(bits(xc), m0, bits(w), bb, yp, n0, n1, N, K); break;
            default: tile2_bf16<4>(bits(xc), m0, bits(w), bb, yp, n0, n1, N, K); break;
          }
        } else {
          dispatch_rows<float>(M - m0, [&](auto c) {
            tile_f32<decltype(c)::value>(xc.data_ptr<float>(), m0, w.data_ptr<float>(),
                                         bc.defined() ? bc.data_ptr<float>() : nullptr, y.data_ptr<float>(), n0, n1, N, K);
          });
        }
      }
    }
  });
  return y;
}

namespace {
using sglite_simd::exp_nonpos;

// silu16 (avx512_math.h): -21 % per silu_mul call against the e^-|g| division form (0.26 against
// 0.33 ms at 512 x 1536, one thread), and on 786k N(0, 2) gates the same bf16 results, bit for bit
// (decode_layer.cpp's float32 silu_mul keeps the division form; F.silu agreement is tested).
using sglite_simd::silu16;
using sglite_simd::gelu_tanh16;  // avx512_math.h: decode_family.h's formula too

inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __m256i round_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }  // round to nearest even
}  // namespace

// out = act(g) * u elementwise (silu_mul: SwiGLU's activation; gelu_tanh_mul: GeGLU's), same shape
// and dtype (bf16 or fp32). act(g) is rounded to the dtype before the product, as F.silu(g) * u rounds. Every element runs the same
// vector code (the tail masked), so a value never depends on its position. g and u are read in
// place when they are [M, I] row-strided views with unit stride along I (the two halves of the fused
// gate_up product): no torch copy, whose intra-op (OpenMP) threads stall for a scheduler slice when
// another process holds a core; other layouts are made contiguous first. out is contiguous.
// act16: the activation on 16 float32 lanes (silu16, gelu_tanh16); who: the op's name in errors.
template <typename Act>
torch::Tensor act_mul(torch::Tensor g, torch::Tensor u, const char* who, Act act16) {
  TORCH_CHECK(g.sizes() == u.sizes() && g.scalar_type() == u.scalar_type(), who, ": g and u must match");
  const auto dt = g.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat, who, ": bf16 or fp32 only");
  const bool rows = g.dim() == 2 && g.stride(1) == 1 && u.stride(1) == 1 && g.size(1) > 0;
  auto gc = rows ? g : g.contiguous(), uc = rows ? u : u.contiguous();
  auto out = at::empty(g.sizes(), g.options().memory_format(at::MemoryFormat::Contiguous));
  // as [M, I]: rows of I elements at row strides gs / us (the flat tensor is one row when not `rows`)
  const int64_t M = rows ? g.size(0) : 1, I = rows ? g.size(1) : gc.numel();
  const int64_t gs = rows ? g.stride(0) : 0, us = rows ? u.stride(0) : 0;
  const int64_t per_row = (I + 15) / 16;
  const bool f32 = dt == at::kFloat;
  // base pointers read once (data_ptr<T>() checks the dtype on every call)
  const char* gb = static_cast<const char*>(gc.data_ptr());
  const char* ub = static_cast<const char*>(uc.data_ptr());
  char* ob = static_cast<char*>(out.data_ptr());
  sglite_pool::parallel_for(0, M * per_row, 2048, [&](int64_t c0, int64_t c1) {
    int64_t r = c0 / per_row, i = (c0 - r * per_row) * 16;
    for (int64_t c = c0; c < c1; ++c) {
      const __mmask16 m = I - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (I - i)) - 1);
      const int64_t go = r * gs + i, uo = r * us + i, oo = r * I + i;
      if (f32) {
        const __m512 s = act16(_mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(gb) + go));
        _mm512_mask_storeu_ps(reinterpret_cast<float*>(ob) + oo, m,
                              _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(ub) + uo)));
      } else {
        const uint16_t* gp = reinterpret_cast<const uint16_t*>(gb) + go;
        const uint16_t* up = reinterpret_cast<const uint16_t*>(ub) + uo;
        uint16_t* op = reinterpret_cast<uint16_t*>(ob) + oo;
        const __m256i s = round_bf16(act16(load_bf16(gp, m)));  // the activation rounded to bf16
        const __m512 sf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(s), 16));
        _mm256_mask_storeu_epi16(op, m, round_bf16(_mm512_mul_ps(sf, load_bf16(up, m))));
      }
      i += 16;
      if (i >= I) i = 0, ++r;
    }
  });
  return out;
}

// (the activation goes in as a lambda, a type of its own, so each instantiation inlines it: a plain
// function pointer, the one type silu16 and gelu_tanh16 share, made it an indirect call per vector)
torch::Tensor silu_mul(torch::Tensor g, torch::Tensor u) {
  return act_mul(g, u, "silu_mul", [](__m512 x) { return silu16(x); });
}

// out = gelu_tanh(g) * u (GeGLU's activation, Gemma's MLP), as silu_mul: the activation rounded to
// the dtype before the product (as F.gelu(g, approximate="tanh") * u rounds), every element the same
// vector code, row-strided halves read in place.
torch::Tensor gelu_tanh_mul(torch::Tensor g, torch::Tensor u) {
  return act_mul(g, u, "gelu_tanh_mul", [](__m512 x) { return gelu_tanh16(x); });
}
