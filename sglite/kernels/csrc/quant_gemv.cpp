// Group-quantized weights on CPU: few-row GEMV straight on the codes, and dequantization (the
// GEMM path). Representation, contracts and measurements: sglite/kernels/quant_linear.py and
// sglite/kernels/quant_cpu.py. Two builds of this one source: with AVX-512-BF16 (VDPBF16PS on
// codes turned into exact bf16 integers) and a portable one (plain float loops).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include "quant_rows.h"

namespace {

using namespace sglite_quant;

// half: the scales and mins are float16 (quant_gemv_q8's compact ones), checked as stored (no
// float32 copy of them per call: a 262,144-row LM head's would be 21 MB each)
void check_weight(const at::Tensor& q, const at::Tensor& s, const at::Tensor& mn, int64_t bits,
                  int64_t gs, int64_t K, bool half = false) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant: bits must be 4 or 8");
  TORCH_CHECK(K % BLK == 0 && ((gs > 0 && gs % BLK == 0 && K % gs == 0) || (gs == 16 && bits == 8)),
              "quant: group_size must be a multiple of 32 dividing K (or 16 with 8-bit codes), got ", gs);
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous() && q.size(1) * 8 == K * bits,
              "quant: qweight must be contiguous uint8 [N, K * bits / 8]");
  const int64_t N = q.size(0), G = K / gs;
  const auto st = half ? at::kHalf : at::kFloat;
  TORCH_CHECK(s.scalar_type() == st && s.is_contiguous() && s.numel() == N * G, "quant: scales must be ",
              half ? "float16" : "float32", " [N, K / group_size]");
  if (mn.numel() > 0)  // an empty tensor stands for "no offsets" (cheaper to pass than None)
    TORCH_CHECK(mn.scalar_type() == st && mn.is_contiguous() && mn.numel() == N * G,
                "quant: mins must be ", half ? "float16" : "float32", " [N, K / group_size]");
}

}  // namespace

// y [M, N] (x's dtype) = x [M, K] (bf16 or float32, 1 <= M <= 8, stored channel order) @ W_stored.T,
// accumulated in float32 and rounded once (bf16: round to nearest even)
at::Tensor quant_gemv(at::Tensor x, at::Tensor q, at::Tensor s, at::Tensor mn, int64_t bits,
                      int64_t gs) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 8, "quant_gemv: x must be [M <= 8, K]");
  const bool xbf = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(xbf || x.scalar_type() == at::kFloat, "quant_gemv: x bf16 or float32");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  check_weight(q, s, mn, bits, gs, K);
  x = x.contiguous();
  // x as float32 (a view of x when it is float32), then the group sums
  std::vector<float> xbuf(xbf ? M * K : 0);
  const float* xf = xbf ? xbuf.data() : x.data_ptr<float>();
  if (xbf) {
    const at::BFloat16* b = x.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) xbuf[i] = (float)b[i];
  }
  at::Tensor y = at::empty({M, N}, x.options());
  std::vector<float> ybuf(xbf ? M * N : 0);
  float* yp = xbf ? ybuf.data() : y.data_ptr<float>();
  const QW w{q.data_ptr<uint8_t>(), s.data_ptr<float>(), mn.numel() > 0 ? mn.data_ptr<float>() : nullptr,
             (int)bits, gs, N, K};
  gemv_float(w, xf, xbf ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr, M, yp);
  if (xbf) {
    at::BFloat16* o = y.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * N; ++i) o[i] = at::BFloat16(ybuf[i]);
  }
  return y;
}

// W_stored [N, K] = s * q + m (float32, then bf16 round-to-nearest-even when out_bf16)
at::Tensor quant_dequant(at::Tensor q, at::Tensor s, at::Tensor mn, int64_t bits, int64_t gs,
                         bool out_bf16) {
  const int64_t N = q.size(0), K = q.size(1) * 8 / bits, G = K / gs;
  check_weight(q, s, mn, bits, gs, K);
  at::Tensor out = at::empty({N, K}, q.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  const float* mp = mn.numel() > 0 ? mn.data_ptr<float>() : nullptr;
  const int64_t rowb = K * bits / 8;
  sglite_pool::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float buf[BLK];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t kb = 0; kb < K; kb += BLK) {
        decode_block(qp + n * rowb, (int)bits, kb, buf);
        for (int i = 0; i < BLK; ++i) {  // s * q exact: one rounding, the sum
          const int64_t g = (kb + i) / gs;
          buf[i] = buf[i] * sp[n * G + g] + (mp ? mp[n * G + g] : 0.f);
        }
        if (out_bf16) {
          at::BFloat16* o = out.data_ptr<at::BFloat16>() + n * K + kb;
          for (int i = 0; i < BLK; ++i) o[i] = at::BFloat16(buf[i]);
        } else {
          std::memcpy(out.data_ptr<float>() + n * K + kb, buf, sizeof(buf));
        }
      }
  });
  return out;
}

// y [M, N] float32 = q8(x) @ W_stored.T: x [M, K] float32 (1 <= M <= 32, stored channel order)
// quantized to int8 per 32-block (sglite_quant::quantize_q8), integer dots (VNNI when built),
// group size 32 (or 16 with 8-bit codes: GGUF Q6_K); tiled: the weight is in 16-row tiles (quant_tiles.h)
at::Tensor quant_gemv_q8(at::Tensor x, at::Tensor q, at::Tensor s, at::Tensor mn, int64_t bits, int64_t gs,
                         bool portable, bool tiled) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 32 && x.scalar_type() == at::kFloat,
              "quant_gemv_q8: x must be float32 [M <= 32, K]");
  TORCH_CHECK(gs == BLK || (gs == 16 && bits == 8), "quant_gemv_q8: group_size must be 32 (or 16 with 8-bit codes), got ", gs);
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  const bool half = s.scalar_type() == at::kHalf;  // float16 scales / mins (exact GGUF ones)
  check_weight(q, s, mn, bits, gs, K, half);
  x = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const QW w{q.data_ptr<uint8_t>(), (const float*)s.data_ptr(), mn.numel() > 0 ? (const float*)mn.data_ptr() : nullptr,
             (int)bits, gs, N, K, half, tiled};
  TORCH_CHECK(!tiled || N % TILE == 0, "quant_gemv_q8: a 16-row tiled weight needs N % 16 == 0");
  gemv_q8(w, x.data_ptr<float>(), M, y.data_ptr<float>(), portable);
  return y;
}

// the activation quantization of quant_gemv_q8: (xq int8 [M, K], dx [M, K/32], sx [M, K/32])
std::vector<at::Tensor> quant_q8_act(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % BLK == 0,
              "quant_q8_act: x must be float32 [M, K], K % 32 == 0");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor dx = at::empty({M, K / BLK}, x.options()), sx = at::empty({M, K / BLK}, x.options());
  quantize_q8(x.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), dx.data_ptr<float>(), sx.data_ptr<float>());
  return {xq, dx, sx};
}

bool quant_vnni() {
#ifdef SGQ_VNNI
  return true;
#else
  return false;
#endif
}

bool quant_simd() {
#ifdef SGQ_AVX512
  return true;
#else
  return false;
#endif
}
