// Segmented LoRA on CPU (contract: sglite/kernels/cpu_lora.py): for each row of an adapter
// segment, shrink t = x_i . A_s^T (float32 sums, rounded to x's dtype), then y_i += t . b_s with
// b_s = B_s^T [R, O] (float32 sums over r in order, the delta rounded to y's dtype before the add).
// x / y (activations, T) and a / b (adapter weights, W: --lora-dtype) are each float32 or bf16,
// independently; W values are read as float32. Rows of slot -1 are skipped.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include "thread_pool.h"
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

// Dot product of n elements in float32 with 16 independent partial sums (element i to lane
// i % 16, then a fixed tree): vectorises without reassociating, same order on every row.
template <typename T, typename U>
inline float dot16(const T* p, const U* q, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += (float)p[i + j] * (float)q[i + j];
  for (int j = 0; i + j < n; ++j) acc[j] += (float)p[i + j] * (float)q[i + j];
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

template <typename T, typename W>
void lora_rows(const T* x, const W* a, const W* b, T* y, const std::vector<int64_t>& row_slot,
               int64_t K, int64_t R, int64_t O, int64_t sx, int64_t sy) {
  const int64_t N = (int64_t)row_slot.size();
  sglite_pool::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> t(R), acc(O);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t s = row_slot[i];
      if (s < 0) continue;
      const T* xi = x + i * sx;
      const W* as = a + s * R * K;
      const W* bs = b + s * R * O;
      for (int64_t r = 0; r < R; ++r)
        t[r] = (float)(T)dot16(xi, as + r * K, K);  // rounded as the shrink matmul's output
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t r = 0; r < R; ++r) {  // expand: rows of b are O contiguous values (vectorised over o)
        const float tr = t[r];
        const W* br = bs + r * O;
        for (int64_t o = 0; o < O; ++o) acc[o] += tr * (float)br[o];
      }
      T* yi = y + i * sy;
      for (int64_t o = 0; o < O; ++o) yi[o] = (T)((float)yi[o] + (float)(T)acc[o]);
    }
  });
}

at::Tensor lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& seg_lens, const at::Tensor& seg_slots) {
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
  std::vector<int64_t> row_slot;
  row_slot.reserve(N);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t g = 0; g < lens.numel(); ++g) {
    TORCH_CHECK(lp[g] >= 0, "lora_add: negative segment length");
    TORCH_CHECK_INDEX(sp[g] >= -1 && sp[g] < S, "lora_add: seg_slots entry ", sp[g], " outside [-1, ", S, ")");
    row_slot.insert(row_slot.end(), lp[g], sp[g]);
  }
  TORCH_CHECK((int64_t)row_slot.size() == N, "lora_add: seg_lens sum to ", row_slot.size(), ", x has ", N, " rows");
  const bool xb = x.scalar_type() == at::kBFloat16, wb = a.scalar_type() == at::kBFloat16;
  const int64_t sx = x.stride(0), sy = y.stride(0);
  if (xb && wb)
    lora_rows<bf16, bf16>(x.data_ptr<bf16>(), a.data_ptr<bf16>(), b.data_ptr<bf16>(), y.data_ptr<bf16>(), row_slot, K, R, O, sx, sy);
  else if (xb)
    lora_rows<bf16, float>(x.data_ptr<bf16>(), a.data_ptr<float>(), b.data_ptr<float>(), y.data_ptr<bf16>(), row_slot, K, R, O, sx, sy);
  else if (wb)
    lora_rows<float, bf16>(x.data_ptr<float>(), a.data_ptr<bf16>(), b.data_ptr<bf16>(), y.data_ptr<float>(), row_slot, K, R, O, sx, sy);
  else
    lora_rows<float, float>(x.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), y.data_ptr<float>(), row_slot, K, R, O, sx, sy);
  return y;
}

}  // namespace

TORCH_LIBRARY(sglite_cpu_lora, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor seg_lens, Tensor seg_slots) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(sglite_cpu_lora, CPU, m) {
  m.impl("lora_add", &lora_add);
}
