// bf16 dot-product flash tiles (VDPBF16PS: two bf16 products summed into each float32 lane, twice
// the multiply-adds of a float32 FMA) for CPUs with AVX512-BF16, shared by the extend attention off
// the AMX tiles (extend_dot.h) and the decode cascade off them (decode_dot_cascade.h); spliced inside
// each source's anonymous namespace after flash_softmax.h. Defines SGL_DOT_TILES where compiled.
//   S = Q K^T: lanes are 16 query rows; each step broadcasts one key's (d, d + 1) pair straight
//     from the pool (no widened copy of K) against the rows' (d, d + 1) query pairs (qp [D/2][Rp]);
//   P V:       lanes are 16 head dims; each step broadcasts one row's weights of two keys
//     (t, t + 1) (pp [kn/2][Rp]) against those keys' values, interleaved per dimension (vp [kn/2][Dp]).
#pragma once

#if defined(SGL_AVX512) && defined(__AVX512BF16__)
#define SGL_DOT_TILES 1

constexpr int kDotKT = 64;  // keys a tile

// Per-thread scratch of a walk over Rp query rows: qp [Dp/2][Rp] (query pairs), s [KT][Rp] (scores,
// then weights), pp [KT/2][Rp] (weight pairs), vp [KT/2][Dp] (value pairs), acc [Rp][Dp] (unnormalised
// outputs), per-row running max m, sum l, rescale alpha and position qpos.
struct DotWork {
  std::vector<uint32_t> qp, pp, vp; std::vector<float> s, acc, m, l, alpha; std::vector<int32_t> qpos;
  DotWork(int Dp, int Rp) : qp((size_t)Dp / 2 * Rp), pp((size_t)kDotKT / 2 * Rp), vp((size_t)kDotKT / 2 * Dp),
                            s((size_t)kDotKT * Rp), acc((size_t)Rp * Dp), m(Rp), l(Rp), alpha(Rp), qpos(Rp) {}
};

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  return x;
}

// Elements (i, i + 1) of a bf16 or float32 query as a bf16 pair (float32 rounded to nearest even).
inline uint32_t query_pair(const void* q, bool q_bf16, int64_t i) {
  if (q_bf16) return load_pair((const uint16_t*)q + i);
  const float* f = (const float*)q + i;
  return (uint32_t)c10::BFloat16(f[0]).x | ((uint32_t)c10::BFloat16(f[1]).x << 16);
}

inline void prefetch_rows(const uint16_t* base, int64_t s0, const int32_t* slots, int n, int64_t S, int D) {
  for (int t = 0; t < n; ++t)
    if (slots[t] >= 0 && slots[t] < S)
      for (int c = 0; c < D; c += 32) _mm_prefetch((const char*)(base + slots[t] * s0 + c), _MM_HINT_T0);
}

// s[(t+u)*Rp + 16(rb0+n) ..] = scale * sum_p kr[u][2p, 2p+1] . qp[p][16(rb0+n) ..] for 4 keys, NB row blocks.
template <int NB>
void score_block_dot(const uint16_t* const* kr, const uint32_t* qp, int Rp, int rb0, int P2, float scale, int t, float* s) {
  __m512 a[4][NB];
  for (int u = 0; u < 4; ++u)
    for (int n = 0; n < NB; ++n) a[u][n] = _mm512_setzero_ps();
  // one base pointer for the query blocks (constant displacements) and one per key row: with an index
  // register per block GCC ran out of general registers and reloaded the NB query blocks for every key
  const uint16_t* k0 = kr[0];
  const uint16_t* k1 = kr[1];
  const uint16_t* k2 = kr[2];
  const uint16_t* k3 = kr[3];
  const uint32_t* qrow = qp + (size_t)16 * rb0;
  for (int p = 0; p < P2; ++p, qrow += Rp) {
    __m512bh qv[NB];
    for (int n = 0; n < NB; ++n) qv[n] = (__m512bh)_mm512_loadu_si512(qrow + 16 * n);
    const __m512bh kb[4] = {(__m512bh)_mm512_set1_epi32((int)load_pair(k0 + 2 * p)),
                            (__m512bh)_mm512_set1_epi32((int)load_pair(k1 + 2 * p)),
                            (__m512bh)_mm512_set1_epi32((int)load_pair(k2 + 2 * p)),
                            (__m512bh)_mm512_set1_epi32((int)load_pair(k3 + 2 * p))};
    for (int u = 0; u < 4; ++u)
      for (int n = 0; n < NB; ++n) a[u][n] = _mm512_dpbf16_ps(a[u][n], qv[n], kb[u]);
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int u = 0; u < 4; ++u)
    for (int n = 0; n < NB; ++n) _mm512_storeu_ps(s + (size_t)(t + u) * Rp + 16 * (rb0 + n), _mm512_mul_ps(a[u][n], sc));
}

// Scores of the tile's kn keys (rows kr[0 .. kn), padded to a multiple of 4 with zero rows).
void scores_dot(const uint16_t* const* kr, const uint32_t* qp, int Rp, int kn, int P2, float scale, float* s) {
  const int nrb = Rp / 16, kn4 = (kn + 3) & ~3;
  for (int t = 0; t < kn4; t += 4)
    for (int rb = 0; rb < nrb; rb += 4) {
      switch (std::min(4, nrb - rb)) {
        case 4: score_block_dot<4>(kr + t, qp, Rp, rb, P2, scale, t, s); break;
        case 3: score_block_dot<3>(kr + t, qp, Rp, rb, P2, scale, t, s); break;
        case 2: score_block_dot<2>(kr + t, qp, Rp, rb, P2, scale, t, s); break;
        default: score_block_dot<1>(kr + t, qp, Rp, rb, P2, scale, t, s);
      }
    }
}

// pp[t/2][r] = (bf16 s[t][r], bf16 s[t+1][r]) for the tile's kn weights (s[kn] taken as 0 when kn is odd).
void pack_weights(const float* s, int Rp, int kn, uint32_t* pp) {
  for (int t = 0; t < kn; t += 2)
    for (int r = 0; r < Rp; r += 16) {
      const __m512 a = _mm512_loadu_ps(s + (size_t)t * Rp + r);
      const __m512 b = t + 1 < kn ? _mm512_loadu_ps(s + (size_t)(t + 1) * Rp + r) : _mm512_setzero_ps();
      const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
      const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
      _mm512_storeu_si512(pp + (size_t)(t / 2) * Rp + r, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}

// vp[t/2][d] = (V[t][d], V[t+1][d]) for the tile's kn value rows (zero past D up to Dp and for the
// missing partner of an odd kn); false when a slot lies outside the pool.
bool pack_values(const uint16_t* base, int64_t s0, const int32_t* slots, int64_t S, int kn, int D, int Dp, uint32_t* vp) {
  // whole 32-value blocks (D a multiple of 32, no padding): each block of the two rows interleaved
  // by two VPERMT2W, 6 instructions a 32 values against 14 for the widen-shift-or below
  const bool whole = D == Dp && D % 32 == 0;
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i il = _mm512_load_si512(lo_idx), ih = _mm512_load_si512(hi_idx);
  for (int t = 0; t < kn; t += 2) {
    if (slots[t] < 0 || slots[t] >= S || (t + 1 < kn && (slots[t + 1] < 0 || slots[t + 1] >= S))) return false;
    const uint16_t* x = base + slots[t] * s0;
    const uint16_t* y = t + 1 < kn ? base + slots[t + 1] * s0 : nullptr;
    if (whole) {
      uint32_t* out = vp + (size_t)(t / 2) * Dp;
      for (int c = 0; c < D; c += 32) {
        const __m512i a = _mm512_loadu_si512(x + c), b = y ? _mm512_loadu_si512(y + c) : _mm512_setzero_si512();
        _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(a, il, b));
        _mm512_storeu_si512(out + c + 16, _mm512_permutex2var_epi16(a, ih, b));
      }
      continue;
    }
    for (int c = 0; c < Dp; c += 16) {
      const int rem = D - c;
      const __mmask16 m = rem >= 16 ? (__mmask16)0xFFFF : (rem <= 0 ? (__mmask16)0 : (__mmask16)((1u << rem) - 1));
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x + c));
      const __m512i hi = y ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, y + c)) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + (size_t)(t / 2) * Dp + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
  return true;
}

// acc[r] = acc[r] * alpha[r] + sum_t P[t][r] V[t] for RB rows from r0 over kn2 key pairs (Dp = 16 NC).
template <int NC, int RB>
void pv_block_dot(const uint32_t* pp, int Rp, int r0, const uint32_t* vp, int kn2, const float* alpha, float* acc) {
  constexpr int Dp = 16 * NC;
  __m512 a[RB][NC];
  for (int i = 0; i < RB; ++i) {
    const __m512 al = _mm512_set1_ps(alpha[r0 + i]);
    for (int c = 0; c < NC; ++c) a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)(r0 + i) * Dp + 16 * c), al);
  }
  for (int tp = 0; tp < kn2; ++tp) {
    __m512bh vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + (size_t)tp * Dp + 16 * c);
    for (int i = 0; i < RB; ++i) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[(size_t)tp * Rp + r0 + i]);
      for (int c = 0; c < NC; ++c) a[i][c] = _mm512_dpbf16_ps(a[i][c], vv[c], w);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + (size_t)(r0 + i) * Dp + 16 * c, a[i][c]);
}

template <int NC>
void pv_rows_dot(const uint32_t* pp, int Rp, int R, const uint32_t* vp, int kn2, const float* alpha, float* acc) {
  constexpr int RB = NC <= 4 ? 4 : (NC <= 8 ? 2 : 1);
  int r = 0;
  for (; r + RB <= R; r += RB) pv_block_dot<NC, RB>(pp, Rp, r, vp, kn2, alpha, acc);
  for (; r < R; ++r) pv_block_dot<NC, 1>(pp, Rp, r, vp, kn2, alpha, acc);
}

void pv_dot(const uint32_t* pp, int Rp, int R, const uint32_t* vp, int Dp, int kn, const float* alpha, float* acc) {
  const int kn2 = (kn + 1) / 2;
  if (Dp == 64) pv_rows_dot<4>(pp, Rp, R, vp, kn2, alpha, acc);
  else if (Dp == 128) pv_rows_dot<8>(pp, Rp, R, vp, kn2, alpha, acc);
  else pv_rows_dot<16>(pp, Rp, R, vp, kn2, alpha, acc);
}

// Rows [0, R) (padded to Rp; queries w.qp, positions w.qpos, and m = -inf, l = 0, acc = 0 set by
// the caller) attend keys [kfirst, kend) of one KV head (kh / vh: the head's K / V row of slot 0,
// row strides ks0 / vs0; slots[t]: key t's slot) in tiles of kDotKT keys from kfirst, with the
// causal mask past each row's position (rows see keys <= qpos; first_q / last_q: the smallest and
// largest) and, window > 0, before its window; scores scaled by `scale`, soft-capped when
// softcap > 0. Leaves the unnormalised outputs in w.acc, the running max in w.m and sum in w.l
// (natural-log units). False on a slot outside [0, S). The tiles work in log2 units (log2 e folded
// into the scale and the cap, weights by exp2_deg3, as on the AMX tiles); w.m goes back to natural
// units at the end.
bool walk_dot(const uint16_t* kh, int64_t ks0, const uint16_t* vh, int64_t vs0, const int32_t* slots, int64_t S,
              int D, int Dp, int R, int Rp, int64_t kfirst, int64_t kend, int64_t first_q, int64_t last_q,
              int64_t wnd, float scale, float softcap, DotWork& w) {
  alignas(64) static const uint16_t zero_row[256] = {};
  const uint16_t* kr[kDotKT + 3];
  for (int64_t t0 = kfirst; t0 < kend; t0 += kDotKT) {
    const int kn = (int)std::min<int64_t>(kDotKT, kend - t0);
    const int32_t* ts = slots + t0;
    if (t0 + kDotKT < kend) {  // the next tile's rows into cache while this one computes (scattered slots)
      const int nn = (int)std::min<int64_t>(kDotKT, kend - t0 - kDotKT);
      prefetch_rows(kh, ks0, ts + kDotKT, nn, S, D);
      prefetch_rows(vh, vs0, ts + kDotKT, nn, S, D);
    }
    for (int t = 0; t < kn; ++t) {
      if (ts[t] < 0 || ts[t] >= S) return false;
      kr[t] = kh + ts[t] * ks0;
    }
    for (int t = kn; t < ((kn + 3) & ~3); ++t) kr[t] = zero_row;
    scores_dot(kr, w.qp.data(), Rp, kn, D / 2, scale * sglite_simd::kLog2e, w.s.data());
    if (softcap > 0.f) {  // logit soft-capping on the scaled scores (Gemma 2): cap tanh(s / cap), in log2 units
      const float cap = softcap * sglite_simd::kLog2e, inv_cap = 1.f / cap;
      float* s = w.s.data();
      for (size_t i = 0; i < (size_t)kn * Rp; ++i) s[i] = cap * std::tanh(s[i] * inv_cap);
    }
    const bool full = t0 + kn - 1 <= first_q && (wnd <= 0 || t0 > last_q - wnd);
    softmax_tile_into<true>(w.s.data(), Rp, kn, t0, full, wnd, w.qpos.data(), w.m.data(), w.l.data(), w.alpha.data());
    pack_weights(w.s.data(), Rp, kn, w.pp.data());
    if (!pack_values(vh, vs0, ts, S, kn, D, Dp, w.vp.data())) return false;
    pv_dot(w.pp.data(), Rp, R, w.vp.data(), Dp, kn, w.alpha.data(), w.acc.data());
  }
  for (int r = 0; r < Rp; ++r) w.m[r] *= sglite_simd::kLn2;
  return true;
}
#endif
