// Int8 GEMM on AVX-512 VNNI for group-quantized weights in 16-row tiles (many activation rows:
// prefill chunks and decode batches past the GEMV's row limit). Contract, numerics and torch
// reference: sglite/kernels/quant_gemm.py. Reads the tile layout of quant_tiles.h (and its helpers
// bcast4 / load_tile_scales, read-only here); what this file adds is the GEMM op: the microkernel of 4
// activation rows x 2 tiles (32 output channels) in registers and the vectorised activation
// quantizer (quantize_q8 of quant_rows.h is the spec it matches bit for bit) of quant_gemm_kernel.h
// (shared with the fused decode), the loop order (every activation row against one pair of tiles
// while it sits in L1/L2, so the codes stream from memory once per call whatever M), the quantizer
// over rows in parallel and a bf16 output converted per tile pair. Measured against the
// first version (8 rows x 1 tile through quant_tiles.h's rows_q8_tile), one thread, the 5 SmolLM2
// matrix shapes, noisy shared machine, best of 15 alternating: 4 bits 1.45x / 1.16x / 1.06x at
// M = 16 / 48 / 256; 8 bits 0.8x / 1.65x / 0.98x.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include "quant_rows.h"
#include "quant_gemm_kernel.h"

#ifndef SGQ_VNNI
#error "quant_gemm.cpp is built only with AVX-512 BF16 + VNNI (sglite/kernels/quant_gemm.py); other CPUs keep the dequantize path"
#endif

using namespace sglite_quant;

namespace {

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
      gemm_pair(xqp, dx, sx, sxs, M, w, t, nt, yt, ldy);
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
