// Cascade (shared-prefix) decode attention off the AMX tiles, on the bf16 dot-product tiles
// (dot_tiles.h: CPUs with AVX512-BF16, e.g. AMD Zen 4); spliced into cpu_attention.cpp inside its
// anonymous namespace after decode_cascade.h (contract: sglite/kernels/cpu_attention.py,
// decode_attention's cascade_min). As run_cascade, a decode batch whose rows continue one
// radix-cache prefix attends it once per group (Hydragen, Juravsky et al. 2024, sec. 3): a task is
// a chunk of a group (one KV head, its rows x the G heads as one block of query rows, which meets
// each shared key on one broadcast instead of once per row) or one (row, KV head) outside every
// group; each grouped row then attends its own keys [P, len) with `attend`, merged with the
// chunk's unnormalised outputs, maxima and sums through a Prefix.
#pragma once

#ifdef SGL_DOT_TILES
constexpr int kCascadeRowsDot = 128;  // query rows of a chunk: its rows x the G heads of a group

void run_cascade_dot(const Job<uint16_t>& j, int64_t B, int Hkv, int64_t max_len, const std::vector<Group>& groups) {
  const int G = j.G, D = j.D, Dw = D <= 64 ? 64 : (D <= 128 ? 128 : 256);  // dot tiles' padded head dim
  // own keys (per row, AVX-512) weigh 2 shared keys on the dot tiles
  const CascadePlan plan = plan_cascade(j.lens, B, Hkv, G, groups, kCascadeRowsDot, 2);
  const std::vector<CascadeTask>& tasks = plan.tasks;
  const int threads = at::get_num_threads(), per = plan.per;
  const Tiled<uint16_t> tiled = pick_tiled<uint16_t>(j.Dp, G);
  std::atomic<bool> bad{false};
  std::atomic<int64_t> next{0};
  const int64_t n = (int64_t)tasks.size();
  const int workers = (int)std::max<int64_t>(1, std::min<int64_t>(threads, n));
  const int Rp_max = (per * G + 15) & ~15;
  auto body = [&](int64_t) {
    std::unique_ptr<DotWork> w;  // made on the first chunk this thread claims
    std::vector<float> qf((size_t)G * j.Dp), sc((size_t)G * max_len + 1), acc((size_t)G * j.Dp + 2 * G);
    for (int64_t i; !bad.load(std::memory_order_relaxed) && (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      const CascadeTask& t = tasks[i];
      if (t.g < 0) {
        if (!attend(j, tiled, t.r0, t.h, qf.data(), sc.data(), acc.data())) bad = true;
        continue;
      }
      if (!w) w = std::make_unique<DotWork>(Dw, Rp_max);
      const Group& gr = groups[t.g];
      const int R = (t.r1 - t.r0) * G, Rp = (R + 15) & ~15;
      for (int r = 0; r < Rp; ++r) {  // every shared key is visible to every row: no mask
        w->qpos[r] = INT32_MAX;
        w->m[r] = -INFINITY; w->l[r] = 0.f;
        const int64_t off = r < R ? gr.rows[t.r0 + r / G] * j.qs0 + (int64_t)(t.h * G + r % G) * j.qs1 : 0;
        for (int p = 0; p < D / 2; ++p) w->qp[(size_t)p * Rp + r] = r < R ? query_pair(j.q, j.q_bf16, off + 2 * p) : 0u;
      }
      std::fill(w->acc.begin(), w->acc.begin() + (size_t)Rp * Dw, 0.f);
      if (!walk_dot(j.k + t.h * j.ks1, j.ks0, j.v + t.h * j.vs1, j.vs0, j.rt + j.rows[gr.rows[0]] * j.rts0, j.S, D, Dw, R,
                    Rp, 0, gr.P, gr.P, gr.P, 0, j.scale, j.softcap, *w)) {
        bad = true;
        break;
      }
      for (int i2 = t.r0; i2 < t.r1; ++i2) {  // each row's own keys, merged with its chunk rows
        const int r = (i2 - t.r0) * G;
        const Prefix pre{w->acc.data() + (size_t)r * Dw, Dw, w->m.data() + r, w->l.data() + r};
        if (!attend(j, tiled, gr.rows[i2], t.h, qf.data(), sc.data(), acc.data(), gr.P, &pre)) bad = true;
      }
    }
  };
  sglite_pool::Pool::get().run(workers, workers, body);
  TORCH_CHECK_INDEX(!bad, "decode_attention: req_to_token holds a slot outside the pool [0, ", j.S, ")");
}
#endif
