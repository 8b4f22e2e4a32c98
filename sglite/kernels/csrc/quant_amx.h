// AMX-BF16 GEMM over group-quantized weights in 16-row tiles, as a header: spliced into
// quant_amx.cpp (the standalone op) and decode_layer.cpp (the fused decode's many-row GEMMs) when
// they are built with -mamx-tile -mamx-bf16 (SGQ_AMX). Needs avx512_math.h (silu_bf16's exp) and
// quant_rows.h (QW, BLK, TILE via quant_tiles.h, load_tile_scales, with_bits / with_scale_type)
// first. Contract and torch reference: sglite/kernels/quant_amx.py. What it holds:
//   - a dequantizer from one 16-row weight tile (all K) into the AMX "B" layout in a per-thread
//     scratch buffer (L1/L2 resident, never a whole weight): per 32-block, 16 tile rows of 64 bytes,
//     row p holding for each output channel n the bf16 pair (W[n, 32j + 2p], W[n, 32j + 2p + 1]);
//     each value is fma(code, scale, min) in float32, rounded once to bf16 (VCVTNE2PS2BF16);
//   - the tile loop: 2 weight tiles (32 output channels) x 2 activation tiles (32 rows) held in 4
//     float32 accumulator tiles, one TDPBF16PS per (row tile, weight tile, 32-block), so the
//     dequantization of a weight tile is amortised over every activation row of the call;
//   - the K loop (kloop_pair, the default): the first 32-row chunk of each tile pair dequantizes
//     block j + KLOOP_AHEAD of both tiles while the tile unit multiplies block j, and prefetches the
//     next pair's codes into L2, so the codes (~0.6 bytes a weight at 4 bits) stream once and the
//     vector work hides behind the products and the memory stream; later chunks reuse the pair's
//     dequantized tiles. pack_b's whole-weight copy (2 bytes a weight) is kept only on request
//     (SGLITE_AMX_REPACK=1, gemm_paths.py): same products in the same order, the same bits;
//   - the loop order (gemm): for K <= 640 each pair sweeps the 32-row chunks of a 128-row block
//     (its B tiles reused from L1, the activation tiles streamed from L2), and each chunk's output
//     is converted and written during the next chunk's K loop (Pending), beside the tile products;
//   - an output stage for a fused gate/up weight (gemm's silu): silu(g) * u written from the two
//     halves' sums (silu_bf16), bit-identical to the bf16 product followed by cpu_gemv's silu_mul.
// Threads: tile pairs split by the caller's Par (thread_pool.h); each worker loads the tile
// configuration itself (per-thread state) and releases it when its share is done.
#pragma once

namespace sglite_amx {

// bf16 values of a weight [N, K] in gemm's B layout (pack_b): ceil(N / 32) tile pairs (a lone last
// tile's partner zero) of 2 x K / 32 x 512.
inline int64_t packed_elems(int64_t N, int64_t K) {
  return (N / sglite_quant::TILE + 1) / 2 * 2 * (K / sglite_quant::BLK) * 512;
}

// t as the B layout of a weight [N, K] (quant_amx_pack's tensor: int16, contiguous, 64-byte aligned,
// packed_elems long) -> its data; an empty t -> nullptr (dequantize per call). Errors prefixed `who`.
inline const uint16_t* packed_data(const at::Tensor& t, int64_t N, int64_t K, const char* who) {
  if (t.numel() == 0) return nullptr;
  TORCH_CHECK(t.scalar_type() == at::kShort && t.is_contiguous() && ((uintptr_t)t.data_ptr() & 63) == 0 &&
              t.numel() == packed_elems(N, K), who, ": a packed AMX weight must be quant_amx_pack's tensor of its weight");
  return (const uint16_t*)t.data_ptr<int16_t>();
}

}  // namespace sglite_amx

#ifdef SGQ_AMX
#include "amx_tiles.h"

namespace sglite_amx {

using namespace sglite_quant;

// tmm0..3: C (16 x 16 float32), tmm4/5: A (16 rows x 32 bf16), tmm6/7: B (16 pair-rows x 16
// channels), in sglite_tiles::configure()'s shapes.

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
  const __m512i mask = _mm512_set1_epi32(0xFF);
  // float32 of the 16 4-bit codes: VPERMPS reads only an index's low 4 bits, so this table is the
  // mask and the conversion in one instruction (exactly float(code), as VCVTDQ2PS gives)
  const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  auto emit = [&](int row, __m512 qa, __m512 qb, int h) {  // channels (2 row, 2 row + 1) of the block
    const __m512 wa = _mm512_fmadd_ps(qa, s[h], m[h]);
    const __m512 wb = _mm512_fmadd_ps(qb, s[h], m[h]);
    const __m512i r = (__m512i)_mm512_cvtne2ps_pbh(wb, wa);  // [wa 0..15 | wb 0..15]
    _mm512_store_si512((__m512i*)(out + row * 32), _mm512_permutexvar_epi16(idx, r));
  };
  for (int c = 0; c < NC; ++c) {
    const __m512i v = _mm512_loadu_si512(qt + c * 64);  // lane n: bytes i = 0..3 of row n's group c
    auto code = [&](int shift) {
      if (BITS == 4) return _mm512_permutexvar_ps(shift ? _mm512_srli_epi32(v, shift) : v, lut);
      // 8-bit: byte 0 masked, byte 3 shifted down, bytes 1 / 2 moved down and zero-extended by one
      // VPSHUFB each (port 5, beside the shifts and conversions on port 0)
      if (shift == 0) return _mm512_cvtepi32_ps(_mm512_and_si512(v, mask));
      if (shift == 24) return _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 24));
      const int i = shift / 8;
      const __m512i sel = _mm512_set_epi32(0x80808000 | (12 + i), 0x80808000 | (8 + i), 0x80808000 | (4 + i), 0x80808000 | i,
                                           0x80808000 | (12 + i), 0x80808000 | (8 + i), 0x80808000 | (4 + i), 0x80808000 | i,
                                           0x80808000 | (12 + i), 0x80808000 | (8 + i), 0x80808000 | (4 + i), 0x80808000 | i,
                                           0x80808000 | (12 + i), 0x80808000 | (8 + i), 0x80808000 | (4 + i), 0x80808000 | i);
      return _mm512_cvtepi32_ps(_mm512_shuffle_epi8(v, sel));
    };
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

// Zero the RT x 2 float32 accumulator tiles (tmm0, tmm1; tmm2, tmm3 when RT == 2).
template <int RT>
inline void zero_acc() {
  _tile_zero(0);
  _tile_zero(1);
  if (RT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
}

// The RT x 2 accumulator tiles into out [16 RT, 32] float32 (128 bytes a row).
template <int RT>
inline void store_acc(float* out) {
  _tile_stored(0, out, 128);
  _tile_stored(1, out + 16, 128);
  if (RT == 2) {
    _tile_stored(2, out + 16 * 32, 128);
    _tile_stored(3, out + 16 * 32 + 16, 128);
  }
}

// One 32-block j of the 2 x 2 plan: the RT activation tiles of rows x (K bf16 apart) times the
// pair's weight tiles b0 / b1 (512 bf16 each) into the accumulators. The activation tiles are
// loaded with the streaming hint (TILELOADDT1): each is used once per pair, while the pair's B tiles
// are reused by every 32-row chunk of the row block and so should stay in L1 (measured: with plain
// loads of both, the A chunk and the B pair (36 KiB each at K = 576) evicted each other from the
// 48 KiB L1 and every tile load waited on L2, docs/benchmarks.md).
template <int RT>
inline void block_step(const uint16_t* x, int64_t K, int64_t j, const uint16_t* b0, const uint16_t* b1) {
  const int64_t ldx = K * 2;
  _tile_stream_loadd(4, x + j * BLK, ldx);
  _tile_loadd(6, b0, 64);
  _tile_loadd(7, b1, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  if (RT == 2) {
    _tile_stream_loadd(5, x + 16 * K + j * BLK, ldx);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// y rows m0..m0+16*RT of tile pair (b0, b1) over K: x bf16 [.., K] (rows padded to a multiple of 32),
// b0 / b1 the dequantized tiles (nb x 512 bf16), out [16*RT, 32] float32; side(j) runs after block
// j's products (the previous chunk's output rows, Pending, written while the tile unit multiplies).
template <int RT, typename Side>
inline void tile_pair(const uint16_t* x, int64_t K, const uint16_t* b0, const uint16_t* b1, float* out, const Side& side) {
  const int64_t nb = K / BLK;
  zero_acc<RT>();
  for (int64_t j = 0; j < nb; ++j) {
    block_step<RT>(x, K, j, b0 + j * 512, b1 + j * 512);
    side(j);
  }
  store_acc<RT>(out);
}

// Dequantized tile pairs kept per thread and block: half the 2 MiB L2, so the block's B tiles are
// read from L2 by every row block (1 MiB measured 5-10 % faster than 512 KiB at 2,048 rows, the
// activations then streamed fewer times; 1.5 MiB slower).
constexpr int64_t kBlockBytes = 1 << 20;

// Rows a block of pairs sweeps pair by pair: for each pair its 32-row chunks of the block in turn,
// so the pair's B tiles (36 KiB at K = 576) are reused from L1 by the block's 4 chunks and the
// activation tiles stream from L2 (128 rows x K bf16: 144 KiB at K = 576, 384 KiB at 1,536).
// Measured against chunks outer / pairs inner (the A chunk reused instead): 2,048 x 576 x 576, one
// thread, CPU time, the products and output alone: 7.6 against 10.8 ns a TDPBF16PS (docs/benchmarks.md).
// Only for pairs of at most kL1PairBytes (K <= 640): a larger pair does not stay in L1 anyway, and
// there (K = 1,536, 96 KiB a pair) the chunks run one at a time over the block's pairs, as before
// (measured the same or slightly better than a row block, with or without splitting K).
// Nor for outputs wider than kRowBlockMaxN: a pair's chunks would then write 64 bytes into each of
// 128 rows a page or more apart (an LM head: 96 KiB a row), a TLB miss per row; chunk by chunk, each
// row's segment of the block's pairs is contiguous (measured on the 49,152 x 576 head, 256 rows).
constexpr int64_t kRowBlock = 128, kL1PairBytes = 40 << 10, kRowBlockMaxN = 8192;

// float32 -> bf16 (round to nearest even) -> float32
inline __m512 bf16_round(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// bf16 of silu(bf16(g)) * bf16(u) for 16 float32 sums g, u: what the unfused path gives (the gate/up
// GEMM's bf16 output, then cpu_gemv.cpp's silu_mul: silu rounded to bf16, then the product). The
// silu is the same sglite_simd::silu16 (avx512_math.h; tests/quant/test_quant_amx_prefill.py
// compares the two paths bit for bit).
inline __m256i silu_bf16(__m512 g, __m512 u) {
  g = bf16_round(g);
  const __m512 s = bf16_round(sglite_simd::silu16(g));
  return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, bf16_round(u)));
}

// A 32 x 32 float32 stage (one 32-row chunk x one tile pair, store_acc's layout) whose rows still
// wait for the output: rows m0..m0+rows-1, channels c0..c0+cols-1 of y [M, N] (float32 yf, or bf16
// ybf rounded once, VCVTNEPS2BF16: round to nearest even). The gemm writes a
// chunk's rows during the next chunk's K loop (rows_at), so the conversions and the stores run
// beside the tile products instead of after the tile stores (measured: the write after the stores
// was a quarter of the time at 2,048 rows, docs/benchmarks.md).
// With gate (the silu_mul epilogue, gemm's silu): stage holds the up half's sums of these rows and
// gate the gate half's, and the output is silu_mul of their bf16 roundings (silu_bf16).
struct Pending {
  const float* stage = nullptr;
  const float* gate = nullptr;
  int64_t m0 = 0, rows = 0, cols = 0, c0 = 0;

  // Stage rows r0..r1-1 (those below rows) into the output.
  void write(int64_t r0, int64_t r1, int64_t N, float* yf, at::BFloat16* ybf) const {
    for (int64_t r = r0; r < std::min(r1, rows); ++r) {
      const float* src = stage + r * 32;
      if (gate) {
        at::BFloat16* o = ybf + (m0 + r) * N + c0;
        for (int64_t u = 0; u < cols; u += TILE)
          _mm256_storeu_si256((__m256i*)(o + u), silu_bf16(_mm512_load_ps(gate + r * 32 + u), _mm512_load_ps(src + u)));
      } else if (ybf) {
        at::BFloat16* o = ybf + (m0 + r) * N + c0;
        // two 32-byte stores: one 64-byte VCVTNE2PS2BF16 store measured 35 % slower here
        for (int64_t u = 0; u < cols; u += TILE)
          _mm256_storeu_si256((__m256i*)(o + u), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(src + u)));
      } else {
        float* o = yf + (m0 + r) * N + c0;
        for (int64_t u = 0; u < cols; u += TILE) _mm512_storeu_ps(o + u, _mm512_load_ps(src + u));
      }
    }
  }

  // The rows due after block j of a K loop: per (ceil(32 / blocks)) a block, all 32 by the last.
  void rows_at(int64_t j, int64_t per, int64_t N, float* yf, at::BFloat16* ybf) const {
    if (stage) write(j * per, (j + 1) * per, N, yf, ybf);
  }
};

// Both tiles of pair p (tiles 2p, 2p + 1; the second zero past the last tile) into b (2 x nb x 512 bf16).
inline void dequant_pair(const QW& w, int64_t p, int64_t nb, uint16_t* b) {
  const int64_t T = w.N / TILE, t = 2 * p, nt = std::min<int64_t>(2, T - t);
  with_scale_type(w, [&](auto st) {
    using ST = decltype(st);
    with_bits(w.bits, [&](auto bb) {
      constexpr int B = decltype(bb)::value;
      for (int64_t u = 0; u < nt; ++u) {
        if constexpr (B == 8) {
          if (w.gs != BLK) { dequant_tile<8, ST, true>(w, t + u, nb, b + u * nb * 512); continue; }
        }
        dequant_tile<B, ST, false>(w, t + u, nb, b + u * nb * 512);
      }
    });
  });
  if (nt == 1) std::memset(b + nb * 512, 0, nb * 512 * sizeof(uint16_t));
}

// Blocks a K-loop dequantizes ahead of the one its tiles multiply: block j + KLOOP_AHEAD's vector
// work runs beside block j's tile products, and its stores have retired by the time they are
// loaded as B tiles.
constexpr int64_t KLOOP_AHEAD = 2;

// tile_pair<RT> for pair p (tiles t = 2p and t + 1, nt of them; a lone last tile's partner zero)
// straight from the codes: block j of both tiles is dequantized (dequant_block) into b (the pair's
// 2 x nb x 512 bf16, the B layout of pack_b) KLOOP_AHEAD blocks before its products, inside the
// same K loop, so the vector units dequantize while the tile unit multiplies. b then holds the
// pair's B tiles for the caller's later row chunks (tile_pair). Same products in the same order as
// tile_pair on pack_b's copy: bit-identical output.
template <int RT, int BITS, typename ST, bool G16, typename Side>
inline void kloop_pair_t(const QW& w, int64_t t, int64_t nt, int64_t nb, const uint16_t* x, uint16_t* b, float* out,
                         const Side& side) {
  const int64_t K = w.K;
  uint16_t* b1 = b + nb * 512;
  if (nt == 1) std::memset(b1, 0, nb * 512 * sizeof(uint16_t));
  // the next pair's codes, scales and mins of block j into L2 (t1) while this pair's block j is
  // dequantized: DRAM latency off the K loop's critical path
  constexpr int NC = BLK * BITS / 32, GB = G16 ? 2 : 1;
  const int64_t tn = t + 2, ntn = std::max<int64_t>(0, std::min<int64_t>(2, w.N / TILE - tn));
  auto deq = [&](int64_t j) {
    for (int64_t u = 0; u < ntn; ++u) {
      const uint8_t* qn = w.q + (tn + u) * nb * NC * 64 + j * NC * 64;
      for (int c = 0; c < NC; ++c) _mm_prefetch((const char*)(qn + c * 64), _MM_HINT_T1);
      const int64_t so = ((tn + u) * GB * nb + GB * j) * TILE;
      _mm_prefetch((const char*)((const ST*)w.s + so), _MM_HINT_T1);
      if (w.mn) _mm_prefetch((const char*)((const ST*)w.mn + so), _MM_HINT_T1);
    }
    dequant_block<BITS, ST, G16>(w, t, j, nb, b + j * 512);
    if (nt == 2) dequant_block<BITS, ST, G16>(w, t + 1, j, nb, b1 + j * 512);
  };
  for (int64_t j = 0; j < std::min(KLOOP_AHEAD, nb); ++j) deq(j);
  zero_acc<RT>();
  for (int64_t j = 0; j < nb; ++j) {
    block_step<RT>(x, K, j, b + j * 512, b1 + j * 512);
    if (j + KLOOP_AHEAD < nb) deq(j + KLOOP_AHEAD);
    side(j);
  }
  store_acc<RT>(out);
}

// kloop_pair_t for pair p of w with rt (1 or 2) row tiles of x, dispatched on w's bits, group size
// and scale type; side as tile_pair's.
template <typename Side>
inline void kloop_pair(const QW& w, int64_t p, int rt, int64_t nb, const uint16_t* x, uint16_t* b, float* out,
                       const Side& side) {
  const int64_t t = 2 * p, nt = std::min<int64_t>(2, w.N / TILE - t);
  with_scale_type(w, [&](auto st) {
    using ST = decltype(st);
    with_bits(w.bits, [&](auto bb) {
      constexpr int B = decltype(bb)::value;
      auto run = [&](auto g16) {
        constexpr bool G = decltype(g16)::value;
        if (rt == 2) kloop_pair_t<2, B, ST, G>(w, t, nt, nb, x, b, out, side);
        else kloop_pair_t<1, B, ST, G>(w, t, nt, nb, x, b, out, side);
      };
      if (B == 8 && w.gs != BLK) run(std::true_type{});
      else run(std::false_type{});
    });
  });
}

// Pairs a K-loop share keeps dequantized at once for its later 32-row chunks: up to 64 rows one
// (the second chunk reads the pair just dequantized from L1/L2, right after the first), past 64 a
// kBlockBytes block of pairs (gemm's loop order within it). Measured on the default model's 30
// layers, one thread, CPU time (docs/benchmarks.md): one pair up to 64 rows 16.0 / 16.9 ms at 48 /
// 64 rows against 18.6 / 19.7 with 512 KiB blocks; at 512 rows 512 KiB blocks 84.6 ms against one
// pair 95.9 (before the row blocks; 1 MiB blocks since, 2,048 rows 8.2 against 8.7 ms a layer).
inline int64_t kloop_block_pairs(int64_t M, int64_t pair_bytes) {
  return M <= 64 ? 1 : std::max<int64_t>(1, kBlockBytes / pair_bytes);
}

// x: [Mp, K] bf16 bits, 64-byte aligned (rows_buffer), Mp = M rounded up to 32, rows >= M zero. Output rows 0..M-1 of [M, N]:
// float32 into yf, or bf16 (one rounding) into ybf; exactly one of them non-null. Tile pairs split
// by par into contiguous shares; each share runs in blocks of pairs; within a block, row blocks of
// kRowBlock rows (K <= 640; else of one 32-row chunk), within those each pair in turn over the row
// block's chunks (so with larger K the chunks are the outer loop, each reused by every pair of the
// block). A chunk's output is written, row segment by row segment, during the next chunk's K loop.
// silu: w a gate/up weight [2I, K] (N % 64 == 0, gate rows first) and the output [M, I] bf16 silu(g) * u
// (silu_bf16); the shares split the gate pairs, each running gate pair i then up pair P / 2 + i
// in the same block, the gate chunks' sums kept in a per-thread buffer of one row block.
// packed: the weight already in that layout (pack_b: every pair, 2 x nb x 512 bf16 each, 64-byte
// aligned), blocks of kBlockBytes; or null: the first row chunk of each pair runs the K loop
// (kloop_pair: the codes dequantized block by block beside the products, into a per-thread buffer
// of kloop_block_pairs pairs) and the later chunks read that buffer. Each weight's codes are read
// and dequantized once per call either way.
template <typename Par>
void gemm(const QW& w, const uint16_t* xd, int64_t M, float* yf, at::BFloat16* ybf, const Par& par,
          const uint16_t* packed = nullptr, bool silu = false) {
  const int64_t N = w.N, K = w.K, nb = K / BLK, T = N / TILE, P = (T + 1) / 2;
  const int64_t pair_elems = 2 * nb * 512;
  const int64_t per_block = packed ? std::max<int64_t>(1, kBlockBytes / (pair_elems * 2)) : kloop_block_pairs(M, pair_elems * 2);
  const int64_t rb = pair_elems * 2 <= kL1PairBytes && N <= kRowBlockMaxN ? kRowBlock : 32;  // kRowBlock
  const int64_t per_step = (32 + nb - 1) / nb;  // Pending::rows_at
  TORCH_CHECK(((uintptr_t)xd & 63) == 0, "sglite_amx::gemm: the activation rows must be 64-byte aligned (rows_buffer)");
  TORCH_CHECK(!silu || (N % 64 == 0 && ybf), "sglite_amx::gemm: silu needs N % 64 == 0 and a bf16 output");
  // silu: the output is [M, N / 2]; the threads split the gate half's pairs, and each share runs its
  // pairs in the order gate 0, up 0, gate 1, up 1, .. (v even: gate pair v / 2; odd: up pair P / 2 + v / 2)
  const int64_t NO = silu ? N / 2 : N, H = P / 2;
  auto pair_of = [&](int64_t v) { return silu ? v / 2 + (v % 2) * H : v; };
  par(0, silu ? H : P, 1, [&](int64_t s0, int64_t s1) {
    const int64_t p0 = silu ? 2 * s0 : s0, p1 = silu ? 2 * s1 : s1;
    sglite_tiles::configure();
    // silu: gate and up pairs in the same block (an even count), so the up pair's chunks follow the
    // gate pair's within each row block
    const int64_t nblk = std::min(silu ? std::max<int64_t>(2, per_block / 2 * 2) : per_block, p1 - p0);
    // uninitialised (every B tile is written before it is loaded): a zero-filled vector would clear
    // up to 512 KiB per call and thread; 64-byte aligned for the B loads
    std::unique_ptr<uint16_t[]> bufv(packed ? nullptr : new uint16_t[nblk * pair_elems + 32]);
    uint16_t* own = (uint16_t*)(((uintptr_t)bufv.get() + 63) & ~(uintptr_t)63);
    alignas(64) float stage[2][32 * 32];
    std::unique_ptr<float[]> gatev(silu ? new float[(kRowBlock / 32) * 32 * 32 + 16] : nullptr);  // silu: the gate pair's chunks of the row block
    float* gate = (float*)(((uintptr_t)gatev.get() + 63) & ~(uintptr_t)63);
    int st_cur = 0;
    Pending pend;  // the chunk whose output rows are written during the next chunk's K loop
    for (int64_t pb = p0; pb < p1; pb += nblk) {
      const int64_t pe = std::min(p1, pb + nblk);
      for (int64_t r0 = 0; r0 < M; r0 += rb) {
        const int64_t r1 = std::min(M, r0 + rb);
        for (int64_t v = pb; v < pe; ++v) {
          const int64_t p = pair_of(v);
          const bool is_gate = silu && v % 2 == 0;
          uint16_t* mine = own + (v - pb) * pair_elems;
          const uint16_t* b0 = packed ? packed + p * pair_elems : mine;
          for (int64_t m0 = r0; m0 < r1; m0 += 32) {
            const int rt = M - m0 > 16 ? 2 : 1;
            float* st = is_gate ? gate + (m0 - r0) / 32 * 32 * 32 : stage[st_cur];
            const Pending prev = pend;
            auto side = [&](int64_t j) { prev.rows_at(j, per_step, NO, yf, ybf); };
            if (!packed && m0 == 0) kloop_pair(w, p, rt, nb, xd, mine, st, side);
            else if (rt == 2) tile_pair<2>(xd + m0 * K, K, b0, b0 + nb * 512, st, side);
            else tile_pair<1>(xd + m0 * K, K, b0, b0 + nb * 512, st, side);
            pend = Pending{};  // written by now (rows_at: all rows by the last block)
            if (is_gate) continue;  // the up pair's chunk writes it
            pend = Pending{st, silu ? gate + (m0 - r0) / 32 * 32 * 32 : nullptr, m0, std::min<int64_t>(16 * rt, M - m0),
                           std::min<int64_t>(2, T - 2 * p) * TILE, 2 * (silu ? p - H : p) * TILE};
            st_cur ^= 1;
          }
        }
      }
    }
    pend.write(0, 32, NO, yf, ybf);
    _tile_release();
  });
}

// The whole weight in gemm's B layout (P pairs x 2 x nb x 512 bf16) into out, 64-byte aligned; pairs split by par.
template <typename Par>
void pack_b(const QW& w, uint16_t* out, const Par& par) {
  const int64_t nb = w.K / BLK, P = (w.N / TILE + 1) / 2;
  par(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) dequant_pair(w, p, nb, out + p * 2 * nb * 512);
  });
}

// Room for the tile GEMM's activation rows [Mp, K] bf16 (Mp = M rounded up to 32) in buf -> its
// 64-byte aligned start. Every tile row is then one cache line: K % 32 == 0 makes each row's stride a
// whole number of lines, and a tile load whose 64-byte rows straddle two lines (malloc's 16-byte
// alignment) measured ~3x slower per load here (7.7 vs 24 ns CPU, docs/benchmarks.md). A fresh (empty)
// buf comes back zero-filled, padding rows included (std::vector::resize value-initialises).
inline uint16_t* rows_buffer(std::vector<uint16_t>& buf, int64_t M, int64_t K) {
  buf.resize((M + 31) / 32 * 32 * K + 32);
  return (uint16_t*)(((uintptr_t)buf.data() + 63) & ~(uintptr_t)63);
}

// float32 rows x [M, K] -> bf16 bits (round to nearest even) in xd [Mp, K], padding rows zero; Mp: M
// rounded up to 32 (rows < 0), else rows (>= M: a share of a larger buffer, its padding included)
inline void pack_rows(const float* x, int64_t M, int64_t K, uint16_t* xd, int64_t rows = -1) {
  const int64_t Mp = rows < 0 ? (M + 31) / 32 * 32 : rows;
  for (int64_t i = 0; i + 16 <= M * K; i += 16)
    _mm256_storeu_si256((__m256i*)(xd + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  for (int64_t i = (M * K) / 16 * 16; i < M * K; ++i) xd[i] = c10::BFloat16(x[i]).x;
  std::memset(xd + M * K, 0, (Mp - M) * K * sizeof(uint16_t));
}

}  // namespace sglite_amx
#endif  // SGQ_AMX
