// The fused decode's steps over an int8 / int4 KIVI KV pool (decode_layer.cpp; contract:
// sglite/kernels/decode_fused.py FusedDecode.quant_pool_args). The step's K/V go into the residual
// windows (the caller passes them as the layer buffers); Step::attend then, per layer, seals the key
// group of every row that stored its group's last position and runs the pool's decode attention (the
// sglite_kv_quant op, kv_quant_attention.cpp, on the same thread pool).
//
// Sealing: the group's G residual rows are quantized into the pool before the layer's attention
// reads them, as the per-op store does (sglite/kernels/kv_quant.py
// store_kv / _seal_groups). The arithmetic is kv_quant.quantize's, bit for bit: float32 math, the
// minimum and the scale (max - min) / qmax rounded to float16 (nearest even) before use, codes
// round((x - min) * (1 / scale)) half to even, clamped to [0, qmax] (a zero scale gives code 0);
// keys per channel over the group's G positions, values per token over the head's D channels;
// int4 codes packed two a byte in split halves (low nibble: channel j, high: channel j + D/2).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Half.h>

namespace sglite_kv_seal {

inline uint16_t half_bits(float x) { return c10::Half(x).x; }
inline float half_value(uint16_t b) { return static_cast<float>(c10::Half(b, c10::Half::from_bits())); }

// n values x[i * stride] -> codes[i] (one byte a value, before int4 packing); sc / mn: float16 bits
inline void quantize(const float* x, int64_t n, int64_t stride, int qmax, uint8_t* codes, uint16_t& sc, uint16_t& mn) {
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  for (int64_t i = 0; i < n; ++i) { lo = std::min(lo, x[i * stride]); hi = std::max(hi, x[i * stride]); }
  mn = half_bits(lo);
  const float mnf = half_value(mn);
  sc = half_bits((hi - mnf) / (float)qmax);
  const float scf = half_value(sc), inv = scf > 0.f ? 1.0f / scf : 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float q = std::nearbyint((x[i * stride] - mnf) * inv);
    codes[i] = (uint8_t)std::min(std::max(q, 0.f), (float)qmax);
  }
}

// D codes of one (position, head) -> the pool row (int8: as is; int4: split halves)
inline void put_codes(const uint8_t* c, int64_t D, int bits, uint8_t* out) {
  if (bits == 8) { std::copy(c, c + D, out); return; }
  for (int64_t j = 0; j < D / 2; ++j) out[j] = (uint8_t)(c[j] | (c[j + D / 2] << 4));
}

// The G residual rows [G, Hkv, D] of request row `row` of a window r [R, G, Hkv, D] (float32 | bf16,
// contiguous) in float32
inline std::vector<float> window(const at::Tensor& r, int64_t row) {
  const int64_t n = r.size(1) * r.size(2) * r.size(3);
  std::vector<float> x(n);
  if (r.scalar_type() == at::kBFloat16) {
    const c10::BFloat16* p = r.data_ptr<c10::BFloat16>() + row * n;
    for (int64_t i = 0; i < n; ++i) x[i] = (float)p[i];
  } else {
    std::copy(r.data_ptr<float>() + row * n, r.data_ptr<float>() + (row + 1) * n, x.begin());
  }
  return x;
}

// Quantize the group of request row `row` whose G pool slots start at slot0 (a multiple of G):
// t = kvq[0..5] (k_data, v_data [S, Hkv, Dq] uint8; k_scale [S/G, Hkv, 2, D] float16 contiguous;
// v_scale [S, Hkv, 2] float16; res_k, res_v [R, G, Hkv, D] float32 | bf16 contiguous).
inline void seal_group(const at::Tensor* t, int64_t row, int64_t slot0, int bits) {
  const at::Tensor &kd = t[0], &vd = t[1], &ks = t[2], &vs = t[3], &rk = t[4], &rv = t[5];
  const int64_t G = rk.size(1), Hkv = rk.size(2), D = rk.size(3), gid = slot0 / G;
  const int qmax = (1 << bits) - 1;
  TORCH_CHECK_INDEX(slot0 >= 0 && slot0 % G == 0 && slot0 + G <= kd.size(0) && row >= 0 && row < rk.size(0),
                    "decode_forward: key group at slot ", slot0, " (request row ", row, ") outside the pool");
  TORCH_CHECK(kd.scalar_type() == at::kByte && vd.scalar_type() == at::kByte && ks.scalar_type() == at::kHalf
              && vs.scalar_type() == at::kHalf && ks.is_contiguous() && rk.is_contiguous() && rv.is_contiguous(),
              "decode_forward: a quantized pool layer has uint8 codes, float16 scales and contiguous windows");
  const std::vector<float> k = window(rk, row), v = window(rv, row);
  std::vector<uint8_t> codes(G * D), col(G);
  uint16_t* kscale = (uint16_t*)ks.data_ptr() + gid * Hkv * 2 * D;
  uint8_t* kdata = kd.data_ptr<uint8_t>();
  for (int64_t h = 0; h < Hkv; ++h) {  // keys: per channel over the G positions
    for (int64_t d = 0; d < D; ++d) {
      quantize(k.data() + h * D + d, G, Hkv * D, qmax, col.data(), kscale[(h * 2) * D + d], kscale[(h * 2 + 1) * D + d]);
      for (int64_t i = 0; i < G; ++i) codes[i * D + d] = col[i];
    }
    for (int64_t i = 0; i < G; ++i) put_codes(codes.data() + i * D, D, bits, kdata + (slot0 + i) * kd.stride(0) + h * kd.stride(1));
  }
  uint8_t* vdata = vd.data_ptr<uint8_t>();
  uint16_t* vscale = (uint16_t*)vs.data_ptr();
  for (int64_t i = 0; i < G; ++i)  // values: per token and head over the D channels
    for (int64_t h = 0; h < Hkv; ++h) {
      uint16_t* s = vscale + (slot0 + i) * vs.stride(0) + h * vs.stride(1);
      quantize(v.data() + (i * Hkv + h) * D, D, 1, qmax, codes.data(), s[0], s[1]);
      put_codes(codes.data(), D, bits, vdata + (slot0 + i) * vd.stride(0) + h * vd.stride(1));
    }
}

}  // namespace sglite_kv_seal

namespace sglite_kv_quant_decode {

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

}  // namespace sglite_kv_quant_decode
