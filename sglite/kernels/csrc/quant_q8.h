// The int8-activation GEMV (the Q8 path) of sglite's quantized weights: activation quantization,
// the row-layout kernels (portable and AVX-512 VNNI) and gemv_q8, which also dispatches to the
// 16-row tiles of quant_tiles.h. Spliced by quant_rows.h inside namespace sglite_quant (uses its
// QW, BLK, scale_at, code_at, with_rows / with_bits / with_scale_type, AtPar). Contract and torch
// reference: sglite/kernels/quant_cpu.py (gemv_q8, quantize_act_q8_reference).
// ---- int8 activations (the Q8 path; torch reference: quant_cpu.quantize_act_q8_reference) ----
// Per row m and 32-block b of x: d = max|x| / 127, xq = round_half_even(x * (1 / d)) (0 when d is
// 0), clamped to [-127, 127]; dx[m, b] = d, sx[m, b] = d * sum(xq) (the offsets' factor).
inline void quantize_q8(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx) {
  const int64_t nb = K / BLK;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xr = x + m * K + b * BLK;
#ifdef SGQ_AVX512
      {  // the same operations 16 lanes at a time (|x|, max, one division, x * id, round half even,
         // clamp, integer sum): bit for bit the scalar loop below (it is serial work between the
         // decode's threaded GEMVs, ~0.3 ms a step of the default model as scalar code)
        const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        const __m512 idv = _mm512_set1_ps(id), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
        constexpr int RNE = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_mul_ps(x0, idv), RNE))));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_mul_ps(x1, idv), RNE))));
        _mm_storeu_si128((__m128i*)(xq + m * K + b * BLK), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(xq + m * K + b * BLK + 16), _mm512_cvtepi32_epi8(q1));
        dx[m * nb + b] = d;
        sx[m * nb + b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        continue;
      }
#endif
      float amax = 0.f;
      for (int i = 0; i < BLK; ++i) amax = std::max(amax, std::fabs(xr[i]));
      const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      int sum = 0;
      for (int i = 0; i < BLK; ++i) {
        float v = std::nearbyint(xr[i] * id);
        v = std::min(127.f, std::max(-127.f, v));
        xq[m * K + b * BLK + i] = (int8_t)v;
        sum += (int)v;
      }
      dx[m * nb + b] = d;
      sx[m * nb + b] = d * (float)sum;
    }
}

// group 16 (8-bit codes, GGUF Q6_K): the offsets' factor per 16-group, sx16[m, 2b + h] =
// dx[m, b] * sum(xq[m, 32 b + 16 h .. + 16]) (the group-32 sx of quantize_q8 covers both halves)
inline void group_sx16(const int8_t* xq, const float* dx, int64_t M, int64_t K, float* sx16) {
  const int64_t nb = K / BLK;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b)
      for (int h = 0; h < 2; ++h) {
        int32_t sum = 0;
        for (int i = 0; i < 16; ++i) sum += xq[m * K + b * BLK + 16 * h + i];
        sx16[m * 2 * nb + 2 * b + h] = dx[m * nb + b] * (float)sum;
      }
}

// portable rows: y[m, n] = sum_g s[n, g] * (dx[m, b(g)] * idot_g(q, xq)) + mn[n, g] * sx[m, g] over the
// groups g (32-blocks, or their 16-halves when w.gs == 16: sx then per 16-group, group_sx16)
template <typename ST>
void rows_q8_portable(const int8_t* xq, const float* dx, const float* sx, int64_t M, int64_t K,
                      const QW& w, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / BLK, rowb = K * w.bits / 8;
  if (w.gs != BLK) {
    const int64_t G = K / w.gs, gs = w.gs;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* qr = w.q + n * rowb;
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          int32_t d = 0;
          for (int64_t i = 0; i < gs; ++i) d += code_at(qr, w.bits, g * gs + i) * xq[m * K + g * gs + i];
          acc += scale_at((const ST*)w.s, n * G + g) * (dx[m * nb + g * gs / BLK] * (float)d);
          if (w.mn) acc += scale_at((const ST*)w.mn, n * G + g) * sx[m * G + g];
        }
        y[m * w.N + n] = acc;
      }
    }
    return;
  }
  const ST* ws = (const ST*)w.s;
  const ST* wm = (const ST*)w.mn;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = w.q + n * rowb;
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* xr = xq + m * K + b * BLK;
        int32_t d = 0;
        if (w.bits == 8) {
          for (int i = 0; i < BLK; ++i) d += (int32_t)qr[b * BLK + i] * xr[i];
        } else {
          const uint8_t* p = qr + b * BLK / 2;
          for (int i = 0; i < 16; ++i) d += (int32_t)(p[i] & 0xF) * xr[i] + (int32_t)(p[i] >> 4) * xr[i + 16];
        }
        acc += scale_at(ws, n * nb + b) * (dx[m * nb + b] * (float)d);
        if (wm) acc += scale_at(wm, n * nb + b) * sx[m * nb + b];
      }
      y[m * w.N + n] = acc;
    }
  }
}

#ifdef SGQ_VNNI
// 64 codes (two 32-blocks b0, b1) as unsigned bytes; `two` false: b0 only, the rest zero. 8 bits:
// channel order. 4 bits: [lo nibbles b0 | lo b1 | hi b0 | hi b1] (16 bytes each, so channels
// [b0 0..15 | b1 0..15 | b0 16..31 | b1 16..31]); the activations are laid out to match (arrange_q8).
template <int BITS> inline __m512i codes64(const uint8_t* qr, int64_t kb, bool two) {
  if (BITS == 8) return two ? _mm512_loadu_si512(qr + kb) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, qr + kb);
  const __m256i raw = two ? _mm256_loadu_si256((const __m256i*)(qr + kb / 2))
                          : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)(qr + kb / 2)));
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, m4)),
                            _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), 1);
}

// xq [M, K] -> xp [M, np * 64] in codes64's channel order per pair of blocks, zero padded
inline void arrange_q8(const int8_t* xq, int64_t M, int64_t K, int bits, int8_t* xp) {
  const int64_t nb = K / BLK, np = (nb + 1) / 2, xs = np * 64;
  std::memset(xp, 0, M * xs);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* src = xq + m * K + b * BLK;
      int8_t* dst = xp + m * xs + (b / 2) * 64;
      if (bits == 8) {
        std::memcpy(dst + (b & 1) * 32, src, 32);
      } else {
        std::memcpy(dst + (b & 1) * 16, src, 16);
        std::memcpy(dst + 32 + (b & 1) * 16, src + 16, 16);
      }
    }
}

inline __m512 load_scales16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load_scales16(const uint16_t* p, __mmask16 k) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p)); }

// VPDPBUSD (u8 codes x s8 activations -> int32 per 4 channels) per pair of blocks; each lane's
// float sum is scaled by its block's s[n, b] * dx[m, b], picked (VPERMPS) from the 16 products of
// the current 16-block chunk; offsets as mins . sx per chunk; one horizontal sum per row.
template <int M, int BITS, typename ST>
void rows_q8_avx(const int8_t* xp, const float* dx, const float* sx, int64_t K, const QW& w, int64_t n0,
                 int64_t n1, float* y) {
  const int64_t nb = K / BLK, xs = (nb + 1) / 2 * 64, rowb = K * BITS / 8;
  const __m512i base = BITS == 4 ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                                 : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i step = _mm512_set1_epi32(2);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = w.q + n * rowb;
    const ST* sr = (const ST*)w.s + n * nb;
    const ST* mr = w.mn ? (const ST*)w.mn + n * nb : nullptr;
    __m512 a0[M], a1[M];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nb; c += 16) {
      const int64_t nbc = std::min<int64_t>(16, nb - c);
      const __mmask16 k = nbc == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nbc) - 1);
      const __m512 sv = load_scales16(sr + c, k);
      __m512 cs[M];
      for (int m = 0; m < M; ++m) cs[m] = _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(k, dx + m * nb + c));
      if (mr) {
        const __m512 mv = load_scales16(mr + c, k);
        for (int m = 0; m < M; ++m) a1[m] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, sx + m * nb + c), a1[m]);
      }
      __m512i idx = base;
      for (int64_t b = 0; b < nbc; b += 2, idx = _mm512_add_epi32(idx, step)) {
        const int64_t j = (c + b) / 2;
        const __m512i z = codes64<BITS>(qr, j * 2 * BLK, c + b + 1 < nb);
        for (int m = 0; m < M; ++m) {
          const __m512i xv = _mm512_loadu_si512(xp + m * xs + j * 64);
          const __m512 f = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), z, xv));
          const __m512 t = _mm512_permutexvar_ps(idx, cs[m]);
          if (b & 2) a1[m] = _mm512_fmadd_ps(f, t, a1[m]);
          else a0[m] = _mm512_fmadd_ps(f, t, a0[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m) y[m * w.N + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
  }
}

#endif

#include "quant_tiles.h"

// y [M, N] float32 = q8(x) @ W_stored.T for x [M, K] float32, group size 32 (or 16 with 8-bit codes)
template <typename Par = AtPar>
void gemv_q8(const QW& w, const float* xf, int64_t M, float* y, bool portable = false, const Par& par = Par{}) {
  const int64_t K = w.K, nb = K / BLK;
  if (M > 8) {  // blocks of 8 rows, as gemv_float
    std::vector<float> part(8 * w.N);
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t mb = std::min<int64_t>(8, M - m0);
      gemv_q8(w, xf + m0 * K, mb, part.data(), portable, par);
      std::memcpy(y + m0 * w.N, part.data(), sizeof(float) * mb * w.N);
    }
    return;
  }
  std::vector<int8_t> xq(M * K + 64);
  std::vector<float> dx(M * nb), sx(M * nb);
  quantize_q8(xf, M, K, xq.data(), dx.data(), sx.data());
  if (w.gs != BLK) {  // group 16: the offsets' factor per 16-group
    sx.resize(M * 2 * nb);
    group_sx16(xq.data(), dx.data(), M, K, sx.data());
  }
  if (w.tiled) {
    gemv_q8_tiled(w, xq.data(), dx.data(), sx.data(), M, y, portable, par);
    return;
  }
  const int64_t grain = std::max<int64_t>(16, (int64_t)(1 << 16) / std::max<int64_t>(K, 1));
#ifdef SGQ_VNNI
  if (!portable && w.gs == BLK) {  // group 16 in the row layout (N % 16 != 0): the portable rows
    std::vector<int8_t> xp(M * ((nb + 1) / 2) * 64);
    arrange_q8(xq.data(), M, K, w.bits, xp.data());
    par(0, w.N, grain, [&](int64_t n0, int64_t n1) {
      with_scale_type(w, [&](auto st) {
        with_bits(w.bits, [&](auto bits) {
          with_rows(M, [&](auto m) {
            constexpr int MM = decltype(m)::value, B = decltype(bits)::value;
            rows_q8_avx<MM, B, decltype(st)>(xp.data(), dx.data(), sx.data(), K, w, n0, n1, y);
          });
        });
      });
    });
    return;
  }
#endif
  (void)portable;
  par(0, w.N, grain, [&](int64_t n0, int64_t n1) {
    with_scale_type(w, [&](auto st) {
      rows_q8_portable<decltype(st)>(xq.data(), dx.data(), sx.data(), M, K, w, n0, n1, y);
    });
  });
}
