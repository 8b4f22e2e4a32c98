// BF16 GEMM on the AMX tile units for group-quantized weights in 16-row tiles (many activation rows:
// prefill chunks and large decode batches): the op around quant_amx.h. Contract, numerics and torch
// reference: sglite/kernels/quant_amx.py.
#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include "quant_rows.h"

#if !defined(SGQ_VNNI) || !defined(SGQ_AMX)
#error "quant_amx.cpp is built only with AVX-512 BF16 + VNNI + AMX (sglite/kernels/quant_amx.py)"
#endif
#include "avx512_math.h"
#include "quant_amx.h"

using namespace sglite_quant;

bool quant_amx_init() { return sglite_tiles::granted(); }

// The tiled weight (codes q [N, K * bits / 8], scales / mins float32 or float16; mins empty: none) as a QW.
static sglite_quant::QW amx_weight(const at::Tensor& q, const at::Tensor& s, const at::Tensor& mn, int64_t bits, int64_t gs) {
  return QW{q.data_ptr<uint8_t>(), (const float*)s.data_ptr(), mn.numel() > 0 ? (const float*)mn.data_ptr() : nullptr,
            (int)bits, gs, q.size(0), q.size(1) * 8 / bits, s.scalar_type() == at::kHalf, true};
}

// The weight dequantized once into the tile GEMM's B layout: bf16 bits [P, 2, K / 32, 512] as int16
// (P = tile pairs; a lone last tile's partner zero), 64-byte aligned. Same checks as quant_gemm_amx.
at::Tensor quant_amx_pack(at::Tensor q, at::Tensor s, at::Tensor mn, int64_t bits, int64_t gs) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous() && q.size(0) % TILE == 0 &&
              (q.size(1) * 8 / bits) % BLK == 0, "quant_amx_pack: qweight must be tiled uint8 [N % 16 == 0, K * bits / 8]");
  const QW w = amx_weight(q, s, mn, bits, gs);
  const int64_t n = sglite_amx::packed_elems(w.N, w.K);
  at::Tensor out = at::empty({n + 32}, q.options().dtype(at::kShort));
  const uintptr_t base = (uintptr_t)out.data_ptr<int16_t>(), off = ((base + 63) & ~(uintptr_t)63) - base;
  at::Tensor view = out.narrow(0, off / 2, n);
  sglite_amx::pack_b(w, (uint16_t*)view.data_ptr<int16_t>(), AtPar{});
  return view;
}

// y [M, N] = x @ W_stored.T (the caller adds the bias): x [M, K] bf16 (stored channel order), the
// weight in 16-row tiles (group size 32, or 16 with 8-bit codes; N % 16 == 0), scales / mins
// float32 or float16; packed: quant_amx_pack's tensor of the weight, or empty (dequantize per call).
// Output bf16 (float32 accumulators rounded once) or float32 when !out_bf16. silu: a gate/up weight
// (N % 64 == 0, gate rows first), the output [M, N / 2] bf16 silu_mul of y's halves (sglite_amx::silu_bf16).
static at::Tensor run_gemm(at::Tensor x, at::Tensor q, at::Tensor s, at::Tensor mn, int64_t bits, int64_t gs, bool out_bf16,
                           at::Tensor packed, bool silu, const char* who) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.scalar_type() == at::kBFloat16, who, ": x must be bf16 [M >= 1, K]");
  TORCH_CHECK(bits == 4 || bits == 8, who, ": bits must be 4 or 8");
  TORCH_CHECK(gs == BLK || (gs == 16 && bits == 8), who, ": group_size must be 32 (or 16 with 8-bit codes), got ", gs);
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = K / gs;
  TORCH_CHECK(K % BLK == 0 && q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous() &&
              q.size(1) * 8 == K * bits, who, ": qweight must be contiguous uint8 [N, K * bits / 8], K % 32 == 0");
  TORCH_CHECK(N % TILE == 0, who, ": the tiled weight needs N % 16 == 0, got N = ", N);
  TORCH_CHECK(!silu || N % 64 == 0, who, ": the gate/up weight needs N % 64 == 0 (whole tile pairs per half), got N = ", N);
  const bool half = s.scalar_type() == at::kHalf;
  TORCH_CHECK((half || s.scalar_type() == at::kFloat) && s.is_contiguous() && s.numel() == N * G,
              who, ": scales must be float32 or float16 [N, K / group_size]");
  TORCH_CHECK(mn.numel() == 0 || (mn.scalar_type() == s.scalar_type() && mn.is_contiguous() && mn.numel() == N * G),
              who, ": mins must match scales' dtype and shape");
  const at::Tensor xp = x.contiguous();
  const uint16_t* xd = (const uint16_t*)xp.data_ptr<at::BFloat16>();
  std::vector<uint16_t> buf;
  if (M % 32 != 0 || ((uintptr_t)xd & 63)) {  // rows_buffer: zero rows up to a multiple of 32 (every tile
    // load reads 16 full rows), 64-byte aligned (a view's offset: tile rows would straddle cache lines)
    uint16_t* al = sglite_amx::rows_buffer(buf, M, K);
    std::memcpy(al, xd, M * K * 2);
    xd = al;
  }
  const QW w = amx_weight(q, s, mn, bits, gs);
  at::Tensor y = at::empty({M, silu ? N / 2 : N}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  const uint16_t* pk = sglite_amx::packed_data(packed, N, K, who);
  sglite_amx::gemm(w, xd, M, out_bf16 ? nullptr : y.data_ptr<float>(), out_bf16 ? y.data_ptr<at::BFloat16>() : nullptr, AtPar{}, pk,
                   silu);
  return y;
}

at::Tensor quant_gemm_amx(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, const at::Tensor& mn, int64_t bits,
                          int64_t gs, bool out_bf16, const at::Tensor& packed) {
  return run_gemm(x, q, s, mn, bits, gs, out_bf16, packed, false, "quant_gemm_amx");
}

// silu(x @ Wg.T) * (x @ Wu.T) for a gate/up weight [2I, K] (gate rows first, I % 32 == 0) -> [M, I]
// bf16, bit-identical to quant_gemm_amx's bf16 output followed by cpu_gemv's silu_mul on its halves.
at::Tensor quant_gemm_amx_silu(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, const at::Tensor& mn,
                               int64_t bits, int64_t gs, const at::Tensor& packed) {
  return run_gemm(x, q, s, mn, bits, gs, true, packed, true, "quant_gemm_amx_silu");
}
