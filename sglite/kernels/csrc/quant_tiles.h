// GEMV on quantized weights interleaved in tiles of 16 rows (layout and torch reference:
// sglite/kernels/quant_linear.py, tile_rows / QuantLinearWeight.untiled). Spliced by quant_q8.h inside
// namespace sglite_quant (uses its QW, BLK, scale_at, with_rows / with_bits / with_scale_type and,
// with VNNI, <immintrin.h>).
//
// Tile t holds rows 16t..16t+15. Per 32-block j its codes are 16 * 32 * bits / 8 bytes: for each
// group c of 4 consecutive code bytes of a row's packed block (8 groups at 8 bits, 4 at 4 bits),
// 64 bytes = the 16 rows' 4 bytes; its scales (and mins) are the 16 rows' values for block j,
// contiguous. So one VPDPBUSD multiplies 4 channels of 16 rows by 4 broadcast activation bytes,
// with no per-row horizontal sum at the end, and codes, scales and mins each stream in order.
// (The interleaving idea is llama.cpp's repacked Q4_0 "x8" CPU formats; this layout is our own.)
constexpr int64_t TILE = 16;

// byte i of group c of row n's packed block j inside the tiled codes
inline uint8_t tile_byte(const uint8_t* q, int64_t nb, int bits, int64_t n, int64_t j, int64_t c, int64_t i) {
  const int64_t bb = BLK * bits / 8;  // bytes per row and block
  return q[((n / TILE) * nb + j) * bb * TILE + c * 4 * TILE + (n % TILE) * 4 + i];
}

// Group 16 (8-bit codes only, GGUF Q6_K): the scales and mins of a tile are [group][lane] with two
// groups per 32-block (channels 0..15: code vectors c = 0..3, 16..31: c = 4..7), and sx holds the
// activations' offset factor per 16-group (group_sx16).
// portable: y[m, n] = sum_j s[n, j] * (dx[m, j] * idot_j) + mn[n, j] * sx[m, j], rows of tiles t0..t1
template <typename ST>
void rows_q8_tile_portable(const int8_t* xq, const float* dx, const float* sx, int64_t M, int64_t K,
                           const QW& w, int64_t t0, int64_t t1, float* y) {
  const int64_t nb = K / BLK, groups = BLK * w.bits / 32;
  const ST* ws = (const ST*)w.s;
  const ST* wm = (const ST*)w.mn;
  if (w.gs != BLK) {  // group 16, 8 bits: code vectors c < 4 -> group 2j, c >= 4 -> group 2j + 1
    const int64_t G = 2 * nb;
    for (int64_t n = t0 * TILE; n < t1 * TILE; ++n) {
      const int64_t si = (n / TILE) * G * TILE + n % TILE;
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t j = 0; j < nb; ++j) {
          const int8_t* xr = xq + m * K + j * BLK;
          for (int h = 0; h < 2; ++h) {
            int32_t d = 0;
            for (int64_t c = 4 * h; c < 4 * h + 4; ++c)
              for (int64_t i = 0; i < 4; ++i) d += (int32_t)tile_byte(w.q, nb, 8, n, j, c, i) * xr[4 * c + i];
            acc += scale_at(ws, si + (2 * j + h) * TILE) * (dx[m * nb + j] * (float)d);
            if (wm) acc += scale_at(wm, si + (2 * j + h) * TILE) * sx[m * G + 2 * j + h];
          }
        }
        y[m * w.N + n] = acc;
      }
    }
    return;
  }
  for (int64_t n = t0 * TILE; n < t1 * TILE; ++n) {
    const int64_t si = (n / TILE) * nb * TILE + n % TILE;  // scale of block j at si + j * TILE
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t j = 0; j < nb; ++j) {
        const int8_t* xr = xq + m * K + j * BLK;
        int32_t d = 0;
        for (int64_t c = 0; c < groups; ++c)
          for (int64_t i = 0; i < 4; ++i) {
            const int32_t b = tile_byte(w.q, nb, w.bits, n, j, c, i);
            if (w.bits == 8) d += b * xr[4 * c + i];
            else d += (b & 0xF) * xr[4 * c + i] + (b >> 4) * xr[16 + 4 * c + i];
          }
        acc += scale_at(ws, si + j * TILE) * (dx[m * nb + j] * (float)d);
        if (wm) acc += scale_at(wm, si + j * TILE) * sx[m * nb + j];
      }
      y[m * w.N + n] = acc;
    }
  }
}

#ifdef SGQ_VNNI
inline __m512 load_tile_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_tile_scales(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512i bcast4(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }

// M activation rows (int8 xq [M, K] in channel order, dx / sx [M, K / 32]) x tiles t0..t1: per
// block the tile's codes are loaded once and VPDPBUSD'd into each row's two int32 accumulators;
// then acc += (s * dx) * float(idot), accm += m * sx. 4 bits: the low nibbles (v & 0x0F) and the
// high ones left in place (v & 0xF0 = 16 * code, no shift per vector) go to separate accumulators,
// idot = (16 * i_lo + i_hi) / 16 with the 1/16 folded into the scale (a power of two: exact; the
// integers stay below 2^24, so float(16 * idot) is exact too).
// G16 (BITS 8): group 16, i0 / i1 hold the two 16-channel halves, each with its own scale and min.
template <int M, int BITS, typename ST, bool G16 = false>
void rows_q8_tile(const int8_t* xq, const float* dx, const float* sx, int64_t K, const QW& w, int64_t t0,
                  int64_t t1, float* y) {
  static_assert(!G16 || BITS == 8, "group 16 needs 8-bit codes");
  constexpr int NC = BLK * BITS / 32;  // 64-byte code vectors per block and tile
  constexpr int GB = G16 ? 2 : 1;  // groups per 32-block
  const int64_t nb = K / BLK;
  const __m512i m4 = _mm512_set1_epi8(0x0F), m4h = _mm512_set1_epi8((char)0xF0);
  const __m512 unit = _mm512_set1_ps(BITS == 4 ? 1.f / 16.f : 1.f);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* qt = w.q + t * nb * NC * 64;
    const ST* st = (const ST*)w.s + t * GB * nb * TILE;
    const ST* mt = w.mn ? (const ST*)w.mn + t * GB * nb * TILE : nullptr;
    __m512 acc[M], accm[M];
    for (int m = 0; m < M; ++m) acc[m] = accm[m] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nb; ++j) {
      __m512i z[8];  // z[k]: channels 4k..4k+3 of block j, 16 rows (4 bits: k < 4 low nibbles, else 16 x high)
      if (BITS == 4) {
        for (int c = 0; c < NC; ++c) {
          const __m512i v = _mm512_loadu_si512(qt + (j * NC + c) * 64);
          z[c] = _mm512_and_si512(v, m4);
          z[NC + c] = _mm512_and_si512(v, m4h);
        }
      } else {
        for (int c = 0; c < NC; ++c) z[c] = _mm512_loadu_si512(qt + (j * NC + c) * 64);
      }
      if (G16) {
        const __m512 s0 = load_tile_scales(st + 2 * j * TILE), s1 = load_tile_scales(st + (2 * j + 1) * TILE);
        for (int m = 0; m < M; ++m) {
          const int8_t* xr = xq + m * K + j * BLK;
          __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
          for (int k = 0; k < 4; ++k) {
            i0 = _mm512_dpbusd_epi32(i0, z[k], bcast4(xr + 4 * k));
            i1 = _mm512_dpbusd_epi32(i1, z[4 + k], bcast4(xr + 16 + 4 * k));
          }
          const __m512 d = _mm512_set1_ps(dx[m * nb + j]);
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(s0, d), acc[m]);
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(s1, d), acc[m]);
        }
        if (mt) {
          const __m512 m0 = load_tile_scales(mt + 2 * j * TILE), m1 = load_tile_scales(mt + (2 * j + 1) * TILE);
          for (int m = 0; m < M; ++m) {
            accm[m] = _mm512_fmadd_ps(m0, _mm512_set1_ps(sx[(m * nb + j) * 2]), accm[m]);
            accm[m] = _mm512_fmadd_ps(m1, _mm512_set1_ps(sx[(m * nb + j) * 2 + 1]), accm[m]);
          }
        }
        continue;
      }
      const __m512 sv = _mm512_mul_ps(load_tile_scales(st + j * TILE), unit);
      for (int m = 0; m < M; ++m) {
        const int8_t* xr = xq + m * K + j * BLK;
        __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
        if (BITS == 4) {  // i0: low nibbles (channels 0..15), i1: 16 x high ones (16..31)
          for (int k = 0; k < 4; ++k) {
            i0 = _mm512_dpbusd_epi32(i0, z[k], bcast4(xr + 4 * k));
            i1 = _mm512_dpbusd_epi32(i1, z[4 + k], bcast4(xr + 16 + 4 * k));
          }
          i0 = _mm512_add_epi32(_mm512_slli_epi32(i0, 4), i1);
        } else {
          for (int k = 0; k < 8; k += 2) {
            i0 = _mm512_dpbusd_epi32(i0, z[k], bcast4(xr + 4 * k));
            i1 = _mm512_dpbusd_epi32(i1, z[k + 1], bcast4(xr + 4 * k + 4));
          }
          i0 = _mm512_add_epi32(i0, i1);
        }
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(sv, _mm512_set1_ps(dx[m * nb + j])), acc[m]);
      }
      if (mt) {
        const __m512 mv = load_tile_scales(mt + j * TILE);
        for (int m = 0; m < M; ++m) accm[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[m * nb + j]), accm[m]);
      }
    }
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(y + m * w.N + t * TILE, _mm512_add_ps(acc[m], accm[m]));
  }
}

#endif

// y [M, N] float32 (1 <= M <= 8) for a tiled weight (w.tiled, N % 16 == 0, group size 32, or 16 at 8 bits) from the
// activations as quantize_q8 wrote them; tiles split across threads by par (quant_rows.h AtPar / PoolPar)
template <typename Par>
void gemv_q8_tiled(const QW& w, const int8_t* xq, const float* dx, const float* sx, int64_t M, float* y,
                   bool portable, const Par& par) {
  const int64_t T = w.N / TILE, grain = std::max<int64_t>(1, (int64_t)(1 << 12) / std::max<int64_t>(w.K, 1));
  par(0, T, grain, [&](int64_t t0, int64_t t1) {
    with_scale_type(w, [&](auto st) {
      using ST = decltype(st);
#ifdef SGQ_VNNI
      if (!portable) {
        with_bits(w.bits, [&](auto bits) {
          with_rows(M, [&](auto m) {
            constexpr int MM = decltype(m)::value, B = decltype(bits)::value;
            if constexpr (B == 8) {
              if (w.gs != BLK) { rows_q8_tile<MM, 8, ST, true>(xq, dx, sx, w.K, w, t0, t1, y); return; }
            }
            rows_q8_tile<MM, B, ST>(xq, dx, sx, w.K, w, t0, t1, y);
          });
        });
        return;
      }
#endif
      rows_q8_tile_portable<ST>(xq, dx, sx, M, w.K, w, t0, t1, y);
    });
  });
}
