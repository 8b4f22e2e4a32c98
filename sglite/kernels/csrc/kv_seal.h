// Sealing KIVI key groups into an int8 / int4 pool in C++: the fused decode's step where a row
// stores its group's last position (decode_kv_quant.h, from the residual window) and the per-op
// store's groups (kv_quant_attention.cpp's seal_groups op, from the step's full-precision blocks;
// sglite/kernels/kv_quant.py _seal_groups). The arithmetic is kv_quant.quantize's, bit for bit: float32 math, the
// minimum and the scale (max - min) / qmax rounded to float16 (nearest even) before use, codes
// round((x - min) * (1 / scale)) half to even, clamped to [0, qmax] (a zero scale gives code 0);
// keys per channel over the group's G positions, values per token over the head's D channels;
// int4 codes packed two a byte in split halves (low nibble: channel j, high: channel j + D/2).
// Also the whole per-op store (store_groups: residual rows and sealed groups in one call) and the
// fp8_e4m3 quantizer (fp8_code, shared by the fused decode, and store_fp8, the per-op store).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include "thread_pool.h"

namespace sglite_kv_seal {

inline uint16_t half_bits(float x) { return c10::Half(x).x; }
inline float half_value(uint16_t b) { return static_cast<float>(c10::Half(b, c10::Half::from_bits())); }

// n values x[i * stride] -> codes[i] (one byte a value, before int4 packing); sc / mn: float16 bits
inline void quantize(const float* x, int64_t n, int64_t stride, int qmax, uint8_t* codes, uint16_t& sc, uint16_t& mn) {
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  for (int64_t i = 0; i < n; ++i) { lo = std::min(lo, x[i * stride]); hi = std::max(hi, x[i * stride]); }
  mn = half_bits(lo);
  const float mnf = half_value(mn);
  sc = half_bits((hi - mnf) / (float)qmax);
  const float scf = half_value(sc), inv = scf > 0.f ? 1.0f / scf : 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float q = std::nearbyint((x[i * stride] - mnf) * inv);
    codes[i] = (uint8_t)std::min(std::max(q, 0.f), (float)qmax);
  }
}

#if defined(__AVX512F__) && defined(__F16C__)
// quantize() for 16 columns at once: x[i * stride + j] for i < n, j < 16 -> codes[i * cstride + j],
// each column's float16 scale / minimum bits into sc[0..16) / mn[0..16); the same float32 and
// rounding steps as the scalar quantize (VCVTPS2PH and VRNDSCALEPS round to nearest even).
inline void quantize16(const float* x, int64_t n, int64_t stride, int qmax, uint8_t* codes, int64_t cstride,
                       uint16_t* sc, uint16_t* mn) {
  constexpr int RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m512 lo = _mm512_set1_ps(std::numeric_limits<float>::infinity()), hi = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; ++i) {
    const __m512 v = _mm512_loadu_ps(x + i * stride);
    lo = _mm512_min_ps(lo, v);
    hi = _mm512_max_ps(hi, v);
  }
  const __m256i mnh = _mm512_cvtps_ph(lo, RN);
  const __m512 mnf = _mm512_cvtph_ps(mnh);
  const __m256i sch = _mm512_cvtps_ph(_mm512_div_ps(_mm512_sub_ps(hi, mnf), _mm512_set1_ps((float)qmax)), RN);
  const __m512 scf = _mm512_cvtph_ps(sch);
  const __mmask16 pos = _mm512_cmp_ps_mask(scf, _mm512_setzero_ps(), _CMP_GT_OQ);
  const __m512 inv = _mm512_maskz_div_ps(pos, _mm512_set1_ps(1.0f), scf);
  _mm256_storeu_si256((__m256i*)mn, mnh);
  _mm256_storeu_si256((__m256i*)sc, sch);
  const __m512 top = _mm512_set1_ps((float)qmax), zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i * stride), mnf), inv), RN);
    q = _mm512_min_ps(_mm512_max_ps(q, zero), top);
    _mm_storeu_si128((__m128i*)(codes + i * cstride), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
  }
}
#endif

// D codes of one (position, head) -> the pool row (int8: as is; int4: split halves)
inline void put_codes(const uint8_t* c, int64_t D, int bits, uint8_t* out) {
  if (bits == 8) { std::copy(c, c + D, out); return; }
  for (int64_t j = 0; j < D / 2; ++j) out[j] = (uint8_t)(c[j] | (c[j + D / 2] << 4));
}

// n values of a contiguous float32 | bf16 tensor t from element `offset` on, in float32 into out
inline void to_float(const at::Tensor& t, int64_t offset, int64_t n, float* out) {
  if (t.scalar_type() == at::kBFloat16) {
    const c10::BFloat16* p = t.data_ptr<c10::BFloat16>() + offset;
    for (int64_t i = 0; i < n; ++i) out[i] = (float)p[i];
  } else {
    std::copy(t.data_ptr<float>() + offset, t.data_ptr<float>() + offset + n, out);
  }
}

// Quantize one group's full-precision K and V (k, v: float32 [G, Hkv, D]) into the pool slots
// slot0 .. slot0 + G - 1 (slot0 a multiple of G): t = (k_data, v_data [S, Hkv, Dq] uint8; k_scale
// [S/G, Hkv, 2, D] float16 contiguous; v_scale [S, Hkv, 2] float16).
inline void seal_block(const at::Tensor* t, const float* k, const float* v, int64_t slot0, int bits) {
  const at::Tensor &kd = t[0], &vd = t[1], &ks = t[2], &vs = t[3];
  const int64_t Hkv = kd.size(1), D = bits == 8 ? kd.size(2) : 2 * kd.size(2), G = kd.size(0) / ks.size(0);
  const int64_t gid = slot0 / G;
  const int qmax = (1 << bits) - 1;
  TORCH_CHECK(kd.scalar_type() == at::kByte && vd.scalar_type() == at::kByte && ks.scalar_type() == at::kHalf
              && vs.scalar_type() == at::kHalf && ks.is_contiguous() && kd.stride(2) == 1 && vd.stride(2) == 1
              && vs.stride(2) == 1, "seal: a quantized pool layer has uint8 codes and float16 scales");
  TORCH_CHECK_INDEX(slot0 >= 0 && slot0 % G == 0 && slot0 + G <= kd.size(0), "seal: key group at slot ", slot0,
                    " outside the pool");
  std::vector<uint8_t> codes(G * D), col(G);
  uint16_t* kscale = (uint16_t*)ks.data_ptr() + gid * Hkv * 2 * D;
  uint8_t* kdata = kd.data_ptr<uint8_t>();
  for (int64_t h = 0; h < Hkv; ++h) {  // keys: per channel over the G positions
    int64_t d = 0;
#if defined(__AVX512F__) && defined(__F16C__)
    for (; d + 16 <= D; d += 16)
      quantize16(k + h * D + d, G, Hkv * D, qmax, codes.data() + d, D, kscale + (h * 2) * D + d, kscale + (h * 2 + 1) * D + d);
#endif
    for (; d < D; ++d) {
      quantize(k + h * D + d, G, Hkv * D, qmax, col.data(), kscale[(h * 2) * D + d], kscale[(h * 2 + 1) * D + d]);
      for (int64_t i = 0; i < G; ++i) codes[i * D + d] = col[i];
    }
    for (int64_t i = 0; i < G; ++i) put_codes(codes.data() + i * D, D, bits, kdata + (slot0 + i) * kd.stride(0) + h * kd.stride(1));
  }
  uint8_t* vdata = vd.data_ptr<uint8_t>();
  uint16_t* vscale = (uint16_t*)vs.data_ptr();
  for (int64_t i = 0; i < G; ++i)  // values: per token and head over the D channels
    for (int64_t h = 0; h < Hkv; ++h) {
      uint16_t* s = vscale + (slot0 + i) * vs.stride(0) + h * vs.stride(1);
      quantize(v + (i * Hkv + h) * D, D, 1, qmax, codes.data(), s[0], s[1]);
      put_codes(codes.data(), D, bits, vdata + (slot0 + i) * vd.stride(0) + h * vd.stride(1));
    }
}

// The group of request row `row` from its residual window (t[4], t[5]: res_k, res_v [R, G, Hkv, D]
// float32 | bf16 contiguous) into the slots from slot0.
inline void seal_group(const at::Tensor* t, int64_t row, int64_t slot0, int bits) {
  TORCH_CHECK(t[4].is_contiguous() && t[5].is_contiguous() && row >= 0 && row < t[4].size(0),
              "seal: residual windows must be contiguous and hold request row ", row);
  const int64_t n = t[4].numel() / t[4].size(0);  // G * Hkv * D
  std::vector<float> k(n), v(n);
  to_float(t[4], row * n, n, k.data());
  to_float(t[5], row * n, n, v.data());
  seal_block(t, k.data(), v.data(), slot0, bits);
}

// The per-op store's sealing (the seal_groups op of kv_quant_attention.cpp): blocks k_blocks /
// v_blocks [NB, G, Hkv, D] float32 | bf16 contiguous (each group's full-precision rows, the step's
// stash) quantized into pool groups gids [NB] int64, the blocks split over the thread pool.
inline void seal_groups(const at::Tensor& kd, const at::Tensor& vd, const at::Tensor& ks, const at::Tensor& vs,
                        const at::Tensor& bk, const at::Tensor& bv, const at::Tensor& gids, int64_t bits) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "seal_groups: bits must be 8 or 4");
  TORCH_CHECK_VALUE(bk.dim() == 4 && bv.sizes() == bk.sizes() && bk.is_contiguous() && bv.is_contiguous()
                    && bk.scalar_type() == bv.scalar_type() && (bk.scalar_type() == at::kFloat || bk.scalar_type() == at::kBFloat16)
                    && bk.size(2) == kd.size(1) && bk.size(3) == (bits == 8 ? kd.size(2) : 2 * kd.size(2))
                    && ks.size(0) > 0 && bk.size(1) * ks.size(0) == kd.size(0),
                    "seal_groups: blocks must be contiguous float32 / bf16 [NB, G, Hkv, D] of the pool's group and heads");
  TORCH_CHECK_VALUE(gids.scalar_type() == at::kLong && gids.is_contiguous() && gids.numel() == bk.size(0),
                    "seal_groups: gids must be int64 [NB]");
  const at::Tensor t[4] = {kd, vd, ks, vs};
  const int64_t NB = bk.size(0), n = bk.numel() / std::max<int64_t>(NB, 1), G = bk.size(1);
  const int64_t* g = gids.data_ptr<int64_t>();
  sglite_pool::parallel_for(0, NB, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> k(n), v(n);
    for (int64_t b = lo; b < hi; ++b) {
      to_float(bk, b * n, n, k.data());
      to_float(bv, b * n, n, v.data());
      seal_block(t, k.data(), v.data(), g[b] * G, (int)bits);
    }
  });
}

// The per-op store of an int8 / int4 layer (kv_quant.store_kv) in one call: the step's tokens (k, v
// [N, Hkv, D] contiguous, in the residual windows' dtype; tok_rows / positions / slots [N] int64;
// row_len [R] int64, the tokens each row holds after the step) go into their rows' residual windows
// (rk, rv [R, G, Hkv, D] contiguous), except those of key groups the step completes: each such group
// is assembled in full precision (its positions before the step from the residual window, the
// step's from k / v) and sealed into its pool group (the slot of its last position // G), before
// any residual row is written. Returns the sealed groups (ascending ids [NB] int64) and their
// full-precision blocks [NB, G, Hkv, D] in the residual dtype: the store's stash.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> store_groups(
    const at::Tensor& kd, const at::Tensor& vd, const at::Tensor& ks, const at::Tensor& vs, const at::Tensor& rk,
    const at::Tensor& rv, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tok_rows,
    const at::Tensor& positions, const at::Tensor& row_len, const at::Tensor& slots, int64_t bits) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "store_groups: bits must be 8 or 4");
  TORCH_CHECK_VALUE(rk.dim() == 4 && rv.sizes() == rk.sizes() && rk.is_contiguous() && rv.is_contiguous()
                    && (rk.scalar_type() == at::kFloat || rk.scalar_type() == at::kBFloat16)
                    && rv.scalar_type() == rk.scalar_type(), "store_groups: residual windows must be contiguous "
                    "float32 / bf16 [R, G, Hkv, D]");
  const int64_t N = k.size(0), R = rk.size(0), G = rk.size(1), Hkv = rk.size(2), D = rk.size(3), row = Hkv * D;
  TORCH_CHECK_VALUE(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == Hkv && k.size(2) == D && k.is_contiguous()
                    && v.is_contiguous() && k.scalar_type() == rk.scalar_type() && v.scalar_type() == rk.scalar_type(),
                    "store_groups: k and v must be contiguous [N, Hkv, D] of the residual windows' dtype and heads");
  TORCH_CHECK_VALUE(ks.size(0) > 0 && G * ks.size(0) == kd.size(0) && kd.size(1) == Hkv
                    && (bits == 8 ? kd.size(2) == D : 2 * kd.size(2) == D), "store_groups: the pool and the windows disagree");
  for (const at::Tensor* t : {&tok_rows, &positions, &slots})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == N,
                      "store_groups: tok_rows, positions and slots must be int64 [N]");
  TORCH_CHECK_VALUE(row_len.scalar_type() == at::kLong && row_len.is_contiguous() && row_len.numel() == R,
                    "store_groups: row_len must be int64 [R]");
  const int64_t *tr = tok_rows.data_ptr<int64_t>(), *ps = positions.data_ptr<int64_t>();
  const int64_t *rl = row_len.data_ptr<int64_t>(), *sl = slots.data_ptr<int64_t>();
  std::vector<char> done(N);
  std::vector<std::pair<int64_t, int64_t>> last;  // (pool group, token) of each group the step completes
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK_INDEX(tr[i] >= 0 && tr[i] < R && ps[i] >= 0 && sl[i] >= 0 && sl[i] < kd.size(0),
                      "store_groups: token ", i, " has a row, position or slot outside the pool");
    done[i] = ps[i] < rl[tr[i]] / G * G;
    if (done[i] && ps[i] % G == G - 1) {
      TORCH_CHECK_INDEX(sl[i] % G == G - 1, "store_groups: position ", ps[i], " is not at its offset in its page");
      last.emplace_back(sl[i] / G, i);
    }
  }
  std::sort(last.begin(), last.end());
  const int64_t NB = (int64_t)last.size();
  at::Tensor gids = at::empty({NB}, slots.options());
  at::Tensor bk = at::empty({NB, G, Hkv, D}, rk.options()), bv = at::empty({NB, G, Hkv, D}, rk.options());
  const size_t rb = (size_t)row * rk.element_size();  // bytes of one position's K (or V) row
  const char *kp = (const char*)k.data_ptr(), *vp = (const char*)v.data_ptr();
  char *rkp = (char*)rk.data_ptr(), *rvp = (char*)rv.data_ptr(), *bkp = (char*)bk.data_ptr(), *bvp = (char*)bv.data_ptr();
  int64_t* gp = gids.data_ptr<int64_t>();
  sglite_pool::parallel_for(0, NB, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t il = last[b].second, r = tr[il], x0 = ps[il] - (G - 1);
      for (int64_t j = 0; j < G; ++j) {  // the step's token at position x0 + j, else the residual row j
        const int64_t i = il - (G - 1 - j);
        const bool own = i >= 0 && tr[i] == r && ps[i] == x0 + j;
        std::memcpy(bkp + (b * G + j) * rb, own ? kp + i * rb : rkp + (r * G + j) * rb, rb);
        std::memcpy(bvp + (b * G + j) * rb, own ? vp + i * rb : rvp + (r * G + j) * rb, rb);
      }
      gp[b] = last[b].first;
    }
  });
  seal_groups(kd, vd, ks, vs, bk, bv, gids, bits);  // the assembled blocks, as the per-op store's stash
  for (int64_t i = 0; i < N; ++i)  // after sealing: the sealed groups read their earlier rows from the windows
    if (!done[i]) {
      std::memcpy(rkp + (tr[i] * G + ps[i] % G) * rb, kp + i * rb, rb);
      std::memcpy(rvp + (tr[i] * G + ps[i] % G) * rb, vp + i * rb, rb);
    }
  return {gids, bk, bv};
}

// fp8_e4m3 pools: the code of x stored at scale `scale`, x / scale clamped to +-448 and rounded to
// float8 e4m3fn (nearest even: c10's conversion, torch's), as kv_quant.store_kv
inline uint8_t fp8_code(float x, float scale) {
  return c10::Float8_e4m3fn(std::min(std::max(x / scale, -448.0f), 448.0f)).x;
}

// The fp8_e4m3 store (kv_quant.store_kv): data[slots[i]] = fp8_code(x[i], scale) for the step's rows
// x [N, Hkv, D] float32 | bf16 (unit stride along D), with per KV head scales [Hkv] float32, for K
// and V (codes [S, Hkv, D] float8 with unit stride along D).
inline void store_fp8(at::Tensor& kd, at::Tensor& vd, const at::Tensor& ks, const at::Tensor& vs, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& slots) {
  const int64_t S = kd.size(0), Hkv = kd.size(1), D = kd.size(2), N = slots.numel();
  TORCH_CHECK_VALUE(kd.dim() == 3 && vd.sizes() == kd.sizes() && kd.element_size() == 1 && vd.element_size() == 1
                    && kd.stride(2) == 1 && vd.stride(2) == 1, "store_fp8: codes must be [S, Hkv, D] float8 with unit stride along D");
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK_VALUE(x->dim() == 3 && x->size(0) == N && x->size(1) == Hkv && x->size(2) == D && x->stride(2) == 1
                      && (x->scalar_type() == at::kFloat || x->scalar_type() == at::kBFloat16),
                      "store_fp8: k and v must be float32 / bf16 [N, Hkv, D] with unit stride along D");
  for (const at::Tensor* t : {&ks, &vs})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == Hkv,
                      "store_fp8: scales must be float32 [Hkv]");
  TORCH_CHECK_VALUE(slots.scalar_type() == at::kLong && slots.is_contiguous(), "store_fp8: slots must be int64");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) TORCH_CHECK_INDEX(sl[i] >= 0 && sl[i] < S, "store_fp8: slot ", sl[i], " outside the pool");
  const at::Tensor* src[2] = {&k, &v};
  at::Tensor* dst[2] = {&kd, &vd};
  const float* sc[2] = {ks.data_ptr<float>(), vs.data_ptr<float>()};
  sglite_pool::parallel_for(0, N, 64, [&](int64_t lo, int64_t hi) {
    std::vector<float> x(D);
    for (int w = 0; w < 2; ++w)
      for (int64_t i = lo; i < hi; ++i)
        for (int64_t h = 0; h < Hkv; ++h) {
          uint8_t* out = (uint8_t*)dst[w]->data_ptr() + sl[i] * dst[w]->stride(0) + h * dst[w]->stride(1);
          to_float(*src[w], i * src[w]->stride(0) + h * src[w]->stride(1), D, x.data());
          for (int64_t d = 0; d < D; ++d) out[d] = fp8_code(x[d], sc[w][h]);
        }
  });
}

}  // namespace sglite_kv_seal

