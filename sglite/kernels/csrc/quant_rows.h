// Quantized GEMV rows shared by sglite's C++ kernels (quant_gemv.cpp, decode_layer.cpp); spliced
// into each source by sglite.kernels.cpu_build.read_source. Representation and contracts:
// sglite/kernels/quant_linear.py (codes, scales, mins) and sglite/kernels/quant_cpu.py (float
// GEMV on bf16 planes; int8 activations on VNNI: quant_q8.h, spliced at the end). Needs
// <ATen/Parallel.h>, <c10/util/BFloat16.h>.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include <c10/util/Half.h>
#include "thread_pool.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define SGQ_AVX512 1
#endif
#if defined(SGQ_AVX512) && defined(__AVX512VNNI__)
#define SGQ_VNNI 1
#endif
#if defined(SGQ_VNNI) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SGQ_AMX 1  // quant_amx.h: the AMX-BF16 tile GEMM (built with -mamx-tile -mamx-bf16)
#endif

namespace sglite_quant {


constexpr int64_t BLK = 32;  // channels per packing block

// How the GEMVs below split their output rows: par(b, e, grain, f) calls f(lo, hi) over shares of
// [b, e). AtPar: thread_pool.h's parallel_for (torch's thread count; at::parallel_for itself is
// serial in sglite's builds, which have no -fopenmp); the fused decode passes PoolPar. Each output row is computed by one call with the same
// code whatever its share, so the results do not depend on the split.
struct AtPar {
  template <typename F> void operator()(int64_t b, int64_t e, int64_t grain, const F& f) const {
    sglite_pool::parallel_for(b, e, grain, f);
  }
};

template <int V> using Int = std::integral_constant<int, V>;

// f(Int<M>{}) for M = 1..8: the row count of the register-tiled kernels (templated on M)
template <typename F> inline void with_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: f(Int<1>{}); break;
    case 2: f(Int<2>{}); break;
    case 3: f(Int<3>{}); break;
    case 4: f(Int<4>{}); break;
    case 5: f(Int<5>{}); break;
    case 6: f(Int<6>{}); break;
    case 7: f(Int<7>{}); break;
    case 8: f(Int<8>{}); break;
    default: TORCH_CHECK(false, "quantized GEMV: 1..8 rows per kernel call, got ", M);
  }
}

// f(Int<bits>{}) for a code width of 4 or 8 bits
template <typename F> inline void with_bits(int bits, F&& f) {
  if (bits == 4) f(Int<4>{});
  else f(Int<8>{});
}

// xs[m * G + g] = float32 sum of x[m, g * gs : (g + 1) * gs] (the offsets' factor)
inline void group_sums(const float* xf, int64_t M, int64_t K, int64_t gs, float* xs) {
  const int64_t G = K / gs;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float a = 0.f;
      for (int64_t i = 0; i < gs; ++i) a += xf[m * K + g * gs + i];
      xs[m * G + g] = a;
    }
}

// codes of one 32-block as floats (stored order), both widths
inline void decode_block(const uint8_t* q, int bits, int64_t kb, float* out) {
  if (bits == 8) {
    for (int i = 0; i < BLK; ++i) out[i] = (float)q[kb + i];
  } else {
    const uint8_t* p = q + kb / 2;
    for (int i = 0; i < 16; ++i) { out[i] = (float)(p[i] & 0xF); out[i + 16] = (float)(p[i] >> 4); }
  }
}

// code of stored channel c of a row's packed codes qr (both widths)
inline int32_t code_at(const uint8_t* qr, int bits, int64_t c) {
  if (bits == 8) return qr[c];
  const uint8_t b = qr[(c / BLK) * 16 + c % 16];
  return c % BLK >= 16 ? b >> 4 : b & 0xF;
}

// portable GEMV: y[m, n] = sum_g s[n, g] * dot(x[m, group g], q[n, group g]) + sum_g mins[n, g] * xs[m, g]
inline void rows_portable(const float* xf, int64_t M, int64_t K, const uint8_t* q, int bits, const float* s,
                   const float* mn, const float* xs, int64_t gs, int64_t n0, int64_t n1, int64_t N, float* y) {
  const int64_t G = K / gs, rowb = K * bits / 8;
  std::vector<float> wq(gs), acc(M);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = q + n * rowb;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t i = 0; i < gs; ++i) wq[i] = (float)code_at(qr, bits, g * gs + i);
      const float sg = s[n * G + g];
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xf + m * K + g * gs;
        float d = 0.f;
        for (int64_t i = 0; i < gs; ++i) d += xr[i] * wq[i];
        acc[m] += sg * d;
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      float a = acc[m];
      if (mn)
        for (int64_t g = 0; g < G; ++g) a += mn[n * G + g] * xs[m * G + g];
      y[m * N + n] = a;
    }
  }
}

#ifdef SGQ_AVX512
inline __m512i lut4() {  // bf16 bit patterns of the integers 0..15 (words 16..31 unused)
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    float f = (float)(i & 15);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    t[i] = (uint16_t)(u >> 16);  // exact: small integers have <= 8 significant bits
  }
  return _mm512_load_si512(t);
}

// 32 codes of a 4-bit block (16 bytes: low nibbles = channels 0..15, high = 16..31) as bf16
inline __m512bh unpack4(const uint8_t* p, __m512i lut) {
  const __m256i w16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(w16), _mm256_srli_epi16(w16, 4), 1);
  z = _mm512_and_si512(z, _mm512_set1_epi16(0x0F));
  return (__m512bh)_mm512_permutexvar_epi16(z, lut);
}

// 32 codes of an 8-bit block as bf16 (integers <= 255 are exact in bf16)
inline __m512bh unpack8(const uint8_t* p) {
  const __m256i raw = _mm256_loadu_si256((const __m256i*)p);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(raw)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(raw, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// M rows of x as P bf16 planes (xp[(p * M + m) * K + k]; P = 1: bf16 x, P = 3: float32 x split
// exactly into hi + mid + lo) against weight rows n0..n1. Per group: the planes' VDPBF16PS
// products (exact in float32) summed into t, then acc += scale * t; two accumulators per row
// (even / odd groups) hide the FMA latency; offsets folded in as mins . xs; one horizontal sum.
template <int M, int P, int BITS>
void rows_avx(const uint16_t* xp, int64_t K, const uint8_t* q, const float* s, const float* mn,
              const float* xs, int64_t gs, int64_t n0, int64_t n1, int64_t N, float* y) {
  const int64_t G = K / gs, rowb = K * BITS / 8, bpg = gs / BLK;
  const __m512i lut = lut4();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = q + n * rowb;
    const float* sr = s + n * G;
    __m512 a0[M], a1[M];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t kb = 0; gs < BLK && kb < K; kb += BLK) {  // group 16 (8 bits): two scales a block;
      // VDPBF16PS lane i sums channels 2i, 2i + 1, so lanes 0..7 hold the first group, 8..15 the second
      const __m512bh w = unpack8(qr + kb);
      const int64_t g = kb / gs;
      const __m512 sv = _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(sr[g]), _mm512_set1_ps(sr[g + 1]));
      for (int m = 0; m < M; ++m) {
        __m512 t = _mm512_setzero_ps();
        for (int p = 0; p < P; ++p) t = _mm512_dpbf16_ps(t, w, (__m512bh)_mm512_loadu_si512(xp + (p * M + m) * K + kb));
        if (g & 2) a1[m] = _mm512_fmadd_ps(t, sv, a1[m]);
        else a0[m] = _mm512_fmadd_ps(t, sv, a0[m]);
      }
    }
    for (int64_t g = 0; gs >= BLK && g < G; ++g) {
      __m512 t[M];
      for (int m = 0; m < M; ++m) t[m] = _mm512_setzero_ps();
      for (int64_t b = 0; b < bpg; ++b) {
        const int64_t kb = (g * bpg + b) * BLK;
        const __m512bh w = BITS == 4 ? unpack4(qr + kb / 2, lut) : unpack8(qr + kb);
        for (int m = 0; m < M; ++m)
          for (int p = 0; p < P; ++p)
            t[m] = _mm512_dpbf16_ps(t[m], w, (__m512bh)_mm512_loadu_si512(xp + (p * M + m) * K + kb));
      }
      const __m512 sv = _mm512_set1_ps(sr[g]);
      if (g & 1)
        for (int m = 0; m < M; ++m) a1[m] = _mm512_fmadd_ps(t[m], sv, a1[m]);
      else
        for (int m = 0; m < M; ++m) a0[m] = _mm512_fmadd_ps(t[m], sv, a0[m]);
    }
    if (mn) {
      const float* mr = mn + n * G;
      for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 k = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1);
        const __m512 mv = _mm512_maskz_loadu_ps(k, mr + g);
        for (int m = 0; m < M; ++m) a1[m] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, xs + m * G + g), a1[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
  }
}

#endif


// One quantized weight as the kernels read it (see quant_linear.py): codes [N, K * bits / 8],
// scales and optional mins [N, K / gs] float32, or float16 bits when `half` (the Q8 path only).
// `tiled`: codes, scales and mins interleaved in tiles of 16 rows (quant_tiles.h; the int8-activation
// path only).
struct QW {
  const uint8_t* q; const float* s; const float* mn; int bits; int64_t gs, N, K; bool half = false;
  bool tiled = false;
  const uint16_t* packed = nullptr;  // the AMX tile GEMM's B layout of this weight (quant_amx.h's pack_b), or none
};

// f(ST{}) with ST the scale storage of w: uint16_t (float16 bits, w.half) or float
template <typename F> inline void with_scale_type(const QW& w, F&& f) {
  if (w.half) f(uint16_t{});
  else f(float{});
}

inline float half_to_float(uint16_t h) { c10::Half v; v.x = h; return (float)v; }
inline float scale_at(const float* p, int64_t i) { return p[i]; }
inline float scale_at(const uint16_t* p, int64_t i) { return half_to_float(p[i]); }

// y [M, N] float32 = x [M, K] @ W_stored.T, float-exact path (see quant_cpu.py): xf is x as
// float32; xbf is x's bf16 bits when x is bf16 (one plane), nullptr for float32 x (three planes).
template <typename Par = AtPar>
void gemv_float(const QW& w, const float* xf, const uint16_t* xbf, int64_t M, float* y, const Par& par = Par{}) {
  const int64_t K = w.K, N = w.N, G = K / w.gs;
  if (M > 8) {  // blocks of 8 rows (the register tiles); the codes stream once per block
    std::vector<float> part(8 * N);
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t mb = std::min<int64_t>(8, M - m0);
      gemv_float(w, xf + m0 * K, xbf ? xbf + m0 * K : nullptr, mb, part.data(), par);
      std::memcpy(y + m0 * N, part.data(), sizeof(float) * mb * N);
    }
    return;
  }
  std::vector<float> xs(M * G);
  group_sums(xf, M, K, w.gs, xs.data());
  const int64_t grain = std::max<int64_t>(16, (int64_t)(1 << 16) / std::max<int64_t>(K, 1));
#ifdef SGQ_AVX512
  const int P = xbf ? 1 : 3;
  std::vector<uint16_t> planes(xbf ? 0 : P * M * K);
  if (!xbf) {  // float32 x = hi + mid + lo, each bf16 (round to nearest even), exact but for <= 2^-24 |x|
    for (int64_t i = 0; i < M * K; ++i) {
      float r = xf[i];
      for (int p = 0; p < 3; ++p) {
        const c10::BFloat16 b(r);
        planes[(p * M) * K + i] = b.x;
        r -= (float)b;
      }
    }
  }
  const uint16_t* xp = xbf ? xbf : planes.data();
  par(0, N, grain, [&](int64_t n0, int64_t n1) {
    with_bits(w.bits, [&](auto bits) {
      with_rows(M, [&](auto m) {
        constexpr int MM = decltype(m)::value, B = decltype(bits)::value;
        if (P == 1) rows_avx<MM, 1, B>(xp, K, w.q, w.s, w.mn, xs.data(), w.gs, n0, n1, N, y);
        else rows_avx<MM, 3, B>(xp, K, w.q, w.s, w.mn, xs.data(), w.gs, n0, n1, N, y);
      });
    });
  });
#else
  (void)xbf;
  par(0, N, grain, [&](int64_t n0, int64_t n1) {
    rows_portable(xf, M, K, w.q, w.bits, w.s, w.mn, xs.data(), w.gs, n0, n1, N, y);
  });
#endif
}

#include "quant_q8.h"

}  // namespace sglite_quant
