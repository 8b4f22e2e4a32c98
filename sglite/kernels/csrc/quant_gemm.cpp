// Int8 GEMM on AVX-512 VNNI for group-quantized weights in 16-row tiles (many activation rows:
// prefill chunks and decode batches past the GEMV's row limit). Contract, numerics and torch
// reference: sglite/kernels/quant_gemm.py. Reads the tile layout of quant_tiles.h (and its helpers
// bcast4 / load_tile_scales, read-only here); what this file adds is the GEMM: a microkernel of 4
// activation rows x 2 tiles (32 output channels) in registers, the loop order (every activation row
// against one pair of tiles while it sits in L1/L2, so the codes stream from memory once per call
// whatever M), a vectorised, row-parallel activation quantizer (quantize_q8 of quant_rows.h is the
// spec it matches bit for bit) and a bf16 output converted per tile pair. Measured against the
// first version (8 rows x 1 tile through quant_tiles.h's rows_q8_tile), one thread, the 5 SmolLM2
// matrix shapes, noisy shared machine, best of 15 alternating: 4 bits 1.45x / 1.16x / 1.06x at
// M = 16 / 48 / 256; 8 bits 0.8x / 1.65x / 0.98x.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include "quant_rows.h"

#ifndef SGQ_VNNI
#error "quant_gemm.cpp is built only with AVX-512 BF16 + VNNI (sglite/kernels/quant_gemm.py); other CPUs keep the dequantize path"
#endif

using namespace sglite_quant;

namespace {

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

// x [M, K] (float32 or bf16) -> xq [M, K] int8, dx / sx [M, K / 32] float32, rows in parallel
void quantize_acts(const at::Tensor& x, int8_t* xq, float* dx, float* sx) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / BLK;
  const bool bf = x.scalar_type() == at::kBFloat16;
  sglite_pool::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> buf(bf ? K : 0);
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr;
      if (bf) {
        const at::BFloat16* b = x.data_ptr<at::BFloat16>() + m * K;
        // bf16 -> float32 is exact: the 16 bits become the high half
        for (int64_t i = 0; i < K; i += 16)
          _mm512_storeu_ps(buf.data() + i, _mm512_castsi512_ps(_mm512_slli_epi32(
              _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(b + i))), 16)));
        xr = buf.data();
      } else {
        xr = x.data_ptr<float>() + m * K;
      }
      quantize_row_avx(xr, K, xq + m * K, dx + m * nb, sx + m * nb);
    }
  });
}

}  // namespace

// y [M, N] = q8(x) @ W_stored.T (+ nothing: the caller adds the bias): x [M, K] float32 or bf16
// (stored channel order, any M >= 1), the weight in 16-row tiles (group size 32, N % 16 == 0),
// scales / mins float32 or float16 (one dtype). Output float32, or bf16 (one rounding) when out_bf16.
// gs: 32, or 16 with 8-bit codes (scales / mins [N, K / 16]).
at::Tensor quant_gemm_q8(at::Tensor x, at::Tensor q, at::Tensor s, at::Tensor mn, int64_t bits, int64_t gs, bool out_bf16) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_gemm_q8: x must be float32 or bf16 [M >= 1, K]");
  TORCH_CHECK(bits == 4 || bits == 8, "quant_gemm_q8: bits must be 4 or 8");
  TORCH_CHECK(gs == BLK || (gs == 16 && bits == 8), "quant_gemm_q8: group_size must be 32 (or 16 with 8-bit codes), got ", gs);
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), nb = K / BLK, G = K / gs;
  TORCH_CHECK(K % BLK == 0 && q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous() &&
              q.size(1) * 8 == K * bits, "quant_gemm_q8: qweight must be contiguous uint8 [N, K * bits / 8], K % 32 == 0");
  TORCH_CHECK(N % TILE == 0, "quant_gemm_q8: the tiled weight needs N % 16 == 0, got N = ", N);
  const bool half = s.scalar_type() == at::kHalf;
  TORCH_CHECK((half || s.scalar_type() == at::kFloat) && s.is_contiguous() && s.numel() == N * G,
              "quant_gemm_q8: scales must be float32 or float16 [N, K / group_size]");
  TORCH_CHECK(mn.numel() == 0 || (mn.scalar_type() == s.scalar_type() && mn.is_contiguous() && mn.numel() == N * G),
              "quant_gemm_q8: mins must match scales' dtype and shape");
  x = x.contiguous();
  at::Tensor xq = at::empty({M * K + 64}, x.options().dtype(at::kChar));
  at::Tensor dsx = at::empty({2, M, nb}, x.options().dtype(at::kFloat));
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* dx = dsx.data_ptr<float>();
  float* sx = dx + M * nb;
  quantize_acts(x, xqp, dx, sx);
  at::Tensor sx16;
  if (gs != BLK) {  // the offsets' factor per 16-group
    sx16 = at::empty({M, G}, x.options().dtype(at::kFloat));
    group_sx16(xqp, dx, M, K, sx16.data_ptr<float>());
    sx = sx16.data_ptr<float>();
  }
  const QW w{q.data_ptr<uint8_t>(), (const float*)s.data_ptr(), mn.numel() > 0 ? (const float*)mn.data_ptr() : nullptr,
             (int)bits, gs, N, K, half, true};
  const int64_t sxs = G;  // sx floats per activation row
  at::Tensor y = at::empty({M, N}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  const int64_t T = N / TILE, P = (T + 1) / 2;  // pairs of tiles (the last one may be single)
  float* yf = out_bf16 ? nullptr : y.data_ptr<float>();
  sglite_pool::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> part(out_bf16 ? M * 2 * TILE : 0);  // a pair's outputs, staged for bf16
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t t = 2 * p, nt = std::min<int64_t>(2, T - t);
      float* yt = out_bf16 ? part.data() : yf + t * TILE;
      const int64_t ldy = out_bf16 ? nt * TILE : N;
      with_scale_type(w, [&](auto st) {
        using ST = decltype(st);
        with_bits(w.bits, [&](auto bb) {
          constexpr int B = decltype(bb)::value;
          for (int64_t m0 = 0; m0 < M; m0 += GEMM_ROWS) {
            const int64_t mb = std::min<int64_t>(GEMM_ROWS, M - m0);
            const int8_t* xm = xqp + m0 * K;
            float* ym = yt + m0 * ldy;
            if constexpr (B == 8) {
              if (gs != BLK) {
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
      if (out_bf16) {
        at::BFloat16* o = y.data_ptr<at::BFloat16>() + t * TILE;
        for (int64_t m = 0; m < M; ++m)
          for (int64_t u = 0; u < nt; ++u) {
            // VCVTNEPS2BF16: round to nearest even, as at::BFloat16(float) for finite values
            _mm256_storeu_si256((__m256i*)(o + m * N + u * TILE),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(part.data() + m * ldy + u * TILE)));
          }
      }
    }
  });
  return y;
}

bool quant_gemm_vnni() {
#ifdef SGQ_VNNI
  return true;
#else
  return false;
#endif
}
