// The float32 flash tiles of the extend attention's per-task path (AVX-512 FMAs, or scalar
// loops without AVX-512), spliced into cpu_extend_attention.cpp inside its anonymous namespace
// after Task / Ext (contract: sglite/kernels/cpu_attention.py, extend_attention): per-thread
// scratch, K/V tiles widened to float32, scores, the online-softmax update and P.V.
#pragma once

// Per-thread scratch: Qt [Dp][Rp] (queries transposed, pre-scaled), kf/vf [KT][Dp] (the tile's K and
// V rows widened to float32), s [KT][Rp] (scores, then weights), acc [Rp][Dp], per-row m, l, alpha.
struct Scratch {
  std::vector<float> qt, kf, vf, s, acc, m, l, alpha; std::vector<int32_t> qpos;
  Scratch(int Dp, int Rp) : qt((size_t)Dp * Rp), kf((size_t)KT * Dp), vf((size_t)KT * Dp), s((size_t)KT * Rp),
                            acc((size_t)Rp * Dp), m(Rp), l(Rp), alpha(Rp), qpos(Rp) {}
};

#ifdef SGL_AVX512
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {  // bf16 bits -> float32 (exact)
  __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#endif

// Widen the tile's rows t0 .. t0+kn-1 of one head into dst [KT][Dp] (zero past D and past kn up to
// a multiple of 4); false when a slot lies outside the pool.
template <typename T>
bool load_tile(const T* base, int64_t s0, const int32_t* slots, int64_t S, int kn, int D, int Dp, float* dst) {
  const int kn4 = (kn + 3) & ~3;
  for (int t = 0; t < kn; ++t) {
    const int64_t sl = slots[t];
    if (sl < 0 || sl >= S) return false;
    const T* src = base + sl * s0;
    float* d = dst + (size_t)t * Dp;
#ifdef SGL_AVX512
    for (int c = 0; c < Dp; c += 16) {
      const int rem = D - c;
      const __mmask16 m = rem >= 16 ? (__mmask16)0xFFFF : (rem <= 0 ? (__mmask16)0 : (__mmask16)((1u << rem) - 1));
      _mm512_storeu_ps(d + c, load16(src + c, m));
    }
#else
    for (int i = 0; i < D; ++i) d[i] = widen(src[i]);
    for (int i = D; i < Dp; ++i) d[i] = 0.f;
#endif
  }
  std::fill(dst + (size_t)kn * Dp, dst + (size_t)kn4 * Dp, 0.f);
  return true;
}

#ifdef SGL_AVX512
using sglite_simd::exp_nonpos;
#include "flash_softmax.h"

// s[(t+u)*Rp + 16(rb0+n) ..] = sum_d kf[t+u][d] * qt[d][16(rb0+n) ..] for 4 keys and NB row blocks.
template <int NB>
void score_block(const float* kf, int Dp, const float* qt, int Rp, int rb0, int t, int D, float* s) {
  __m512 a[4][NB];
  for (int u = 0; u < 4; ++u)
    for (int n = 0; n < NB; ++n) a[u][n] = _mm512_setzero_ps();
  const float* k0 = kf + (size_t)t * Dp;
  for (int d = 0; d < D; ++d) {
    __m512 qv[NB];
    for (int n = 0; n < NB; ++n) qv[n] = _mm512_loadu_ps(qt + (size_t)d * Rp + 16 * (rb0 + n));
    for (int u = 0; u < 4; ++u) {
      const __m512 kb = _mm512_set1_ps(k0[(size_t)u * Dp + d]);
      for (int n = 0; n < NB; ++n) a[u][n] = _mm512_fmadd_ps(kb, qv[n], a[u][n]);
    }
  }
  for (int u = 0; u < 4; ++u)
    for (int n = 0; n < NB; ++n) _mm512_storeu_ps(s + (size_t)(t + u) * Rp + 16 * (rb0 + n), a[u][n]);
}

void scores(const float* kf, int Dp, const float* qt, int Rp, int kn, int D, float* s) {
  const int nrb = Rp / 16, kn4 = (kn + 3) & ~3;
  for (int t = 0; t < kn4; t += 4)
    for (int rb = 0; rb < nrb; rb += 4) {
      switch (std::min(4, nrb - rb)) {
        case 4: score_block<4>(kf, Dp, qt, Rp, rb, t, D, s); break;
        case 3: score_block<3>(kf, Dp, qt, Rp, rb, t, D, s); break;
        case 2: score_block<2>(kf, Dp, qt, Rp, rb, t, D, s); break;
        default: score_block<1>(kf, Dp, qt, Rp, rb, t, D, s);
      }
    }
}

void softmax_tile(float* s, int Rp, int kn, int64_t t0, bool full, int64_t window, Scratch& w) {
  softmax_tile_into(s, Rp, kn, t0, full, window, w.qpos.data(), w.m.data(), w.l.data(), w.alpha.data());
}

// acc[r] = acc[r] * alpha[r] + sum_t s[t][r] * vf[t] for RB rows from r0 (Dp = 16 NC).
template <int NC, int RB>
void pv_block(const float* s, int Rp, int r0, const float* vf, int kn, const float* alpha, float* acc) {
  constexpr int Dp = 16 * NC;
  __m512 a[RB][NC];
  for (int i = 0; i < RB; ++i) {
    const __m512 al = _mm512_set1_ps(alpha[r0 + i]);
    for (int c = 0; c < NC; ++c) a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)(r0 + i) * Dp + 16 * c), al);
  }
  for (int t = 0; t < kn; ++t) {
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(vf + (size_t)t * Dp + 16 * c);
    for (int i = 0; i < RB; ++i) {
      const __m512 w = _mm512_set1_ps(s[(size_t)t * Rp + r0 + i]);
      for (int c = 0; c < NC; ++c) a[i][c] = _mm512_fmadd_ps(w, vv[c], a[i][c]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + (size_t)(r0 + i) * Dp + 16 * c, a[i][c]);
}

template <int NC>
void pv_rows(const float* s, int Rp, int R, const float* vf, int kn, const float* alpha, float* acc) {
  constexpr int RB = NC <= 4 ? 4 : (NC <= 8 ? 2 : 1);
  int r = 0;
  for (; r + RB <= R; r += RB) pv_block<NC, RB>(s, Rp, r, vf, kn, alpha, acc);
  for (; r < R; ++r) pv_block<NC, 1>(s, Rp, r, vf, kn, alpha, acc);
}

void pv(const float* s, int Rp, int R, const float* vf, int Dp, int kn, const float* alpha, float* acc) {
  if (Dp == 64) pv_rows<4>(s, Rp, R, vf, kn, alpha, acc);
  else if (Dp == 128) pv_rows<8>(s, Rp, R, vf, kn, alpha, acc);
  else pv_rows<16>(s, Rp, R, vf, kn, alpha, acc);
}
#else
void scores(const float* kf, int Dp, const float* qt, int Rp, int kn, int D, float* s) {
  const int kn4 = (kn + 3) & ~3;
  for (int t = 0; t < kn4; ++t)
    for (int r = 0; r < Rp; ++r) {
      float a = 0.f;
      for (int d = 0; d < D; ++d) a += kf[(size_t)t * Dp + d] * qt[(size_t)d * Rp + r];
      s[(size_t)t * Rp + r] = a;
    }
}

void softmax_tile(float* s, int Rp, int kn, int64_t t0, bool full, int64_t window, Scratch& w) {
  for (int r = 0; r < Rp; ++r) {
    float mx = w.m[r];
    for (int t = 0; t < kn; ++t) {
      float& sv = s[(size_t)t * Rp + r];
      if (!full && (t0 + t > w.qpos[r] || (window > 0 && t0 + t <= w.qpos[r] - window))) sv = -INFINITY;
      mx = std::max(mx, sv);
    }
    const float alpha = mx == -INFINITY ? 0.f : std::exp(w.m[r] - mx);
    float sum = 0.f;
    for (int t = 0; t < kn; ++t) {
      float& sv = s[(size_t)t * Rp + r];
      sv = sv == -INFINITY ? 0.f : std::exp(sv - mx);
      sum += sv;
    }
    w.m[r] = mx; w.alpha[r] = alpha; w.l[r] = w.l[r] * alpha + sum;
  }
}

void pv(const float* s, int Rp, int R, const float* vf, int Dp, int kn, const float* alpha, float* acc) {
  for (int r = 0; r < R; ++r) {
    float* a = acc + (size_t)r * Dp;
    for (int d = 0; d < Dp; ++d) a[d] *= alpha[r];
    for (int t = 0; t < kn; ++t) sglite_scalar::axpy(s[(size_t)t * Rp + r], vf + (size_t)t * Dp, a, Dp);
  }
}
#endif
