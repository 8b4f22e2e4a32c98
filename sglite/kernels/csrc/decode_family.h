// The fused decode layer of the Llama-like families (Gemma 2/3, OLMo 2, Granite; contract:
// sglite/kernels/decode_family.py), spliced into decode_layer.cpp after its helpers (rms_norm,
// weight, gemv, attention, store_rows, silu_mul), which it reuses. It differs from
// decode_forward only by the family's options, as data:
// * norms [L, 4, H] float32 in the order (in, attn_out, ffn_in, ffn_out), present where bit i of
//   norm_mask is set (Gemma: all four, weights already (1 + w); OLMo 2: attn_out and ffn_out,
//   applied to the attention / MLP output before the residual add; Granite: Llama's in / ffn_in);
// * QK-norm (qk_kind 1: each head over D, Gemma 3 and Qwen3; 2: the whole q / k projection width,
//   OLMo 2) before RoPE with weights qk_norms [2L] = (q_norm, k_norm) per layer, float32;
// * residual_scale on each block's output before its add (Granite);
// * act 0: SiLU(g) * u, 1: gelu_tanh(g) * u (Gemma's GeGLU);
// * per-layer local flags: a local layer rotates with (lcos, lsin), attends to the last `window`
//   positions only, and reads / writes the K/V slots of (lout_loc, lrt, lrows) (the hybrid pool's
//   local slot space, sglite/runtime/swa_pool.py; the full ones when it has none);
// * softcap > 0: cap * tanh(s / cap) on the attention scores (Gemma 2).
// Quantized KV pools (kvq, kvq_pool_loc, kvq_bits: decode_forward's, decode_kv_quant.h's Pool; the
// caller passes the residual windows / fp8 codes as the k/v buffers) run as in decode_forward; they
// support neither local layers nor softcap (refused).
#pragma once

namespace {

// act[i] = gelu_tanh(g[i]) * u[i] = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) u (Hendrycks &
// Gimpel 2016, the tanh approximation; torch's gelu(approximate="tanh")). The AVX-512 build computes
// tanh(|y|) = (1 - e) / (1 + e), e = e^(-2|y|) (exp_nonpos, abs. error ~1e-7), sign restored.
void gelu_tanh_mul(const float* g, const float* u, int64_t n, float* act) {
  const float k0 = 0.7978845608028654f, k1 = 0.044715f;
  int64_t i = 0;
#ifdef SGQ_AVX512
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(act + i, _mm512_mul_ps(sglite_simd::gelu_tanh16(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(u + i)));
#endif
  for (; i < n; ++i) {
    const float x = g[i];
    act[i] = 0.5f * x * (1.f + std::tanh(k0 * (x + k1 * x * x * x))) * u[i];
  }
}

// x[i] += s * y[i] (s == 1: a plain add, as decode_forward's residual)
void add_scaled(float* x, const float* y, int64_t n, float s) {
  if (s == 1.f) for (int64_t i = 0; i < n; ++i) x[i] += y[i];
  else for (int64_t i = 0; i < n; ++i) x[i] += y[i] * s;
}


}  // namespace

// x [M, H] float32 (the embedded, scaled tokens) -> [M, H] float32 hidden after the final RMSNorm,
// the K/V of every layer written. Options: the header comment; the rest as decode_forward's
// arguments (cos/sin and lcos/lsin [M, D/2] float32; local [L] 0/1; lout_loc / lrows [M] int64,
// lrt int32 for the local layers). lora_* / amx_min / amx_packed as decode_forward's: the step's LoRA
// deltas are added to each projection's output before the family's norms, and from amx_min rows
// (AMX builds, tiled weights) the GEMMs run on the tiles. kvq / kvq_pool_loc / kvq_bits: a quantized
// pool, as decode_forward's.
at::Tensor decode_family_forward(
    at::Tensor x, at::Tensor norms, int64_t norm_mask, std::vector<at::Tensor> qk_norms, int64_t qk_kind,
    std::vector<at::Tensor> lin, std::vector<int64_t> bits, at::Tensor final_norm, at::Tensor cos, at::Tensor sin,
    at::Tensor lcos, at::Tensor lsin, std::vector<int64_t> local, int64_t window, double softcap, double residual_scale,
    int64_t act_kind, std::vector<at::Tensor> kbufs, std::vector<at::Tensor> vbufs, at::Tensor out_loc,
    at::Tensor req_to_token, at::Tensor rows, at::Tensor lout_loc, at::Tensor lrt, at::Tensor lrows, at::Tensor lens,
    int64_t Hq, int64_t Hkv, int64_t D, double eps, double sm_scale, bool q8, bool tiled, int64_t threads,
    int64_t attn_split_min, std::vector<at::Tensor> lora_ab, at::Tensor lora_rows, std::vector<at::Tensor> lora_spans,
    int64_t lora_split_min, int64_t amx_min, std::vector<at::Tensor> amx_packed,
    int64_t cascade_min, std::vector<at::Tensor> kvq, at::Tensor kvq_pool_loc, int64_t kvq_bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "decode_family_forward: x must be contiguous float32 [M <= ", kMaxRows, ", H]");
  const int64_t M = x.size(0), H = x.size(1), L = (int64_t)kbufs.size(), half = D / 2;
  TORCH_CHECK((int64_t)lin.size() == 12 * L && (int64_t)bits.size() == 4 * L && (int64_t)vbufs.size() == L
              && (int64_t)local.size() == L && norms.scalar_type() == at::kFloat && norms.is_contiguous()
              && norms.numel() == L * 4 * H && (amx_packed.empty() || (int64_t)amx_packed.size() == 4 * L),
              "decode_family_forward: per-layer inputs disagree with the layer count");
  TORCH_CHECK(qk_kind >= 0 && qk_kind <= 2 && (qk_kind == 0 || (int64_t)qk_norms.size() == 2 * L),
              "decode_family_forward: qk_kind must be 0, 1 or 2 with 2 weights per layer");
  TORCH_CHECK(act_kind == 0 || act_kind == 1, "decode_family_forward: act_kind must be 0 (silu) or 1 (gelu_tanh)");
  TORCH_CHECK(window >= 0 && softcap >= 0, "decode_family_forward: window and softcap must be >= 0");
  for (const at::Tensor* c : {&cos, &sin, &lcos, &lsin})
    TORCH_CHECK(c->scalar_type() == at::kFloat && c->is_contiguous() && c->numel() == M * half && D % 2 == 0,
                "decode_family_forward: cos/sin tables must be float32 [M, D/2]");
  for (const at::Tensor* t : {&out_loc, &lout_loc, &lens, &rows, &lrows})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == M,
                "decode_family_forward: out_cache_loc, rows and seq_lens must be int64 [M]");
  TORCH_CHECK(threads >= 1 && threads <= 1024, "decode_family_forward: threads must be in [1, 1024], got ", threads);
  static auto attn = c10::Dispatcher::singleton()
      .findSchemaOrThrow("sglite_cpu_attention::decode_attention", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, double, int64_t, double, int64_t, const c10::optional<at::Tensor>&)>();
  const sglite_kv_quant_decode::Pool pool(kvq, kvq_pool_loc, rows, lens, kvq_bits, L, M, cascade_min);
  TORCH_CHECK(!pool.quantized() || (softcap == 0 && std::count(local.begin(), local.end(), 0) == L),
              "decode_family_forward: a quantized KV pool supports neither local layers nor soft-capping");
  const PoolPar par{(int)threads};
  const sglite_lora_fused::Step lora(std::move(lora_ab), std::move(lora_rows), std::move(lora_spans), L, M,
                                     lora_split_min);
  const int64_t Nqkv = (Hq + 2 * Hkv) * D;
  const float rs = (float)residual_scale, ep = (float)eps;
  at::Tensor out = at::empty_like(x);  // a plain copy, not x.clone(): see decode_forward
  std::memcpy(out.data_ptr<float>(), x.data_ptr<float>(), sizeof(float) * x.numel());
  float* xr = out.data_ptr<float>();
  std::vector<float> h(M * H), qkv, att(M * Hq * D), tmp(M * H), gu, act;
  const float* np_ = norms.data_ptr<float>();
  at::Tensor q_t = at::empty({M, Hq, D}, x.options());
  const c10::optional<at::Tensor> groups = step_groups(req_to_token, rows, lens, cascade_min);
  for (int64_t l = 0; l < L; ++l) {
    QW wqkv = weight(lin, 12 * l, bits[4 * l], tiled), wo = weight(lin, 12 * l + 3, bits[4 * l + 1], tiled);
    QW wgu = weight(lin, 12 * l + 6, bits[4 * l + 2], tiled), wd = weight(lin, 12 * l + 9, bits[4 * l + 3], tiled);
    TORCH_CHECK(wqkv.K == H && wqkv.N == Nqkv && wo.K == Hq * D && wo.N == H && wgu.K == H && wd.N == H
                && wd.K * 2 == wgu.N, "decode_family_forward: layer ", l, " weight shapes disagree with the model");
    QW* ws[4] = {&wqkv, &wo, &wgu, &wd};
    for (int k = 0; k < 4; ++k) attach_packed(*ws[k], amx_packed, 4 * l + k);
    const int64_t I = wd.K;
    const float* nw = np_ + l * 4 * H;  // this layer's 4 norm weights
    const bool loc_layer = local[l] != 0;
    const float* hin = xr;
    if (norm_mask & 1) { add_norm_rows(par, M, H, xr, nullptr, nw, ep, h.data()); hin = h.data(); }
    qkv.resize(M * Nqkv);
    gemv(wqkv, hin, M, qkv.data(), q8, par, amx_min);
    lora.apply(l, 0, hin, H, qkv.data(), Nqkv, par);
    const float *qn = nullptr, *kn = nullptr;
    const int64_t qw = qk_kind == 1 ? D : Hq * D, kw = qk_kind == 1 ? D : Hkv * D;
    if (qk_kind) {
      const at::Tensor &qnt = qk_norms[2 * l], &knt = qk_norms[2 * l + 1];
      TORCH_CHECK(qnt.scalar_type() == at::kFloat && knt.scalar_type() == at::kFloat && qnt.is_contiguous()
                  && knt.is_contiguous() && qnt.numel() == qw && knt.numel() == kw,
                  "decode_family_forward: q_norm / k_norm of layer ", l, " must be float32 [", qw, "] / [", kw, "]");
      qn = qnt.data_ptr<float>();
      kn = knt.data_ptr<float>();
    }
    const float* cp = (loc_layer ? lcos : cos).data_ptr<float>();
    const float* sp = (loc_layer ? lsin : sin).data_ptr<float>();
    at::Tensor& kb = kbufs[l];
    at::Tensor& vb = vbufs[l];
    const int64_t* loc = (loc_layer ? lout_loc : out_loc).data_ptr<int64_t>();
    check_pool(kb, vb, Hkv, D, "decode_family_forward", l, pool.fp8);
    const float* f8s[2];
    const float* const* f8 = pool.scales(l, Hkv, f8s);  // fp8 pools: the layer's key / value scales
    row_shares(par, M, [&](int64_t lo, int64_t hi) {
      for (int64_t m = lo; qn && m < hi; ++m) {  // in place: rms_norm reads each row before writing it
        float* q = qkv.data() + m * Nqkv;
        rms_norm(q, qn, Hq * D / qw, qw, ep, q);
        rms_norm(q + Hq * D, kn, Hkv * D / kw, kw, ep, q + Hq * D);
      }
      rope_store_rows(kb, vb, loc, qkv.data(), lo, hi, Hq, Hkv, D, Nqkv, cp, sp, q_t.data_ptr<float>(), f8);
    });
    if (pool.step) pool.step->attend(l, q_t, req_to_token, sm_scale, att.data());
    else attention(attn, q_t, kb, vb, loc_layer ? lrt : req_to_token, loc_layer ? lrows : rows, lens, sm_scale, M, Hq,
                   Hkv, D, (int)threads, attn_split_min, att.data(), loc_layer ? window : 0, softcap,
                   loc_layer ? c10::nullopt : groups);
    pool.scale_output(f8, att.data(), M, Hq, Hkv, D);
    gemv(wo, att.data(), M, tmp.data(), q8, par, amx_min);
    lora.apply(l, 1, att.data(), Hq * D, tmp.data(), H, par);
    hin = xr;
    // (OLMo 2) the attention output's norm, the residual add, (the others) the MLP's input norm
    row_shares(par, M, [&](int64_t lo, int64_t hi) {
      if (norm_mask & 2) rms_norm(tmp.data() + lo * H, nw + H, hi - lo, H, ep, tmp.data() + lo * H);
      add_scaled(xr + lo * H, tmp.data() + lo * H, (hi - lo) * H, rs);
      if (norm_mask & 4) rms_norm(xr + lo * H, nw + 2 * H, hi - lo, H, ep, h.data() + lo * H);
    });
    if (norm_mask & 4) hin = h.data();
    gu.resize(M * 2 * I);
    act.resize(M * I);
    gemv(wgu, hin, M, gu.data(), q8, par, amx_min);
    lora.apply(l, 2, hin, H, gu.data(), 2 * I, par);
    row_shares(par, M, [&](int64_t lo, int64_t hi) {
      for (int64_t m = lo; m < hi; ++m) {
        const float* g = gu.data() + m * 2 * I;
        if (act_kind == 1) gelu_tanh_mul(g, g + I, I, act.data() + m * I);
        else silu_mul(g, g + I, I, act.data() + m * I);
      }
    });
    gemv(wd, act.data(), M, tmp.data(), q8, par, amx_min);
    lora.apply(l, 3, act.data(), I, tmp.data(), H, par);
    row_shares(par, M, [&](int64_t lo, int64_t hi) {
      if (norm_mask & 8) rms_norm(tmp.data() + lo * H, nw + 3 * H, hi - lo, H, ep, tmp.data() + lo * H);
      add_scaled(xr + lo * H, tmp.data() + lo * H, (hi - lo) * H, rs);
    });
  }
  TORCH_CHECK(final_norm.scalar_type() == at::kFloat && final_norm.numel() == H,
              "decode_family_forward: final_norm must be float32 [H]");
  at::Tensor y = at::empty({M, H}, x.options());
  add_norm_rows(par, M, H, xr, nullptr, final_norm.data_ptr<float>(), ep, y.data_ptr<float>());
  return y;
}
