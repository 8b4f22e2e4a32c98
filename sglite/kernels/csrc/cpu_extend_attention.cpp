// Paged extend (prefill) attention on CPU, flash-style (contract: sglite/kernels/cpu_attention.py,
// extend_attention). One task = (request, KV head, block of new tokens); its rows are the block's
// tokens x the G query heads of the group. The task walks the request's keys 0 .. last visible in
// tiles of KT slots read in place from the pool through req_to_token (no gather of the context),
// and keeps a running max, sum and output per row (online softmax: Milakov & Gimelshein 2018;
// the tiled form of Dao et al. 2022, "FlashAttention", Alg. 1). On the AMX tiles a request of 2-16
// blocks of new tokens (a short extend over a long cached prefix) runs as fused tasks instead:
// (request, KV head, up to 16 blocks), each key block packed once and used by all its blocks' rows.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include "thread_pool.h"
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#include "scalar_math.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include "avx512_math.h"
#define SGL_AVX512 1
#endif
#include "amx_attention.h"

namespace {

constexpr int kMaxD = 256, KT = 64, kMaxRows = 64;
constexpr int kFuseMax = 16;  // query blocks of one fused AMX task at most (run_fused_amx)

using sglite_scalar::widen;

// A task: new tokens [i0, i1) of request b against KV head h (keys up to kend). On the AMX path a
// task may hold several query blocks of qb tokens (a fused task, run_fused_amx); otherwise i1 - i0 <= qb.
struct Task { int64_t b; int h; int64_t i0, i1, kend; };

// Everything a task reads; strides in elements.
template <typename T> struct Ext {
  const T *k, *v; int64_t ks0, ks1, vs0, vs1, S;
  const void* q; bool q_bf16; int64_t qs0, qs1;
  void* out; bool out_bf16; int Hq;
  const int32_t* rt; int64_t rts0; const int64_t *rows, *pre, *start;
  int G, D, Dp; float scale;
  int64_t window; float softcap;  // window > 0: keys (pos - window, pos] only; softcap > 0: cap * tanh(s / cap)
};

#include "extend_flash.h"

// The task's R rows out: acc row r (ld floats apart) / l[r], rounded once to the output dtype.
template <typename T>
void write_rows(const Ext<T>& j, const Task& tk, int R, const float* acc, int64_t ld, const float* l) {
  const int G = j.G, D = j.D;
  const int64_t q0 = j.start[tk.b];
  for (int r = 0; r < R; ++r) {
    const int64_t off = ((q0 + tk.i0 + r / G) * j.Hq + tk.h * G + r % G) * D;
    const float inv = 1.f / l[r];
    const float* a = acc + (size_t)r * ld;
    if (j.out_bf16) {
      c10::BFloat16* o = (c10::BFloat16*)j.out + off;
      for (int d = 0; d < D; ++d) o[d] = c10::BFloat16(a[d] * inv);
    } else {
      float* o = (float*)j.out + off;
      for (int d = 0; d < D; ++d) o[d] = a[d] * inv;
    }
  }
}

template <typename T>
bool run_task(const Ext<T>& j, const Task& tk, Scratch& w) {
  const int G = j.G, D = j.D, Dp = j.Dp;
  const int R = (int)(tk.i1 - tk.i0) * G, Rp = (R + 15) & ~15;
  const int64_t pre = j.pre[tk.b], q0 = j.start[tk.b];
  const int32_t* slots = j.rt + j.rows[tk.b] * j.rts0;
  std::fill(w.qt.begin(), w.qt.begin() + (size_t)Dp * Rp, 0.f);
  for (int r = 0; r < Rp; ++r) {
    const int64_t i = r < R ? tk.i0 + r / G : tk.i1 - 1;  // padding rows copy the last position
    w.qpos[r] = (int32_t)(pre + i);
    w.m[r] = -INFINITY; w.l[r] = 0.f;
    if (r >= R) continue;
    const int64_t off = (q0 + i) * j.qs0 + (int64_t)(tk.h * G + r % G) * j.qs1;
    for (int d = 0; d < D; ++d) {
      const float x = j.q_bf16 ? widen(((const uint16_t*)j.q)[off + d]) : ((const float*)j.q)[off + d];
      w.qt[(size_t)d * Rp + r] = x * j.scale;
    }
  }
  std::fill(w.acc.begin(), w.acc.begin() + (size_t)Rp * Dp, 0.f);
  const int64_t first_q = pre + tk.i0;  // every row sees keys 0 .. first_q
  // sliding window: rows see keys (pos - window, pos]; tiles stay anchored at key 0 (a tile fully
  // outside a row's window changes nothing of it), starting at the tile of the first row's first key
  const int64_t last_q = pre + tk.i1 - 1, wnd = j.window;
  const int64_t kfirst = wnd > 0 ? std::max<int64_t>(0, first_q - wnd + 1) / KT * KT : 0;
  for (int64_t t0 = kfirst; t0 < tk.kend; t0 += KT) {
    const int kn = (int)std::min<int64_t>(KT, tk.kend - t0);
    if (!load_tile(j.k + tk.h * j.ks1, j.ks0, slots + t0, j.S, kn, D, Dp, w.kf.data())) return false;
    if (!load_tile(j.v + tk.h * j.vs1, j.vs0, slots + t0, j.S, kn, D, Dp, w.vf.data())) return false;
    scores(w.kf.data(), Dp, w.qt.data(), Rp, kn, D, w.s.data());
    if (j.softcap > 0.f) {  // logit soft-capping on the scaled scores (Gemma 2)
      const float cap = j.softcap, inv_cap = 1.f / j.softcap;
      float* s = w.s.data();
      for (size_t i = 0; i < (size_t)kn * Rp; ++i) s[i] = cap * std::tanh(s[i] * inv_cap);
    }
    const bool full = t0 + kn - 1 <= first_q && (wnd <= 0 || t0 > last_q - wnd);
    softmax_tile(w.s.data(), Rp, kn, t0, full, wnd, w);
    pv(w.s.data(), Rp, R, w.vf.data(), Dp, kn, w.alpha.data(), w.acc.data());
  }
  write_rows(j, tk, R, w.acc.data(), Dp, w.l.data());
  return true;
}

#include "extend_dot.h"

// True when this build has the bf16 dot-product path (AVX512-BF16).
bool dot_built() {
#ifdef SGL_EXT_DOT
  return true;
#else
  return false;
#endif
}

#ifdef SGL_AMX_ATTN
// One call's packed keys (amx_attention.h's pack_to layout): for each request that more than one
// task per KV head reads (extend > 64 / G tokens), its keys [kbase, pre + extend) per KV head in
// blocks of KB anchored at kbase (the first task's first block: key 0, or the window's first
// block), packed once (in parallel over blocks) instead of once per task. A task then reads the
// same tiles it would have packed itself, plus, in its last block, finite keys past its own last
// one where it would have had zeros: their weights are exactly zero, so no bit of a result moves.
struct PackPlan {
  std::vector<int64_t> kbase, blk0, nblk;  // per request: first packed key, first block in buf, blocks per head (0: none)
  std::vector<int64_t> jobs;               // (request, head, block) as (b * Hkv + h) * nblk_max + i
  int64_t nblk_max = 0;
  uint16_t* buf = nullptr;
  size_t be = 0;  // bf16 elements per block
  PackPlan() = default;
  PackPlan(const PackPlan&) = delete;
  PackPlan& operator=(const PackPlan&) = delete;
  ~PackPlan() { std::free(buf); }
};

constexpr size_t kPackCapBytes = (size_t)256 << 20;  // one call's packed keys at most; requests past it pack per task

void plan_pack(const Ext<uint16_t>& j, int64_t B, const int64_t* ext, const std::vector<char>& fused, int64_t qb, int Hkv,
               PackPlan& p) {
  namespace A = sglite_amx_attn;
  const int Dp = (j.D + 31) & ~31;
  p.be = A::packed_block_elems(Dp);
  p.kbase.assign(B, 0); p.blk0.assign(B, 0); p.nblk.assign(B, 0);
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (ext[b] <= qb || fused[b]) continue;  // one task per head, or fused tasks that pack for themselves
    const int64_t pre = j.pre[b], kb = j.window > 0 ? std::max<int64_t>(0, pre - j.window + 1) / A::KB * A::KB : 0;
    const int64_t nb = (pre + ext[b] - kb + A::KB - 1) / A::KB;
    if ((size_t)(total + nb * Hkv) * p.be * 2 > kPackCapBytes) continue;
    p.kbase[b] = kb; p.blk0[b] = total; p.nblk[b] = nb;
    total += nb * Hkv;
    p.nblk_max = std::max(p.nblk_max, nb);
  }
  if (total == 0) return;
  p.buf = A::aligned<uint16_t>((size_t)total * p.be);
  for (int64_t b = 0; b < B; ++b)
    for (int h = 0; h < Hkv; ++h)
      for (int64_t i = 0; i < p.nblk[b]; ++i) p.jobs.push_back((b * Hkv + h) * p.nblk_max + i);
}

// Pack job `job` of the plan (a KB-key block of one request's head); false on a bad slot.
bool pack_job(const Ext<uint16_t>& j, const PackPlan& p, int Hkv, int64_t job) {
  namespace A = sglite_amx_attn;
  const int64_t i = job % p.nblk_max, bh = job / p.nblk_max, b = bh / Hkv;
  const int h = (int)(bh % Hkv), Dp = (j.D + 31) & ~31;
  const int64_t t0 = p.kbase[b] + i * A::KB, kend = j.pre[b] + (j.start[b + 1] - j.start[b]);
  uint16_t* kt = p.buf + (size_t)(p.blk0[b] + h * p.nblk[b] + i) * p.be;
  return A::pack_to(j.k + h * j.ks1, j.ks0, j.v + h * j.vs1, j.vs0, j.rt + j.rows[b] * j.rts0 + t0,
                    (int)std::min<int64_t>(A::KB, kend - t0), j.S, j.D, Dp, kt, kt + (size_t)A::KB * Dp);
}

// The task on the AMX tiles (bf16 pools): the same rows, keys and block anchoring (key 0, or the
// window's first block), in blocks of up to KB keys (amx_attention.h), packed by the task itself
// or read from the plan's buffer.
bool run_task_amx(const Ext<uint16_t>& j, const Task& tk, const PackPlan& p, sglite_amx_attn::Work& w) {
  namespace A = sglite_amx_attn;
  const int G = j.G, D = j.D, Dp = (D + 31) & ~31;
  const int R = (int)(tk.i1 - tk.i0) * G;
  const int64_t pre = j.pre[tk.b], q0 = j.start[tk.b];
  A::begin(w, R, Dp);
  for (int r = 0; r < R; ++r) {
    const int64_t i = tk.i0 + r / G;
    w.qpos[r] = (int32_t)(pre + i);
    const int64_t off = (q0 + i) * j.qs0 + (int64_t)(tk.h * G + r % G) * j.qs1;
    if (j.q_bf16) A::set_query(w, r, (const uint16_t*)j.q + off, D, j.scale);
    else A::set_query(w, r, (const float*)j.q + off, D, j.scale);
  }
  const int64_t first_q = pre + tk.i0, last_q = pre + tk.i1 - 1, wnd = j.window;
  const int64_t kfirst = wnd > 0 ? std::max<int64_t>(0, first_q - wnd + 1) / A::KB * A::KB : 0;
  if (!p.nblk.empty() && p.nblk[tk.b] > 0)
    A::walk_packed(w, R, Dp, p.buf + (size_t)(p.blk0[tk.b] + tk.h * p.nblk[tk.b]) * p.be, p.kbase[tk.b], kfirst, tk.kend,
                   first_q, last_q, wnd, j.softcap);
  else if (!A::walk(w, R, D, Dp, j.k + tk.h * j.ks1, j.ks0, j.v + tk.h * j.vs1, j.vs0, j.rt + j.rows[tk.b] * j.rts0, j.S,
                    kfirst, tk.kend, first_q, last_q, wnd, j.softcap))
    return false;
  write_rows(j, tk, R, w.acc, A::kAld, w.l);
  return true;
}

// A fused task (a request with a few query blocks: a short extend over a long cached prefix, e.g.
// an agent's late turn): its ng <= kFuseMax blocks of qb tokens walk the keys together, each KB-key
// block packed once into this thread's scratch (w[0]'s kt / vp, L2-resident) and then multiplied
// by every row block that sees it, instead of packed into a call-wide buffer that each block's own
// task re-reads from memory. Every row block gets the block calls of its own task (the same t0, n,
// `full` and anchoring; its last block may hold finite keys past its own last one where run_task_amx's
// packing had zeros or the plan's other keys: zero weights), so every bit is run_task_amx's.
bool run_fused_amx(const Ext<uint16_t>& j, const Task& tk, int64_t qb, std::vector<std::unique_ptr<sglite_amx_attn::Work>>& w) {
  namespace A = sglite_amx_attn;
  const int G = j.G, D = j.D, Dp = (D + 31) & ~31;
  const int ng = (int)((tk.i1 - tk.i0 + qb - 1) / qb);
  const int64_t pre = j.pre[tk.b], q0 = j.start[tk.b], wnd = j.window;
  while ((int)w.size() < ng + 1) w.push_back(std::make_unique<A::Work>(*w[0]));
  Task sub[kFuseMax];
  int R[kFuseMax];
  int64_t kfirst[kFuseMax];
  for (int g = 0; g < ng; ++g) {
    const int64_t i0 = tk.i0 + g * qb, i1 = std::min(tk.i1, i0 + qb);
    sub[g] = Task{tk.b, tk.h, i0, i1, pre + i1};
    R[g] = (int)(i1 - i0) * G;
    A::Work& wg = *w[g + 1];
    A::begin(wg, R[g], Dp);
    for (int r = 0; r < R[g]; ++r) {
      const int64_t i = i0 + r / G;
      wg.qpos[r] = (int32_t)(pre + i);
      const int64_t off = (q0 + i) * j.qs0 + (int64_t)(tk.h * G + r % G) * j.qs1;
      if (j.q_bf16) A::set_query(wg, r, (const uint16_t*)j.q + off, D, j.scale);
      else A::set_query(wg, r, (const float*)j.q + off, D, j.scale);
    }
    kfirst[g] = wnd > 0 ? std::max<int64_t>(0, pre + i0 - wnd + 1) / A::KB * A::KB : 0;
  }
  const uint16_t *kh = j.k + tk.h * j.ks1, *vh = j.v + tk.h * j.vs1;
  const int32_t* slots = j.rt + j.rows[tk.b] * j.rts0;
  A::RowPrefetch pf = A::RowPrefetch::head(kh, j.ks0, vh, j.vs0, j.S, D);
  for (int64_t t0 = kfirst[0]; t0 < tk.kend; t0 += A::KB) {  // kfirst[g] grows with g
    if (!A::pack_block(kh, j.ks0, vh, j.vs0, slots + t0, (int)std::min<int64_t>(A::KB, tk.kend - t0), j.S, D, Dp, *w[0]))
      return false;
    // the next block's K and V rows into L2 while this one's products run (a late turn's cached
    // keys come from DRAM: the 30 layers' pools do not stay in cache between steps)
    pf.slots = slots + t0 + A::KB;
    pf.n = (int)std::max<int64_t>(0, std::min<int64_t>(A::KB, tk.kend - t0 - A::KB));
    pf.next = 0;
    pf.per = std::max(1, (pf.n + 8 * ng - 1) / (8 * ng));  // done within the first ~half of the block calls
    for (int g = 0; g < ng; ++g) {
      if (t0 < kfirst[g] || t0 >= sub[g].kend) continue;
      const int n = (int)std::min<int64_t>(A::KB, sub[g].kend - t0);
      const bool full = A::block_full(t0, n, pre + sub[g].i0, pre + sub[g].i1 - 1, wnd);
      A::block(*w[g + 1], w[0]->kt, w[0]->vp, R[g], Dp, n, t0, full, wnd, j.softcap, &pf);
    }
  }
  for (int g = 0; g < ng; ++g) write_rows(j, sub[g], R[g], w[g + 1]->acc, A::kAld, w[g + 1]->l);
  return true;
}
#else
struct PackPlan {};
#endif

// amx: 0 the AVX-512 path; 1 the AMX tiles with each request's keys packed once per call
// (plan_pack) or once per fused task (run_fused_amx); 2 the AMX tiles, every task packing its own keys.
// dot (amx 0, bf16 pools): the bf16 dot-product tiles (extend_dot.h) instead of the float32 ones.
template <typename T>
void run(const Ext<T>& j, const std::vector<Task>& tasks, int Rp_max, int amx, bool dot, int64_t B, const int64_t* ext,
         const std::vector<char>& fused, int64_t qb, int Hkv) {
  std::atomic<bool> bad{false};
  std::atomic<int64_t> next{0};
  const int64_t n = (int64_t)tasks.size();
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
#ifdef SGL_AMX_ATTN
  PackPlan plan;
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (amx == 1) plan_pack(j, B, ext, fused, qb, Hkv, plan);
    const int64_t nj = (int64_t)plan.jobs.size();
    if (nj > 0) {
      std::atomic<int64_t> nextj{0};
      sglite_pool::parallel_for(0, std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nj)), 1, [&](int64_t, int64_t) {
        for (int64_t i; !bad.load(std::memory_order_relaxed) && (i = nextj.fetch_add(1)) < nj;)
          if (!pack_job(j, plan, Hkv, plan.jobs[i])) bad = true;
      });
      TORCH_CHECK_INDEX(!bad, "extend_attention: req_to_token holds a slot outside the pool [0, ", j.S, ")");
    }
  }
#else
  (void)B; (void)ext; (void)fused; (void)qb; (void)Hkv;
#endif
  // Workers pull tasks (longest first) from a shared counter: balanced whatever the lengths; each
  // row's arithmetic is fixed by its own task, so the split never changes a result.
  sglite_pool::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
#ifdef SGL_AMX_ATTN
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (amx) {
        std::vector<std::unique_ptr<sglite_amx_attn::Work>> w;  // [0]: the block scratch; [1..]: a fused task's row blocks
        w.push_back(std::make_unique<sglite_amx_attn::Work>());
        sglite_tiles::configure();
        for (int64_t i; !bad.load(std::memory_order_relaxed) && (i = next.fetch_add(1)) < n;) {
          const Task& tk = tasks[i];
          if (tk.i1 - tk.i0 > qb ? !run_fused_amx(j, tk, qb, w) : !run_task_amx(j, tk, plan, *w[0])) bad = true;
        }
        _tile_release();
        return;
      }
    }
#endif
#ifdef SGL_EXT_DOT
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (dot) {
        DotWork w(j.Dp, Rp_max);
        for (int64_t i; !bad.load(std::memory_order_relaxed) && (i = next.fetch_add(1)) < n;)
          if (!run_task_dot(j, tasks[i], w)) bad = true;
        return;
      }
    }
#endif
    Scratch w(j.Dp, Rp_max);
    for (int64_t i; !bad.load(std::memory_order_relaxed) && (i = next.fetch_add(1)) < n;)
      if (!run_task(j, tasks[i], w)) bad = true;
  });
  TORCH_CHECK_INDEX(!bad, "extend_attention: req_to_token holds a slot outside the pool [0, ", j.S, ")");
}

// Most query rows of an AMX task (a task holds at least one token's G heads).
constexpr int sglite_amx_attn_rows() {
#ifdef SGL_AMX_ATTN
  return sglite_amx_attn::kMaxRows;
#else
  return 0;
#endif
}

// True when this build has the AMX path and Linux granted the tile state.
bool amx_ready() {
#ifdef SGL_AMX_ATTN
  return sglite_tiles::granted();
#else
  return false;
#endif
}

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb, const at::Tensor& rt,
                            const at::Tensor& rows, const at::Tensor& pre, const at::Tensor& ext, double sm_scale,
                            int64_t window, double softcap, int64_t amx, bool dot) {
  TORCH_CHECK_VALUE(q.dim() == 3 && kb.dim() == 3 && vb.dim() == 3, "extend_attention: q, k_buffer, v_buffer must be 3-D");
  TORCH_CHECK_VALUE(window >= 0 && softcap >= 0, "extend_attention: window=", window, " and softcap=", softcap, " must be >= 0");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = kb.size(1), S = kb.size(0);
  TORCH_CHECK_VALUE(vb.sizes() == kb.sizes() && kb.size(2) == D, "extend_attention: k_buffer/v_buffer must be [S, Hkv, D] with q's D");
  TORCH_CHECK_VALUE(Hkv > 0 && Hq % Hkv == 0, "extend_attention: Hq=", Hq, " is not a multiple of Hkv=", Hkv);
  TORCH_CHECK_VALUE(D >= 1 && D <= kMaxD, "extend_attention: head dim D=", D, " outside [1, ", kMaxD, "]");
  TORCH_CHECK_VALUE(kb.scalar_type() == vb.scalar_type(), "extend_attention: k_buffer and v_buffer dtypes differ");
  TORCH_CHECK_VALUE(q.stride(2) == 1 && kb.stride(2) == 1 && vb.stride(2) == 1, "extend_attention: D must have unit stride");
  TORCH_CHECK_VALUE(rt.dim() == 2 && rt.scalar_type() == at::kInt && rt.stride(1) == 1, "extend_attention: req_to_token must be int32 [R, Lmax] with unit stride");
  const int64_t B = rows.numel();
  TORCH_CHECK_VALUE(rows.scalar_type() == at::kLong && pre.scalar_type() == at::kLong && ext.scalar_type() == at::kLong
                    && rows.is_contiguous() && pre.is_contiguous() && ext.is_contiguous() && pre.numel() == B && ext.numel() == B,
                    "extend_attention: req_pool_indices, prefix_lens and extend_lens must be contiguous int64 [B]");
  const bool kv_bf16 = kb.scalar_type() == at::kBFloat16, q_bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(kv_bf16 || kb.scalar_type() == at::kFloat, "extend_attention: pool dtype must be float32 or bfloat16");
  TORCH_CHECK_VALUE(q_bf16 || q.scalar_type() == at::kFloat, "extend_attention: q dtype must be float32 or bfloat16");
  TORCH_CHECK_VALUE(rt.size(1) < INT32_MAX, "extend_attention: req_to_token has too many columns");
  const int64_t *rp = rows.data_ptr<int64_t>(), *pp = pre.data_ptr<int64_t>(), *ep = ext.data_ptr<int64_t>();
  const int G = (int)(Hq / Hkv), Dp = D <= 64 ? 64 : (D <= 128 ? 128 : 256);
  const int amx_run = kv_bf16 && amx != 0 && G <= sglite_amx_attn_rows() && amx_ready() ? (amx == 2 ? 2 : 1) : 0;
  const bool dot_run = dot && kv_bf16 && amx_run == 0 && D % 2 == 0 && dot_built();
#ifdef SGL_EXT_DOT
  const int rows_max = dot_run ? kMaxRowsDot : kMaxRows;
#else
  const int rows_max = kMaxRows;
#endif
  const int64_t qb = std::max<int64_t>(1, rows_max / G);  // new tokens per task
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_INDEX(rp[b] >= 0 && rp[b] < rt.size(0), "extend_attention: req_pool_indices[", b, "]=", rp[b], " outside [0, ", rt.size(0), ")");
    TORCH_CHECK_VALUE(pp[b] >= 0 && ep[b] >= 1 && pp[b] + ep[b] <= rt.size(1), "extend_attention: prefix_lens[", b, "]=", pp[b],
                      " + extend_lens[", b, "]=", ep[b], " must satisfy prefix >= 0, extend >= 1, sum <= ", rt.size(1));
  }
  // Requests of 2 .. kFuseMax query blocks run as fused tasks (amx == 1) of qg blocks each: the
  // largest qg (a power of two) that still leaves >= 3 tasks a thread; none if even qg = 2 does not.
  std::vector<char> fused(B, 0);
  int64_t qg = 0;
  if (amx_run == 1 && amx != 3) {
    int64_t other = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t nq = (ep[b] + qb - 1) / qb;
      fused[b] = nq >= 2 && nq <= kFuseMax;
      if (!fused[b]) other += nq * Hkv;
    }
    for (int64_t g = kFuseMax; g >= 2 && qg == 0; g /= 2) {
      int64_t n = other;
      for (int64_t b = 0; b < B; ++b)
        if (fused[b]) n += ((ep[b] + qb - 1) / qb + g - 1) / g * Hkv;
      if (n >= 3 * (int64_t)at::get_num_threads()) qg = g;
    }
    if (qg == 0) std::fill(fused.begin(), fused.end(), 0);
  }
  std::vector<int64_t> start(B + 1);
  std::vector<Task> tasks;
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    start[b] = total;
    total += ep[b];
    const int64_t step = fused[b] ? qg * qb : qb;
    for (int64_t i0 = 0; i0 < ep[b]; i0 += step)
      for (int h = 0; h < Hkv; ++h) {
        const int64_t i1 = std::min(ep[b], i0 + step);
        tasks.push_back(Task{b, h, i0, i1, pp[b] + i1});
      }
  }
  start[B] = total;
  TORCH_CHECK_VALUE(total == N, "extend_attention: q has ", N, " rows but extend_lens sum to ", total);
  at::Tensor out = at::empty({N, Hq, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (tasks.empty()) return out;
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) {
    return (a.i1 - a.i0) * a.kend > (b.i1 - b.i0) * b.kend;
  });
  const int Rp_max = (int)((std::min<int64_t>(qb, N) * G + 15) & ~15);
  if (kv_bf16) {
    Ext<uint16_t> j{(const uint16_t*)kb.data_ptr(), (const uint16_t*)vb.data_ptr(), kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1), S,
                    q.data_ptr(), q_bf16, q.stride(0), q.stride(1), out.data_ptr(), q_bf16, (int)Hq, rt.data_ptr<int32_t>(), rt.stride(0),
                    rp, pp, start.data(), G, (int)D, Dp, (float)sm_scale, window, (float)softcap};
    run(j, tasks, Rp_max, amx_run, dot_run, B, ep, fused, qb, (int)Hkv);
  } else {
    Ext<float> j{kb.data_ptr<float>(), vb.data_ptr<float>(), kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1), S,
                 q.data_ptr(), q_bf16, q.stride(0), q.stride(1), out.data_ptr(), q_bf16, (int)Hq, rt.data_ptr<int32_t>(), rt.stride(0),
                 rp, pp, start.data(), G, (int)D, Dp, (float)sm_scale, window, (float)softcap};
    run(j, tasks, Rp_max, 0, false, B, ep, fused, qb, (int)Hkv);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(sglite_cpu_extend, m) {
  m.def("extend_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor prefix_lens, Tensor extend_lens, float sm_scale, int window=0, "
        "float softcap=0.0, int amx=1, bool dot=True) -> Tensor");  // amx: 0 AVX-512, 1 AMX (fused tasks, else keys
                                                   // packed once per call), 2 AMX (per task), 3 AMX (keys packed once per
                                                   // call, no fused tasks); dot: bf16 dot products off the tiles (AVX512-BF16)
  m.def("amx_ready() -> bool", &amx_ready);
  m.def("dot_built() -> bool", &dot_built);
}

TORCH_LIBRARY_IMPL(sglite_cpu_extend, CPU, m) { m.impl("extend_attention", &extend_attention); }
