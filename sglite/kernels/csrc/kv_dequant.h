// Whole key groups of an int8 / int4 KIVI pool dequantized into a float32 or bf16 buffer (the scratch
// of sglite/kernels/kv_quant_extend.py; contract there, dequant_groups). The arithmetic is the torch
// reference's (kv_quant.dequant_codes: code * scale + min in float32, a product then a sum, never
// fused into one FMA), rounded once to bf16 (nearest even) for a bf16 buffer. Spliced into
// kv_quant_attention.cpp after its row helpers, whose unpack_row (a pool row's codes in float32) and
// half_to_float it reads the codes and scales with (the op is registered there). Also fp8_e4m3
// slots (dequant_fp8: float32(code) * scale, as kv_quant.dequant_slots).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "thread_pool.h"

namespace sglite_kv_dequant {

// code * scale + min with the product rounded before the sum (the empty asm keeps the compiler from
// contracting the two into an FMA, which torch's separate mul and add do not do)
inline float dq(float c, float s, float m) {
  float p = c * s;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  asm volatile("" : "+x"(p));
#endif
  return p + m;
}

// o[d] = T(c[d] * s[d] + m[d]) for d < D (s, m: float16 bits, or one broadcast value each when
// sv / mv are given), AVX-512 where compiled for it (the product kept apart from the sum as in dq)
template <typename T>
inline void dq_row(const float* c, const uint16_t* s, const uint16_t* m, float sv, float mv, int64_t D, T* o) {
  int64_t d = 0;
#if defined(__AVX512F__) && defined(__F16C__)
  for (; d + 16 <= D; d += 16) {
    const __m512 sc = s ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + d))) : _mm512_set1_ps(sv);
    const __m512 mn = m ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(m + d))) : _mm512_set1_ps(mv);
    __m512 p = _mm512_mul_ps(_mm512_loadu_ps(c + d), sc);
    asm volatile("" : "+v"(p));
    const __m512 x = _mm512_add_ps(p, mn);
    if constexpr (std::is_same_v<T, float>) {
      _mm512_storeu_ps(o + d, x);
    } else {  // bf16, round to nearest even (finite values: c10::BFloat16's rounding)
      const __m512i b = _mm512_castps_si512(x);
      const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                            _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
      _mm256_storeu_si256((__m256i*)(o + d), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
    }
  }
#endif
  for (; d < D; ++d) o[d] = T(dq(c[d], s ? half_to_float(s[d]) : sv, m ? half_to_float(m[d]) : mv));
}

template <typename T>
void run(const at::Tensor& kd, const at::Tensor& vd, const at::Tensor& ks, const at::Tensor& vs, const int64_t* g,
         int64_t n, int64_t G, int64_t D, int bits, T* ko, T* vo) {
  const int64_t H = kd.size(1);
  const uint8_t *kp = kd.data_ptr<uint8_t>(), *vp = vd.data_ptr<uint8_t>();
  const uint16_t *ksp = (const uint16_t*)ks.data_ptr(), *vsp = (const uint16_t*)vs.data_ptr();
  sglite_pool::parallel_for(0, n * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> c(D);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t i = task / H, h = task % H, gid = g[i];
      const uint16_t* sc = ksp + (gid * H + h) * 2 * D;  // [2, D]: scales, minima
      for (int64_t t = 0; t < G; ++t) {
        const int64_t slot = gid * G + t, o = ((i * G + t) * H + h) * D;
        unpack_row(kp + slot * kd.stride(0) + h * kd.stride(1), (int)D, bits, c.data());
        dq_row<T>(c.data(), sc, sc + D, 0.f, 0.f, D, ko + o);
        const uint16_t* v2 = vsp + slot * vs.stride(0) + h * vs.stride(1);
        unpack_row(vp + slot * vd.stride(0) + h * vd.stride(1), (int)D, bits, c.data());
        dq_row<T>(c.data(), nullptr, nullptr, half_to_float(v2[0]), half_to_float(v2[1]), D, vo + o);
      }
    }
  });
}

// k_data / v_data [S, Hkv, Dq] uint8 (unit last stride), k_scale [S/G, Hkv, 2, D] float16 contiguous,
// v_scale [S, Hkv, 2] float16 (unit last stride), gids [n] int64 group ids -> K and V [n * G, Hkv, D]
// float32 (or bf16 with bf16_out) of slots gid * G .. gid * G + G - 1 in order.
inline std::tuple<at::Tensor, at::Tensor> dequant_groups(const at::Tensor& kd, const at::Tensor& vd, const at::Tensor& ks,
                                                         const at::Tensor& vs, const at::Tensor& gids, int64_t bits,
                                                         int64_t group, bool bf16_out) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "dequant_groups: bits must be 8 or 4");
  TORCH_CHECK_VALUE(kd.dim() == 3 && vd.sizes() == kd.sizes() && kd.scalar_type() == at::kByte && vd.scalar_type() == at::kByte
                    && kd.stride(2) == 1 && vd.stride(2) == 1, "dequant_groups: codes must be uint8 [S, Hkv, Dq], unit stride along Dq");
  const int64_t S = kd.size(0), H = kd.size(1), D = bits == 8 ? kd.size(2) : 2 * kd.size(2), G = group;
  TORCH_CHECK_VALUE(G >= 1 && S % G == 0 && ks.scalar_type() == at::kHalf && ks.is_contiguous() && ks.dim() == 4
                    && ks.size(0) == S / G && ks.size(1) == H && ks.size(2) == 2 && ks.size(3) == D,
                    "dequant_groups: k_scale must be contiguous float16 [S/G, Hkv, 2, D]");
  TORCH_CHECK_VALUE(vs.scalar_type() == at::kHalf && vs.dim() == 3 && vs.size(0) == S && vs.size(1) == H && vs.size(2) == 2
                    && vs.stride(2) == 1, "dequant_groups: v_scale must be float16 [S, Hkv, 2]");
  TORCH_CHECK_VALUE(gids.scalar_type() == at::kLong && gids.is_contiguous() && gids.dim() == 1, "dequant_groups: gids must be int64 [n]");
  const int64_t n = gids.size(0);
  const int64_t* g = gids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK_INDEX(g[i] >= 0 && g[i] < S / G, "dequant_groups: group ", g[i], " outside the pool");
  const auto opt = kd.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat);
  at::Tensor k = at::empty({n * G, H, D}, opt), v = at::empty({n * G, H, D}, opt);
  if (bf16_out) run<c10::BFloat16>(kd, vd, ks, vs, g, n, G, D, (int)bits, k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>());
  else run<float>(kd, vd, ks, vs, g, n, G, D, (int)bits, k.data_ptr<float>(), v.data_ptr<float>());
  return {k, v};
}

// fp8_e4m3 pools (codes [S, Hkv, D] float8_e4m3fn bits, a static float32 scale per KV head [Hkv]):
// the K and V of `slots` [T] int64 as kv_quant.dequant_slots computes them (float32(code) * scale,
// one product), rounded once to bf16 when bf16_out; [T, Hkv, D] each. One 256-entry table per call
// (widen of scalar_math.h: exact), the slots split over the thread pool.
inline std::tuple<at::Tensor, at::Tensor> dequant_fp8(const at::Tensor& kd, const at::Tensor& vd, const at::Tensor& ks,
                                                      const at::Tensor& vs, const at::Tensor& slots, bool bf16_out) {
  TORCH_CHECK_VALUE(kd.dim() == 3 && vd.sizes() == kd.sizes() && kd.element_size() == 1 && vd.element_size() == 1
                    && kd.stride(2) == 1 && vd.stride(2) == 1, "dequant_fp8: codes must be [S, Hkv, D] float8 with unit stride along D");
  const int64_t S = kd.size(0), Hkv = kd.size(1), D = kd.size(2), T = slots.numel();
  for (const at::Tensor* t : {&ks, &vs})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == Hkv,
                      "dequant_fp8: scales must be float32 [Hkv]");
  TORCH_CHECK_VALUE(slots.scalar_type() == at::kLong && slots.is_contiguous(), "dequant_fp8: slots must be int64");
  const at::ScalarType dt = bf16_out ? at::kBFloat16 : at::kFloat;
  at::Tensor ko = at::empty({T, Hkv, D}, kd.options().dtype(dt)), vo = at::empty({T, Hkv, D}, kd.options().dtype(dt));
  float lut[256];
  for (int c = 0; c < 256; ++c) lut[c] = widen((uint8_t)c);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK_INDEX(sl[t] >= 0 && sl[t] < S, "dequant_fp8: slot ", sl[t], " outside the pool");
  const at::Tensor* src[2] = {&kd, &vd};
  const float* sc[2] = {ks.data_ptr<float>(), vs.data_ptr<float>()};
  at::Tensor* dst[2] = {&ko, &vo};
  sglite_pool::parallel_for(0, T, 64, [&](int64_t lo, int64_t hi) {
    for (int w = 0; w < 2; ++w) {
      const uint8_t* base = (const uint8_t*)src[w]->data_ptr();
      for (int64_t t = lo; t < hi; ++t)
        for (int64_t h = 0; h < Hkv; ++h) {
          const uint8_t* c = base + sl[t] * src[w]->stride(0) + h * src[w]->stride(1);
          const float s = sc[w][h];
          const int64_t o = (t * Hkv + h) * D;
          if (bf16_out) {
            c10::BFloat16* out = dst[w]->data_ptr<c10::BFloat16>() + o;
            for (int64_t d = 0; d < D; ++d) out[d] = c10::BFloat16(lut[c[d]] * s);
          } else {
            float* out = dst[w]->data_ptr<float>() + o;
            for (int64_t d = 0; d < D; ++d) out[d] = lut[c[d]] * s;
          }
        }
    }
  });
  return {ko, vo};
}

}  // namespace sglite_kv_dequant
