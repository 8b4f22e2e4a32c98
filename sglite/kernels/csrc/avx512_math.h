// Shared AVX-512 math of sglite's C++ kernels; spliced into each source by
// sglite.kernels.cpu_build.read_source (so the build tag hashes it too). Needs <immintrin.h>.
#pragma once

namespace sglite_simd {
constexpr float kLog2e = 1.44269504088896341f, kLn2 = 0.693147180559945309f;  // log2(e), ln(2)

// e^x for x <= 0 (x >= -87 after the clamp): 2^n * p(r), n = round(x log2 e), r = x - n ln2 in
// two steps (Cody-Waite), p the degree-DEG Taylor polynomial (|r| <= ln2/2; relative error ~2e-7
// at the default 6, < 5e-5 at 4: enough for weights then rounded to bf16).
template <int DEG = 6>
inline __m512 exp_nonpos(__m512 x) {
  static_assert(DEG >= 1 && DEG <= 6, "exp_nonpos: degree 1..6");
  constexpr float inv_fact[] = {1.f, 1.f, 0.5f, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720};
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(inv_fact[DEG]);
  for (int k = DEG - 1; k >= 0; --k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(inv_fact[k]));
  return _mm512_scalef_ps(p, n);
}

// 2^x on 16 float32 lanes for finite x < 128 (2^x underflows to 0 below -149; -inf or NaN give
// NaN: callers mask those lanes): r = x - floor(x) in [0, 1) by one VREDUCEPS (round down, exact),
// p(r) the degree-3 polynomial of least maximum relative error for 2^r on [0, 1) (Remez exchange;
// max relative error 7.5e-5 with these float32 coefficients, tests/kernels/test_amx_softmax.py
// evaluates them from this file), and VSCALEFPS, which multiplies by 2^floor(x) itself: 5
// instructions (against round, subtract, 3 FMAs and scale for a reduction to [-1/2, 1/2]). For
// softmax weights that are rounded to bf16 (half an ulp: 2^-9 = 2.0e-3 relative, 26x larger);
// callers fold log2(e) into the scores (one multiply per query element, none per score).
inline __m512 exp2_deg3(__m512 x) {
  const __m512 r = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0780245513f), r, _mm512_set1_ps(0.226067185f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.695833504f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.999925256f));
  return _mm512_scalef_ps(p, x);
}

// exp2_deg3 on the lanes of k, zero elsewhere (the mask rides on the final scale: no extra
// instruction; masked lanes may hold anything, -inf and NaN included).
inline __m512 exp2_deg3_maskz(__mmask16 k, __m512 x) {
  const __m512 r = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0780245513f), r, _mm512_set1_ps(0.226067185f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.695833504f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.999925256f));
  return _mm512_maskz_scalef_ps(k, p, x);
}

// 2^x on 16 float32 lanes for x in [-150, 126] (callers clamp): the floor form of exp2_deg3 with
// the degree-5 polynomial of least maximum relative error for 2^r on [0, 1) (Remez exchange; max
// relative error 1.6e-7 with these float32 coefficients, about one float32 ulp; evaluated by
// tests/kernels/test_silu_fast.py from this file). 7 instructions against exp_nonpos's 13.
inline __m512 exp2_deg5(__m512 x) {
  const __m512 r = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.877576811e-03f), r, _mm512_set1_ps(8.989340626e-03f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.582631752e-02f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.401536107e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931530833e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.999999404e-01f));
  return _mm512_scalef_ps(p, x);
}

// silu(g) = g / (1 + 2^(-g log2 e)) on 16 float32 lanes (Elfwing et al. 2018, "SiLU"): exp2_deg5
// (rel. error 1.6e-7) on the exponent clamped to [-150, 126] (no overflow: g >= -87 is exact, below
// it the result is ~g 2^-126, as the division form's e^-87 clamp gave), and the reciprocal by
// VRCP14PS and one Newton step (rel. error ~2^-28) instead of a VDIVPS. The one silu of the bf16
// SwiGLU paths: cpu_gemv.cpp's silu_mul and quant_amx.h's gate/up output stage both call it, so the
// fused stage equals the product followed by silu_mul bit for bit.
inline __m512 silu16(__m512 g) {
  const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(g, _mm512_set1_ps(-1.44269504088896341f)), _mm512_set1_ps(-150.f)),
                                 _mm512_set1_ps(126.f));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp2_deg5(x));
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(g, _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.f)), r));
}

// gelu_tanh(x) = 0.5 x (1 + tanh(y)), y = sqrt(2/pi) (x + 0.044715 x^3) (Hendrycks & Gimpel 2016,
// the tanh approximation; torch's gelu(approximate="tanh")) on 16 float32 lanes: tanh(|y|) =
// (1 - e) / (1 + e) with e = e^(-2|y|) (exp_nonpos: abs. error ~1e-7), sign restored.
inline __m512 gelu_tanh16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                 _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x), _mm512_mul_ps(x, x), x));
  const __m512 e = exp_nonpos(_mm512_mul_ps(_mm512_set1_ps(-2.f), _mm512_abs_ps(y)));
  __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  t = _mm512_mask_sub_ps(t, _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_setzero_ps(), t);
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(one, t));
}
}  // namespace sglite_simd
