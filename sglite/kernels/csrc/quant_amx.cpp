// BF16 GEMM on the AMX tile units for group-quantized weights in 16-row tiles (many activation rows:
// prefill chunks and large decode batches). Contract, numerics and torch reference:
// sglite/kernels/quant_amx.py. Reads the tile layout of quant_tiles.h (load_tile_scales); adds:
//   - a dequantizer from one 16-row weight tile (all K) into the AMX "B" layout in a per-thread
//     scratch buffer (L1/L2 resident, never a whole weight): per 32-block, 16 tile rows of 64 bytes,
//     row p holding for each output channel n the bf16 pair (W[n, 32j + 2p], W[n, 32j + 2p + 1]);
//     each value is fma(code, scale, min) in float32, rounded once to bf16 (VCVTNE2PS2BF16);
//   - the tile loop: 2 weight tiles (32 output channels) x 2 activation tiles (32 rows) held in 4
//     float32 accumulator tiles, one TDPBF16PS per (row tile, weight tile, 32-block), so the
//     dequantization of a weight tile is amortised over every activation row of the call.
// Threads: tile pairs split over the persistent pool (thread_pool.h); each worker loads the tile
// configuration itself (it is per-thread state) and releases it when its share is done.
#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "quant_rows.h"

#ifndef SGQ_VNNI
#error "quant_amx.cpp is built only with AVX-512 BF16 + VNNI + AMX (sglite/kernels/quant_amx.py)"
#endif

using namespace sglite_quant;

namespace {

constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;  // Linux: ask for a dynamically enabled XSAVE feature
constexpr long XFEATURE_XTILEDATA = 18;       // the AMX tile data state

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0..3: C (16 x 16 float32), tmm4/5: A (16 rows x 32 bf16), tmm6/7: B (16 pair-rows x 16 channels)
inline void configure_tiles() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

// w.q tile t, block j -> 16 rows x 64 bytes of AMX B layout at out (bf16 pairs per channel)
template <int BITS, typename ST, bool G16>
inline void dequant_block(const QW& w, int64_t t, int64_t j, int64_t nb, uint16_t* out) {
  constexpr int NC = BLK * BITS / 32;  // 64-byte code vectors per block and tile
  constexpr int GB = G16 ? 2 : 1;
  const int64_t G = GB * nb;
  const uint8_t* qt = w.q + t * nb * NC * 64 + j * NC * 64;
  const ST* st = (const ST*)w.s + t * G * TILE;
  const ST* mt = w.mn ? (const ST*)w.mn + t * G * TILE : nullptr;
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512 s[GB], m[GB];
  for (int h = 0; h < GB; ++h) {
    s[h] = load_tile_scales(st + (GB * j + h) * TILE);
    m[h] = mt ? load_tile_scales(mt + (GB * j + h) * TILE) : _mm512_setzero_ps();
  }
  const __m512i mask = _mm512_set1_epi32(BITS == 4 ? 0xF : 0xFF);
  auto emit = [&](int row, __m512i qa, __m512i qb, int h) {  // channels (2 row, 2 row + 1) of the block
    const __m512 wa = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qa), s[h], m[h]);
    const __m512 wb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qb), s[h], m[h]);
    const __m512i r = (__m512i)_mm512_cvtne2ps_pbh(wb, wa);  // [wa 0..15 | wb 0..15]
    _mm512_store_si512((__m512i*)(out + row * 32), _mm512_permutexvar_epi16(idx, r));
  };
  for (int c = 0; c < NC; ++c) {
    const __m512i v = _mm512_loadu_si512(qt + c * 64);  // lane n: bytes i = 0..3 of row n's group c
    auto code = [&](int shift) { return _mm512_and_si512(_mm512_srli_epi32(v, shift), mask); };
    if (BITS == 8) {  // byte i: channel 4c + i
      const int h = G16 && c >= 4 ? 1 : 0;
      emit(2 * c, code(0), code(8), h);
      emit(2 * c + 1, code(16), code(24), h);
    } else {  // byte i: low nibble channel 4c + i, high nibble channel 16 + 4c + i
      emit(2 * c, code(0), code(8), 0);
      emit(2 * c + 1, code(16), code(24), 0);
      emit(8 + 2 * c, code(4), code(12), 0);
      emit(8 + 2 * c + 1, code(20), code(28), 0);
    }
  }
}

// Every 32-block of tile t into buf (nb x 16 x 32 bf16).
template <int BITS, typename ST, bool G16>
void dequant_tile(const QW& w, int64_t t, int64_t nb, uint16_t* buf) {
  for (int64_t j = 0; j < nb; ++j) dequant_block<BITS, ST, G16>(w, t, j, nb, buf + j * 512);
}

// y rows m0..m0+16*RT of tile pair (b0, b1) over K: x bf16 [.., K] (rows padded to a multiple of 32),
// b0 / b1 the dequantized tiles (nb x 512 bf16), out [16*RT, 32] float32.
template <int RT>
inline void tile_pair(const uint16_t* x, int64_t K, const uint16_t* b0, const uint16_t* b1, float* out) {
  const int64_t nb = K / BLK, ldx = K * 2;
  _tile_zero(0);
  _tile_zero(1);
  if (RT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t j = 0; j < nb; ++j) {
    _tile_loadd(4, x + j * BLK, ldx);
    _tile_loadd(6, b0 + j * 512, 64);
    _tile_loadd(7, b1 + j * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (RT == 2) {
      _tile_loadd(5, x + 16 * K + j * BLK, ldx);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, 128);
  _tile_stored(1, out + 16, 128);
  if (RT == 2) {
    _tile_stored(2, out + 16 * 32, 128);
    _tile_stored(3, out + 16 * 32 + 16, 128);
  }
}

}  // namespace

bool quant_amx_init() {
  // Linux keeps the tile state off until the process asks (arch_prctl), once per process
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// y [M, N] = x @ W_stored.T (the caller adds the bias): x [M, K] bf16 (stored channel order), the
// weight in 16-row tiles (group size 32, or 16 with 8-bit codes; N % 16 == 0), scales / mins
// float32 or float16. Output bf16 (float32 accumulators rounded once) or float32 when !out_bf16.
at::Tensor quant_gemm_amx(at::Tensor x, at::Tensor q, at::Tensor s, at::Tensor mn, int64_t bits, int64_t gs, bool out_bf16) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.scalar_type() == at::kBFloat16, "quant_gemm_amx: x must be bf16 [M >= 1, K]");
  TORCH_CHECK(bits == 4 || bits == 8, "quant_gemm_amx: bits must be 4 or 8");
  TORCH_CHECK(gs == BLK || (gs == 16 && bits == 8), "quant_gemm_amx: group_size must be 32 (or 16 with 8-bit codes), got ", gs);
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), nb = K / BLK, G = K / gs;
  TORCH_CHECK(K % BLK == 0 && q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous() &&
              q.size(1) * 8 == K * bits, "quant_gemm_amx: qweight must be contiguous uint8 [N, K * bits / 8], K % 32 == 0");
  TORCH_CHECK(N % TILE == 0, "quant_gemm_amx: the tiled weight needs N % 16 == 0, got N = ", N);
  const bool half = s.scalar_type() == at::kHalf;
  TORCH_CHECK((half || s.scalar_type() == at::kFloat) && s.is_contiguous() && s.numel() == N * G,
              "quant_gemm_amx: scales must be float32 or float16 [N, K / group_size]");
  TORCH_CHECK(mn.numel() == 0 || (mn.scalar_type() == s.scalar_type() && mn.is_contiguous() && mn.numel() == N * G),
              "quant_gemm_amx: mins must match scales' dtype and shape");
  const int64_t Mp = (M + 31) / 32 * 32;
  at::Tensor xp = x.contiguous();
  if (Mp != M) {  // zero rows up to a multiple of 32: every tile load reads 16 full rows
    at::Tensor pad = at::empty({Mp, K}, x.options());
    std::memcpy(pad.data_ptr(), xp.data_ptr(), M * K * 2);
    std::memset((uint16_t*)pad.data_ptr() + M * K, 0, (Mp - M) * K * 2);
    xp = pad;
  }
  const uint16_t* xd = (const uint16_t*)xp.data_ptr<at::BFloat16>();
  const QW w{q.data_ptr<uint8_t>(), (const float*)s.data_ptr(), mn.numel() > 0 ? (const float*)mn.data_ptr() : nullptr,
             (int)bits, gs, N, K, half, true};
  at::Tensor y = at::empty({M, N}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  const int64_t T = N / TILE, P = (T + 1) / 2;
  sglite_pool::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    configure_tiles();
    // two dequantized tiles (64-byte aligned for the B loads) and one 32 x 32 float32 staging block
    std::vector<uint16_t> bufv(2 * nb * 512 + 32);
    uint16_t* b0 = (uint16_t*)(((uintptr_t)bufv.data() + 63) & ~(uintptr_t)63);
    uint16_t* b1 = b0 + nb * 512;
    alignas(64) float stage[32 * 32];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t t = 2 * p, nt = std::min<int64_t>(2, T - t);
      with_scale_type(w, [&](auto st) {
        using ST = decltype(st);
        with_bits(w.bits, [&](auto bb) {
          constexpr int B = decltype(bb)::value;
          for (int64_t u = 0; u < nt; ++u) {
            uint16_t* bu = u ? b1 : b0;
            if constexpr (B == 8) {
              if (gs != BLK) { dequant_tile<8, ST, true>(w, t + u, nb, bu); continue; }
            }
            dequant_tile<B, ST, false>(w, t + u, nb, bu);
          }
        });
      });
      if (nt == 1) std::memset(b1, 0, nb * 512 * sizeof(uint16_t));
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int rt = M - m0 > 16 ? 2 : 1;
        if (rt == 2) tile_pair<2>(xd + m0 * K, K, b0, b1, stage);
        else tile_pair<1>(xd + m0 * K, K, b0, b1, stage);
        const int64_t rows = std::min<int64_t>(16 * rt, M - m0), cols = nt * TILE;
        for (int64_t r = 0; r < rows; ++r) {
          const float* src = stage + r * 32;
          if (out_bf16) {
            at::BFloat16* o = y.data_ptr<at::BFloat16>() + (m0 + r) * N + t * TILE;
            for (int64_t u = 0; u < cols; u += TILE)  // VCVTNEPS2BF16: round to nearest even
              _mm256_storeu_si256((__m256i*)(o + u), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(src + u)));
          } else {
            float* o = y.data_ptr<float>() + (m0 + r) * N + t * TILE;
            for (int64_t u = 0; u < cols; u += TILE) _mm512_storeu_ps(o + u, _mm512_load_ps(src + u));
          }
        }
      }
    }
    _tile_release();
  });
  return y;
}
