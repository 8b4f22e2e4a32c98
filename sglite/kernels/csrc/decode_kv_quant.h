// The fused decode's steps over a quantized KV pool: fp8_e4m3 (fp8_code, fp8_scales: the codes
// stored and attended in decode_layer.cpp's loop) and int8 / int4 KIVI (decode_layer.cpp; contract:
// sglite/kernels/decode_fused.py FusedDecode.quant_pool_args). The step's K/V go into the residual
// windows (the caller passes them as the layer buffers); Step::attend then, per layer, seals the key
// group of every row that stored its group's last position and runs the pool's decode attention (the
// sglite_kv_quant op, kv_quant_attention.cpp, on the same thread pool).
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include "kv_seal.h"

namespace sglite_kv_quant_decode {

using sglite_kv_seal::fp8_code;  // fp8_e4m3 pools: the stored code of x at a scale (kv_seal.h)

// fp8 pools: layer l's scale tensor k of kvq (2 a layer: key scales, value scales; float32
// contiguous [n]), checked
inline const float* fp8_scales(const std::vector<at::Tensor>& kvq, int64_t l, int k, int64_t n) {
  const at::Tensor& t = kvq[2 * l + k];
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n,
              "decode_forward: fp8 scales of layer ", l, " must be float32 [", n, "]");
  return t.data_ptr<float>();
}

// One fused step's view of the pool: kvq holds 6 tensors a layer (k_data, v_data, k_scale,
// v_scale, res_k, res_v; sglite/kernels/kv_quant.py QuantKVLayer); pool_loc [M] int64 the rows'
// pool slots; rows / lens [M] int64 their request rows and lengths (the new token included).
struct Step {
  const std::vector<at::Tensor>& kvq;
  at::Tensor rows, lens, sealed;  // sealed [M]: positions below it are read from the codes (lens // G * G)
  std::vector<int64_t> seal_rows, seal_slot0;  // rows completing their group this step
  int64_t bits;

  Step(const std::vector<at::Tensor>& kvq_, const at::Tensor& pool_loc, const at::Tensor& rows_, const at::Tensor& lens_,
       int64_t bits_, int64_t L, int64_t M)
      : kvq(kvq_), rows(rows_), lens(lens_), bits(bits_) {
    TORCH_CHECK((int64_t)kvq.size() == 6 * L && (bits == 8 || bits == 4) && pool_loc.scalar_type() == at::kLong
                && pool_loc.is_contiguous() && pool_loc.numel() == M,
                "decode_forward: a quantized pool needs 6 tensors per layer, bits 8 or 4 and pool slots int64 [M]");
    const int64_t G = kvq[4].size(1);
    sealed = at::empty({M}, lens.options());
    const int64_t* lp = lens.data_ptr<int64_t>();
    const int64_t* loc = pool_loc.data_ptr<int64_t>();
    int64_t* sp = sealed.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m) {
      sp[m] = lp[m] / G * G;
      if (lp[m] % G == 0) {
        seal_rows.push_back(rows.data_ptr<int64_t>()[m]);
        seal_slot0.push_back(loc[m] / G * G);
      }
    }
  }

  // Layer l: seal the completed groups, then q [M, Hq, D] float32 -> att [M, Hq * D] float32.
  void attend(int64_t l, const at::Tensor& q, const at::Tensor& rt, double sm, float* att) const {
    static auto op = c10::Dispatcher::singleton()
        .findSchemaOrThrow("sglite_kv_quant::decode_attention", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, double, int64_t, int64_t)>();
    const at::Tensor* t = kvq.data() + 6 * l;
    for (size_t i = 0; i < seal_rows.size(); ++i) sglite_kv_seal::seal_group(t, seal_rows[i], seal_slot0[i], (int)bits);
    at::Tensor o = op.call(q, t[0], t[1], t[2], t[3], t[4], t[5], rt, rows, lens, sealed, sm, bits, t[4].size(1));
    std::memcpy(att, o.data_ptr<float>(), sizeof(float) * o.numel());  // [M, Hq, D]
  }
};

// A fused step's quantized-pool arguments (decode_forward's and decode_family_forward's kvq,
// kvq_pool_loc, kvq_bits), checked once: a float pool (kvq empty), an int8 / int4 KIVI pool (step:
// bits 8 / 4, 6 tensors a layer) or an fp8_e4m3 pool (bits 0: its key and value scales, 2 a layer).
// No shared-prefix pass over a quantized pool (cascade_min must be 0).
struct Pool {
  const std::vector<at::Tensor>& kvq;
  const bool fp8;
  const c10::optional<Step> step;

  Pool(const std::vector<at::Tensor>& kvq_, const at::Tensor& pool_loc, const at::Tensor& rows, const at::Tensor& lens,
       int64_t bits, int64_t L, int64_t M, int64_t cascade_min)
      : kvq(kvq_), fp8(!kvq_.empty() && bits == 0),
        step(!kvq_.empty() && bits != 0 ? c10::optional<Step>(Step(kvq_, pool_loc, rows, lens, bits, L, M)) : c10::nullopt) {
    TORCH_CHECK(!fp8 || (int64_t)kvq.size() == 2 * L, "decode_forward: an fp8 pool needs 2 scale tensors per layer");
    TORCH_CHECK(kvq.empty() || cascade_min == 0, "decode_forward: no shared-prefix pass over a quantized pool");
  }

  bool quantized() const { return !kvq.empty(); }

  // fp8 pools: layer l's key and value scales [Hkv] into f8 (returned; rope_store_rows' fp8
  // argument); nullptr for the other pools
  const float* const* scales(int64_t l, int64_t Hkv, const float* f8[2]) const {
    if (!fp8) return nullptr;
    for (int k = 0; k < 2; ++k) f8[k] = fp8_scales(kvq, l, k, Hkv);
    return f8;
  }

  // fp8 pools (f8: scales()' result): each query head's attention output att [M, Hq, D] times the
  // value scale of its KV head; nothing for the other pools (f8 null)
  static void scale_output(const float* const* f8, float* att, int64_t M, int64_t Hq, int64_t Hkv, int64_t D) {
    if (!f8) return;
    const int64_t G = Hq / Hkv;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t d = 0; d < D; ++d) att[(m * Hq + h) * D + d] *= f8[1][h / G];
  }
};

}  // namespace sglite_kv_quant_decode
