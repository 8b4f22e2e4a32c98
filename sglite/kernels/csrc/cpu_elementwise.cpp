// Fused elementwise kernels around the GEMMs on CPU (contract: sglite/kernels/cpu_elementwise.py):
// residual add + RMSNorm in one pass, RoPE + KV store in one pass, the greedy argmax of logits rows, and quantized embedding rows. Rows are independent and
// each row's arithmetic order is fixed by its length alone (batch-invariant).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include "thread_pool.h"
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <atomic>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define SGL_AVX512 1
#endif

namespace {

using bf16 = c10::BFloat16;

inline float f(float x) { return x; }
inline float f(bf16 x) { return (float)x; }
template <typename T> inline T cast(float x) { return (T)x; }  // bf16: round to nearest even

// Sum of squares of n floats, 16 partial sums (element i to lane i % 16, a fixed order), then added
// pairwise in a fixed tree.
inline float sumsq(const float* h, int64_t n) {
#ifdef SGL_AVX512
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) { const __m512 v = _mm512_loadu_ps(h + i); acc = _mm512_fmadd_ps(v, v, acc); }
  if (i < n) {
    const __m512 v = _mm512_maskz_loadu_ps((__mmask16)((1u << (n - i)) - 1), h + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float s[16] = {0};
  for (int64_t i = 0; i < n; ++i) s[i % 16] += h[i] * h[i];
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) s[l] += s[l + w];
  return s[0];
#endif
}

#ifdef SGL_AVX512
inline __m512 ld_bf16(const uint16_t* p, __mmask16 m) {  // bf16 bits -> float32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
// float32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0 (as c10::BFloat16's constructor).
// With AVX512-BF16 one VCVTNEPS2BF16 (the same rounding; 2 uops against the integer form's 9,
// the rounding being most of RoPE's and add_rms_norm's vector work) unless a lane is a NaN (it
// keeps the sign and payload) or a float32 denormal (it flushes them to zero): one VFPCLASSPS
// finds those and the integer form takes the vector (never, in a model's activations).
inline __m256i rne_bf16_int(__m512 v);
inline __m256i rne_bf16(__m512 v) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x01 | 0x20 | 0x80) == 0, 1)) return (__m256i)_mm512_cvtneps_pbh(v);
#endif
  return rne_bf16_int(v);
}
inline __m256i rne_bf16_int(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
#endif

// Per row: h = x + r (rounded to T, written to sum when r is given), out = rmsnorm(h) * w with
// torch's rounding (F.rms_norm on CPU): T(h * rsqrt(mean(h^2) + eps) * w), in float32, rounded once.
// W: the weight's type, T or float (a bf16 x with a float32 weight: the float32 norm of the exact
// float32 copy of x, rounded once to bf16 -- the bits of rms_norm(x.float(), w).to(bf16)).
template <typename T, typename W = T>
void add_rms_rows(const T* x, int64_t xs, const T* r, int64_t rs, const W* w, T* sum, T* out, int64_t M, int64_t H, float eps) {
  sglite_pool::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> hf(H);
    for (int64_t m = m0; m < m1; ++m) {
      const T* xr = x + m * xs;
#ifdef SGL_AVX512
      if constexpr (std::is_same_v<T, bf16>) {  // the same arithmetic as the scalar loops, 16 lanes
        const uint16_t* xb = (const uint16_t*)xr;
        const uint16_t* rb = r ? (const uint16_t*)(r + m * rs) : nullptr;
        uint16_t* sb = r ? (uint16_t*)(sum + m * H) : nullptr;
        __m512 acc = _mm512_setzero_ps();  // sumsq's lanes and order, summed in this same pass
        for (int64_t i = 0; i < H; i += 16) {
          const __mmask16 mk = H - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (H - i)) - 1);
          __m512 h = ld_bf16(xb + i, mk);
          if (rb) {
            const __m256i hs = rne_bf16(_mm512_add_ps(h, ld_bf16(rb + i, mk)));
            _mm256_mask_storeu_epi16(sb + i, mk, hs);
            h = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hs), 16));
          }
          _mm512_mask_storeu_ps(hf.data() + i, mk, h);
          acc = _mm512_fmadd_ps(h, h, acc);  // masked-off lanes hold 0, as sumsq's masked tail
        }
        const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / (float)H + eps));
        uint16_t* ob = (uint16_t*)(out + m * H);
        for (int64_t i = 0; i < H; i += 16) {
          const __mmask16 mk = H - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (H - i)) - 1);
          __m512 wv;
          if constexpr (std::is_same_v<W, float>) wv = _mm512_maskz_loadu_ps(mk, w + i);
          else wv = ld_bf16((const uint16_t*)w + i, mk);
          const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, hf.data() + i), inv), wv);
          _mm256_mask_storeu_epi16(ob + i, mk, rne_bf16(y));
        }
        continue;
      }
#endif
      if (r) {
        const T* rr = r + m * rs;
        T* sr = sum + m * H;
        for (int64_t i = 0; i < H; ++i) { const T v = cast<T>(f(xr[i]) + f(rr[i])); sr[i] = v; hf[i] = f(v); }
      } else {
        for (int64_t i = 0; i < H; ++i) hf[i] = f(xr[i]);
      }
      const float inv = 1.f / std::sqrt(sumsq(hf.data(), H) / (float)H + eps);
      T* o = out + m * H;
      for (int64_t i = 0; i < H; ++i) o[i] = cast<T>(hf[i] * inv * f(w[i]));
    }
  });
}

// add_rms_norm(x [M, H], residual [M, H] or None, weight [H], eps) -> (sum [M, H] (empty without
// residual), out [M, H]); x and residual need unit stride along H; weight of x's dtype, or float32
// with a bf16 x (the float32 norm, one rounding: Gemma's norm_fp32 without two copies of x).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& res,
                                                const at::Tensor& w, double eps) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1, "add_rms_norm: x must be [M, H] with unit stride along H");
  const int64_t M = x.size(0), H = x.size(1);
  const bool w32 = x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kFloat;
  TORCH_CHECK_VALUE(w.dim() == 1 && w.size(0) == H && w.is_contiguous() && (w.scalar_type() == x.scalar_type() || w32),
                    "add_rms_norm: weight must be contiguous [", H, "] of x's dtype (or float32 with bf16 x)");
  const bool has_r = res.has_value() && res->defined();
  if (has_r)
    TORCH_CHECK_VALUE(res->sizes() == x.sizes() && res->stride(1) == 1 && res->scalar_type() == x.scalar_type(),
                      "add_rms_norm: residual must match x ([M, H], unit stride along H, x's dtype)");
  at::Tensor out = at::empty({M, H}, x.options());
  at::Tensor sum = has_r ? at::empty({M, H}, x.options()) : at::empty({0}, x.options());
  if (M == 0) return {sum, out};
  if (w32) {
    add_rms_rows<bf16, float>((const bf16*)x.data_ptr(), x.stride(0), has_r ? (const bf16*)res->data_ptr() : nullptr,
                              has_r ? res->stride(0) : 0, w.data_ptr<float>(), has_r ? (bf16*)sum.data_ptr() : nullptr,
                              (bf16*)out.data_ptr(), M, H, (float)eps);
  } else if (x.scalar_type() == at::kBFloat16) {
    add_rms_rows<bf16>((const bf16*)x.data_ptr(), x.stride(0), has_r ? (const bf16*)res->data_ptr() : nullptr,
                       has_r ? res->stride(0) : 0, (const bf16*)w.data_ptr(), has_r ? (bf16*)sum.data_ptr() : nullptr,
                       (bf16*)out.data_ptr(), M, H, (float)eps);
  } else {
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, "add_rms_norm: dtype must be float32 or bfloat16");
    add_rms_rows<float>(x.data_ptr<float>(), x.stride(0), has_r ? res->data_ptr<float>() : nullptr,
                        has_r ? res->stride(0) : 0, w.data_ptr<float>(), has_r ? sum.data_ptr<float>() : nullptr,
                        out.data_ptr<float>(), M, H, (float)eps);
  }
  return {sum, out};
}

// Rotate-half RoPE of one head in T (each product and the sum rounded to T, as HF's
// x1 * c - x2 * s, x2 * c + x1 * s in the tensor dtype). The AVX-512 build runs 16 lanes at a time
// with the same roundings (products rounded to T, then the sum; float32: no fused multiply-add).
template <typename T>
inline void rotate(const T* x, const T* c, const T* s, T* o, int64_t half) {
  int64_t i = 0;
#ifdef SGL_AVX512
  for (; i < half; i += 16) {
    const __mmask16 mk = half - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (half - i)) - 1);
    if constexpr (std::is_same_v<T, bf16>) {
      const uint16_t *xb = (const uint16_t*)x, *cb = (const uint16_t*)c, *sb = (const uint16_t*)s;
      const __m512 x1 = ld_bf16(xb + i, mk), x2 = ld_bf16(xb + half + i, mk);
      const __m512 ci = ld_bf16(cb + i, mk), si = ld_bf16(sb + i, mk);
      const auto r = [](__m512 v) {  // v rounded to bf16, back as float32 (exact)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rne_bf16(v)), 16));
      };
      uint16_t* ob = (uint16_t*)o;
      _mm256_mask_storeu_epi16(ob + i, mk, rne_bf16(_mm512_sub_ps(r(_mm512_mul_ps(x1, ci)), r(_mm512_mul_ps(x2, si)))));
      _mm256_mask_storeu_epi16(ob + half + i, mk,
                               rne_bf16(_mm512_add_ps(r(_mm512_mul_ps(x2, ci)), r(_mm512_mul_ps(x1, si)))));
    } else {
      const float *xf = (const float*)x, *cf = (const float*)c, *sf = (const float*)s;
      const __m512 x1 = _mm512_maskz_loadu_ps(mk, xf + i), x2 = _mm512_maskz_loadu_ps(mk, xf + half + i);
      const __m512 ci = _mm512_maskz_loadu_ps(mk, cf + i), si = _mm512_maskz_loadu_ps(mk, sf + i);
      float* of = (float*)o;
      _mm512_mask_storeu_ps(of + i, mk, _mm512_sub_ps(_mm512_mul_ps(x1, ci), _mm512_mul_ps(x2, si)));
      _mm512_mask_storeu_ps(of + half + i, mk, _mm512_add_ps(_mm512_mul_ps(x2, ci), _mm512_mul_ps(x1, si)));
    }
  }
#endif
  for (; i < half; ++i) {
    const float x1 = f(x[i]), x2 = f(x[i + half]), ci = f(c[i]), si = f(s[i]);
    o[i] = cast<T>(f(cast<T>(x1 * ci)) - f(cast<T>(x2 * si)));
    o[i + half] = cast<T>(f(cast<T>(x2 * ci)) + f(cast<T>(x1 * si)));
  }
}

template <typename T>
bool rope_rows(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
               const at::Tensor& kb, const at::Tensor& vb, const int64_t* loc, int64_t Hq, at::Tensor& q) {
  const int64_t N = qk.size(0), H = qk.size(1), D = qk.size(2), Hkv = H - Hq, half = D / 2, S = kb.size(0);
  const T *qkp = (const T*)qk.data_ptr(), *vp = (const T*)v.data_ptr(), *cp = (const T*)cos.data_ptr(), *sp = (const T*)sin.data_ptr();
  T *kbp = (T*)kb.data_ptr(), *vbp = (T*)vb.data_ptr(), *qp = (T*)q.data_ptr();
  // strides read once, outside the rows' loop
  const int64_t qs0 = qk.stride(0), qs1 = qk.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const int64_t cs = cos.stride(0), ss = sin.stride(0), ks0 = kb.stride(0), ks1 = kb.stride(1);
  const int64_t vbs0 = vb.stride(0), vbs1 = vb.stride(1);
  std::atomic<bool> bad{false};
  sglite_pool::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t slot = loc[n];
      if (slot < 0 || slot >= S) { bad = true; return; }
      const T *c = cp + n * cs, *s = sp + n * ss;
      for (int64_t h = 0; h < Hq; ++h) rotate(qkp + n * qs0 + h * qs1, c, s, qp + (n * Hq + h) * D, half);
      for (int64_t h = 0; h < Hkv; ++h) {
        rotate(qkp + n * qs0 + (Hq + h) * qs1, c, s, kbp + slot * ks0 + h * ks1, half);
        std::memcpy(vbp + slot * vbs0 + h * vbs1, vp + n * vs0 + h * vs1, D * sizeof(T));
      }
    }
  });
  return !bad;
}

// rope_store_kv(qk [N, Hq+Hkv, D], v [N, Hkv, D], cos/sin [N, D/2], k_buffer/v_buffer [S, Hkv, D],
// out_cache_loc [N] int64, Hq) -> q [N, Hq, D] rotated; rotated k and v written to the pool slots.
at::Tensor rope_store_kv(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& kb, const at::Tensor& vb, const at::Tensor& loc, int64_t Hq) {
  TORCH_CHECK_VALUE(qk.dim() == 3 && v.dim() == 3 && kb.dim() == 3 && vb.dim() == 3, "rope_store_kv: qk, v and the pools must be 3-D");
  const int64_t N = qk.size(0), H = qk.size(1), D = qk.size(2);
  TORCH_CHECK_VALUE(Hq >= 0 && Hq < H && D % 2 == 0, "rope_store_kv: need 0 <= Hq < heads of qk (", H, ") and an even head dim (", D, ")");
  const int64_t Hkv = H - Hq;
  TORCH_CHECK_VALUE(v.size(0) == N && v.size(1) == Hkv && v.size(2) == D, "rope_store_kv: v must be [N, ", Hkv, ", ", D, "]");
  TORCH_CHECK_VALUE(kb.sizes() == vb.sizes() && kb.size(1) == Hkv && kb.size(2) == D, "rope_store_kv: pools must be [S, ", Hkv, ", ", D, "]");
  TORCH_CHECK_VALUE(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) == N && cos.size(1) == D / 2
                    && cos.stride(1) == 1 && sin.stride(1) == 1, "rope_store_kv: cos/sin must be [N, D/2] with unit inner stride");
  const auto dt = qk.scalar_type();
  TORCH_CHECK_VALUE((dt == at::kBFloat16 || dt == at::kFloat) && v.scalar_type() == dt && cos.scalar_type() == dt
                    && sin.scalar_type() == dt && kb.scalar_type() == dt && vb.scalar_type() == dt,
                    "rope_store_kv: qk, v, cos, sin and the pools must share one dtype, float32 or bfloat16");
  TORCH_CHECK_VALUE(qk.stride(2) == 1 && v.stride(2) == 1 && kb.stride(2) == 1 && vb.stride(2) == 1, "rope_store_kv: D must have unit stride");
  TORCH_CHECK_VALUE(loc.dim() == 1 && loc.numel() == N && loc.scalar_type() == at::kLong && loc.is_contiguous(),
                    "rope_store_kv: out_cache_loc must be contiguous int64 [N]");
  at::Tensor q = at::empty({N, Hq, D}, qk.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t* lp = loc.data_ptr<int64_t>();
  const bool ok = dt == at::kBFloat16 ? rope_rows<bf16>(qk, v, cos, sin, kb, vb, lp, Hq, q)
                                      : rope_rows<float>(qk, v, cos, sin, kb, vb, lp, Hq, q);
  TORCH_CHECK_INDEX(ok, "rope_store_kv: out_cache_loc holds a slot outside the pool [0, ", kb.size(0), ")");
  return q;
}

// ---- argmax_rows: the greedy pick of each logits row (first index of the maximum; a NaN counts
// as the maximum, the first NaN wins: numpy's and torch's argmax). The vocabulary is cut into
// contiguous shares (four per thread) for all rows; each share yields, per row, its first NaN or its
// first maximum, and the shares are then combined in order (a later share wins only with a strictly
// greater value), so the result never depends on the thread count.
struct ArgBest {
  float v;
  int64_t i;    // first index of the maximum within the share (-1: empty share)
  int64_t nan;  // first NaN within the share, or -1
};

inline ArgBest argmax_scalar(const float* p, int64_t lo, int64_t hi, ArgBest b) {
  for (int64_t j = lo; j < hi; ++j) {
    const float x = p[j];
    if (x != x) { b.nan = j; return b; }
    if (b.i < 0 || x > b.v) { b.v = x; b.i = j; }
  }
  return b;
}

// Blocks of 256 values: the block's maximum by a VMAXPS tree (no index bookkeeping per value), and
// only when it beats the running maximum (strictly: the first maximum wins) a scan of that block
// for the first value equal to it. A NaN anywhere in a block sends the span to the scalar scan.
inline ArgBest argmax_span(const float* p, int64_t lo, int64_t hi) {
  ArgBest b{-INFINITY, -1, -1};
  int64_t j = lo;
#ifdef SGL_AVX512
  constexpr int64_t BLK = 256;
  for (; j + BLK <= hi; j += BLK) {
    const float* q = p + j;
    __m512 v[16];
    for (int k = 0; k < 16; ++k) v[k] = _mm512_loadu_ps(q + 16 * k);
    __mmask16 nan = 0;
    for (int k = 0; k < 16; k += 2) nan |= _mm512_cmp_ps_mask(v[k], v[k + 1], _CMP_UNORD_Q);
    if (nan) return argmax_scalar(p, lo, hi, ArgBest{-INFINITY, -1, -1});  // the first NaN (rare)
    __m512 m8[8];
    for (int k = 0; k < 8; ++k) m8[k] = _mm512_max_ps(v[k], v[k + 8]);
    for (int k = 0; k < 4; ++k) m8[k] = _mm512_max_ps(m8[k], m8[k + 4]);
    const __m512 m = _mm512_max_ps(_mm512_max_ps(m8[0], m8[2]), _mm512_max_ps(m8[1], m8[3]));
    const float bm = _mm512_reduce_max_ps(m);
    if (b.i >= 0 && !(bm > b.v)) continue;
    const __m512 t = _mm512_set1_ps(bm);
    for (int k = 0; k < 16; ++k) {
      const __mmask16 eq = _mm512_cmp_ps_mask(v[k], t, _CMP_EQ_OQ);
      if (eq) { b.v = bm; b.i = j + 16 * k + __builtin_ctz((unsigned)eq); break; }
    }
  }
#endif
  return argmax_scalar(p, j, hi, b);
}

// argmax_rows(x [B, V] float32, unit stride along V, threads) -> [B] int64.
at::Tensor argmax_rows(const at::Tensor& x, int64_t threads) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) >= 1 && x.stride(1) == 1,
                    "argmax_rows: x must be float32 [B, V] with V >= 1 and unit stride along V");
  TORCH_CHECK_VALUE(x.size(1) < (int64_t(1) << 31), "argmax_rows: V must be below 2^31, got ", x.size(1));
  TORCH_CHECK_VALUE(threads >= 1 && threads <= 1024, "argmax_rows: threads must be in [1, 1024], got ", threads);
  const int64_t B = x.size(0), V = x.size(1), rs = x.stride(0);
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  if (B == 0) return out;
  const float* p = x.data_ptr<float>();
  // four shares per thread, each at least ~32k values (fewer for a small batch): a worker that
  // wakes late or loses its core leaves the caller at most one small share to wait for
  const int64_t grain = std::max<int64_t>(256, (int64_t(1) << 15) / B);
  const int n = (int)std::max<int64_t>(1, std::min<int64_t>(4 * threads, V / grain));
  std::vector<ArgBest> part((size_t)(B * n));
  auto share = [&](int64_t c) {
    int64_t lo, hi;
    sglite_pool::split(0, V, (int)c, n, lo, hi);
    for (int64_t r = 0; r < B; ++r) part[(size_t)(r * n + c)] = argmax_span(p + r * rs, lo, hi);
  };
  sglite_pool::Pool::get().run((int)std::min<int64_t>(threads, n), n, share);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < B; ++r) {
    const ArgBest* q = part.data() + r * n;
    int64_t pick = -1, nan = -1;
    float best = 0.f;
    for (int c = 0; c < n && nan < 0; ++c) {
      if (q[c].nan >= 0) nan = q[c].nan;
      else if (q[c].i >= 0 && (pick < 0 || q[c].v > best)) { best = q[c].v; pick = q[c].i; }
    }
    o[r] = nan >= 0 ? nan : pick;
  }
  return out;
}

// ---- dequant_rows: rows `ids` of a group-quantized weight (an embedding lookup of a quantized
// table), w = float(code) * float(scale) [+ float(min)] in float32 with each product and sum
// rounded (as QuantLinearWeight.dequantize's torch ops), then cast to the output dtype. Codes in
// the row layout (per 32-block: 4-bit -- byte j holds codes j (low nibble) and j + 16 (high);
// 8-bit -- one byte per code) or the 16-row tiled one (quant_layout.tile_views: codes
// [N/16, K/32, C, 16, 4] bytes, scales / mins [N/16, G, 16]).
template <typename S, typename O>
void dequant_rows_t(const uint8_t* q, const S* sc, const S* mn, const int64_t* ids, int64_t M, int64_t N, int64_t K,
                    int64_t bits, int64_t gs, bool tiled, O* out) {
  const int64_t nb = K / 32, G = K / gs, C = bits;  // C: 4-byte groups per 32-block
  const int64_t row_bytes = K * bits / 8;
  for (int64_t r = 0; r < M; ++r) {
    const int64_t n = ids[r], t = n / 16, lane = n % 16;
    O* o = out + r * K;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t blk[32];
      if (tiled) {
        const uint8_t* base = q + ((t * nb + b) * C * 16) * 4;
        for (int64_t c = 0; c < C; ++c) std::memcpy(blk + 4 * c, base + (c * 16 + lane) * 4, 4);
      } else {
        std::memcpy(blk, q + n * row_bytes + b * C * 4, (size_t)(C * 4));
      }
      uint8_t code[32];
      if (bits == 8) std::memcpy(code, blk, 32);
      else for (int j = 0; j < 16; ++j) { code[j] = blk[j] & 0xF; code[j + 16] = blk[j] >> 4; }
      for (int h = 0; h < 32; h += 16) {  // a scale (and min) per 16 codes: groups of 16, 32 or more
        const int64_t g = (b * 32 + h) / gs;
        const int64_t si = tiled ? (t * G + g) * 16 + lane : n * G + g;
        const float s = (float)sc[si], m = mn ? (float)mn[si] : 0.f;
        O* ob = o + b * 32 + h;
#ifdef SGL_AVX512
        if constexpr (std::is_same<O, bf16>::value) {  // 16 codes at once; the rounding of c10's bf16 (rne_bf16)
          __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(code + h)))),
                                   _mm512_set1_ps(s));
          if (mn) v = _mm512_add_ps(v, _mm512_set1_ps(m));
          _mm256_storeu_si256((__m256i*)ob, rne_bf16(v));
          continue;
        }
#endif
        if (mn) for (int j = 0; j < 16; ++j) ob[j] = cast<O>((float)code[h + j] * s + m);  // no FMA (-ffp-contract=off)
        else for (int j = 0; j < 16; ++j) ob[j] = cast<O>((float)code[h + j] * s);
      }
    }
  }
}

// dequant_rows(qweight, scales [N, G] | tiled, mins or None, ids [M] int64, bits 4 | 8, group size,
// K, tiled, out dtype float32 | bfloat16) -> [M, K].
at::Tensor dequant_rows(const at::Tensor& q, const at::Tensor& sc, const c10::optional<at::Tensor>& mn_opt,
                        const at::Tensor& ids, int64_t bits, int64_t gs, int64_t K, bool tiled, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(bits == 4 || bits == 8, "dequant_rows: bits must be 4 or 8, got ", bits);
  TORCH_CHECK_VALUE(K > 0 && K % 32 == 0 && gs > 0 && (gs % 16 == 0) && K % gs == 0 && (bits == 8 || gs % 32 == 0),
                    "dequant_rows: in_features must be a multiple of 32 and of the group size (", gs, "), got ", K);
  TORCH_CHECK_VALUE(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 2 && q.size(1) * 8 == K * bits,
                    "dequant_rows: qweight must be contiguous uint8 [N, K * bits / 8]");
  const int64_t N = q.size(0), G = K / gs;
  TORCH_CHECK_VALUE(!tiled || N % 16 == 0, "dequant_rows: a tiled weight needs N % 16 == 0, got ", N);
  const auto st = sc.scalar_type();
  TORCH_CHECK_VALUE((st == at::kFloat || st == at::kHalf) && sc.is_contiguous() && sc.numel() == N * G,
                    "dequant_rows: scales must be contiguous float32 or float16 with N * K / group_size values");
  const bool has_min = mn_opt.has_value() && mn_opt->defined();
  if (has_min)
    TORCH_CHECK_VALUE(mn_opt->scalar_type() == st && mn_opt->is_contiguous() && mn_opt->numel() == N * G,
                      "dequant_rows: mins must be contiguous, of the scales' dtype and shape");
  TORCH_CHECK_VALUE(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "dequant_rows: ids must be contiguous int64 [M]");
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16, "dequant_rows: dtype must be float32 or bfloat16");
  const int64_t M = ids.numel();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) TORCH_CHECK_INDEX(ip[r] >= 0 && ip[r] < N, "dequant_rows: id ", ip[r], " outside [0, ", N, ")");
  at::Tensor out = at::empty({M, K}, q.options().dtype(dtype));
  const uint8_t* qp = q.data_ptr<uint8_t>();
  auto go = [&](auto* sp, auto* mp) {
    if (dtype == at::kFloat) dequant_rows_t(qp, sp, mp, ip, M, N, K, bits, gs, tiled, out.data_ptr<float>());
    else dequant_rows_t(qp, sp, mp, ip, M, N, K, bits, gs, tiled, out.data_ptr<bf16>());
  };
  if (st == at::kFloat) go(sc.data_ptr<float>(), has_min ? mn_opt->data_ptr<float>() : (const float*)nullptr);
  else go(sc.data_ptr<at::Half>(), has_min ? mn_opt->data_ptr<at::Half>() : (const at::Half*)nullptr);
  return out;
}

}  // namespace

TORCH_LIBRARY(sglite_cpu_elementwise, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_store_kv(Tensor qk, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_buffer, Tensor(b!) v_buffer, "
        "Tensor out_cache_loc, int num_q_heads) -> Tensor");
  m.def("argmax_rows(Tensor x, int threads) -> Tensor");
  m.def("dequant_rows(Tensor qweight, Tensor scales, Tensor? mins, Tensor ids, int bits, int group_size, "
        "int in_features, bool tiled, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(sglite_cpu_elementwise, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_store_kv", &rope_store_kv);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("dequant_rows", &dequant_rows);
}
