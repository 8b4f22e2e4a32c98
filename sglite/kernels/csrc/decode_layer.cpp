// Fused batch-1 (1..32 rows; up to 128 with a many-row GEMM: the AMX tile GEMM of quant_amx.h, or the VNNI GEMM of quant_gemm_kernel.h) decode through every decoder layer of a Llama-family model with
// group-quantized matmul weights, in one call (contract: sglite/kernels/decode_fused.py). Per
// layer: RMSNorm, QKV GEMV, RoPE (rotate-half), K/V stored into the paged pool, paged decode
// attention reading the pool in place (the sglite_cpu_attention op), o_proj + residual, RMSNorm,
// gate/up GEMV, SiLU(g) * u, down + residual; then the final RMSNorm. Activations stay float32
// between ops; the GEMVs are quant_rows.h's float-exact one (q8 = false) or the int8-activation
// one (q8 = true). Threads: each GEMV's output rows (16-row tiles) and the attention's
// (row, KV head) tasks split in contiguous shares over a persistent pool (thread_pool.h), one
// fork/join per matrix; the elementwise ops between them (norms with their residual adds, RoPE with
// the K/V stores, SiLU * up, the GEMMs' bf16 activation rows) split the rows over the same pool
// (row_shares), each row computed by the same code as on one thread, so the split changes no bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include "quant_rows.h"
#include "thread_pool.h"
#include "quant_gemm_kernel.h"
// avx512_math.h before quant_amx.h, which uses it (read_source splices a header once)
#ifdef SGQ_AVX512
#include "avx512_math.h"
#endif
#include "quant_amx.h"
#include "lora_fused.h"
#include "decode_kv_quant.h"

namespace {

using namespace sglite_quant;
using sglite_pool::PoolPar;

constexpr int64_t kMaxRows = 128;  // decode rows of one call (decode_fused.MAX_ROWS_AMX; 32 without a many-row GEMM)

// f(lo, hi) over contiguous shares of the rows [0, M) on the pool, at least kShareRows rows a share
// (fewer rows: one share on the calling thread, no fork/join). For the per-row elementwise ops: a
// 64-row step of the default model spent ~20 % of its wall time in them on the calling thread while
// the other threads waited (perf, 2026-12-07: the pool's spin loop).
constexpr int64_t kShareRows = 8;
template <typename F> inline void row_shares(const PoolPar& par, int64_t M, const F& f) { par(0, M, kShareRows, f); }

// One row's output from its sum of squares ss: y = x / sqrt(ss / H + eps) * w.
inline void rms_scale_row(const float* xr, const float* w, int64_t H, float ss, float eps, float* yr) {
  const float r = 1.f / std::sqrt(ss / (float)H + eps);
  for (int64_t i = 0; i < H; ++i) yr[i] = xr[i] * r * w[i];
}

// y[m, :] = x[m, :] / sqrt(mean(x[m, :]^2) + eps) * w. Each row's sum of squares runs in element
// order (i = 0, 1, ..., every product and sum rounded to float32); the AVX-512 build sums 16 rows
// at once, lane j holding row j's running sum (a gather of column i across the rows per step), so
// each row's bits are those of the one-row loop while the 16 chains overlap instead of one add's
// latency per element (a 48-row step's 61 norms: ~1 ms of serial adds on the calling thread).
void rms_norm(const float* x, const float* w, int64_t M, int64_t H, float eps, float* y) {
  int64_t m = 0;
#ifdef SGQ_AVX512
  if (M >= 2 && H * 16 < (int64_t(1) << 31)) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)H));
    for (; m < M; m += 16) {
      const int64_t n = std::min<int64_t>(16, M - m);
      const __mmask16 live = (__mmask16)((1u << n) - 1);
      const float* xb = x + m * H;
      __m512 ss = _mm512_setzero_ps();
      for (int64_t i = 0; i < H; ++i) {
        const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, rows, xb + i, 4);
        ss = _mm512_add_ps(ss, _mm512_mul_ps(v, v));
      }
      alignas(64) float s[16];
      _mm512_store_ps(s, ss);
      for (int64_t j = 0; j < n; ++j) rms_scale_row(xb + j * H, w, H, s[j], eps, y + (m + j) * H);
    }
  }
#endif
  for (; m < M; ++m) {
    const float* xr = x + m * H;
    float ss = 0.f;
    for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
    rms_scale_row(xr, w, H, ss, eps, y + m * H);
  }
}

// act[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u for i < n. The AVX-512 build computes the
// sigmoid from e^-|g| (exp_nonpos, rel. error ~2e-7): e^-|g| / (1 + e^-|g|) for g < 0, else
// 1 / (1 + e^-|g|); one vector per 16 values instead of a libm call per value (~0.2 ms a step of
// the default model per row).
void silu_mul(const float* g, const float* u, int64_t n, float* act) {
  int64_t i = 0;
#ifdef SGQ_AVX512
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = sglite_simd::exp_nonpos(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
    const __m512 sig = _mm512_mask_mul_ps(inv, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), e, inv);
    _mm512_storeu_ps(act + i, _mm512_mul_ps(_mm512_mul_ps(x, sig), _mm512_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) act[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

QW weight(const std::vector<at::Tensor>& t, size_t i, int64_t bits, bool tiled) {  // t[i..i+2] = codes, scales, mins
  const at::Tensor &q = t[i], &s = t[i + 1], &mn = t[i + 2];
  const int64_t N = q.size(0), K = q.size(1) * 8 / bits;
  const auto st = s.scalar_type();
  // group size from the scales' count: 32, or 16 with 8-bit codes (GGUF Q6_K)
  const int64_t gs = s.numel() == N * (K / 16) && bits == 8 && K % BLK == 0 ? 16 : BLK, G = K / gs;
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && (st == at::kFloat || st == at::kHalf) && s.is_contiguous()
              && s.numel() == N * G && (mn.numel() == 0 || (mn.scalar_type() == st && mn.is_contiguous()
              && mn.numel() == N * G)), "decode_forward: a weight breaks the group-32 (or 8-bit group-16) layout");
  return QW{q.data_ptr<uint8_t>(), (const float*)s.data_ptr(), mn.numel() ? (const float*)mn.data_ptr() : nullptr,
            (int)bits, gs, N, K, st == at::kHalf, tiled};
}

// pk[i] (when pk has entries and pk[i] is not empty): w repacked once by quant_amx_pack (bf16 bits as
// int16, 64-byte aligned), read by the AMX GEMM instead of dequantizing the codes every call.
void attach_packed(QW& w, const std::vector<at::Tensor>& pk, size_t i) {
  if (pk.empty()) return;
  w.packed = sglite_amx::packed_data(pk[i], w.N, w.K, "decode_forward");
  TORCH_CHECK(!w.packed || w.tiled, "decode_forward: a packed AMX weight needs its weight in 16-row tiles");
}

#ifdef SGQ_VNNI
// y [M, N] float32 = q8(x) @ W_stored.T on the int8 VNNI GEMM (quant_gemm_kernel.h) for a tiled weight:
// the rows quantized as quantize_q8 does (in row shares on the pool), then the tile pairs split over
// the pool, each streaming its codes once for all M rows (the GEMV re-reads them per 8-row block).
void gemm_vnni(const QW& w, const float* x, int64_t M, float* y, const PoolPar& par) {
  const int64_t K = w.K, nb = K / BLK, sxs = K / w.gs;
  static thread_local std::vector<int8_t> xq;  // the calling thread's buffers, kept across calls
  static thread_local std::vector<float> dsx, sx16;
  if ((int64_t)xq.size() < M * K + 64) xq.resize(M * K + 64);
  if ((int64_t)dsx.size() < 2 * M * nb) dsx.resize(2 * M * nb);
  float *dx = dsx.data(), *sx = dx + M * nb;
  int8_t* xqp = xq.data();
  row_shares(par, M, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) quantize_row_avx(x + m * K, K, xqp + m * K, dx + m * nb, sx + m * nb);
  });
  if (w.gs != BLK) {  // the offsets' factor per 16-group
    if ((int64_t)sx16.size() < M * sxs) sx16.resize(M * sxs);
    group_sx16(xqp, dx, M, K, sx16.data());
    sx = sx16.data();
  }
  const int64_t T = w.N / TILE, P = (T + 1) / 2;  // pairs of tiles (the last one may be single)
  par(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      gemm_pair(xqp, dx, sx, sxs, M, w, 2 * p, std::min<int64_t>(2, T - 2 * p), y + 2 * p * TILE, w.N);
  });
}
#endif

// amx_min > 0 (16-row tiles, int8 path): M >= amx_min rows run the many-row GEMM instead of the
// int8-activation GEMV in 8-row blocks: in AMX builds the AMX-BF16 tile GEMM of quant_amx.h (bf16
// activations, float32 sums), in other VNNI builds the int8 VNNI GEMM (gemm_vnni; the GEMV's
// activation rounding). The caller passes 0 where neither applies (decode_fused.FusedDecode.amx_min).
void gemv(const QW& w, const float* x, int64_t M, float* y, bool q8, const PoolPar& par, int64_t amx_min = 0) {
  TORCH_CHECK(q8 || (!w.half && !w.tiled), "decode_forward: float16 scales and 16-row tiles need the int8-activation path");
#ifdef SGQ_AMX
  if (q8 && w.tiled && amx_min > 0 && M >= amx_min) {
    // the calling thread's rows buffer, kept across calls and never zero-filled (pack_rows writes
    // every row, padding included): a fresh zeroed vector cost a memset and, past 128 KiB, an
    // mmap / page faults / munmap per GEMM
    static thread_local std::unique_ptr<uint16_t[]> buf;
    static thread_local int64_t cap = 0;
    const int64_t Mp = (M + 31) / 32 * 32, need = Mp * w.K + 32;
    if (need > cap) { buf.reset(new uint16_t[need]); cap = need; }
    uint16_t* xd = (uint16_t*)(((uintptr_t)buf.get() + 63) & ~(uintptr_t)63);  // one cache line per tile row
    row_shares(par, Mp, [&](int64_t lo, int64_t hi) {  // rows >= M of the last share: the zero padding
      const int64_t real = std::max<int64_t>(0, std::min(hi, M) - lo);
      sglite_amx::pack_rows(x + lo * w.K, real, w.K, xd + lo * w.K, hi - lo);
    });
    sglite_amx::gemm(w, xd, M, y, nullptr, par, w.packed);
    return;
  }
#elif defined(SGQ_VNNI)
  if (q8 && w.tiled && amx_min > 0 && M >= amx_min) {
    gemm_vnni(w, x, M, y, par);
    return;
  }
#endif
  if (q8) gemv_q8(w, x, M, y, false, par);
  else gemv_float(w, x, nullptr, M, y, par);
}

using AttnOp = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&, const at::Tensor&, double, int64_t, double, int64_t,
                                                   const c10::optional<at::Tensor>&)>;

// Paged decode attention of the step's M rows into att [M, Hq * D] float32: the M * Hkv (row, KV
// head) tasks in n contiguous shares claimed by the pool's threads; a share is at most three calls of the
// attention op (a partial row, whole rows, a partial row) on views of q, the pool and the rows.
// The op computes every (row, KV head) task with the same code wherever it lies, so att does not
// depend on the split; its own at::parallel_for is serial in these builds (no -fopenmp). Steps
// that read fewer than split_min K/V values run it in one call on the calling thread. groups (the
// step's shared-prefix groups, step_groups; no window): one call for the whole step, whose
// shared-prefix pass (decode_cascade.h) splits its own work over the op's threads.
void attention(const AttnOp& attn, const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb, const at::Tensor& rt,
               const at::Tensor& rows, const at::Tensor& lens, double sm, int64_t M, int64_t Hq, int64_t Hkv, int64_t D,
               int threads, int64_t split_min, float* att, int64_t window = 0, double softcap = 0.0,
               const c10::optional<at::Tensor>& groups = c10::nullopt) {
  const int64_t T = M * Hkv, G = Hq / Hkv;
  int64_t work = 0;  // K/V values the step reads: below split_min the op calls cost more than they share
  for (int64_t m = 0; m < M; ++m) work += lens.data_ptr<int64_t>()[m] * Hkv * D;
  const bool casc = window == 0 && groups.has_value();
  if (threads <= 1 || T <= 1 || work < split_min || casc) {
    at::Tensor o = attn.call(q, kb, vb, rt, rows, lens, sm, window, softcap, casc ? 1 : 0,
                             casc ? groups : c10::nullopt);  // [M, Hq, D] float32
    std::memcpy(att, o.data_ptr<float>(), sizeof(float) * M * Hq * D);
    return;
  }
  // rows [m0, m1), KV heads [h0, h1) of each of them
  auto piece = [&](int64_t m0, int64_t m1, int64_t h0, int64_t h1) {
    if (m0 >= m1 || h0 >= h1) return;
    at::Tensor o = attn.call(q.slice(0, m0, m1).slice(1, h0 * G, h1 * G), kb.slice(1, h0, h1), vb.slice(1, h0, h1), rt,
                             rows.slice(0, m0, m1), lens.slice(0, m0, m1), sm, window, softcap, 0, c10::nullopt);  // [m1 - m0, (h1 - h0) * G, D]
    const float* op = o.data_ptr<float>();
    const int64_t w = (h1 - h0) * G * D;
    for (int64_t m = m0; m < m1; ++m) std::memcpy(att + m * Hq * D + h0 * G * D, op + (m - m0) * w, sizeof(float) * w);
  };
  // n contiguous shares of the flat task range (task = m * Hkv + h) of about equal work: a task
  // costs its row's length plus a fixed 16 keys' worth (rows of a step differ in length by 10x)
  const int n = (int)std::min<int64_t>(threads, T);
  const int64_t* lp = lens.data_ptr<int64_t>();
  std::vector<int64_t> bound(n + 1, T);
  bound[0] = 0;
  int64_t total = 0;
  for (int64_t m = 0; m < M; ++m) total += (lp[m] + 16) * Hkv;
  for (int64_t t = 0, acc = 0, c = 1; t < T && c < n; ++t) {
    acc += lp[t / Hkv] + 16;
    while (c < n && acc * n >= total * c) bound[c++] = t + 1;
  }
  auto share = [&](int64_t c) {
    const int64_t a = bound[c], b = bound[c + 1];  // flat task range [a, b)
    if (a >= b) return;
    const int64_t ma = a / Hkv, ha = a % Hkv, mb = b / Hkv, hb = b % Hkv;
    if (ma == mb) return piece(ma, ma + 1, ha, hb);
    int64_t full0 = ma;
    if (ha > 0) { piece(ma, ma + 1, ha, Hkv); full0 = ma + 1; }
    piece(full0, mb, 0, Hkv);
    if (hb > 0) piece(mb, mb + 1, 0, hb);
  };
  sglite_pool::Pool::get().run(n, n, share);
}

// The groups of the step's rows that continue one cached prefix of >= cascade_min keys (the
// attention op's shared_prefix_groups, decode_cascade.h), found once per step; nullopt when there
// are none (or cascade_min is 0): those steps keep the split attention above.
inline c10::optional<at::Tensor> step_groups(const at::Tensor& rt, const at::Tensor& rows, const at::Tensor& lens,
                                             int64_t cascade_min) {
  if (cascade_min <= 0 || rows.numel() < 2) return c10::nullopt;
  static auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("sglite_cpu_attention::shared_prefix_groups", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
  at::Tensor g = op.call(rt, rows, lens, cascade_min);
  return g.data_ptr<int64_t>()[0] > 0 ? c10::optional<at::Tensor>(g) : c10::nullopt;
}

// The M rows' Hkv heads of D values (src, rows src_stride apart) written into buf [S, Hkv, D] at
// slots loc as conv(head, value): the element type T of the pool and its conversion.
template <typename T, typename Conv>
void store_rows(at::Tensor& buf, const int64_t* loc, const float* src, int64_t M, int64_t Hkv, int64_t D,
                int64_t src_stride, const Conv& conv) {
  T* p = static_cast<T*>(buf.data_ptr());
  const int64_t s0 = buf.stride(0), s1 = buf.stride(1), S = buf.size(0);
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK_INDEX(loc[m] >= 0 && loc[m] < S, "decode_forward: out_cache_loc[", m, "]=", loc[m], " outside the pool");
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t d = 0; d < D; ++d) p[loc[m] * s0 + h * s1 + d] = conv(h, src[m * src_stride + h * D + d]);
  }
}

// RoPE (rotate-half, Su et al. 2021) in place on the first `heads` heads (q, then k) of each of the
// M rows of qkv [M, Nqkv] float32; cp / sp: the rows' cos / sin [M, D/2] float32.
void rope_rows(float* qkv, int64_t M, int64_t Nqkv, int64_t heads, int64_t D, const float* cp, const float* sp) {
  const int64_t half = D / 2;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t hd = 0; hd < heads; ++hd) {
      float* v = qkv + m * Nqkv + hd * D;
      for (int64_t i = 0; i < half; ++i) {
        const float c = cp[m * half + i], s = sp[m * half + i], a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
      }
    }
}

// x [M, H] += t (t null: nothing added), then y [M, H] = rms_norm(x) * w [H] (all float32), the
// rows split over the pool by row_shares; each row's bits are those of the one-thread loop.
void add_norm_rows(const PoolPar& par, int64_t M, int64_t H, float* x, const float* t, const float* w, float eps,
                   float* y) {
  row_shares(par, M, [&](int64_t lo, int64_t hi) {
    if (t) for (int64_t i = lo * H; i < hi * H; ++i) x[i] += t[i];
    rms_norm(x + lo * H, w, hi - lo, H, eps, y + lo * H);
  });
}

// Layer `l`'s pool checked for the K/V stores of rope_store_rows (kb / vb: [S, Hkv, D], float32 or
// bf16, unit stride along D; the error prefixed `who`).
void check_pool(const at::Tensor& kb, const at::Tensor& vb, int64_t Hkv, int64_t D, const char* who, int64_t l,
                bool fp8 = false) {
  TORCH_CHECK(kb.dim() == 3 && kb.size(1) == Hkv && kb.size(2) == D && kb.stride(2) == 1 && vb.sizes() == kb.sizes()
              && vb.stride(2) == 1 && vb.scalar_type() == kb.scalar_type(), who, ": pool of layer ", l, " is not [S, Hkv, D]");
  TORCH_CHECK(fp8 ? kb.scalar_type() == at::kFloat8_e4m3fn : (kb.scalar_type() == at::kBFloat16 || kb.scalar_type() == at::kFloat),
              who, ": pool dtype must be float32 or bfloat16 (float8_e4m3fn with its scales)");
}

// Rows [lo, hi) of the M qkv rows [M, Nqkv] (q: Hq heads, then Hkv k and Hkv v heads of D): RoPE on
// their q and k heads (cp / sp: cos / sin [M, D/2]), the k and v heads written into the pool at
// slots loc (check_pool first), the q heads copied into q_t [M, Hq, D] float32.
void rope_store_rows(at::Tensor& kb, at::Tensor& vb, const int64_t* loc, float* qkv, int64_t lo, int64_t hi, int64_t Hq,
                     int64_t Hkv, int64_t D, int64_t Nqkv, const float* cp, const float* sp, float* q_t,
                     const float* const* fp8 = nullptr) {
  const int64_t n = hi - lo, half = D / 2;
  float* rows = qkv + lo * Nqkv;
  rope_rows(rows, n, Nqkv, Hq + Hkv, D, cp + lo * half, sp + lo * half);
  const float *k_src = rows + Hq * D, *v_src = rows + (Hq + Hkv) * D;
  if (fp8) {  // fp8[0], fp8[1]: key and value scales [Hkv]; q heads times the key scale of their KV head
    using sglite_kv_quant_decode::fp8_code;
    store_rows<uint8_t>(kb, loc + lo, k_src, n, Hkv, D, Nqkv, [&](int64_t h, float x) { return fp8_code(x, fp8[0][h]); });
    store_rows<uint8_t>(vb, loc + lo, v_src, n, Hkv, D, Nqkv, [&](int64_t h, float x) { return fp8_code(x, fp8[1][h]); });
    const int64_t G = Hq / Hkv;
    for (int64_t m = lo; m < hi; ++m)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t d = 0; d < D; ++d) q_t[(m * Hq + h) * D + d] = qkv[m * Nqkv + h * D + d] * fp8[0][h / G];
    return;
  }
  if (kb.scalar_type() == at::kBFloat16) {
    const auto bf16 = [](int64_t, float x) { return c10::BFloat16(x); };
    store_rows<c10::BFloat16>(kb, loc + lo, k_src, n, Hkv, D, Nqkv, bf16);
    store_rows<c10::BFloat16>(vb, loc + lo, v_src, n, Hkv, D, Nqkv, bf16);
  } else {
    const auto f32 = [](int64_t, float x) { return x; };
    store_rows<float>(kb, loc + lo, k_src, n, Hkv, D, Nqkv, f32);
    store_rows<float>(vb, loc + lo, v_src, n, Hkv, D, Nqkv, f32);
  }
  for (int64_t m = lo; m < hi; ++m) std::memcpy(q_t + m * Hq * D, qkv + m * Nqkv, sizeof(float) * Hq * D);
}

}  // namespace

// x [M, H] float32 (the embedded tokens) -> [M, H] float32 hidden after the final RMSNorm.
// norms [L, 2, H] float32 (input, post-attention); lin: per layer 4 weights (qkv, o, gate_up,
// down) x (codes, scales, mins (empty: none)); bits [4L]; cos/sin [M, D/2] float32 of the rows'
// positions; k/v buffers [S, Hkv, D] per layer (float32 or bf16, unit stride along D; written at
// out_cache_loc [M] int64); req_to_token [R, Lmax] int32; rows/lens [M] int64; tiled: every layer
// weight is in 16-row tiles (quant_tiles.h; needs q8). lora_ab / lora_rows / lora_spans /
// lora_split_min: the step's LoRA adapters (lora_fused.h's Step; an empty lora_ab: none, the base
// model's path as before). amx_packed: [4L] weights repacked for the AMX GEMM (attach_packed; an empty
// list or empty tensors: dequantize per call). kvq (empty: a plain pool): an int8 / int4 KIVI pool's
// 6 tensors a layer (decode_kv_quant.h), with the layer's residual windows as the k/v buffers
// ([R * G, Hkv, D]) and out_cache_loc their rows (request row * G + position % G); kvq_pool_loc [M]
// int64: the rows' pool slots; kvq_bits 8 / 4. An fp8_e4m3 pool: kvq_bits 0, its codes as the k/v
// buffers, kvq its key and value scales [Hkv] float32 a layer (fp8_scales; stores x / scale, attends
// q * key scale, scales the output by the value scale).
at::Tensor decode_forward(at::Tensor x, at::Tensor norms, std::vector<at::Tensor> lin, std::vector<int64_t> bits,
                          at::Tensor final_norm, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> kbufs,
                          std::vector<at::Tensor> vbufs, at::Tensor out_loc, at::Tensor req_to_token, at::Tensor rows,
                          at::Tensor lens, int64_t Hq, int64_t Hkv, int64_t D, double eps, double sm_scale, bool q8,
                          bool tiled, int64_t threads, int64_t attn_split_min, std::vector<at::Tensor> lora_ab,
                          at::Tensor lora_rows, std::vector<at::Tensor> lora_spans, int64_t lora_split_min,
                          int64_t amx_min, std::vector<at::Tensor> amx_packed,
                          int64_t cascade_min, std::vector<at::Tensor> kvq, at::Tensor kvq_pool_loc, int64_t kvq_bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "decode_forward: x must be contiguous float32 [M <= ", kMaxRows, ", H]");
  const int64_t M = x.size(0), H = x.size(1), L = (int64_t)kbufs.size();
  TORCH_CHECK((int64_t)lin.size() == 12 * L && (int64_t)bits.size() == 4 * L && (int64_t)vbufs.size() == L
              && (amx_packed.empty() || (int64_t)amx_packed.size() == 4 * L)
              && norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.numel() == L * 2 * H,
              "decode_forward: per-layer inputs disagree with the layer count");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous()
              && cos.numel() == M * (D / 2) && sin.numel() == M * (D / 2) && D % 2 == 0, "decode_forward: cos/sin must be float32 [M, D/2]");
  TORCH_CHECK(out_loc.scalar_type() == at::kLong && out_loc.is_contiguous() && out_loc.numel() == M,
              "decode_forward: out_cache_loc must be int64 [M]");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.is_contiguous() && lens.numel() == M && rows.numel() == M,
              "decode_forward: seq_lens and req_pool_indices must be int64 [M]");
  TORCH_CHECK(threads >= 1 && threads <= 1024, "decode_forward: threads must be in [1, 1024], got ", threads);
  static auto attn = c10::Dispatcher::singleton()
      .findSchemaOrThrow("sglite_cpu_attention::decode_attention", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, double, int64_t, double, int64_t, const c10::optional<at::Tensor>&)>();
  const sglite_kv_quant_decode::Pool pool(kvq, kvq_pool_loc, rows, lens, kvq_bits, L, M, cascade_min);
  const PoolPar par{(int)threads};
  const sglite_lora_fused::Step lora(std::move(lora_ab), std::move(lora_rows), std::move(lora_spans), L, M,
                                         lora_split_min);
  const int64_t Nqkv = (Hq + 2 * Hkv) * D;
  // a plain copy: x.clone() is torch's copy kernel, which at >= 32k values forks its OpenMP team; on
  // a machine whose cores this pool's threads hold, that fork waited ~1 ms a step for a core
  at::Tensor out = at::empty_like(x);
  std::memcpy(out.data_ptr<float>(), x.data_ptr<float>(), sizeof(float) * x.numel());
  float* xr = out.data_ptr<float>();
  std::vector<float> h(M * H), qkv, att(M * Hq * D), tmp(M * H), gu, act;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float* np_ = norms.data_ptr<float>();
  const int64_t* loc = out_loc.data_ptr<int64_t>();
  at::Tensor q_t = at::empty({M, Hq, D}, x.options());
  const c10::optional<at::Tensor> groups = step_groups(req_to_token, rows, lens, cascade_min);
  auto add_norm = [&](const float* t, const float* w, float* y) { add_norm_rows(par, M, H, xr, t, w, (float)eps, y); };
  for (int64_t l = 0; l < L; ++l) {
    QW wqkv = weight(lin, 12 * l, bits[4 * l], tiled), wo = weight(lin, 12 * l + 3, bits[4 * l + 1], tiled);
    QW wgu = weight(lin, 12 * l + 6, bits[4 * l + 2], tiled), wd = weight(lin, 12 * l + 9, bits[4 * l + 3], tiled);
    TORCH_CHECK(wqkv.K == H && wqkv.N == Nqkv && wo.K == Hq * D && wo.N == H && wgu.K == H && wd.N == H
                && wd.K * 2 == wgu.N, "decode_forward: layer ", l, " weight shapes disagree with the model");
    QW* ws[4] = {&wqkv, &wo, &wgu, &wd};
    for (int k = 0; k < 4; ++k) attach_packed(*ws[k], amx_packed, 4 * l + k);
    const int64_t I = wd.K;
    // (the previous layer's down output added to the residual first) the input norm
    add_norm(l == 0 ? nullptr : tmp.data(), np_ + (2 * l) * H, h.data());
    qkv.resize(M * Nqkv);
    gemv(wqkv, h.data(), M, qkv.data(), q8, par, amx_min);
    lora.apply(l, 0, h.data(), H, qkv.data(), Nqkv, par);
    at::Tensor& kb = kbufs[l];
    at::Tensor& vb = vbufs[l];
    check_pool(kb, vb, Hkv, D, "decode_forward", l, pool.fp8);
    const float* f8s[2];
    const float* const* f8 = pool.scales(l, Hkv, f8s);  // fp8 pools: the layer's key / value scales
    row_shares(par, M, [&](int64_t lo, int64_t hi) {
      rope_store_rows(kb, vb, loc, qkv.data(), lo, hi, Hq, Hkv, D, Nqkv, cp, sp, q_t.data_ptr<float>(), f8);
    });
    if (pool.step) pool.step->attend(l, q_t, req_to_token, sm_scale, att.data());
    else attention(attn, q_t, kb, vb, req_to_token, rows, lens, sm_scale, M, Hq, Hkv, D, (int)threads, attn_split_min,
                   att.data(), 0, 0.0, groups);
    pool.scale_output(f8, att.data(), M, Hq, Hkv, D);
    gemv(wo, att.data(), M, tmp.data(), q8, par, amx_min);
    lora.apply(l, 1, att.data(), Hq * D, tmp.data(), H, par);
    add_norm(tmp.data(), np_ + (2 * l + 1) * H, h.data());
    gu.resize(M * 2 * I);
    act.resize(M * I);
    gemv(wgu, h.data(), M, gu.data(), q8, par, amx_min);
    lora.apply(l, 2, h.data(), H, gu.data(), 2 * I, par);
    row_shares(par, M, [&](int64_t lo, int64_t hi) {
      for (int64_t m = lo; m < hi; ++m) silu_mul(gu.data() + m * 2 * I, gu.data() + m * 2 * I + I, I, act.data() + m * I);
    });
    gemv(wd, act.data(), M, tmp.data(), q8, par, amx_min);
    lora.apply(l, 3, act.data(), I, tmp.data(), H, par);
  }
  TORCH_CHECK(final_norm.scalar_type() == at::kFloat && final_norm.numel() == H, "decode_forward: final_norm must be float32 [H]");
  at::Tensor y = at::empty({M, H}, x.options());
  add_norm(L > 0 ? tmp.data() : nullptr, final_norm.data_ptr<float>(), y.data_ptr<float>());
  return y;
}

// LM head of the fused decode on the same pool: y [M, N] float32 = h @ W_stored.T for h [M, K] float32
// (1 <= M <= kMaxRows) and a group-32 weight (codes, scales, mins (empty: none), float32 or float16
// scales, tiled: 16-row tiles). Below amx_min rows (or amx_min 0) the arithmetic of quant_gemv_q8
// (quant_cpu.gemv_q8: h rounded to int8 per 32-block); from amx_min rows the AMX tile GEMM (h rounded
// to bf16), reading amx_packed (quant_amx_pack's tensor; empty: dequantize per call).
at::Tensor head_q8(at::Tensor x, at::Tensor q, at::Tensor s, at::Tensor mn, int64_t bits, bool tiled, int64_t threads,
                   int64_t amx_min, at::Tensor amx_packed) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "head_q8: x must be contiguous float32 [M <= ", kMaxRows, ", K]");
  TORCH_CHECK(threads >= 1 && threads <= 1024, "head_q8: threads must be in [1, 1024], got ", threads);
  TORCH_CHECK(q.dim() == 2 && q.size(1) * 8 == x.size(1) * bits, "head_q8: codes must be [N, K * bits / 8]");
  const std::vector<at::Tensor> t{q, s, mn};
  QW w = weight(t, 0, bits, tiled);
  TORCH_CHECK(!tiled || w.N % TILE == 0, "head_q8: a 16-row tiled weight needs N % 16 == 0");
  attach_packed(w, {amx_packed}, 0);
  at::Tensor y = at::empty({x.size(0), w.N}, x.options());
  gemv(w, x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), true, PoolPar{(int)threads}, amx_min);
  return y;
}

// The thread-count probe (sglite/kernels/decode_threads.py): seconds of the best of `reps` passes
// over every layer GEMV of decode_forward (lin / bits / q8 / tiled as there) and the LM head
// (head: codes, scales, mins of a group-32 weight read by head_q8; an empty list: none) at one
// activation row on `threads` threads; the activations are fixed non-zero values.
double probe_gemvs(std::vector<at::Tensor> lin, std::vector<int64_t> bits, bool q8, bool tiled, std::vector<at::Tensor> head,
                   bool head_tiled, int64_t head_bits, int64_t threads, int64_t reps) {
  TORCH_CHECK(threads >= 1 && threads <= 1024 && reps >= 1, "probe_gemvs: threads in [1, 1024] and reps >= 1");
  TORCH_CHECK(lin.size() == 3 * bits.size() && (head.empty() || head.size() == 3), "probe_gemvs: 3 tensors per weight");
  std::vector<QW> ws;
  for (size_t i = 0; i < bits.size(); ++i) ws.push_back(weight(lin, 3 * i, bits[i], tiled));
  const bool with_head = !head.empty();
  if (with_head) ws.push_back(weight(head, 0, head_bits, head_tiled));
  int64_t K = 1, N = 1;
  for (const QW& w : ws) { K = std::max(K, w.K); N = std::max(N, w.N); }
  std::vector<float> x(K), y(N);
  for (int64_t i = 0; i < K; ++i) x[i] = std::sin(0.37f * (float)i) + 0.01f;
  const PoolPar par{(int)threads};
  double best = 1e30;
  for (int64_t r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < ws.size(); ++i) {
      if (with_head && i + 1 == ws.size()) gemv_q8(ws[i], x.data(), 1, y.data(), false, par);
      else gemv(ws[i], x.data(), 1, y.data(), q8, par);
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// The families' fused decode layer (Gemma 2/3, OLMo 2, Granite): decode_family_forward.
#include "decode_family.h"
