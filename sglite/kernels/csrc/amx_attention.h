// Attention of up to 64 query rows against a run of paged keys on the AMX tiles (bf16 pools), as a
// header spliced into cpu_extend_attention.cpp (extend tasks) and cpu_attention.cpp (the shared
// prefix of a decode batch). Contract and torch reference: sglite/kernels/cpu_attention.py.
//
// One call walks keys in blocks of up to KB = 256 slots read in place from the pool through a slot list,
// and keeps per row a running max m, sum l and unnormalised output acc (online softmax: Milakov &
// Gimelshein 2018; tiled as in Dao et al. 2022, "FlashAttention", Alg. 1). Per block:
//   - K^T is packed into the tiles' B layout: for each 32-wide slice of D and 16 keys, a 16 x 16
//     transpose of 32-bit bf16 pairs (tile row p holds, for each key, its dims 2p and 2p + 1);
//   - scores S [rows, 64] = Q [rows, Dp] . K^T: one TDPBF16PS per (16-row tile, 16-key tile,
//     32-dim slice), Q pre-scaled and rounded to bf16 once per task (float32 sums);
//   - masking (causal / window / past the run; only the 16-key chunks that cross an edge), soft-
//     capping, and the online softmax in float32 on AVX-512, in log2 units (log2(e) folded into
//     the query scale; weights 2^(s - m) by a degree-3 polynomial, relative error 7.5e-5, then
//     rounded to bf16 as the VDPBF16PS decode path does; the running max moves lazily, kTau);
//   - V is packed as key pairs interleaved per dimension (VPERMT2W), and acc += P . V runs one
//     TDPBF16PS per (16-row tile, 16-dim tile, 32-key slice) on acc loaded into the tiles after
//     its rows were rescaled by 2^(m_old - m_new) (only the rows whose max moved).
// A row's result depends only on its own query, the keys it sees and the block anchoring (which
// the caller fixes per request), never on the other rows of the task. walk packs each block
// itself; a caller whose calls share keys packs them once (pack_to into a buffer of
// packed_block_elems blocks) and walks them with walk_packed: the same tiles, the same bits; or
// packs a block into one Work and runs several row blocks (Works made with Work(Work&)) over it
// with block(), prefetching its next block meanwhile (RowPrefetch).
#pragma once
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define SGL_AMX_ATTN 1
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include "amx_tiles.h"
#include "avx512_math.h"

namespace sglite_amx_attn {

constexpr int KB = 256;       // keys per block at most (a multiple of 64; a short run packs and multiplies only the 64-key quads it fills)
constexpr int kMaxRows = 64;  // query rows per call (4 row tiles)
constexpr int kMaxDp = 256;   // padded head dim (a multiple of 32)
// Row strides of the scratch (elements): one 64-byte line past a power of two, so the 16 rows a
// tile load or store touches fall in 16 different L1 sets instead of 4 (a stride of 1 KiB, as
// KB floats or kMaxDp floats, maps every row of a tile to the same 4 sets of the 64, and the 64
// rows of acc or of the scores then overflow those sets' 12 ways: -11 % per call, docs/benchmarks.md).
constexpr int kSld = KB + 16;      // w.s: float32 scores
constexpr int kPld = KB + 32;      // w.p: bf16 weights
constexpr int kAld = kMaxDp + 16;  // w.acc: float32 outputs

// Tiles (sglite_tiles::configure()'s shapes): tmm0..3 C (16 x 16 float32), tmm4 and tmm6 A (16
// rows x 32 bf16), tmm5 B (16 pair-rows x 16 columns).

template <typename T> T* aligned(size_t n) { return (T*)std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64); }

// Per-thread scratch and the running state of one call's rows.
struct Work {
  uint16_t* q;    // [kMaxRows][kMaxDp] bf16 queries (pre-scaled), zero past D and past the rows
  uint16_t* kt;   // K^T B tiles: [Dp / 32][KB / 16] tiles of 512 bf16
  uint16_t* vp;   // V B tiles: [KB / 32][Dp / 16] tiles of 512 bf16
  float* s;       // [kMaxRows][kSld] scores (KB used)
  uint16_t* p;    // [kMaxRows][kPld] bf16 weights (A tiles; KB used)
  float* acc;     // [kMaxRows][kAld] unnormalised outputs (Dp used)
  alignas(64) float m[kMaxRows], l[kMaxRows], alpha[kMaxRows];
  alignas(64) int32_t qpos[kMaxRows];  // last visible key position of each row (INT32_MAX: all)
  bool owns_block = true;              // false: kt, vp, s, p borrowed (Work(Work&))
  Work() : q(aligned<uint16_t>(kMaxRows * kMaxDp)), kt(aligned<uint16_t>(kMaxDp / 32 * KB / 16 * 512)),
           vp(aligned<uint16_t>(KB / 32 * kMaxDp / 16 * 512)), s(aligned<float>(kMaxRows * kSld)),
           p(aligned<uint16_t>(kMaxRows * kPld)), acc(aligned<float>(kMaxRows * kAld)) {}
  // Rows of their own (q, acc, m, l, ...) on `share`'s block scratch (kt, vp, s, p): several row
  // blocks walked over the same packed keys on one thread, one block() call at a time (s and p
  // live only within a call). `share` must outlive this Work.
  explicit Work(Work& share) : q(aligned<uint16_t>(kMaxRows * kMaxDp)), kt(share.kt), vp(share.vp), s(share.s), p(share.p),
                               acc(aligned<float>(kMaxRows * kAld)), owns_block(false) {}
  ~Work() {
    std::free(q); std::free(acc);
    if (owns_block) { std::free(kt); std::free(vp); std::free(s); std::free(p); }
  }
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
};

// Start a call: rows [0, R) (R <= 64) with Dp (a multiple of 32, >= D); the caller then fills
// w.q rows [0, R) columns [0, D) (row stride kMaxDp) and w.qpos [0, R).
inline void begin(Work& w, int R, int Dp) {
  const int Rp = (R + 15) & ~15;
  for (int r = 0; r < Rp; ++r) {
    std::memset(w.q + (size_t)r * kMaxDp, 0, sizeof(uint16_t) * Dp);
    std::memset(w.acc + (size_t)r * kAld, 0, sizeof(float) * Dp);
    w.m[r] = -INFINITY; w.l[r] = 0.f; w.qpos[r] = -1;
  }
}

constexpr float kLog2e = 1.44269504088896341f, kLn2 = 0.693147180559945309f;
// Lazy rescaling: a row's running max moves only when a block's max exceeds it by more than kTau
// (log2 units), so most blocks leave acc and l alone; weights then reach 2^kTau at most (float32 and
// bf16 share the exponent range; the result, acc / l, is the same softmax whatever the shift).
constexpr float kTau = 8.f;

// Row r's query: x[0 .. D) * scale * log2(e) rounded to bf16 (T: float or bf16 bits): scores come
// out in log2 units, so the weights are 2^(s - m) (exp2_deg3, no multiply per score) and w.m holds
// log2-unit maxima (m_natural converts).
template <typename T> inline void set_query(Work& w, int r, const T* x, int D, float scale) {
  uint16_t* q = w.q + (size_t)r * kMaxDp;
  const float s2 = scale * kLog2e;
  int d = 0;
  for (; d + 16 <= D; d += 16) {
    __m512 v;
    if constexpr (sizeof(T) == 2) v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(x + d))), 16));
    else v = _mm512_loadu_ps(x + d);
    _mm256_storeu_si256((__m256i*)(q + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(v, _mm512_set1_ps(s2))));
  }
  for (; d < D; ++d) {
    float v;
    if constexpr (sizeof(T) == 2) { const uint32_t b = (uint32_t)x[d] << 16; std::memcpy(&v, &b, 4); }
    else v = (float)x[d];
    q[d] = c10::BFloat16(v * s2).x;
  }
}

// Row r's running max in natural-log units (for merging with softmax partials computed elsewhere).
inline float m_natural(const Work& w, int r) { return w.m[r] * kLn2; }

struct RowPrefetch;  // below: prefetch of the rows a caller reads next, stepped from inside block()

// Walk keys [k_begin, k_end) of one head (slots: the request's slot row, indexed by position),
// blocks anchored at multiples of KB from `anchor`; `first_q` / `last_q`: the smallest / largest
// row position (blocks ending at or before first_q need no causal mask); `pf`: rows to prefetch
// meanwhile (none when null). False on a bad slot.
inline bool walk(Work& w, int R, int D, int Dp, const uint16_t* kh, int64_t s0k, const uint16_t* vh, int64_t s0v,
                 const int32_t* slots, int64_t S, int64_t k_begin, int64_t k_end, int64_t first_q, int64_t last_q,
                 int64_t window, float softcap, RowPrefetch* pf = nullptr);

// 16 x 16 transpose of 32-bit lanes: r[i] lane j -> r[j] lane i.
inline void transpose16(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // b[4i + j] lane L: rows 4i..4i+3, column 4L + j
    const __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i c2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i c3 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
    r[j] = _mm512_shuffle_i32x4(c0, c2, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + j] = _mm512_shuffle_i32x4(c0, c2, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + j] = _mm512_shuffle_i32x4(c1, c3, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + j] = _mm512_shuffle_i32x4(c1, c3, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

inline __mmask32 dmask(int rem) {  // bf16 lanes [0, rem) of 32
  return rem >= 32 ? (__mmask32)0xFFFFFFFFu : (rem <= 0 ? (__mmask32)0 : (__mmask32)((1u << rem) - 1));
}

// Pack keys slots[0 .. n) (n <= KB; the rest zero) of one head: K^T tiles into w.kt, V tiles into
// w.vp. base_k / base_v point at the head's row of slot 0; s0k / s0v: elements between slots.
// False when a slot lies outside [0, S).
// pack_to: the same into kt / vp, each KB x Dp bf16 (64-byte aligned), e.g. a block of a buffer
// that several calls read (packed_block_elems, walk_packed).
inline bool pack_to(const uint16_t* base_k, int64_t s0k, const uint16_t* base_v, int64_t s0v,
                    const int32_t* slots, int n, int64_t S, int D, int Dp, uint16_t* kt, uint16_t* vp) {
  for (int t = 0; t < n; ++t)
    if (slots[t] < 0 || slots[t] >= S) return false;
  const int nd = Dp / 32, n64 = (n + 63) & ~63;  // keys past n64 are never read
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int ndg = Dp / 16, row_bytes = 2 * D;
  // per 16 keys: K^T tiles, then the same keys' V pairs; the next 16 keys' K and V rows are
  // prefetched first (paged rows: the hardware prefetcher cannot follow the slot list)
  auto prefetch = [&](int kg) {
    for (int u = 0; u < 16; ++u) {
      const int t = kg * 16 + u;
      if (t >= n) break;
      const char *pk = (const char*)(base_k + slots[t] * s0k), *pv = (const char*)(base_v + slots[t] * s0v);
      for (int b = 0; b < row_bytes; b += 64) { _mm_prefetch(pk + b, _MM_HINT_T0); _mm_prefetch(pv + b, _MM_HINT_T0); }
    }
  };
  const bool run = n > 0 && std::abs(slots[n - 1] - slots[0]) == n - 1;  // one run (either way): the hardware prefetcher follows it
  if (!run) prefetch(0);
  for (int kg = 0; kg < n64 / 16; ++kg) {
    if (!run) prefetch(kg + 1);
    for (int c = 0; c < nd; ++c) {
      __m512i r[16];
      for (int u = 0; u < 16; ++u) {
        const int t = kg * 16 + u;
        r[u] = t < n ? _mm512_maskz_loadu_epi16(dmask(D - 32 * c), base_k + slots[t] * s0k + 32 * c) : _mm512_setzero_si512();
      }
      transpose16(r);
      uint16_t* dst = kt + (size_t)(c * (KB / 16) + kg) * 512;
      for (int u = 0; u < 16; ++u) _mm512_store_si512(dst + 32 * u, r[u]);
    }
    for (int pr = kg * 8; pr < kg * 8 + 8; ++pr) {
      const int t0 = 2 * pr, kc = t0 / 32, p = (t0 % 32) / 2;
      for (int c = 0; c < nd; ++c) {
        const __m512i a = t0 < n ? _mm512_maskz_loadu_epi16(dmask(D - 32 * c), base_v + slots[t0] * s0v + 32 * c) : _mm512_setzero_si512();
        const __m512i b = t0 + 1 < n ? _mm512_maskz_loadu_epi16(dmask(D - 32 * c), base_v + slots[t0 + 1] * s0v + 32 * c) : _mm512_setzero_si512();
        uint16_t* dst = vp + (size_t)(kc * ndg + 2 * c) * 512 + 32 * p;
        _mm512_store_si512(dst, _mm512_permutex2var_epi16(a, lo, b));
        _mm512_store_si512(dst + 512, _mm512_permutex2var_epi16(a, hi, b));
      }
    }
  }
  return true;
}

inline bool pack_block(const uint16_t* base_k, int64_t s0k, const uint16_t* base_v, int64_t s0v,
                       const int32_t* slots, int n, int64_t S, int D, int Dp, Work& w) {
  return pack_to(base_k, s0k, base_v, s0v, slots, n, S, D, Dp, w.kt, w.vp);
}

// bf16 elements of one packed block in a shared buffer: K^T tiles (KB x Dp), then V tiles (KB x Dp).
inline size_t packed_block_elems(int Dp) { return (size_t)2 * KB * Dp; }

// Lane i of the result: the max (MAX) or the sum of the 16 lanes of v[i]; every row through the
// same tree (quarters (0 + 2, 1 + 3), their two halves, then lanes (0 + 2, 1 + 3) within a quarter
// and the last pair), so a row's result never depends on its neighbours. 46 operations for 16
// rows, against 2 x 4 dependent shuffles and operations per row for _mm512_reduce_*.
template <bool MAX> inline __m512 reduce16(const __m512 v[16]) {
  auto op = [](__m512 a, __m512 b) { return MAX ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b); };
  __m512 u[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // rows 2i, 2i + 1: 8 lanes each
    u[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // quarter k: row 4i + k, 4 lanes
    x[i] = op(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // quarter k: rows 8i + k, 8i + 4 + k, 2 lanes each
    y[i] = op(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z = op(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));  // lane 4k + j: row 4j + k
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), z);
}


// C tiles 0..Rt-1 += A . B (tile 5), A = Rt row tiles of bf16 rows `a` (ld elements apart),
// 16 rows per tile; A goes through tiles 4 and 6 alternately.
inline void dp_row_tiles(int Rt, const uint16_t* a, int64_t ld) {
  _tile_loadd(4, a, ld * 2);
  _tile_dpbf16ps(0, 4, 5);
  if (Rt > 1) { _tile_loadd(6, a + 16 * ld, ld * 2); _tile_dpbf16ps(1, 6, 5); }
  if (Rt > 2) { _tile_loadd(4, a + 32 * ld, ld * 2); _tile_dpbf16ps(2, 4, 5); }
  if (Rt > 3) { _tile_loadd(6, a + 48 * ld, ld * 2); _tile_dpbf16ps(3, 6, 5); }
}

// C tiles 0..Rt-1 to (STORE) or from float32 rows c, ld elements apart, 16 rows per tile.
template <bool STORE> inline void c_row_tiles(int Rt, float* c, int64_t ld) {
  if (STORE) {
    _tile_stored(0, c, ld * 4);
    if (Rt > 1) _tile_stored(1, c + 16 * ld, ld * 4);
    if (Rt > 2) _tile_stored(2, c + 32 * ld, ld * 4);
    if (Rt > 3) _tile_stored(3, c + 48 * ld, ld * 4);
  } else {
    _tile_loadd(0, c, ld * 4);
    if (Rt > 1) _tile_loadd(1, c + 16 * ld, ld * 4);
    if (Rt > 2) _tile_loadd(2, c + 32 * ld, ld * 4);
    if (Rt > 3) _tile_loadd(3, c + 48 * ld, ld * 4);
  }
}

inline void tile_zero_n(int t) {  // _tile_zero takes an immediate
  switch (t) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3);
  }
}

// The keys of one row in one block (by index in the block): lo_rel < t <= hi visible, chunks of 16
// [c_lo, c_hi) touched at all.
struct Span { int c_lo, c_hi; int32_t hi, lo_rel; };

// Visible lanes of chunk c (keys 16c .. 16c + 15); all of them unless the chunk crosses an edge.
inline __mmask16 chunk_mask(const Span& sp, int c) {
  if (16 * c + 15 <= sp.hi && 16 * c > sp.lo_rel) return (__mmask16)0xFFFF;
  const __m512i kp = _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16 * c));
  return _mm512_cmple_epi32_mask(kp, _mm512_set1_epi32(sp.hi)) & _mm512_cmpgt_epi32_mask(kp, _mm512_set1_epi32(sp.lo_rel));
}

// Lane-wise max of a row's visible scores s (-inf where none).
inline __m512 row_max(const float* s, const Span& sp) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int c = sp.c_lo; c < sp.c_hi; ++c) mx = _mm512_mask_max_ps(mx, chunk_mask(sp, c), mx, _mm512_loadu_ps(s + 16 * c));
  return mx;
}

// One row's weights 2^(s - m) (zero where not visible) as bf16 into p (chunks [0, nc)), their
// lane-wise sums returned (float32, before rounding) and the visible scores' lane-wise max in mx.
inline __m512 row_exp(const float* s, uint16_t* p, const Span& sp, int nc, float m, __m512& mx) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps(), mv = _mm512_set1_ps(-INFINITY);
  for (int c = 0; c < nc; c += 2) {
    __m512 e0 = _mm512_setzero_ps(), e1 = _mm512_setzero_ps();
    if (c >= sp.c_lo && c < sp.c_hi) {
      const __mmask16 k = chunk_mask(sp, c);
      const __m512 v = _mm512_loadu_ps(s + 16 * c);
      mv = _mm512_mask_max_ps(mv, k, mv, v);
      e0 = sglite_simd::exp2_deg3_maskz(k, _mm512_sub_ps(v, vm));
    }
    if (c + 1 >= sp.c_lo && c + 1 < sp.c_hi) {
      const __mmask16 k = chunk_mask(sp, c + 1);
      const __m512 v = _mm512_loadu_ps(s + 16 * c + 16);
      mv = _mm512_mask_max_ps(mv, k, mv, v);
      e1 = sglite_simd::exp2_deg3_maskz(k, _mm512_sub_ps(v, vm));
    }
    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
    _mm512_storeu_si512(p + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
  }
  mx = mv;
  return sum;
}

// Prefetch into L2 of the K and V rows a caller packs next (e.g. its next block of a cold pool),
// `per` keys at a time from inside block()'s loops (each 16-key score tile and each 16-row softmax
// step), so that the loads overlap the products instead of stalling in one burst on the fill
// buffers. Slots outside [0, S) are skipped (the packing refuses them).
struct RowPrefetch {
  const char *k = nullptr, *v = nullptr;  // the head's row of slot 0 in each pool
  int64_t sk = 0, sv = 0, S = 0;          // bytes between slots; pool slots
  const int32_t* slots = nullptr;
  int n = 0, next = 0, per = 1, lines = 1;  // keys, the next to fetch, keys per step, 64-byte lines a row
  // one head of bf16 pools (kh / vh: the head's row of slot 0, s0k / s0v elements between slots,
  // S slots, D elements a row); the keys (slots, n, per) are the caller's
  static RowPrefetch head(const uint16_t* kh, int64_t s0k, const uint16_t* vh, int64_t s0v, int64_t S, int D) {
    RowPrefetch p;
    p.k = (const char*)kh;
    p.v = (const char*)vh;
    p.sk = 2 * s0k;
    p.sv = 2 * s0v;
    p.S = S;
    p.lines = (2 * D + 63) / 64;
    return p;
  }
  inline void step() {
    for (const int e = std::min(n, next + per); next < e; ++next) {
      const int64_t sl = slots[next];
      if (sl < 0 || sl >= S) continue;
      for (int l = 0; l < lines; ++l) {
        _mm_prefetch(k + sl * sk + 64 * l, _MM_HINT_T1);
        _mm_prefetch(v + sl * sv + 64 * l, _MM_HINT_T1);
      }
    }
  }
};

// One block of n keys at positions t0 .. t0 + n - 1 for rows [0, R): scores, mask, online softmax,
// acc update. `full`: every row sees every key of the block (no masking needed).
// kt / vp: the block's packed K^T and V tiles (pack_to's layout).
inline void block(Work& w, const uint16_t* kt, const uint16_t* vp, int R, int Dp, int n, int64_t t0, bool full,
                  int64_t window, float softcap, RowPrefetch* pf = nullptr) {
  const int Rt = (R + 15) / 16, nd = Dp / 32, ndg = Dp / 16, n64 = (n + 63) & ~63;  // keys past n64: skipped
  // scores: per 16-key tile, C tiles 0..Rt-1 = the row tiles; each K^T tile is loaded once (the
  // queries, 8 KB at most, are re-read from L1 instead)
  for (int kg = 0; kg < n64 / 16; ++kg) {
    if (pf) pf->step();
    for (int rt = 0; rt < Rt; ++rt) tile_zero_n(rt);
    for (int c = 0; c < nd; ++c) {
      _tile_loadd(5, kt + (size_t)(c * (KB / 16) + kg) * 512, 64);
      dp_row_tiles(Rt, w.q + 32 * c, kMaxDp);
    }
    c_row_tiles<true>(Rt, w.s + 16 * kg, kSld);
  }
  // softmax, per 16 rows: per row the chunks of 16 keys it can see at all ([c_lo, c_hi): the rest
  // get zero weights and no exp), masks only on the chunks that cross the diagonal, the window's
  // edge or the block's end. When every row that sees keys here already has a running max (every
  // block after a row's first), one pass per row takes 2^(s - m_old), the bf16 weights, the sum
  // and the block's max together; the 16 maxima are then reduced at once, and only a row whose max
  // moved (past m_old + kTau: rare) is redone against its new max. Otherwise (a first block) a
  // max pass comes first. Either way a row's weights are 2^(s - m_next) for the same m_next, bit
  // for bit.
  alignas(64) float m_next[kMaxRows], rsum[kMaxRows], bmax[16];
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  const int nc = n64 / 16;
  for (int r0 = 0; r0 < Rt * 16; r0 += 16) {
    if (pf) pf->step();
    __m512 mx[16], sm[16];
    Span sp[16];
    bool seen = true;  // every row that sees a key here has a finite running max
    for (int i = 0; i < 16; ++i) {
      const int r = r0 + i;
      // keys (by index in the block) lo_rel < t <= hi are visible
      int64_t hi = n - 1, lo_rel = -1;
      if (r >= R) hi = -1;  // padding rows: no weights
      else if (!full) {
        hi = std::min<int64_t>(hi, (int64_t)w.qpos[r] - t0);
        if (window > 0) lo_rel = std::max<int64_t>(-1, std::min<int64_t>(KB, (int64_t)w.qpos[r] - window - t0));
      }
      sp[i] = Span{(int)std::max<int64_t>(0, (lo_rel + 1) / 16), hi < 0 ? 0 : (int)(hi / 16 + 1), (int32_t)hi, (int32_t)lo_rel};
      if (sp[i].c_lo >= sp[i].c_hi) continue;
      if (w.m[r] == -INFINITY) seen = false;
      if (softcap > 0.f) {  // on log2-unit scores: cap' = cap log2(e) gives log2(e) cap tanh(s / cap)
        float* s = w.s + (size_t)r * kSld;
        const float cap = softcap * kLog2e, inv = 1.f / cap;
        for (int t = 16 * sp[i].c_lo; t < 16 * sp[i].c_hi; ++t) s[t] = cap * std::tanh(s[t] * inv);
      }
    }
    const __m512 mo = _mm512_load_ps(w.m + r0);
    const __m512 lim = _mm512_add_ps(mo, _mm512_set1_ps(kTau));
    if (seen) {
      for (int i = 0; i < 16; ++i)
        sm[i] = row_exp(w.s + (size_t)(r0 + i) * kSld, w.p + (size_t)(r0 + i) * kPld, sp[i], nc, w.m[r0 + i], mx[i]);
    } else {
      for (int i = 0; i < 16; ++i) mx[i] = row_max(w.s + (size_t)(r0 + i) * kSld, sp[i]);
    }
    // the running max moves only past m_old + kTau (also when m_old = -inf; a row that sees nothing
    // here, block max -inf, keeps its own)
    const __m512 bm = reduce16<true>(mx);
    const __mmask16 moved = _mm512_cmp_ps_mask(bm, lim, _CMP_GT_OQ);
    _mm512_store_ps(bmax, bm);
    _mm512_store_ps(m_next + r0, _mm512_mask_mov_ps(mo, moved, bm));
    for (int i = 0; i < 16; ++i) {
      if (seen && !((moved >> i) & 1)) continue;
      uint16_t* p = w.p + (size_t)(r0 + i) * kPld;
      if (sp[i].c_lo >= sp[i].c_hi || bmax[i] == -INFINITY) {  // nothing visible
        std::memset(p, 0, sizeof(uint16_t) * KB);
        sm[i] = _mm512_setzero_ps();
        continue;
      }
      __m512 unused;
      sm[i] = row_exp(w.s + (size_t)(r0 + i) * kSld, p, sp[i], nc, m_next[r0 + i], unused);
    }
    _mm512_store_ps(rsum + r0, reduce16<false>(sm));
  }
  // per 16 rows: alpha = 2^(m_old - m_new) (exactly 1 when the max stayed, 0 when m_old = -inf),
  // l = l * alpha + the block's sum
  for (int r = 0; r < Rt * 16; r += 16) {
    const __m512 mo = _mm512_load_ps(w.m + r), mn = _mm512_load_ps(m_next + r);
    const __mmask16 same = _mm512_cmp_ps_mask(mn, mo, _CMP_EQ_OQ) | _mm512_cmp_ps_mask(mn, ninf, _CMP_EQ_OQ);
    const __mmask16 fresh = _mm512_cmp_ps_mask(mo, ninf, _CMP_EQ_OQ);
    __m512 al = sglite_simd::exp_nonpos(_mm512_mul_ps(_mm512_sub_ps(mo, mn), _mm512_set1_ps(kLn2)));
    al = _mm512_mask_mov_ps(al, fresh, _mm512_setzero_ps());
    al = _mm512_mask_mov_ps(al, same, _mm512_set1_ps(1.f));
    _mm512_store_ps(w.alpha + r, al);
    _mm512_store_ps(w.m + r, mn);
    _mm512_store_ps(w.l + r, _mm512_fmadd_ps(_mm512_load_ps(w.l + r), al, _mm512_load_ps(rsum + r)));
  }
  // acc = acc * alpha + P . V
  for (int r = 0; r < R; ++r) {
    if (w.alpha[r] == 1.f) continue;
    const __m512 a = _mm512_set1_ps(w.alpha[r]);
    float* ar = w.acc + (size_t)r * kAld;
    for (int d = 0; d < Dp; d += 16) _mm512_storeu_ps(ar + d, _mm512_mul_ps(_mm512_loadu_ps(ar + d), a));
  }
  // acc += P . V: per 16-dim tile, C tiles 0..Rt-1 = the row tiles; each V tile is loaded once
  for (int dg = 0; dg < ndg; ++dg) {
    float* acc = w.acc + 16 * dg;
    c_row_tiles<false>(Rt, acc, kAld);
    for (int kc = 0; kc < n64 / 32; ++kc) {
      _tile_loadd(5, vp + (size_t)(kc * ndg + dg) * 512, 64);
      dp_row_tiles(Rt, w.p + 32 * kc, kPld);
    }
    c_row_tiles<true>(Rt, acc, kAld);
  }
}

// The block packed in w.kt / w.vp (pack_block).
inline void block(Work& w, int R, int Dp, int n, int64_t t0, bool full, int64_t window, float softcap) {
  block(w, w.kt, w.vp, R, Dp, n, t0, full, window, softcap);
}

// Whether every row (positions first_q .. last_q) sees all n keys of the block at t0: it ends at or
// before the first row's position and, with a window, starts inside the last row's window.
inline bool block_full(int64_t t0, int n, int64_t first_q, int64_t last_q, int64_t window) {
  return t0 + n - 1 <= first_q && (window <= 0 || t0 > last_q - window);
}

inline bool walk(Work& w, int R, int D, int Dp, const uint16_t* kh, int64_t s0k, const uint16_t* vh, int64_t s0v,
                 const int32_t* slots, int64_t S, int64_t k_begin, int64_t k_end, int64_t first_q, int64_t last_q,
                 int64_t window, float softcap, RowPrefetch* pf) {
  for (int64_t t0 = k_begin; t0 < k_end; t0 += KB) {
    const int n = (int)std::min<int64_t>(KB, k_end - t0);
    if (!pack_block(kh, s0k, vh, s0v, slots + t0, n, S, D, Dp, w)) return false;
    const bool full = block_full(t0, n, first_q, last_q, window);
    block(w, w.kt, w.vp, R, Dp, n, t0, full, window, softcap, pf);
  }
  return true;
}

// walk over keys already packed: block i of `packed` (packed_block_elems(Dp) apart) holds keys
// kbase + i KB .. (pack_to over at least the keys [k_begin, k_end) need, anchored at kbase; keys
// past a block's fill that a call's last block still reads are multiplied by zero weights, so
// they change no bit of a result as long as they are finite). The rest as walk; never fails.
inline void walk_packed(Work& w, int R, int Dp, const uint16_t* packed, int64_t kbase, int64_t k_begin, int64_t k_end,
                        int64_t first_q, int64_t last_q, int64_t window, float softcap) {
  const size_t be = packed_block_elems(Dp);
  for (int64_t t0 = k_begin; t0 < k_end; t0 += KB) {
    const int n = (int)std::min<int64_t>(KB, k_end - t0);
    const uint16_t* kt = packed + (size_t)((t0 - kbase) / KB) * be;
    const bool full = block_full(t0, n, first_q, last_q, window);
    block(w, kt, kt + (size_t)KB * Dp, R, Dp, n, t0, full, window, softcap);
  }
}

}  // namespace sglite_amx_attn
#endif
