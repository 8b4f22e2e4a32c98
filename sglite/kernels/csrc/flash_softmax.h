// The flash tiles' online-softmax update (AVX-512), shared by the extend attention's tiles
// (extend_flash.h, extend_dot.h) and the decode cascade off the AMX tiles (decode_dot_cascade.h);
// spliced inside each source's anonymous namespace, where SGL_AVX512 is defined.
#pragma once

// Online-softmax update of 16 rows at a time: masks keys past each row's position, turns scores
// into weights exp(s - m_new) in place, and updates m, l and alpha = exp(m_old - m_new).
// (qpos, m, l, alpha: Rp per-row arrays.) LOG2: scores, m and the exponent in log2 units (the
// caller folded log2 e into the scale), weights 2^(s - m_new) by exp2_deg3 (5 instructions against
// exp_nonpos's 13; relative error 7.5e-5), for weights that are then rounded to bf16 (2^-9).
template <bool LOG2 = false>
void softmax_tile_into(float* s, int Rp, int kn, int64_t t0, bool full, int64_t window, const int32_t* qpos, float* m,
                       float* l, float* alpha_out) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  for (int r = 0; r < Rp; r += 16) {
    const __m512i qp = _mm512_loadu_si512(qpos + r);
    const __m512i lo = _mm512_sub_epi32(qp, _mm512_set1_epi32((int32_t)window));  // keys <= lo: outside
    const __m512 m_old = _mm512_loadu_ps(m + r);
    __m512 mx = m_old;
    for (int t = 0; t < kn; ++t) {
      __m512 sv = _mm512_loadu_ps(s + (size_t)t * Rp + r);
      if (!full) {
        const __m512i kt = _mm512_set1_epi32((int32_t)(t0 + t));
        __mmask16 hid = _mm512_cmpgt_epi32_mask(kt, qp);
        if (window > 0) hid |= _mm512_cmple_epi32_mask(kt, lo);
        sv = _mm512_mask_mov_ps(sv, hid, ninf);
        _mm512_storeu_ps(s + (size_t)t * Rp + r, sv);
      }
      mx = _mm512_max_ps(mx, sv);
    }
    // m_old = -inf: ~0, times l = acc = 0; a row that has seen no key yet (mx = -inf, a window's
    // first tiles) gets alpha 0 instead of exp(-inf + inf) = NaN
    const __mmask16 none = _mm512_cmp_ps_mask(mx, ninf, _CMP_EQ_OQ);
    const __m512 d_old = _mm512_sub_ps(m_old, mx);  // -inf where the row had seen no key
    const __m512 alpha = _mm512_mask_mov_ps(
        LOG2 ? sglite_simd::exp2_deg3(_mm512_max_ps(d_old, _mm512_set1_ps(-150.f))) : sglite_simd::exp_nonpos(d_old),
        none, _mm512_setzero_ps());
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < kn; ++t) {
      const __m512 sv = _mm512_loadu_ps(s + (size_t)t * Rp + r);
      const __mmask16 seen = _mm512_cmp_ps_mask(sv, ninf, _CMP_NEQ_OQ);
      const __m512 p = LOG2 ? sglite_simd::exp2_deg3_maskz(seen, _mm512_sub_ps(sv, mx))
                            : _mm512_maskz_mov_ps(seen, sglite_simd::exp_nonpos(_mm512_sub_ps(sv, mx)));
      _mm512_storeu_ps(s + (size_t)t * Rp + r, p);
      sum = _mm512_add_ps(sum, p);
    }
    _mm512_storeu_ps(m + r, mx);
    _mm512_storeu_ps(alpha_out + r, alpha);
    _mm512_storeu_ps(l + r, _mm512_fmadd_ps(_mm512_loadu_ps(l + r), alpha, sum));
  }
}

