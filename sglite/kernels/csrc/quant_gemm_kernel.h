// The int8 GEMM on AVX-512 VNNI over group-quantized weights in 16-row tiles: the activation
// quantizer and the microkernel, shared by the per-op GEMM (quant_gemm.cpp: contract, numerics and
// torch reference in sglite/kernels/quant_gemm.py) and the fused decode's many-row steps on CPUs
// without AMX (decode_layer.cpp). Reads the tile layout of quant_tiles.h (and its helpers bcast4 /
// load_tile_scales); namespace sglite_quant, after quant_rows.h.
#pragma once

#ifdef SGQ_VNNI
namespace sglite_quant {

// quantize_q8 (quant_rows.h) for one row: per 32-block d = max|x| / 127, xq = round_half_even(x * (1 / d))
// (0 when d is 0) clamped to [-127, 127], sx = d * sum(xq). Same float32 operations in the same
// order per element, so the result equals the scalar spec exactly.
inline void quantize_row_avx(const float* x, int64_t K, int8_t* xq, float* dx, float* sx) {
  const __m512 lim = _mm512_set1_ps(127.f), nlim = _mm512_set1_ps(-127.f);
  for (int64_t b = 0; b < K / BLK; ++b) {
    const __m512 a = _mm512_loadu_ps(x + b * BLK), c = _mm512_loadu_ps(x + b * BLK + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    const __m512 idv = _mm512_set1_ps(id);
    // cvtps_epi32 rounds with MXCSR (round to nearest even by default), as std::nearbyint does
    const __m512 ra = _mm512_min_ps(lim, _mm512_max_ps(nlim, _mm512_roundscale_ps(_mm512_mul_ps(a, idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    const __m512 rc = _mm512_min_ps(lim, _mm512_max_ps(nlim, _mm512_roundscale_ps(_mm512_mul_ps(c, idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    const __m512i ia = _mm512_cvtps_epi32(ra), ic = _mm512_cvtps_epi32(rc);
    _mm_storeu_si128((__m128i*)(xq + b * BLK), _mm512_cvtsepi32_epi8(ia));
    _mm_storeu_si128((__m128i*)(xq + b * BLK + 16), _mm512_cvtsepi32_epi8(ic));
    dx[b] = d;
    sx[b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(ia, ic));
  }
}

// The GEMM microkernel: R activation rows x NT adjacent 16-row tiles (t, t + 1, ...), register-blocked
// so each broadcast of 4 activation bytes feeds NT VPDPBUSDs and each code vector R of them. Per
// 32-block: int32 dots over the block (exact), then acc += float(idot) * (s * dx) and acc += m * sx
// (float32). 4 bits: the high nibbles are shifted down once per vector (amortised over R rows), so
// one int32 accumulator per (row, tile) holds the whole block's dot. y[r * ldy + 16 u + lane].
// G16 (8 bits, GGUF Q6_K's group 16): a second int32 accumulator per (row, tile) takes the block's
// channels 16..31 (code vectors c >= 4), each half scaled by its own group's scale; the offsets use
// sx per 16-group (group_sx16) and the tile's [group][lane] mins.
template <int R, int NT, int BITS, typename ST, bool G16 = false>
void gemm_block(const int8_t* xq, const float* dx, const float* sx, int64_t K, const QW& w, int64_t t, float* y,
                int64_t ldy) {
  static_assert(!G16 || BITS == 8, "group 16 needs 8-bit codes");
  constexpr int NC = BLK * BITS / 32;  // 64-byte code vectors per block and tile
  constexpr int GB = G16 ? 2 : 1;  // groups per 32-block
  const int64_t nb = K / BLK, tile_bytes = nb * NC * 64, G = GB * nb;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const ST* st = (const ST*)w.s + t * G * TILE;
  const ST* mt = w.mn ? (const ST*)w.mn + t * G * TILE : nullptr;
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NT; ++u) acc[r][u] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nb; ++j) {
    __m512i id[R][NT], id2[G16 ? R : 1][NT];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < NT; ++u) id[r][u] = _mm512_setzero_si512();
    if (G16)
      for (int r = 0; r < R; ++r)
        for (int u = 0; u < NT; ++u) id2[r][u] = _mm512_setzero_si512();
    for (int c = 0; c < NC; ++c) {
      __m512i lo[NT], hi[NT];
      for (int u = 0; u < NT; ++u) {
        const __m512i v = _mm512_loadu_si512(w.q + (t + u) * tile_bytes + (j * NC + c) * 64);
        if (BITS == 4) {
          lo[u] = _mm512_and_si512(v, m4);
          hi[u] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        } else {
          lo[u] = v;
        }
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * K + j * BLK;
        const __m512i b = bcast4(xr + 4 * c);
        if (G16 && c >= 4) {
          for (int u = 0; u < NT; ++u) id2[r][u] = _mm512_dpbusd_epi32(id2[r][u], lo[u], b);
          continue;
        }
        for (int u = 0; u < NT; ++u) id[r][u] = _mm512_dpbusd_epi32(id[r][u], lo[u], b);
        if (BITS == 4) {  // channels 16 + 4c .. 16 + 4c + 3 sit in the high nibbles
          const __m512i b2 = bcast4(xr + 16 + 4 * c);
          for (int u = 0; u < NT; ++u) id[r][u] = _mm512_dpbusd_epi32(id[r][u], hi[u], b2);
        }
      }
    }
    if (G16) {
      for (int h = 0; h < 2; ++h) {
        __m512 sv[NT], mv[NT];
        for (int u = 0; u < NT; ++u) {
          sv[u] = load_tile_scales(st + (u * G + 2 * j + h) * TILE);
          if (mt) mv[u] = load_tile_scales(mt + (u * G + 2 * j + h) * TILE);
        }
        for (int r = 0; r < R; ++r) {
          const __m512 d = _mm512_set1_ps(dx[r * nb + j]);
          for (int u = 0; u < NT; ++u)
            acc[r][u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h ? id2[r][u] : id[r][u]), _mm512_mul_ps(sv[u], d), acc[r][u]);
          if (mt) {
            const __m512 e = _mm512_set1_ps(sx[r * G + 2 * j + h]);
            for (int u = 0; u < NT; ++u) acc[r][u] = _mm512_fmadd_ps(mv[u], e, acc[r][u]);
          }
        }
      }
      continue;
    }
    __m512 sv[NT], mv[NT];
    for (int u = 0; u < NT; ++u) {
      sv[u] = load_tile_scales(st + (u * nb + j) * TILE);
      if (mt) mv[u] = load_tile_scales(mt + (u * nb + j) * TILE);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(dx[r * nb + j]);
      for (int u = 0; u < NT; ++u) acc[r][u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(id[r][u]), _mm512_mul_ps(sv[u], d), acc[r][u]);
      if (mt) {
        const __m512 e = _mm512_set1_ps(sx[r * nb + j]);
        for (int u = 0; u < NT; ++u) acc[r][u] = _mm512_fmadd_ps(mv[u], e, acc[r][u]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NT; ++u) _mm512_storeu_ps(y + r * ldy + u * TILE, acc[r][u]);
}

constexpr int64_t GEMM_ROWS = 4;  // R of the main microkernel (4 rows x 2 tiles: 8 int32 + 8 float accumulators)

template <int NT, int BITS, typename ST, bool G16 = false>
void gemm_rows(const int8_t* xq, const float* dx, const float* sx, int64_t K, const QW& w, int64_t t, int64_t mb,
               float* y, int64_t ldy) {
  switch (mb) {
    case 4: gemm_block<4, NT, BITS, ST, G16>(xq, dx, sx, K, w, t, y, ldy); break;
    case 3: gemm_block<3, NT, BITS, ST, G16>(xq, dx, sx, K, w, t, y, ldy); break;
    case 2: gemm_block<2, NT, BITS, ST, G16>(xq, dx, sx, K, w, t, y, ldy); break;
    default: gemm_block<1, NT, BITS, ST, G16>(xq, dx, sx, K, w, t, y, ldy); break;
  }
}

// Every activation row against tiles t (and t + 1 when nt == 2): y[m * ldy + u * TILE + lane] for
// m < M, float32. xq / dx: the rows as quantize_row_avx wrote them; sx: sxs floats a row (K / 32, or
// K / 16 for group 16: group_sx16).
inline void gemm_pair(const int8_t* xq, const float* dx, const float* sx, int64_t sxs, int64_t M, const QW& w, int64_t t,
                      int64_t nt, float* y, int64_t ldy) {
  const int64_t K = w.K, nb = K / BLK;
  with_scale_type(w, [&](auto st) {
    using ST = decltype(st);
    with_bits(w.bits, [&](auto bb) {
      constexpr int B = decltype(bb)::value;
      for (int64_t m0 = 0; m0 < M; m0 += GEMM_ROWS) {
        const int64_t mb = std::min<int64_t>(GEMM_ROWS, M - m0);
        const int8_t* xm = xq + m0 * K;
        float* ym = y + m0 * ldy;
        if constexpr (B == 8) {
          if (w.gs != BLK) {
            if (nt == 2) gemm_rows<2, 8, ST, true>(xm, dx + m0 * nb, sx + m0 * sxs, K, w, t, mb, ym, ldy);
            else gemm_rows<1, 8, ST, true>(xm, dx + m0 * nb, sx + m0 * sxs, K, w, t, mb, ym, ldy);
            continue;
          }
        }
        if (nt == 2) gemm_rows<2, B, ST>(xm, dx + m0 * nb, sx + m0 * sxs, K, w, t, mb, ym, ldy);
        else gemm_rows<1, B, ST>(xm, dx + m0 * nb, sx + m0 * sxs, K, w, t, mb, ym, ldy);
      }
    });
  });
}

}  // namespace sglite_quant
#endif  // SGQ_VNNI
