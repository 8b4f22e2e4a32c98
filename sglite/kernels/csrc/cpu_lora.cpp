// Segmented LoRA on CPU (contract: sglite/kernels/cpu_lora.py): for each row of an adapter
// segment, shrink t = x_i . A_s^T (float32 sums, rounded to x's dtype), then y_i += t . b_s with
// b_s = B_s^T [R, O] (float32 sums over r in order, the delta rounded to y's dtype before the add).
// Tiles of up to 16 rows of one segment run the fused decode's blocked shrink / expand (lora_fused.h).
// x / y (activations, T) and a / b (adapter weights, W: --lora-dtype) are each float32 or bf16,
// independently; W values are read as float32. Rows of slot -1 are skipped.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include "thread_pool.h"
#include "lora_fused.h"
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

constexpr int64_t TILE = 16;  // rows of one segment sharing each load of A / b

inline const float* wptr(const float* p) { return p; }
inline const uint16_t* wptr(const bf16* p) { return reinterpret_cast<const uint16_t*>(p); }  // bf16 bits

// One tile: rows [r0, r0 + n) of one slot (n <= TILE), with the register-blocked shrink / expand of
// the fused decode (lora_fused.h: 8 rows per A load, 4 rows x 64 columns per b load; float32 sums).
// Each A row and each b row is read once per tile (a per-row loop read them once per row); every
// value is computed by the same code whatever the tile's other rows, so the result does not depend
// on the tiling or the thread split. The shrink result is rounded to T (as the shrink matmul's
// output), the delta to T before the add (as the reference). sp: the slot's [blocks, 3] spans (rank
// rows in use, output columns [lo, hi) of each rank block of R / blocks rows): rows past a block's
// rank and chunks outside its columns are zero in A / b and skipped (they would add exact zeros).
template <typename T, typename W>
void lora_tile(const T* x, const W* as, const W* bs, T* y, int64_t r0, int64_t n, int64_t K, int64_t R,
               int64_t O, int64_t sx, int64_t sy, const int64_t* sp, int64_t blocks, std::vector<float>& xf,
               std::vector<float>& t, std::vector<float>& yf, std::vector<int64_t>& qs) {
  namespace lf = sglite_lora_fused;
  const int64_t Rb = R / blocks;
  int64_t idx[TILE];
  for (int64_t i = 0; i < n; ++i) {
    idx[i] = i;
    const T* xi = x + (r0 + i) * sx;
    float* d = xf.data() + i * K;
    for (int64_t k = 0; k < K; ++k) d[k] = (float)xi[k];
  }
  std::fill(t.begin(), t.begin() + n * R, 0.f);
  for (int64_t j = 0; j < blocks; ++j)  // shrink, 4 rank rows at a time
    for (int64_t r = j * Rb; r < j * Rb + sp[3 * j] && sp[3 * j + 1] < sp[3 * j + 2]; r += 4)
      lf::shrink_rows_q(wptr(as) + r * K, std::min<int64_t>(4, j * Rb + sp[3 * j] - r), xf.data(), K, idx, n, t.data(),
                        R, r);
  for (int64_t i = 0; i < n * R; ++i) t[i] = (float)(T)t[i];
  std::fill(yf.begin(), yf.begin() + n * O, 0.f);
  for (int64_t o0 = 0; o0 < O; o0 += lf::COLS) {  // expand, 64 columns at a time
    const int64_t o1 = std::min(O, o0 + lf::COLS);
    qs.clear();
    for (int64_t j = 0; j < blocks; ++j) {
      if (std::max(o0, sp[3 * j + 1]) >= std::min(o1, sp[3 * j + 2])) continue;  // b is zero over this chunk
      for (int64_t r = 0; r < sp[3 * j]; ++r) qs.push_back(j * Rb + r);
    }
    if (!qs.empty()) lf::expand_rows(wptr(bs), O, qs.data(), (int64_t)qs.size(), t.data(), R, idx, n, o0, o1, yf.data());
  }
  for (int64_t i = 0; i < n; ++i) {
    T* yi = y + (r0 + i) * sy;
    const float* fi = yf.data() + i * O;
    for (int64_t o = 0; o < O; ++o) yi[o] = (T)((float)yi[o] + (float)(T)fi[o]);
  }
}

// tiles: (first row, rows, slot) of at most TILE rows within one adapted segment
template <typename T, typename W>
void lora_rows(const T* x, const W* a, const W* b, T* y, const std::vector<int64_t>& tiles, int64_t K, int64_t R,
               int64_t O, int64_t sx, int64_t sy, const int64_t* spans, int64_t blocks) {
  const int64_t n_tiles = (int64_t)tiles.size() / 3;
  int64_t rows = 1;  // the longest tile: scratch for it only (a decode step's segments are often 1 row)
  for (int64_t j = 0; j < n_tiles; ++j) rows = std::max(rows, tiles[3 * j + 1]);
  sglite_pool::parallel_for(0, n_tiles, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> xf(rows * K), t(rows * R), yf(rows * O);
    std::vector<int64_t> qs;
    for (int64_t j = lo; j < hi; ++j) {
      const int64_t r0 = tiles[3 * j], n = tiles[3 * j + 1], s = tiles[3 * j + 2];
      lora_tile<T, W>(x, a + s * R * K, b + s * R * O, y, r0, n, K, R, O, sx, sy, spans + s * blocks * 3, blocks, xf,
                      t, yf, qs);
    }
  });
}

at::Tensor lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& seg_lens, const at::Tensor& seg_slots, const c10::optional<at::Tensor>& spans) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 3 && b.dim() == 3,
              "lora_add: x [N, K], y [N, O], a [S, R, K], b [S, R, O] expected");
  const int64_t N = x.size(0), K = x.size(1), S = a.size(0), R = a.size(1), O = b.size(2);
  TORCH_CHECK(a.size(2) == K && b.size(0) == S && b.size(1) == R && y.size(0) == N && y.size(1) == O,
              "lora_add: shapes disagree (x [N, K], y [N, O], a [S, R, K], b [S, R, O])");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == b.scalar_type(),
              "lora_add: x and y must share one dtype, a and b another");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
              "lora_add: x, y, a, b must be float32 or bfloat16");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1 && a.is_contiguous() && b.is_contiguous(),
              "lora_add: rows of x and y need unit stride; a and b must be contiguous");
  TORCH_CHECK(seg_lens.numel() == seg_slots.numel(), "lora_add: seg_lens and seg_slots differ in length");
  auto lens = seg_lens.to(at::kLong).contiguous();
  auto slots = seg_slots.to(at::kLong).contiguous();
  std::vector<int64_t> tiles;  // (first row, rows, slot) per tile of an adapted segment
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t g = 0; g < lens.numel(); ++g) {
    TORCH_CHECK(lp[g] >= 0, "lora_add: negative segment length");
    TORCH_CHECK_INDEX(sp[g] >= -1 && sp[g] < S, "lora_add: seg_slots entry ", sp[g], " outside [-1, ", S, ")");
    if (sp[g] >= 0)
      for (int64_t r = 0; r < lp[g]; r += TILE) {
        tiles.push_back(total + r);
        tiles.push_back(std::min(TILE, lp[g] - r));
        tiles.push_back(sp[g]);
      }
    total += lp[g];
  }
  TORCH_CHECK(total == N, "lora_add: seg_lens sum to ", total, ", x has ", N, " rows");
  // spans [S, blocks, 3] (optional): per slot and rank block the rank rows in use and the output
  // columns [lo, hi) written; none: one block of all R rows over all O columns
  std::vector<int64_t> whole;  // no spans: per slot one block {R, 0, O}
  const int64_t* spp = nullptr;
  int64_t blocks = 1;
  if (spans.has_value() && spans->defined() && spans->numel() > 0) {
    const at::Tensor& sp = *spans;
    TORCH_CHECK(sp.scalar_type() == at::kLong && sp.is_contiguous() && sp.dim() == 3 && sp.size(0) == S && sp.size(2) == 3
                && sp.size(1) > 0 && R % sp.size(1) == 0, "lora_add: spans must be int64 [S, blocks, 3] with blocks dividing R");
    blocks = sp.size(1);
    spp = sp.data_ptr<int64_t>();
  } else {
    for (int64_t i = 0; i < S; ++i) whole.insert(whole.end(), {R, (int64_t)0, O});
    spp = whole.data();
  }
  for (int64_t i = 0; i < S * blocks; ++i)
    TORCH_CHECK(spp[3 * i] >= 0 && spp[3 * i] <= R / blocks && spp[3 * i + 1] >= 0 && spp[3 * i + 2] <= O,
                "lora_add: spans entry ", i, " outside [0, R / blocks] rank rows or [0, O) columns");
  const bool xb = x.scalar_type() == at::kBFloat16, wb = a.scalar_type() == at::kBFloat16;
  const int64_t sx = x.stride(0), sy = y.stride(0);
  if (xb && wb)
    lora_rows<bf16, bf16>(x.data_ptr<bf16>(), a.data_ptr<bf16>(), b.data_ptr<bf16>(), y.data_ptr<bf16>(), tiles, K, R, O, sx, sy, spp, blocks);
  else if (xb)
    lora_rows<bf16, float>(x.data_ptr<bf16>(), a.data_ptr<float>(), b.data_ptr<float>(), y.data_ptr<bf16>(), tiles, K, R, O, sx, sy, spp, blocks);
  else if (wb)
    lora_rows<float, bf16>(x.data_ptr<float>(), a.data_ptr<bf16>(), b.data_ptr<bf16>(), y.data_ptr<float>(), tiles, K, R, O, sx, sy, spp, blocks);
  else
    lora_rows<float, float>(x.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), y.data_ptr<float>(), tiles, K, R, O, sx, sy, spp, blocks);
  return y;
}

}  // namespace

TORCH_LIBRARY(sglite_cpu_lora, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor seg_lens, Tensor seg_slots, Tensor? spans=None) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(sglite_cpu_lora, CPU, m) {
  m.impl("lora_add", &lora_add);
}
