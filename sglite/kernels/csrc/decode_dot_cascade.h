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
  struct Task { int64_t cost; int32_t g, h, r0, r1; };  // g >= 0: rows [r0, r1) of group g; g < 0: batch row r0
  std::vector<Task> tasks;
  std::vector<char> grouped(B, 0);
  const int threads = at::get_num_threads();
  auto chunk_tasks = [&](int p) {
    int64_t c = 0;
    for (const Group& gr : groups) c += ((int64_t)gr.rows.size() + p - 1) / p;
    return c * Hkv;
  };
  int per = std::max(1, kCascadeRowsDot / G);  // halved while threads would idle and a chunk keeps >= 16 rows
  while (chunk_tasks(per) < threads && (per / 2) * G >= 16) per /= 2;
  for (int g = 0; g < (int)groups.size(); ++g) {
    const Group& gr = groups[g];
    const int k = (int)gr.rows.size();
    for (int64_t b : gr.rows) grouped[b] = 1;
    for (int r0 = 0; r0 < k; r0 += per) {
      const int r1 = std::min(k, r0 + per);
      int64_t own = 0;
      for (int r = r0; r < r1; ++r) own += j.lens[gr.rows[r]] - gr.P;
      for (int h = 0; h < Hkv; ++h) tasks.push_back(Task{gr.P * (r1 - r0) + 2 * own + 16 * (r1 - r0), g, h, r0, r1});
    }
  }
  for (int64_t b = 0; b < B; ++b)
    if (!grouped[b])
      for (int h = 0; h < Hkv; ++h) tasks.push_back(Task{2 * j.lens[b] + 16, -1, h, (int32_t)b, (int32_t)b + 1});
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
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
      const Task& t = tasks[i];
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
