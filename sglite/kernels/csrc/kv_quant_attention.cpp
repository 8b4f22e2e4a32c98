// Fused decode attention over an int8 / int4 KIVI-quantized KV pool on CPU
// (see sglite/kernels/kv_quant_cpu.py for the contract and sglite/kernels/kv_quant.py for the layout).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include "thread_pool.h"
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>
#include "scalar_math.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include "avx512_math.h"
#define SGL_AVX512 1
#endif

namespace {

constexpr int kMaxD = 256;

using sglite_scalar::widen;
#if defined(__F16C__)
}  // namespace
#include <immintrin.h>
namespace {
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
#endif

struct Job {
  const uint8_t *kd, *vd; int64_t ks0, ks1, vs0, vs1;  // codes [S, Hkv, Dq], strides in bytes
  const uint16_t *kscale, *vscale; int64_t vss0, vss1;  // [S/G, Hkv, 2, D], [S, Hkv, 2] float16 (vscale strides)
  const void *rk, *rv; bool res_bf16;                   // residual [R, G, Hkv, D]
  int64_t S, R;
  const void* q; bool q_bf16; int Hq, Hkv; int64_t qs0, qs1;
  void* out;
  const int32_t* rt; int64_t rts0; const int64_t *rows, *lens, *sealed;
  int G, D, bits, group;
  float scale;
};

// codes of one row -> float32 x[0..D) (int8: one code per byte; int4: split halves)
inline void unpack_row(const uint8_t* p, int D, int bits, float* x) {
#ifdef SGL_AVX512
  if (bits == 8 && D % 16 == 0) {
    for (int c = 0; c < D; c += 16)
      _mm512_storeu_ps(x + c, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + c)))));
    return;
  }
  if (bits == 4 && D % 32 == 0) {
    const int h = D / 2;
    const __m512i m = _mm512_set1_epi32(0xF);
    for (int c = 0; c < h; c += 16) {
      __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + c)));
      _mm512_storeu_ps(x + c, _mm512_cvtepi32_ps(_mm512_and_si512(w, m)));
      _mm512_storeu_ps(x + h + c, _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4)));
    }
    return;
  }
#endif
  if (bits == 8) {
    for (int d = 0; d < D; ++d) x[d] = (float)p[d];
  } else {
    const int h = D / 2;
    for (int d = 0; d < h; ++d) { x[d] = (float)(p[d] & 0xF); x[h + d] = (float)(p[d] >> 4); }
  }
}

inline float dot(const float* a, const float* b, int D) {
#ifdef SGL_AVX512
  if (D % 16 == 0) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (int c = 16; c < D; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  return sglite_scalar::dot(a, b, D);
}

inline void axpy(float w, const float* x, float* y, int D) {
#ifdef SGL_AVX512
  if (D % 16 == 0) {
    const __m512 wv = _mm512_set1_ps(w);
    for (int c = 0; c < D; c += 16) _mm512_storeu_ps(y + c, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + c), _mm512_loadu_ps(y + c)));
    return;
  }
#endif
  sglite_scalar::axpy(w, x, y, D);
}

inline void load_res(const Job& j, const void* base, int64_t row, int64_t t, int h, float* x) {
  const int64_t off = ((row * j.group + t % j.group) * j.Hkv + h) * (int64_t)j.D;
  if (j.res_bf16) { const uint16_t* p = (const uint16_t*)base + off; for (int d = 0; d < j.D; ++d) x[d] = widen(p[d]); }
  else std::memcpy(x, (const float*)base + off, sizeof(float) * j.D);
}

// In place: row of L scores -> exp(s - max); returns their sum.
inline float softmax_row(float* x, int64_t L) {
  float m = -INFINITY, sum = 0;
  for (int64_t t = 0; t < L; ++t) m = std::max(m, x[t]);
  int64_t t = 0;
#ifdef SGL_AVX512
  __m512 vm = _mm512_set1_ps(m), vs = _mm512_setzero_ps();
  for (; t + 16 <= L; t += 16) {
    __m512 e = sglite_simd::exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(x + t), vm));
    _mm512_storeu_ps(x + t, e);
    vs = _mm512_add_ps(vs, e);
  }
  sum = _mm512_reduce_add_ps(vs);
#endif
  for (; t < L; ++t) { x[t] = std::exp(x[t] - m); sum += x[t]; }
  return sum;
}


#ifdef SGL_AVX512
// Register-tiled paths for D = 16 * NC (NC 4 or 8) and G <= 8 query heads per KV head.
template <int NC, int BITS> inline void load_codes(const uint8_t* p, __m512* out) {
  if (BITS == 8) {
    for (int c = 0; c < NC; ++c)
      out[c] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * c))));
  } else {
    const __m512i m = _mm512_set1_epi32(0xF);
    for (int c = 0; c < NC / 2; ++c) {
      __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * c)));
      out[c] = _mm512_cvtepi32_ps(_mm512_and_si512(w, m));
      out[c + NC / 2] = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
    }
  }
}

// Row loaders for the tiled loops: codes of a sealed row, or a residual row (float32 / bfloat16).
template <int NC, int BITS> struct CodeRows {
  const uint8_t* base; int64_t stride;
  inline void operator()(int64_t i, __m512* out) const {
    __builtin_prefetch(base + (i + 8) * stride);
    load_codes<NC, BITS>(base + i * stride, out);
  }
};
template <int NC> struct F32Rows {
  const float* base; int64_t stride;
  inline void operator()(int64_t i, __m512* out) const {
    for (int c = 0; c < NC; ++c) out[c] = _mm512_loadu_ps(base + i * stride + 16 * c);
  }
};
template <int NC> struct BF16Rows {
  const uint16_t* base; int64_t stride;
  inline void operator()(int64_t i, __m512* out) const {
    for (int c = 0; c < NC; ++c)
      out[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(base + i * stride + 16 * c))), 16));
  }
};

inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  __m512 x = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(x);
}

// sc[g * L + t] for t in [t0, t1) of one sealed group: (q*s) . codes + kz[g]; rows contiguous.
template <int NC, int G, typename Rows>
void rows_scores(const Rows& rows, int64_t n, const float* qs, const float* kz, float* sc, int64_t L, int64_t t0) {
  __m512 qv[G][NC], kv[NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) qv[g][c] = _mm512_loadu_ps(qs + g * NC * 16 + 16 * c);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    __m512 acc[G][4];
    for (int u = 0; u < 4; ++u) {
      rows(i + u, kv);
      for (int g = 0; g < G; ++g) {
        acc[g][u] = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < NC; ++c) acc[g][u] = _mm512_fmadd_ps(qv[g][c], kv[c], acc[g][u]);
      }
    }
    for (int g = 0; g < G; ++g)
      _mm_storeu_ps(sc + g * L + t0 + i, _mm_add_ps(hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), _mm_set1_ps(kz[g])));
  }
  for (; i < n; ++i) {
    rows(i, kv);
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(qv[g][c], kv[c], a);
      sc[g * L + t0 + i] = _mm512_reduce_add_ps(a) + kz[g];
    }
  }
}

// acc[g * D + d] += sum_t p[g * L + t] * sv_t * codes_t[d]; zsum[g] += sum_t p * zv_t, for sealed t < Ls.
template <int NC, int G, int BITS>
void sealed_values(const uint8_t* vd, int64_t vs0, int64_t vs1, const uint16_t* vscale, int64_t vss0, int64_t vss1, int h,
                   const int32_t* slots, int64_t Ls, const float* p, int64_t L, float* acc, float* zsum) {
  __m512 a[G][NC], vv[NC];
  float z[G];
  for (int g = 0; g < G; ++g) { z[g] = 0.f; for (int c = 0; c < NC; ++c) a[g][c] = _mm512_setzero_ps(); }
  for (int64_t t = 0; t < Ls; ++t) {
    const int64_t s = slots[t];
    if (t + 8 < Ls) {
      __builtin_prefetch(vd + slots[t + 8] * vs0 + h * vs1);
      __builtin_prefetch(vscale + slots[t + 8] * vss0 + h * vss1);
    }
    const uint16_t* sc = vscale + s * vss0 + h * vss1;
    const float sv = half_to_float(sc[0]), zv = half_to_float(sc[1]);
    load_codes<NC, BITS>(vd + s * vs0 + h * vs1, vv);
    for (int g = 0; g < G; ++g) {
      const float w = p[g * L + t];
      const __m512 wv = _mm512_set1_ps(w * sv);
      for (int c = 0; c < NC; ++c) a[g][c] = _mm512_fmadd_ps(wv, vv[c], a[g][c]);
      z[g] += w * zv;
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * NC * 16 + 16 * c, a[g][c]);
    zsum[g] = z[g];
  }
}

template <int NC, int G, int BITS>
void group_scores(const uint8_t* k0, int64_t stride, int64_t n, const float* qs, const float* kz, float* sc, int64_t L, int64_t t0) {
  rows_scores<NC, G>(CodeRows<NC, BITS>{k0, stride}, n, qs, kz, sc, L, t0);
}

// Residual positions [t0, L) of one (row, head): scores (kz = 0) and acc += p * row.
template <int NC, int G, typename Rows>
void rows_values(const Rows& rows, int64_t n, const float* p, int64_t L, int64_t t0, float* acc) {
  __m512 a[G][NC], vv[NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) a[g][c] = _mm512_loadu_ps(acc + g * NC * 16 + 16 * c);
  for (int64_t i = 0; i < n; ++i) {
    rows(i, vv);
    for (int g = 0; g < G; ++g) {
      const __m512 wv = _mm512_set1_ps(p[g * L + t0 + i]);
      for (int c = 0; c < NC; ++c) a[g][c] = _mm512_fmadd_ps(wv, vv[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * NC * 16 + 16 * c, a[g][c]);
}

// The residual rows of positions [t0, L) are rows t % group of the request's window: contiguous
// runs (the window wraps at most once), stride Hkv * D elements.
template <int NC, int G>
void residual_pass(const void* base, bool bf16, int64_t row, int group, int Hkv, int h, int64_t t0, int64_t L,
                   bool scores, const float* qf, float* sc, float* acc) {
  const int D = NC * 16;
  const float zero[G] = {};
  for (int64_t t = t0; t < L;) {
    const int64_t r = t % group, n = std::min<int64_t>(L - t, group - r);
    const int64_t off = ((row * group + r) * Hkv + h) * (int64_t)D, stride = (int64_t)Hkv * D;
    if (bf16) {
      BF16Rows<NC> rows{(const uint16_t*)base + off, stride};
      if (scores) rows_scores<NC, G>(rows, n, qf, zero, sc, L, t); else rows_values<NC, G>(rows, n, sc, L, t, acc);
    } else {
      F32Rows<NC> rows{(const float*)base + off, stride};
      if (scores) rows_scores<NC, G>(rows, n, qf, zero, sc, L, t); else rows_values<NC, G>(rows, n, sc, L, t, acc);
    }
    t += n;
  }
}

struct TiledQ {
  void (*scores)(const uint8_t*, int64_t, int64_t, const float*, const float*, float*, int64_t, int64_t);
  void (*values)(const uint8_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, int, const int32_t*, int64_t, const float*, int64_t, float*, float*);
  void (*residual)(const void*, bool, int64_t, int, int, int, int64_t, int64_t, bool, const float*, float*, float*);
};

template <int NC, int BITS, int... Gs> TiledQ pick_q(int G, std::integer_sequence<int, Gs...>) {
  TiledQ r{nullptr, nullptr, nullptr};
  ((G == Gs + 1 ? (void)(r = TiledQ{&group_scores<NC, Gs + 1, BITS>, &sealed_values<NC, Gs + 1, BITS>,
                                    &residual_pass<NC, Gs + 1>}) : (void)0), ...);
  return r;
}

TiledQ pick_tiled_q(int D, int G, int bits) {
  auto gs = std::make_integer_sequence<int, 8>{};
  if (D == 64) return bits == 8 ? pick_q<4, 8>(G, gs) : pick_q<4, 4>(G, gs);
  if (D == 128) return bits == 8 ? pick_q<8, 8>(G, gs) : pick_q<8, 4>(G, gs);
  return TiledQ{nullptr, nullptr, nullptr};
}
#else
struct TiledQ { void *scores, *values, *residual; };
TiledQ pick_tiled_q(int, int, int) { return TiledQ{nullptr, nullptr, nullptr}; }
#endif

struct Scratch { std::vector<float> qf, qs, sc, acc, row, kz; };

bool attend(const Job& j, const TiledQ& tq, int64_t b, int h, Scratch& w) {
  const int G = j.G, D = j.D;
  const int64_t L = j.lens[b], row = j.rows[b];
  const int64_t Ls = std::min<int64_t>(L, std::max<int64_t>(0, j.sealed[b]));
  const int32_t* slots = j.rt + row * j.rts0;
  for (int64_t t = 0; t < Ls; ++t)
    if (slots[t] < 0 || slots[t] >= j.S) return false;
  float* qf = w.qf.data(); float* qs = w.qs.data(); float* sc = w.sc.data(); float* acc = w.acc.data();
  float* x = w.row.data(); float* kz = w.kz.data();
  for (int g = 0; g < G; ++g) {
    const int64_t off = b * j.qs0 + (int64_t)(h * G + g) * j.qs1;
    for (int d = 0; d < D; ++d)
      qf[g * D + d] = (j.q_bf16 ? widen(((const uint16_t*)j.q)[off + d]) : ((const float*)j.q)[off + d]) * j.scale;
  }
  // pass 1: scores. Sealed groups: (q*s) . codes + q . z, the group's G slots contiguous.
  for (int64_t t0 = 0; t0 < Ls; t0 += j.group) {
    const int64_t s0 = slots[t0];
    if (s0 % j.group != t0 % j.group) return false;  // pages not aligned to positions
    const uint16_t* ksc = j.kscale + ((s0 / j.group) * j.Hkv + h) * 2 * (int64_t)D;  // [2, D]
    for (int d = 0; d < D; ++d) x[d] = half_to_float(ksc[d]);
    for (int g = 0; g < G; ++g) {
      for (int d = 0; d < D; ++d) qs[g * D + d] = qf[g * D + d] * x[d];
    }
    for (int d = 0; d < D; ++d) x[d] = half_to_float(ksc[D + d]);
    for (int g = 0; g < G; ++g) kz[g] = dot(qf + g * D, x, D);
    const int64_t t1 = std::min<int64_t>(Ls, t0 + j.group);
#ifdef SGL_AVX512
    if (tq.scores) { tq.scores(j.kd + s0 * j.ks0 + h * j.ks1, j.ks0, t1 - t0, qs, kz, sc, L, t0); continue; }
#endif
    for (int64_t t = t0; t < t1; ++t) {
      unpack_row(j.kd + (s0 + (t - t0)) * j.ks0 + h * j.ks1, D, j.bits, x);
      for (int g = 0; g < G; ++g) sc[g * L + t] = dot(qs + g * D, x, D) + kz[g];
    }
  }
#ifdef SGL_AVX512
  if (tq.residual) tq.residual(j.rk, j.res_bf16, row, j.group, j.Hkv, h, Ls, L, true, qf, sc, acc); else
#endif
  for (int64_t t = Ls; t < L; ++t) {
    load_res(j, j.rk, row, t, h, x);
    for (int g = 0; g < G; ++g) sc[g * L + t] = dot(qf + g * D, x, D);
  }
  for (int g = 0; g < G; ++g) kz[g] = 1.f / softmax_row(sc + g * L, L);
  // pass 2: values. Sealed tokens: acc += (p*sv) * codes, zsum += p*zv.
  std::fill(acc, acc + G * D, 0.f);
  float zsum[32] = {0};
#ifdef SGL_AVX512
  if (tq.values) tq.values(j.vd, j.vs0, j.vs1, j.vscale, j.vss0, j.vss1, h, slots, Ls, sc, L, acc, zsum); else
#endif
  for (int64_t t = 0; t < Ls; ++t) {
    const int64_t s = slots[t];
    const uint16_t* vsc = j.vscale + s * j.vss0 + h * j.vss1;
    const float sv = half_to_float(vsc[0]), zv = half_to_float(vsc[1]);
    unpack_row(j.vd + s * j.vs0 + h * j.vs1, D, j.bits, x);
    for (int g = 0; g < G; ++g) {
      const float p = sc[g * L + t];
      axpy(p * sv, x, acc + g * D, D);
      zsum[g] += p * zv;
    }
  }
#ifdef SGL_AVX512
  if (tq.residual) tq.residual(j.rv, j.res_bf16, row, j.group, j.Hkv, h, Ls, L, false, qf, sc, acc); else
#endif
  for (int64_t t = Ls; t < L; ++t) {
    load_res(j, j.rv, row, t, h, x);
    for (int g = 0; g < G; ++g) axpy(sc[g * L + t], x, acc + g * D, D);
  }
  for (int g = 0; g < G; ++g) {
    const float inv = kz[g];
    const int64_t off = (b * (int64_t)j.Hq + h * G + g) * D;
    const float* ag = acc + g * D;
    if (j.q_bf16) {
      c10::BFloat16* o = (c10::BFloat16*)j.out + off;
      for (int d = 0; d < D; ++d) o[d] = c10::BFloat16((ag[d] + zsum[g]) * inv);
    } else {
      float* o = (float*)j.out + off;
      for (int d = 0; d < D; ++d) o[d] = (ag[d] + zsum[g]) * inv;
    }
  }
  return true;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kd, const at::Tensor& vd,
                            const at::Tensor& kscale, const at::Tensor& vscale, const at::Tensor& rk,
                            const at::Tensor& rv, const at::Tensor& rt, const at::Tensor& rows,
                            const at::Tensor& lens, const at::Tensor& sealed, double sm_scale,
                            int64_t bits, int64_t group) {
  TORCH_CHECK_VALUE(q.dim() == 3 && kd.dim() == 3 && vd.dim() == 3, "decode_attention: q, k_data, v_data must be 3-D");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = kd.size(1), S = kd.size(0);
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "decode_attention: bits must be 8 or 4");
  TORCH_CHECK_VALUE(kd.size(2) == (bits == 8 ? D : D / 2) && vd.sizes() == kd.sizes() && (bits == 8 || D % 2 == 0),
                    "decode_attention: codes must be [S, Hkv, D] (int8) or [S, Hkv, D/2] (int4)");
  TORCH_CHECK_VALUE(Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= 32, "decode_attention: Hq=", Hq, " must be a multiple of Hkv=", Hkv, " (<= 32 per group)");
  TORCH_CHECK_VALUE(D >= 1 && D <= kMaxD, "decode_attention: head dim D=", D, " outside [1, ", kMaxD, "]");
  TORCH_CHECK_VALUE(group >= 1 && S % group == 0, "decode_attention: group must divide the slot count");
  TORCH_CHECK_VALUE(kd.scalar_type() == at::kByte && vd.scalar_type() == at::kByte && kd.stride(2) == 1 && vd.stride(2) == 1,
                    "decode_attention: codes must be uint8 with unit stride along D");
  TORCH_CHECK_VALUE(kscale.scalar_type() == at::kHalf && kscale.is_contiguous() && kscale.dim() == 4
                    && kscale.size(0) == S / group && kscale.size(1) == Hkv && kscale.size(2) == 2 && kscale.size(3) == D,
                    "decode_attention: k_scale must be contiguous float16 [S/G, Hkv, 2, D]");
  TORCH_CHECK_VALUE(vscale.scalar_type() == at::kHalf && vscale.stride(2) == 1 && vscale.dim() == 3
                    && vscale.size(0) == S && vscale.size(1) == Hkv && vscale.size(2) == 2,
                    "decode_attention: v_scale must be float16 [S, Hkv, 2] with unit stride along the last dim");
  TORCH_CHECK_VALUE(rk.dim() == 4 && rk.sizes() == rv.sizes() && rk.size(1) == group && rk.size(2) == Hkv && rk.size(3) == D
                    && rk.is_contiguous() && rv.is_contiguous() && rk.scalar_type() == rv.scalar_type()
                    && (rk.scalar_type() == at::kFloat || rk.scalar_type() == at::kBFloat16),
                    "decode_attention: residual windows must be contiguous float32/bfloat16 [R, G, Hkv, D]");
  TORCH_CHECK_VALUE(q.stride(2) == 1 && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
                    "decode_attention: q must be float32/bfloat16 with unit stride along D");
  TORCH_CHECK_VALUE(rt.dim() == 2 && rt.scalar_type() == at::kInt && rt.stride(1) == 1, "decode_attention: req_to_token must be int32 [R, Lmax] with unit stride");
  for (const at::Tensor* t : {&rows, &lens, &sealed})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == B,
                      "decode_attention: req_pool_indices, seq_lens and sealed_lens must be contiguous int64 [B]");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  int64_t max_len = 1;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(lp[b] >= 1 && lp[b] <= rt.size(1), "decode_attention: seq_lens[", b, "]=", lp[b], " outside [1, ", rt.size(1), "]");
    TORCH_CHECK_INDEX(rp[b] >= 0 && rp[b] < rt.size(0) && rp[b] < rk.size(0), "decode_attention: req_pool_indices[", b, "]=", rp[b], " outside the table");
    max_len = std::max(max_len, lp[b]);
  }
  at::Tensor out = at::empty({B, Hq, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (B == 0) return out;
  const int G = (int)(Hq / Hkv);
  Job j{kd.data_ptr<uint8_t>(), vd.data_ptr<uint8_t>(), kd.stride(0), kd.stride(1), vd.stride(0), vd.stride(1),
        (const uint16_t*)kscale.data_ptr(), (const uint16_t*)vscale.data_ptr(), vscale.stride(0), vscale.stride(1),
        rk.data_ptr(), rv.data_ptr(), rk.scalar_type() == at::kBFloat16, S, rk.size(0),
        q.data_ptr(), q.scalar_type() == at::kBFloat16, (int)Hq, (int)Hkv, q.stride(0), q.stride(1), out.data_ptr(),
        rt.data_ptr<int32_t>(), rt.stride(0), rp, lp, sealed.data_ptr<int64_t>(),
        G, (int)D, (int)bits, (int)group, (float)sm_scale};
  std::atomic<bool> bad{false};
  const TiledQ tq = pick_tiled_q((int)D, G, (int)bits);
  sglite_pool::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    w.qf.resize(G * D); w.qs.resize(G * D); w.sc.resize(G * max_len); w.acc.resize(G * D); w.row.resize(D + 16); w.kz.resize(G);
    for (int64_t i = begin; i < end && !bad.load(std::memory_order_relaxed); ++i)
      if (!attend(j, tq, i / Hkv, (int)(i % Hkv), w)) bad = true;
  });
  TORCH_CHECK_INDEX(!bad, "decode_attention: req_to_token holds a slot outside the pool [0, ", S, ") or not aligned to its position");
  return out;
}

}  // namespace

// kv_dequant.h reads the pool with unpack_row and half_to_float above: spliced after them
#include "kv_dequant.h"
#include "kv_seal.h"

TORCH_LIBRARY(sglite_kv_quant, m) {
  m.def("decode_attention(Tensor q, Tensor k_data, Tensor v_data, Tensor k_scale, Tensor v_scale, Tensor res_k, "
        "Tensor res_v, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor sealed_lens, "
        "float sm_scale, int bits, int group) -> Tensor");
  m.def("dequant_groups(Tensor k_data, Tensor v_data, Tensor k_scale, Tensor v_scale, Tensor gids, int bits, "
        "int group, bool bf16_out) -> (Tensor, Tensor)");
  m.def("seal_groups(Tensor(a!) k_data, Tensor(b!) v_data, Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor k_blocks, "
        "Tensor v_blocks, Tensor gids, int bits) -> ()");
  m.def("dequant_fp8(Tensor k_data, Tensor v_data, Tensor k_scale, Tensor v_scale, Tensor slots, bool bf16_out) "
        "-> (Tensor, Tensor)");
  m.def("store_fp8(Tensor(a!) k_data, Tensor(b!) v_data, Tensor k_scale, Tensor v_scale, Tensor k, Tensor v, "
        "Tensor slots) -> ()");
  m.def("store_groups(Tensor(a!) k_data, Tensor(b!) v_data, Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor(e!) res_k, "
        "Tensor(f!) res_v, Tensor k, Tensor v, Tensor tok_rows, Tensor positions, Tensor row_len, Tensor slots, "
        "int bits) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sglite_kv_quant, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("dequant_groups", &sglite_kv_dequant::dequant_groups);
  m.impl("seal_groups", &sglite_kv_seal::seal_groups);
  m.impl("store_groups", &sglite_kv_seal::store_groups);
  m.impl("dequant_fp8", &sglite_kv_dequant::dequant_fp8);
  m.impl("store_fp8", &sglite_kv_seal::store_fp8);
}
