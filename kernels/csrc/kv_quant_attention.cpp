// Fused decode attention over an int8 / int4 KIVI-quantized KV pool on CPU
// (see sglite/kernels/kv_quant_cpu.py for the contract and sglite/kernels/kv_quant.py for the layout).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include "avx512_math.h"
#define SGL_AVX512 1
#endif

namespace {

constexpr int kMaxD = 256;

inline float widen(float x) { return x; }
inline float widen(uint16_t x) { uint32_t u = uint32_t(x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

struct Job {
  const uint8_t *kd, *vd; int64_t ks0, ks1, vs0, vs1;  // codes [S, Hkv, Dq], strides in bytes
  const uint16_t *kscale, *vscale;                      // [S/G, Hkv, 2, D], [S, Hkv, 2] float16
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
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int d = 0;
  for (; d + 8 <= D; d += 8)
    for (int i = 0; i < 8; ++i) s[i] += a[d + i] * b[d + i];
  for (; d < D; ++d) s[0] += a[d] * b[d];
  float t = 0;
  for (float x : s) t += x;
  return t;
}

inline void axpy(float w, const float* x, float* y, int D) {
#ifdef SGL_AVX512
  if (D % 16 == 0) {
    const __m512 wv = _mm512_set1_ps(w);
    for (int c = 0; c < D; c += 16) _mm512_storeu_ps(y + c, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + c), _mm512_loadu_ps(y + c)));
    return;
  }
#endif
  for (int d = 0; d < D; ++d) y[d] += w * x[d];
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

struct Scratch { std::vector<float> qf, qs, sc, acc, row, kz; };

bool attend(const Job& j, int64_t b, int h, Scratch& w) {
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
    for (int64_t t = t0; t < t1; ++t) {
      unpack_row(j.kd + (s0 + (t - t0)) * j.ks0 + h * j.ks1, D, j.bits, x);
      for (int g = 0; g < G; ++g) sc[g * L + t] = dot(qs + g * D, x, D) + kz[g];
    }
  }
  for (int64_t t = Ls; t < L; ++t) {
    load_res(j, j.rk, row, t, h, x);
    for (int g = 0; g < G; ++g) sc[g * L + t] = dot(qf + g * D, x, D);
  }
  for (int g = 0; g < G; ++g) kz[g] = 1.f / softmax_row(sc + g * L, L);
  // pass 2: values. Sealed tokens: acc += (p*sv) * codes, zsum += p*zv.
  std::fill(acc, acc + G * D, 0.f);
  float zsum[32] = {0};
  for (int64_t t = 0; t < Ls; ++t) {
    const int64_t s = slots[t];
    const uint16_t* vsc = j.vscale + (s * j.Hkv + h) * 2;
    const float sv = half_to_float(vsc[0]), zv = half_to_float(vsc[1]);
    unpack_row(j.vd + s * j.vs0 + h * j.vs1, D, j.bits, x);
    for (int g = 0; g < G; ++g) {
      const float p = sc[g * L + t];
      axpy(p * sv, x, acc + g * D, D);
      zsum[g] += p * zv;
    }
  }
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
  TORCH_CHECK_VALUE(kd.scalar_type() == at::kByte && vd.scalar_type() == at::kByte && kd.is_contiguous() && vd.is_contiguous(),
                    "decode_attention: codes must be contiguous uint8");
  TORCH_CHECK_VALUE(kscale.scalar_type() == at::kHalf && kscale.is_contiguous() && kscale.dim() == 4
                    && kscale.size(0) == S / group && kscale.size(1) == Hkv && kscale.size(2) == 2 && kscale.size(3) == D,
                    "decode_attention: k_scale must be contiguous float16 [S/G, Hkv, 2, D]");
  TORCH_CHECK_VALUE(vscale.scalar_type() == at::kHalf && vscale.is_contiguous() && vscale.dim() == 3
                    && vscale.size(0) == S && vscale.size(1) == Hkv && vscale.size(2) == 2,
                    "decode_attention: v_scale must be contiguous float16 [S, Hkv, 2]");
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
        (const uint16_t*)kscale.data_ptr(), (const uint16_t*)vscale.data_ptr(),
        rk.data_ptr(), rv.data_ptr(), rk.scalar_type() == at::kBFloat16, S, rk.size(0),
        q.data_ptr(), q.scalar_type() == at::kBFloat16, (int)Hq, (int)Hkv, q.stride(0), q.stride(1), out.data_ptr(),
        rt.data_ptr<int32_t>(), rt.stride(0), rp, lp, sealed.data_ptr<int64_t>(),
        G, (int)D, (int)bits, (int)group, (float)sm_scale};
  std::atomic<bool> bad{false};
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    w.qf.resize(G * D); w.qs.resize(G * D); w.sc.resize(G * max_len); w.acc.resize(G * D); w.row.resize(D + 16); w.kz.resize(G);
    for (int64_t i = begin; i < end && !bad.load(std::memory_order_relaxed); ++i)
      if (!attend(j, i / Hkv, (int)(i % Hkv), w)) bad = true;
  });
  TORCH_CHECK_INDEX(!bad, "decode_attention: req_to_token holds a slot outside the pool [0, ", S, ") or not aligned to its position");
  return out;
}

}  // namespace

TORCH_LIBRARY(sglite_kv_quant, m) {
  m.def("decode_attention(Tensor q, Tensor k_data, Tensor v_data, Tensor k_scale, Tensor v_scale, Tensor res_k, "
        "Tensor res_v, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor sealed_lens, "
        "float sm_scale, int bits, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(sglite_kv_quant, CPU, m) { m.impl("decode_attention", &decode_attention); }
