// LoRA deltas inside the fused decode (decode_layer.cpp; contract: sglite/kernels/decode_fused.py,
// "LoRA"): after a layer matmul y [M, O] = W x [M, K] (float32 activations), every row m whose
// adapter slot s = row_slot[m] >= 0 gets y[m] += t . b_s with t = x[m] . A_s^T (Hu et al. 2021;
// rows grouped by slot as S-LoRA's / Punica's SGMV). a [S, RT, K], b [S, RT, O] (B transposed,
// scaling folded in; RT = blocks * R rank rows, one block per part of the fused matmul: q/k/v,
// gate/up) in float32 or bf16, read as float32; sums in float32. spans [S, blocks, 3] int64: per
// slot and block the rank rows in use and the output columns [lo, hi) they write (zero rows and
// columns of the stacked buffers are never read).
// Threads: the shrink's (slot, up to 4 rank rows) tasks, then the expand's 64-column chunks, split over
// the pool (thread_pool.h) when the phase has at least split_min multiply-adds (below, one
// fork/join costs more than it shares on a loaded machine: the calling thread runs it); every value is computed by one thread with the same code whatever
// the split (t: one 16-lane dot over K; y: a sum over the rank rows in order), so the result does
// not depend on the thread count.
#pragma once
#include <ATen/core/Tensor.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include "thread_pool.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace sglite_lora_fused {

using sglite_pool::PoolPar;

inline float ldf(const float* p, int64_t i) { return p[i]; }
inline float ldf(const uint16_t* p, int64_t i) {  // bf16 bits -> float32 (exact)
  const uint32_t u = (uint32_t)p[i] << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// x . w over n values with 16 partial sums in a fixed order (vectorises, same on every thread)
template <typename T>
inline float dot16(const float* x, const T* w, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += x[i + j] * ldf(w, i + j);
  for (int j = 0; i + j < n; ++j) acc[j] += x[i + j] * ldf(w, i + j);
  for (int w2 = 8; w2 >= 1; w2 /= 2)
    for (int l = 0; l < w2; ++l) acc[l] += acc[l + w2];
  return acc[0];
}

constexpr int64_t COLS = 64;  // expand chunk width (columns of y per task)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SGLITE_LORA_AVX512 1
inline __m512 ld16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 ld16(const uint16_t* p, __mmask16 m) {  // 16 bf16 -> float32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n > 0 ? n : 0)) - 1); }

// t[row, q] = x[row] . a_row for NB rows (NB a compile-time count: the accumulators stay in
// registers; a run-time count made the compiler keep them on the stack)
template <int NB, typename T>
inline void shrink_tile(const T* ar, const float* x, int64_t K, const int64_t* rows, float* t, int64_t RT, int64_t q) {
  __m512 acc[NB];
  const float* xr[NB];
  for (int i = 0; i < NB; ++i) { acc[i] = _mm512_setzero_ps(); xr[i] = x + rows[i] * K; }
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = lanes(K - k);
    const __m512 a = ld16(ar + k, m);
    for (int i = 0; i < NB; ++i) acc[i] = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(m, xr[i] + k), acc[i]);
  }
  for (int i = 0; i < NB; ++i) t[rows[i] * RT + q] = _mm512_reduce_add_ps(acc[i]);
}

// the n rows rows[0..n), 8 at a time: one A load per 8 FMAs
template <typename T>
inline void shrink_rows(const T* ar, const float* x, int64_t K, const int64_t* rows, int64_t n, float* t, int64_t RT,
                        int64_t q) {
  int64_t i0 = 0;
  for (; i0 + 8 <= n; i0 += 8) shrink_tile<8>(ar, x, K, rows + i0, t, RT, q);
  switch (n - i0) {
    case 7: shrink_tile<7>(ar, x, K, rows + i0, t, RT, q); break;
    case 6: shrink_tile<6>(ar, x, K, rows + i0, t, RT, q); break;
    case 5: shrink_tile<5>(ar, x, K, rows + i0, t, RT, q); break;
    case 4: shrink_tile<4>(ar, x, K, rows + i0, t, RT, q); break;
    case 3: shrink_tile<3>(ar, x, K, rows + i0, t, RT, q); break;
    case 2: shrink_tile<2>(ar, x, K, rows + i0, t, RT, q); break;
    case 1: shrink_tile<1>(ar, x, K, rows + i0, t, RT, q); break;
    default: break;
  }
}

// t[row, q + j] = x[row] . a_(q + j) for NB rows and NQ consecutive rank rows (a rows K apart):
// each x load feeds NQ FMAs and each A load NB (fewer loads per FMA than one rank row at a time);
// every t value sums the same lanes in the same order as shrink_tile's
template <int NB, int NQ, typename T>
inline void shrink_tile_q(const T* ar, const float* x, int64_t K, const int64_t* rows, float* t, int64_t RT, int64_t q) {
  __m512 acc[NB][NQ];
  const float* xr[NB];
  for (int i = 0; i < NB; ++i) {
    xr[i] = x + rows[i] * K;
    for (int j = 0; j < NQ; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = lanes(K - k);
    __m512 a[NQ];
    for (int j = 0; j < NQ; ++j) a[j] = ld16(ar + j * K + k, m);
    for (int i = 0; i < NB; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, xr[i] + k);
      for (int j = 0; j < NQ; ++j) acc[i][j] = _mm512_fmadd_ps(a[j], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < NQ; ++j) t[rows[i] * RT + q + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int NQ, typename T>
inline void shrink_q(const T* ar, const float* x, int64_t K, const int64_t* rows, int64_t n, float* t, int64_t RT,
                     int64_t q) {
  int64_t i0 = 0;
  for (; i0 + 4 <= n; i0 += 4) shrink_tile_q<4, NQ>(ar, x, K, rows + i0, t, RT, q);
  switch (n - i0) {
    case 3: shrink_tile_q<3, NQ>(ar, x, K, rows + i0, t, RT, q); break;
    case 2: shrink_tile_q<2, NQ>(ar, x, K, rows + i0, t, RT, q); break;
    case 1: shrink_tile_q<1, NQ>(ar, x, K, rows + i0, t, RT, q); break;
    default: break;
  }
}

// the nq (1..4) consecutive rank rows q.. of ar (K apart) for the n rows rows[0..n)
template <typename T>
inline void shrink_rows_q(const T* ar, int64_t nq, const float* x, int64_t K, const int64_t* rows, int64_t n, float* t,
                          int64_t RT, int64_t q) {
  switch (nq) {
    case 4: shrink_q<4>(ar, x, K, rows, n, t, RT, q); break;
    case 3: shrink_q<3>(ar, x, K, rows, n, t, RT, q); break;
    case 2: shrink_q<2>(ar, x, K, rows, n, t, RT, q); break;
    case 1: shrink_q<1>(ar, x, K, rows, n, t, RT, q); break;
    default: break;
  }
}

// y[row, o0:o0+64] += sum over the rank rows qs of t[row, q] * b[q, o0:o0+64] for NB rows (4
// vectors of 16 columns per row held in registers; NB compile-time, as shrink_tile)
template <int NB, typename T>
inline void expand_tile(const T* B, int64_t O, const int64_t* qs, int64_t nq, const float* t, int64_t RT,
                        const int64_t* rows, int64_t o0, const __mmask16* mk, float* y) {
  __m512 acc[NB][4];
  const float* tr[NB];
  for (int i = 0; i < NB; ++i) {
    tr[i] = t + rows[i] * RT;
    for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
  }
  for (int64_t e = 0; e < nq; ++e) {
    const T* br = B + qs[e] * O + o0;
    const int64_t q = qs[e] % RT;
    // the next chunk of this b row: each chunk reads ~R rows 2 O bytes apart, 128-256 bytes of
    // each, too little per row for the hardware prefetchers to follow (prefetches never fault)
    for (int64_t c = 0; c < COLS * (int64_t)sizeof(T); c += 64)
      _mm_prefetch((const char*)(br + COLS) + c, _MM_HINT_T0);
    __m512 b[4];
    for (int v = 0; v < 4; ++v) b[v] = ld16(br + 16 * v, mk[v]);
    for (int i = 0; i < NB; ++i) {
      const __m512 tv = _mm512_set1_ps(tr[i][q]);
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_fmadd_ps(tv, b[v], acc[i][v]);
    }
  }
  for (int i = 0; i < NB; ++i) {
    float* yi = y + rows[i] * O + o0;
    for (int v = 0; v < 4; ++v)
      _mm512_mask_storeu_ps(yi + 16 * v, mk[v], _mm512_add_ps(_mm512_maskz_loadu_ps(mk[v], yi + 16 * v), acc[i][v]));
  }
}

// the n rows, 4 at a time: one b load per 4 x 4 FMAs, 64 columns [o0, o1)
template <typename T>
inline void expand_rows(const T* B, int64_t O, const int64_t* qs, int64_t nq, const float* t, int64_t RT,
                        const int64_t* rows, int64_t n, int64_t o0, int64_t o1, float* y) {
  __mmask16 mk[4];
  for (int v = 0; v < 4; ++v) mk[v] = lanes(o1 - o0 - 16 * v);
  int64_t i0 = 0;
  for (; i0 + 4 <= n; i0 += 4) expand_tile<4>(B, O, qs, nq, t, RT, rows + i0, o0, mk, y);
  switch (n - i0) {
    case 3: expand_tile<3>(B, O, qs, nq, t, RT, rows + i0, o0, mk, y); break;
    case 2: expand_tile<2>(B, O, qs, nq, t, RT, rows + i0, o0, mk, y); break;
    case 1: expand_tile<1>(B, O, qs, nq, t, RT, rows + i0, o0, mk, y); break;
    default: break;
  }
}
#else
template <typename T>
inline void shrink_rows(const T* ar, const float* x, int64_t K, const int64_t* rows, int64_t n, float* t, int64_t RT,
                        int64_t q) {
  for (int64_t i = 0; i < n; ++i) t[rows[i] * RT + q] = dot16(x + rows[i] * K, ar, K);
}

template <typename T>
inline void shrink_rows_q(const T* ar, int64_t nq, const float* x, int64_t K, const int64_t* rows, int64_t n, float* t,
                          int64_t RT, int64_t q) {
  for (int64_t j = 0; j < nq; ++j) shrink_rows(ar + j * K, x, K, rows, n, t, RT, q + j);
}

template <typename T>
inline void expand_rows(const T* B, int64_t O, const int64_t* qs, int64_t nq, const float* t, int64_t RT,
                        const int64_t* rows, int64_t n, int64_t o0, int64_t o1, float* y) {
  float acc[COLS];
  for (int64_t i = 0; i < n; ++i) {
    std::fill(acc, acc + COLS, 0.f);
    for (int64_t e = 0; e < nq; ++e) {
      const float tv = t[rows[i] * RT + qs[e] % RT];
      const T* br = B + qs[e] * O;
      for (int64_t o = o0; o < o1; ++o) acc[o - o0] += tv * ldf(br, o);
    }
    float* yi = y + rows[i] * O;
    for (int64_t o = o0; o < o1; ++o) yi[o] += acc[o - o0];
  }
}
#endif

template <typename T>
void apply_t(const T* A, const T* B, const int64_t* spans, int64_t blocks, int64_t RT, const int64_t* row_slot,
             const float* x, int64_t M, int64_t K, float* y, int64_t O, const PoolPar& pool, int64_t split_min) {
  const int64_t R = RT / blocks;
  // groups of rows by slot, in the order their slot first appears
  std::vector<int64_t> gslot, gbeg, order;
  for (int64_t m = 0; m < M; ++m) {
    const int64_t s = row_slot[m];
    if (s < 0) continue;
    bool seen = false;
    for (int64_t g : gslot) seen |= g == s;
    if (seen) continue;
    gslot.push_back(s);
    gbeg.push_back((int64_t)order.size());
    for (int64_t r = m; r < M; ++r)
      if (row_slot[r] == s) order.push_back(r);
  }
  const int64_t G = (int64_t)gslot.size();
  if (G == 0) return;
  gbeg.push_back((int64_t)order.size());
  // shrink tasks: (group, rank row) over the rank rows each slot's blocks use
  constexpr int64_t QT = 4;  // rank rows per shrink task (shrink_rows_q)
  std::vector<int64_t> tg, tq, tn;
  int64_t ranks = 0;  // rank rows in use over the groups
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < blocks; ++j) {
      const int64_t* sp = spans + (gslot[g] * blocks + j) * 3;
      if (sp[1] >= sp[2]) continue;
      for (int64_t r = 0; r < sp[0]; r += QT) {
        tg.push_back(g);
        tq.push_back(j * R + r);
        tn.push_back(std::min(QT, sp[0] - r));
      }
      ranks += sp[0];
    }
  std::vector<float> t(M * RT, 0.f);
  const int64_t n_rows = (int64_t)order.size();
  PoolPar par{n_rows * ranks * K >= split_min ? pool.threads : 1};
  par(0, (int64_t)tg.size(), 2, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t g = tg[i];
      shrink_rows_q(A + (gslot[g] * RT + tq[i]) * K, tn[i], x, K, order.data() + gbeg[g], gbeg[g + 1] - gbeg[g],
                    t.data(), RT, tq[i]);
    }
  });
  const int64_t chunks = (O + COLS - 1) / COLS;
  par.threads = n_rows * ranks / G * O / blocks >= split_min ? pool.threads : 1;  // ~ the expand's work
  par(0, chunks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> qs;  // rank rows (as slot * RT + q) whose block writes this chunk
    // slot-major: one slot's ~R rows of b are streamed at a time (chunk-major interleaved every
    // slot's rows, more streams than the prefetchers follow); rows of a group belong to no other
    // group, so the order does not change a value
    for (int64_t g = 0; g < G; ++g) {
      const int64_t s = gslot[g];
      for (int64_t c = lo; c < hi; ++c) {
        const int64_t o0 = c * COLS, o1 = std::min(O, o0 + COLS);
        qs.clear();
        for (int64_t j = 0; j < blocks; ++j) {
          const int64_t* sp = spans + (s * blocks + j) * 3;
          if (std::max(o0, sp[1]) >= std::min(o1, sp[2])) continue;  // b is zero over this chunk
          for (int64_t r = 0; r < sp[0]; ++r) qs.push_back(s * RT + j * R + r);
        }
        if (!qs.empty())
          expand_rows(B, O, qs.data(), (int64_t)qs.size(), t.data(), RT, order.data() + gbeg[g], gbeg[g + 1] - gbeg[g],
                      o0, o1, y);
      }
    }
  });
}

// One step's adapters: per layer and fused matmul (qkv, o, gate_up, down) the stacked a / b
// (undefined or empty: no row adapted there), per matmul the rows' slots and the spans.
struct Step {
  std::vector<at::Tensor> ab;     // [8 L]: a, b of (layer l, key k) at 2 * (4 l + k)
  at::Tensor rows;                // [4, M] int64 slot per key and row (-1: none)
  std::vector<at::Tensor> spans;  // [4]: [S, blocks, 3] int64 per key (empty: no adapter there)
  int64_t M = 0, split_min = 0;  // split_min: multiply-adds from which a phase splits over threads

  Step(std::vector<at::Tensor> ab_, at::Tensor rows_, std::vector<at::Tensor> spans_, int64_t L, int64_t M_,
       int64_t split_min_)
      : ab(std::move(ab_)), rows(std::move(rows_)), spans(std::move(spans_)), M(M_), split_min(split_min_) {
    if (ab.empty()) return;
    TORCH_CHECK((int64_t)ab.size() == 8 * L && spans.size() == 4, "decode_forward: lora_ab must hold 8 tensors per layer and lora_spans 4");
    TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == 4 * M,
                "decode_forward: lora_rows must be int64 [4, M]");
  }

  // y [M, O] += the deltas of matmul `key` of layer l on x [M, K] (a no-op without adapters there)
  void apply(int64_t l, int key, const float* x, int64_t K, float* y, int64_t O, const PoolPar& par) const {
    if (ab.empty()) return;
    const at::Tensor &a = ab[2 * (4 * l + key)], &b = ab[2 * (4 * l + key) + 1], &sp = spans[key];
    if (!a.defined() || a.numel() == 0 || sp.numel() == 0) return;
    TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(1) == b.size(1) && a.size(2) == K
                && b.size(2) == O && a.is_contiguous() && b.is_contiguous() && a.scalar_type() == b.scalar_type()
                && sp.scalar_type() == at::kLong && sp.is_contiguous() && sp.dim() == 3 && sp.size(0) == a.size(0)
                && sp.size(2) == 3 && a.size(1) % sp.size(1) == 0,
                "decode_forward: LoRA buffers of layer ", l, " matmul ", key, " are not a [S, RT, K], b [S, RT, O], spans [S, blocks, 3]");
    const int64_t S = a.size(0), RT = a.size(1), blocks = sp.size(1);
    const int64_t* rs = rows.data_ptr<int64_t>() + key * M;
    for (int64_t m = 0; m < M; ++m)
      TORCH_CHECK_INDEX(rs[m] >= -1 && rs[m] < S, "decode_forward: lora_rows entry ", rs[m], " outside [-1, ", S, ")");
    const int64_t* spp = sp.data_ptr<int64_t>();
    for (int64_t i = 0; i < S * blocks; ++i)
      TORCH_CHECK(spp[3 * i] >= 0 && spp[3 * i] <= RT / blocks && spp[3 * i + 1] >= 0 && spp[3 * i + 2] <= O,
                  "decode_forward: lora_spans entry ", i, " outside the buffers");
    if (a.scalar_type() == at::kBFloat16)
      apply_t<uint16_t>((const uint16_t*)a.data_ptr(), (const uint16_t*)b.data_ptr(), spp, blocks, RT, rs, x, M, K, y, O, par, split_min);
    else {
      TORCH_CHECK(a.scalar_type() == at::kFloat, "decode_forward: LoRA buffers must be float32 or bfloat16");
      apply_t<float>(a.data_ptr<float>(), b.data_ptr<float>(), spp, blocks, RT, rs, x, M, K, y, O, par, split_min);
    }
  }
};

}  // namespace sglite_lora_fused
