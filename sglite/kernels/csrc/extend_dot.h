// The extend attention's per-task path on the bf16 dot-product tiles (dot_tiles.h) for CPUs with
// AVX512-BF16 and no AMX tiles (e.g. AMD Zen 4), bf16 pools and even head dims; spliced into
// cpu_extend_attention.cpp inside its anonymous namespace after extend_flash.h (contract:
// sglite/kernels/cpu_attention.py, extend_attention). The same tasks, key tiles (KT keys anchored
// at key 0) and online softmax as run_task, both products on the dot tiles. The queries stay exact
// (bf16 as stored; float32 queries are rounded to bf16 once) and the scale multiplies the float32
// scores; the weights P are rounded to bf16 (float32 sums), as on the AMX
// tiles. A row's result depends only on its own query, position and keys.
#pragma once

#include "dot_tiles.h"
#ifdef SGL_DOT_TILES
#define SGL_EXT_DOT 1

constexpr int kMaxRowsDot = 128;  // query rows of a dot-path task: tokens x the G heads of a group
static_assert(kDotKT == KT, "the dot tiles anchor at the float32 tiles' key tiles");

// run_task on the dot tiles (bf16 pool, even D): the same rows, tiles, masks and output rounding.
bool run_task_dot(const Ext<uint16_t>& j, const Task& tk, DotWork& w) {
  const int G = j.G, D = j.D, Dp = j.Dp, P2 = D / 2;
  const int R = (int)(tk.i1 - tk.i0) * G, Rp = (R + 15) & ~15;
  const int64_t pre = j.pre[tk.b], q0 = j.start[tk.b];
  for (int r = 0; r < Rp; ++r) {
    const int64_t i = r < R ? tk.i0 + r / G : tk.i1 - 1;  // padding rows: the last position, zero queries
    w.qpos[r] = (int32_t)(pre + i);
    w.m[r] = -INFINITY; w.l[r] = 0.f;
    const int64_t off = (q0 + i) * j.qs0 + (int64_t)(tk.h * G + r % G) * j.qs1;
    for (int p = 0; p < P2; ++p)
      w.qp[(size_t)p * Rp + r] = r < R ? query_pair(j.q, j.q_bf16, off + 2 * p) : 0u;
  }
  std::fill(w.acc.begin(), w.acc.begin() + (size_t)Rp * Dp, 0.f);
  const int64_t first_q = pre + tk.i0, last_q = pre + tk.i1 - 1, wnd = j.window;
  const int64_t kfirst = wnd > 0 ? std::max<int64_t>(0, first_q - wnd + 1) / KT * KT : 0;
  if (!walk_dot(j.k + tk.h * j.ks1, j.ks0, j.v + tk.h * j.vs1, j.vs0, j.rt + j.rows[tk.b] * j.rts0, j.S, D, Dp, R, Rp,
                kfirst, tk.kend, first_q, last_q, wnd, j.scale, j.softcap, w))
    return false;
  write_rows(j, tk, R, w.acc.data(), Dp, w.l.data());
  return true;
}
#endif
