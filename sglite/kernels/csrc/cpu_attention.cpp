// Fused paged decode attention on CPU (see sglite/kernels/cpu_attention.py for the contract).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include "thread_pool.h"
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <memory>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include "scalar_math.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include "avx512_math.h"
#define SGL_AVX512 1
#endif
#include "amx_attention.h"

namespace {

constexpr int kMaxD = 256, kPrefetch = 16;

using sglite_scalar::widen;

// Everything one (request, KV head) task reads; strides in elements.
template <typename T> struct Job {
  const T *k, *v; int64_t ks0, ks1, vs0, vs1, S;
  const void* q; bool q_bf16; int Hq; int64_t qs0, qs1;
  void* out; bool out_bf16;
  const int32_t* rt; int64_t rts0; const int64_t *rows, *lens;
  int G, D, Dp; float scale;
  int64_t window; float softcap;  // window > 0: the last `window` keys only; softcap > 0: cap * tanh(s / cap)
};

template <typename T> inline void prefetch_row(const T* p, int D) {
  for (int i = 0; i < D * (int)sizeof(T); i += 64) __builtin_prefetch((const char*)p + i);
}

#ifdef SGL_AVX512
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
// float8 e4m3fn bits -> float32: the 7 low bits shifted into a float16's exponent and mantissa
// (e4m3's exponent bias 7 against float16's 15: a factor 2^-8, undone by the product, exact), so
// subnormals convert exactly too; used for fp8_e4m3 pools (NaN codes are not stored: the store clamps)
inline __m512 load16(const uint8_t* p, __mmask16 m) {
  const __m512i x = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p));
  const __m512i h = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 8),
                                    _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)), _mm512_set1_ps(256.0f));
}
using sglite_simd::exp_nonpos;

template <int NC, typename T> inline void load_row(const T* p, int D, __m512* out) {
  for (int c = 0; c < NC; ++c) {
    const int rem = D - 16 * c;
    out[c] = load16(p + 16 * c, rem >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << rem) - 1));
  }
}

// The four horizontal sums of a..d, as one vector [sum a, sum b, sum c, sum d].
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  __m512 x = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));  // per 128-bit lane
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(x);
}

// Register-tiled variants for compile-time NC = Dp / 16 and G: q, score and output accumulators
// stay in registers; scores of 4 tokens share one horizontal reduction.
template <typename T, int NC, int G>
void scores_tiled(const Job<T>& j, const int32_t* slots, int64_t L, int h, const float* qf, float* sc) {
  __m512 qv[G][NC], kv[NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) qv[g][c] = _mm512_loadu_ps(qf + g * j.Dp + 16 * c);
  const T* kh = j.k + h * j.ks1;
  int64_t t = 0;
  for (; t + 4 <= L; t += 4) {
    __m512 acc[G][4];
    for (int u = 0; u < 4; ++u) {
      if (t + u + kPrefetch < L) prefetch_row(kh + slots[t + u + kPrefetch] * j.ks0, j.D);
      load_row<NC>(kh + slots[t + u] * j.ks0, j.D, kv);
      for (int g = 0; g < G; ++g) {
        acc[g][u] = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < NC; ++c) acc[g][u] = _mm512_fmadd_ps(qv[g][c], kv[c], acc[g][u]);
      }
    }
    for (int g = 0; g < G; ++g) _mm_storeu_ps(sc + g * L + t, hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
  }
  for (; t < L; ++t) {
    load_row<NC>(kh + slots[t] * j.ks0, j.D, kv);
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(qv[g][c], kv[c], a);
      sc[g * L + t] = _mm512_reduce_add_ps(a);
    }
  }
}

template <typename T, int NC, int G>
void values_tiled(const Job<T>& j, const int32_t* slots, int64_t L, int h, float* p, float* out) {
  __m512 acc[G][NC], vv[NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
  const T* vh = j.v + h * j.vs1;
  for (int64_t t = 0; t < L; ++t) {
    if (t + kPrefetch < L) prefetch_row(vh + slots[t + kPrefetch] * j.vs0, j.D);
    load_row<NC>(vh + slots[t] * j.vs0, j.D, vv);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * L + t]);
      for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + g * j.Dp + 16 * c, acc[g][c]);
}

template <typename T> struct Tiled {
  void (*scores)(const Job<T>&, const int32_t*, int64_t, int, const float*, float*);
  void (*values)(const Job<T>&, const int32_t*, int64_t, int, float*, float*);  // p: the caller's scratch, may be consumed
};

template <typename T, int NC, int... Gs> Tiled<T> pick_g(int G, std::integer_sequence<int, Gs...>) {
  Tiled<T> r{nullptr, nullptr};
  ((G == Gs + 1 ? (void)(r = Tiled<T>{&scores_tiled<T, NC, Gs + 1>, &values_tiled<T, NC, Gs + 1>}) : (void)0), ...);
  return r;
}

#include "decode_bf16dot.h"

// Tiled kernels for D in (48, 64] or (112, 128] and G <= 8 (bf16 pools on AVX512-BF16: the
// VDPBF16PS ones); {nullptr, nullptr} otherwise.
template <typename T> Tiled<T> pick_tiled(int Dp, int G) {
#ifdef SGL_BF16DOT
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (Dp == 64) return pick_bf16<2>(G, std::make_integer_sequence<int, 8>{});
    if (Dp == 128) return pick_bf16<4>(G, std::make_integer_sequence<int, 8>{});
  }
#endif
  if (Dp == 64) return pick_g<T, 4>(G, std::make_integer_sequence<int, 8>{});
  if (Dp == 128) return pick_g<T, 8>(G, std::make_integer_sequence<int, 8>{});
  return Tiled<T>{nullptr, nullptr};
}
#else
template <typename T> struct Tiled { void *scores, *values; };
template <typename T> Tiled<T> pick_tiled(int, int) { return Tiled<T>{nullptr, nullptr}; }
#endif

// Scores of the G heads against K rows 0..L-1: sc[g * L + t] (q pre-scaled, qf padded to Dp).
template <typename T>
void scores(const Job<T>& j, const int32_t* slots, int64_t L, int h, const float* qf, float* sc) {
  const int G = j.G, D = j.D;
  for (int64_t t = 0; t < L; ++t) {
    const int64_t s = slots[t];
    if (t + kPrefetch < L) prefetch_row(j.k + slots[t + kPrefetch] * j.ks0 + h * j.ks1, D);
    const T* kr = j.k + s * j.ks0 + h * j.ks1;
#ifdef SGL_AVX512
    const int NC = j.Dp / 16;
    __m512 kv[kMaxD / 16];
    for (int c = 0; c < NC; ++c) {
      int rem = D - 16 * c;
      kv[c] = load16(kr + 16 * c, rem >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << rem) - 1));
    }
    for (int g = 0; g < G; ++g) {
      const float* qg = qf + g * j.Dp;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
      for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kv[c], acc);
      sc[g * L + t] = _mm512_reduce_add_ps(acc);
    }
#else
    float kf[kMaxD];
    for (int d = 0; d < D; ++d) kf[d] = widen(kr[d]);
    for (int g = 0; g < G; ++g) sc[g * L + t] = sglite_scalar::dot(qf + g * j.Dp, kf, D);
#endif
  }
}

// In place: row of L scores -> unnormalised weights exp(s - max); returns their sum (the max in *mx).
inline float softmax_row(float* x, int64_t L, float* mx) {
  float m = -INFINITY, sum = 0;
#ifdef SGL_AVX512
  __m512 vmx = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= L; t += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(x + t));
  const __mmask16 tail = (__mmask16)((1u << (L - t)) - 1);
  if (tail) vmx = _mm512_mask_max_ps(vmx, tail, vmx, _mm512_maskz_loadu_ps(tail, x + t));
  m = _mm512_reduce_max_ps(vmx);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vs = _mm512_setzero_ps();
  for (t = 0; t + 16 <= L; t += 16) {
    const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(x + t), vm));
    _mm512_storeu_ps(x + t, e);
    vs = _mm512_add_ps(vs, e);
  }
  if (tail) {  // the last L % 16 scores, masked (no scalar exp)
    const __m512 e = _mm512_maskz_mov_ps(tail, exp_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + t), vm)));
    _mm512_mask_storeu_ps(x + t, tail, e);
    vs = _mm512_add_ps(vs, e);
  }
  sum = _mm512_reduce_add_ps(vs);
#else
  for (int64_t t = 0; t < L; ++t) m = std::max(m, x[t]);
  for (int64_t t = 0; t < L; ++t) { x[t] = std::exp(x[t] - m); sum += x[t]; }
#endif
  *mx = m;
  return sum;
}

// acc[g * Dp + d] = sum_t p[g * L + t] * V[t, d]
template <typename T>
void weighted_values(const Job<T>& j, const int32_t* slots, int64_t L, int h, float* p, float* acc) {
  const int G = j.G, D = j.D, Dp = j.Dp;
  std::fill(acc, acc + G * Dp, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    if (t + kPrefetch < L) prefetch_row(j.v + slots[t + kPrefetch] * j.vs0 + h * j.vs1, D);
    const T* vr = j.v + (int64_t)slots[t] * j.vs0 + h * j.vs1;
#ifdef SGL_AVX512
    const int NC = Dp / 16;
    __m512 vv[kMaxD / 16];
    for (int c = 0; c < NC; ++c) {
      int rem = D - 16 * c;
      vv[c] = load16(vr + 16 * c, rem >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << rem) - 1));
    }
    for (int g = 0; g < G; ++g) {
      __m512 w = _mm512_set1_ps(p[g * L + t]);
      float* ag = acc + g * Dp;
      for (int c = 0; c < NC; ++c)
        _mm512_storeu_ps(ag + 16 * c, _mm512_fmadd_ps(w, vv[c], _mm512_loadu_ps(ag + 16 * c)));
    }
#else
    float vf[kMaxD];
    for (int d = 0; d < D; ++d) vf[d] = widen(vr[d]);
    for (int g = 0; g < G; ++g) sglite_scalar::axpy(p[g * L + t], vf, acc + g * Dp, D);
#endif
  }
}

// The shared-prefix pass's partial result for one (row, KV head) task (decode_cascade.h): for head
// g of the group, the unnormalised output acc[g * ld .. + D), the running max m[g] (natural-log
// units) and sum l[g].
struct Prefix { const float* acc; int64_t ld; const float* m; const float* l; };

// Keys [first0, len) of row b (first0 > 0: keys [0, first0) were attended by the shared-prefix
// pass, whose partials for the task are `pre`; merged here: o = (a1 e^(m1 - m) + a2 e^(m2 - m)) /
// (l1 e^(m1 - m) + l2 e^(m2 - m)), m = max(m1, m2)). pre == nullptr: the whole row.
template <typename T>
bool attend(const Job<T>& j, const Tiled<T>& tiled, int64_t b, int h, float* qf, float* sc, float* acc,
            int64_t first0 = 0, const Prefix* pre = nullptr) {
  const int G = j.G, D = j.D, Dp = j.Dp;
  const int64_t len = j.lens[b];
  const int64_t first = std::max(first0, (j.window > 0 && len > j.window) ? len - j.window : (int64_t)0);  // sliding window
  const int64_t L = len - first;
  const int32_t* slots = j.rt + j.rows[b] * j.rts0 + first;
  for (int g = 0; g < G; ++g) {
    const int64_t off = b * j.qs0 + (int64_t)(h * G + g) * j.qs1;
#ifdef SGL_AVX512
    const __m512 sc16 = _mm512_set1_ps(j.scale);
    for (int d = 0; d < Dp; d += 16) {  // the same products as the scalar loop, zero past D
      const int rem = D - d;
      const __mmask16 m = rem >= 16 ? (__mmask16)0xFFFF : (rem <= 0 ? (__mmask16)0 : (__mmask16)((1u << rem) - 1));
      const __m512 x = j.q_bf16 ? load16((const uint16_t*)j.q + off + d, m) : load16((const float*)j.q + off + d, m);
      _mm512_storeu_ps(qf + g * Dp + d, _mm512_mul_ps(x, sc16));
    }
#else
    for (int d = 0; d < Dp; ++d) {
      float x = 0.f;
      if (d < D) x = j.q_bf16 ? widen(((const uint16_t*)j.q)[off + d]) : ((const float*)j.q)[off + d];
      qf[g * Dp + d] = x * j.scale;
    }
#endif
  }
  for (int64_t t = 0; t < L; ++t)
    if (slots[t] < 0 || slots[t] >= j.S) return false;
#ifdef SGL_AVX512
  if (tiled.scores) tiled.scores(j, slots, L, h, qf, sc); else
#endif
  scores(j, slots, L, h, qf, sc);
  if (j.softcap > 0.f) {  // logit soft-capping on the scaled scores (Gemma 2)
    const float cap = j.softcap, inv_cap = 1.f / j.softcap;
    for (int64_t i = 0; i < (int64_t)G * L; ++i) sc[i] = cap * std::tanh(sc[i] * inv_cap);
  }
  for (int g = 0; g < G; ++g) {
    float mx;
    acc[G * Dp + g] = softmax_row(sc + g * L, L, &mx);  // per-head sum and max kept after the accumulators
    acc[G * Dp + G + g] = mx;
  }
#ifdef SGL_AVX512
  if (tiled.values) tiled.values(j, slots, L, h, sc, acc); else
#endif
  weighted_values(j, slots, L, h, sc, acc);
  for (int g = 0; g < G; ++g) {
    const int64_t off = (b * (int64_t)(j.Hq) + h * G + g) * D;
    const float* ag = acc + g * Dp;
    float inv = 1.f / acc[G * Dp + g], a2 = 1.f, a1 = 0.f;
    const float* p1 = pre ? pre->acc + g * pre->ld : nullptr;
    if (p1) {
      const float m1 = pre->m[g], l1 = pre->l[g], m2 = acc[G * Dp + G + g], m = std::max(m1, m2);
      a1 = std::exp(m1 - m);
      a2 = std::exp(m2 - m);
      inv = 1.f / (l1 * a1 + acc[G * Dp + g] * a2);
    }
#ifdef SGL_AVX512
    if (!j.out_bf16) {  // the same products as the scalar loops below, 16 at a time
      float* o = (float*)j.out + off;
      const __m512 vi = _mm512_set1_ps(inv), v1 = _mm512_set1_ps(a1), v2 = _mm512_set1_ps(a2);
      for (int d = 0; d < D; d += 16) {
        const __mmask16 m = D - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - d)) - 1);
        const __m512 a = _mm512_maskz_loadu_ps(m, ag + d);
        const __m512 y = p1 ? _mm512_mul_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, p1 + d), v1), _mm512_mul_ps(a, v2)), vi)
                            : _mm512_mul_ps(a, vi);
        _mm512_mask_storeu_ps(o + d, m, y);
      }
      continue;
    }
#endif
    if (j.out_bf16) {
      c10::BFloat16* o = (c10::BFloat16*)j.out + off;
      if (p1) for (int d = 0; d < D; ++d) o[d] = c10::BFloat16((p1[d] * a1 + ag[d] * a2) * inv);
      else for (int d = 0; d < D; ++d) o[d] = c10::BFloat16(ag[d] * inv);
    } else {
      float* o = (float*)j.out + off;
      if (p1) for (int d = 0; d < D; ++d) o[d] = (p1[d] * a1 + ag[d] * a2) * inv;
      else for (int d = 0; d < D; ++d) o[d] = ag[d] * inv;
    }
  }
  return true;
}

// Into L2: the first kPrefetch K and V rows task (b, h) reads (its scores and values passes
// prefetch the rest as they go), issued while the task before it runs so that the task does not
// start on a DRAM miss per row. Slots outside [0, S) are skipped (attend refuses them).
template <typename T> void prefetch_task_head(const Job<T>& j, int64_t b, int h) {
  const int64_t len = j.lens[b];
  const int64_t first = (j.window > 0 && len > j.window) ? len - j.window : 0;
  const int32_t* slots = j.rt + j.rows[b] * j.rts0 + first;
  const int64_t n = std::min<int64_t>(len - first, kPrefetch);
  const int bytes = j.D * (int)sizeof(T);
  for (int64_t t = 0; t < n; ++t) {
    if (slots[t] < 0 || slots[t] >= j.S) continue;
    const char* k = (const char*)(j.k + slots[t] * j.ks0 + h * j.ks1);
    const char* v = (const char*)(j.v + slots[t] * j.vs0 + h * j.vs1);
    for (int i = 0; i < bytes; i += 64) {
      __builtin_prefetch(k + i, 0, 2);
      __builtin_prefetch(v + i, 0, 2);
    }
  }
}

// Every (row, KV head) task over the pool's threads.
template <typename T>
void run(const Job<T>& j, int64_t B, int Hkv, int64_t max_len) {
  std::atomic<bool> bad{false};
  const Tiled<T> tiled = pick_tiled<T>(j.Dp, j.G);
  sglite_pool::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(j.G * j.Dp), sc(j.G * max_len), acc(j.G * j.Dp + 2 * j.G);
    for (int64_t i = begin; i < end && !bad.load(std::memory_order_relaxed); ++i) {
      if (i + 1 < end) prefetch_task_head(j, (i + 1) / Hkv, (int)((i + 1) % Hkv));
      if (!attend(j, tiled, i / Hkv, (int)(i % Hkv), qf.data(), sc.data(), acc.data())) bad = true;
    }
  });
  TORCH_CHECK_INDEX(!bad, "decode_attention: req_to_token holds a slot outside the pool [0, ", j.S, ")");
}

#include "decode_cascade.h"
#ifdef SGL_AVX512
#include "flash_softmax.h"
#include "dot_tiles.h"
#endif
#include "decode_dot_cascade.h"

// True when this build has the shared-prefix pass on the bf16 dot-product tiles (AVX512-BF16).
bool dot_cascade_built() {
#ifdef SGL_DOT_TILES
  return true;
#else
  return false;
#endif
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb,
                            const at::Tensor& rt, const at::Tensor& rows, const at::Tensor& lens,
                            double sm_scale, int64_t window, double softcap, int64_t cascade_min,
                            const c10::optional<at::Tensor>& groups_in) {
  TORCH_CHECK_VALUE(q.dim() == 3 && kb.dim() == 3 && vb.dim() == 3, "decode_attention: q, k_buffer, v_buffer must be 3-D");
  // cascade_min < 0: the shared-prefix pass from -cascade_min keys on the dot tiles even where AMX is granted
  const bool force_dot = cascade_min < 0;
  cascade_min = std::abs(cascade_min);
  TORCH_CHECK_VALUE(window >= 0 && softcap >= 0, "decode_attention: window=", window, " and softcap=", softcap, " must be >= 0");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = kb.size(1), S = kb.size(0);
  TORCH_CHECK_VALUE(vb.sizes() == kb.sizes() && kb.size(2) == D, "decode_attention: k_buffer/v_buffer must be [S, Hkv, D] with q's D");
  TORCH_CHECK_VALUE(Hkv > 0 && Hq % Hkv == 0, "decode_attention: Hq=", Hq, " is not a multiple of Hkv=", Hkv);
  TORCH_CHECK_VALUE(D >= 1 && D <= kMaxD, "decode_attention: head dim D=", D, " outside [1, ", kMaxD, "]");
  TORCH_CHECK_VALUE(kb.scalar_type() == vb.scalar_type(), "decode_attention: k_buffer and v_buffer dtypes differ");
  TORCH_CHECK_VALUE(q.stride(2) == 1 && kb.stride(2) == 1 && vb.stride(2) == 1, "decode_attention: D must have unit stride");
  TORCH_CHECK_VALUE(rt.dim() == 2 && rt.scalar_type() == at::kInt && rt.stride(1) == 1, "decode_attention: req_to_token must be int32 [R, Lmax] with unit stride");
  TORCH_CHECK_VALUE(rows.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && rows.is_contiguous() && lens.is_contiguous()
                    && rows.numel() == B && lens.numel() == B, "decode_attention: req_pool_indices and seq_lens must be contiguous int64 [B]");
  const bool kv_bf16 = kb.scalar_type() == at::kBFloat16, q_bf16 = q.scalar_type() == at::kBFloat16;
  const bool kv_fp8 = kb.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK_VALUE(kv_bf16 || kv_fp8 || kb.scalar_type() == at::kFloat,
                    "decode_attention: pool dtype must be float32, bfloat16 or float8_e4m3fn");
  TORCH_CHECK_VALUE(q_bf16 || q.scalar_type() == at::kFloat, "decode_attention: q dtype must be float32 or bfloat16");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  int64_t max_len = 1;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(lp[b] >= 1 && lp[b] <= rt.size(1), "decode_attention: seq_lens[", b, "]=", lp[b], " outside [1, ", rt.size(1), "]");
    TORCH_CHECK_INDEX(rp[b] >= 0 && rp[b] < rt.size(0), "decode_attention: req_pool_indices[", b, "]=", rp[b], " outside [0, ", rt.size(0), ")");
    max_len = std::max(max_len, lp[b]);
  }
  at::Tensor out = at::empty({B, Hq, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (B == 0) return out;
  const int G = (int)(Hq / Hkv), Dp = (int)((D + 15) / 16 * 16);
  const int32_t* rtp = rt.data_ptr<int32_t>();
  if (kv_bf16) {
    Job<uint16_t> j{(const uint16_t*)kb.data_ptr(), (const uint16_t*)vb.data_ptr(), kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1), S,
                    q.data_ptr(), q_bf16, (int)Hq, q.stride(0), q.stride(1), out.data_ptr(), q_bf16, rtp, rt.stride(0), rp, lp,
                    G, (int)D, Dp, (float)sm_scale, window, (float)softcap};
    // the shared-prefix pass: on the AMX tiles where granted, else on the bf16 dot-product tiles
    bool amx = false, dot = false;
#ifdef SGL_AMX_ATTN
    amx = !force_dot && G <= sglite_amx_attn::kMaxRows && sglite_tiles::granted();
#endif
#ifdef SGL_DOT_TILES
    dot = !amx && D % 2 == 0;
#endif
    (void)force_dot;
    if (cascade_min > 0 && window == 0 && B >= 2 && (amx || dot)) {
      const std::vector<Group> groups = groups_in.has_value() ? groups_from(*groups_in, lp, B)
                                                              : shared_prefix_groups(rtp, rt.stride(0), rp, lp, B, cascade_min);
      if (!groups.empty()) {
#ifdef SGL_AMX_ATTN
        if (amx) run_cascade(j, B, (int)Hkv, max_len, groups);
#endif
#ifdef SGL_DOT_TILES
        if (dot) run_cascade_dot(j, B, (int)Hkv, max_len, groups);
#endif
        return out;
      }
    }
    run(j, B, (int)Hkv, max_len);
  } else if (kv_fp8) {  // keys and values as stored (their per-head scales are the caller's: kv_quant_cpu)
    Job<uint8_t> j{(const uint8_t*)kb.data_ptr(), (const uint8_t*)vb.data_ptr(), kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1), S,
                   q.data_ptr(), q_bf16, (int)Hq, q.stride(0), q.stride(1), out.data_ptr(), q_bf16, rtp, rt.stride(0), rp, lp,
                   G, (int)D, Dp, (float)sm_scale, window, (float)softcap};
    run(j, B, (int)Hkv, max_len);
  } else {
    Job<float> j{kb.data_ptr<float>(), vb.data_ptr<float>(), kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1), S,
                 q.data_ptr(), q_bf16, (int)Hq, q.stride(0), q.stride(1), out.data_ptr(), q_bf16, rtp, rt.stride(0), rp, lp,
                 G, (int)D, Dp, (float)sm_scale, window, (float)softcap};
    run(j, B, (int)Hkv, max_len);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(sglite_cpu_attention, m) {
  m.def("decode_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, int window=0, float softcap=0.0, "
        "int cascade_min=0, Tensor? groups=None) -> Tensor");
  m.def("shared_prefix_groups(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int min_shared) -> Tensor",
        &shared_prefix_groups_op);
  m.def("dot_cascade_built() -> bool", &dot_cascade_built);
}

TORCH_LIBRARY_IMPL(sglite_cpu_attention, CPU, m) { m.impl("decode_attention", &decode_attention); }
