// Cascade (shared-prefix) decode attention, spliced into cpu_attention.cpp inside its anonymous
// namespace after Job / Tiled / attend (contract: sglite/kernels/cpu_attention.py, decode_attention's
// cascade_min). A decode batch whose rows continue one radix-cache prefix reads that prefix's K/V
// once per group on the AMX tiles instead of once per row (Hydragen, Juravsky et al. 2024, sec. 3).
#pragma once

// Rows of the batch that share their first P keys' slots (radix-cache prefixes): groups of >= 2
// rows whose slot rows agree on [0, P), P >= min_shared, each row keeping >= 1 key of its own. In
// the rows' lexicographic order (of their slot rows up to each one's own last key) a group is a
// maximal run of neighbours whose common prefixes are all >= min_shared, its P the smallest of
// them. Found without that sort: two rows (each longer than min_shared) have a common prefix >=
// min_shared exactly when their first min_shared slots agree, so the runs are the classes of
// equal first-min_shared slots (rows bucketed by a hash of those, then compared), and the smallest
// neighbour prefix of a run is the class's common prefix: min over its rows of (len - 1) and of
// the prefix each shares with the class's first row. Groups come out in the lexicographic order
// of their first min_shared slots, rows ascending. Cost: O(B log B + sum of the rows' P) int
// compares (the sort compared P-long prefixes O(B log B) times).
struct Group { int64_t P; std::vector<int64_t> rows; };

// Common prefix of a[0 .. cap) and c[0 .. cap).
inline int64_t common_prefix(const int32_t* a, const int32_t* c, int64_t cap) {
  if (std::memcmp(a, c, sizeof(int32_t) * cap) == 0) return cap;  // the usual answer in a group: one pass
  int64_t n = 0;
  while (n + 64 <= cap && std::memcmp(a + n, c + n, 64 * sizeof(int32_t)) == 0) n += 64;
  while (n < cap && a[n] == c[n]) ++n;
  return n;
}

std::vector<Group> shared_prefix_groups(const int32_t* rt, int64_t rts0, const int64_t* rows, const int64_t* lens,
                                        int64_t B, int64_t min_shared) {
  struct Cand { uint64_t hash; int64_t b; };
  std::vector<Cand> idx;
  auto row = [&](int64_t b) { return rt + rows[b] * rts0; };
  const size_t head = sizeof(int32_t) * (size_t)min_shared;
  for (int64_t b = 0; b < B; ++b)
    if (lens[b] > min_shared) {  // a row needs min_shared shared keys + one of its own
      const int32_t* r = row(b);  // FNV-style over 64-bit words, four independent lanes
      uint64_t h[4] = {1469598103934665603ull, 7ull, 11ull, 13ull};
      int64_t t = 0;
      for (; t + 2 <= min_shared; t += 2) {
        uint64_t x;
        std::memcpy(&x, r + t, 8);
        h[(t / 2) & 3] = (h[(t / 2) & 3] ^ x) * 1099511628211ull;
      }
      if (t < min_shared) h[0] = (h[0] ^ (uint32_t)r[t]) * 1099511628211ull;
      idx.push_back(Cand{((h[0] * 31 + h[1]) * 31 + h[2]) * 31 + h[3], b});
    }
  std::sort(idx.begin(), idx.end(), [&](const Cand& x, const Cand& y) {
    if (x.hash != y.hash) return x.hash < y.hash;
    const int c = std::memcmp(row(x.b), row(y.b), head);
    return c != 0 ? c < 0 : x.b < y.b;
  });
  std::vector<Group> out;
  for (size_t i = 0; i < idx.size();) {
    size_t e = i + 1;
    while (e < idx.size() && idx[e].hash == idx[i].hash && std::memcmp(row(idx[i].b), row(idx[e].b), head) == 0) ++e;
    if (e - i >= 2) {
      Group g{INT64_MAX, {}};
      const int64_t b0 = idx[i].b;
      for (size_t k = i; k < e; ++k) {
        const int64_t b = idx[k].b;
        g.rows.push_back(b);
        g.P = std::min(g.P, lens[b] - 1);
      }
      for (size_t k = i + 1; k < e; ++k) g.P = std::min(g.P, common_prefix(row(b0), row(idx[k].b), g.P));
      out.push_back(std::move(g));  // rows ascending: the sort's tie-break
    }
    i = e;
  }
  std::sort(out.begin(), out.end(), [&](const Group& x, const Group& y) {  // the lexicographic order of the runs
    return std::lexicographical_compare(row(x.rows[0]), row(x.rows[0]) + min_shared, row(y.rows[0]), row(y.rows[0]) + min_shared);
  });
  return out;
}

// A cascade call's tasks, costliest first (longest-processing-time order, so the last tasks
// claimed are the short ones): a chunk of a group on one KV head (g >= 0: its rows [r0, r1)) or one
// (row, KV head) outside every group (g < 0: batch row r0). per (rows a chunk): max_rows / G,
// halved while there are fewer chunk tasks than threads and a chunk keeps >= 16 query rows (one
// small group on one KV head would leave threads idle; a chunk's extra K / V passes cost less than
// the idle thread). own_cost: what a row's own key costs against a shared one.
struct CascadeTask { int64_t cost; int32_t g, h, r0, r1; };
struct CascadePlan { std::vector<CascadeTask> tasks; int per; };

CascadePlan plan_cascade(const int64_t* lens, int64_t B, int Hkv, int G, const std::vector<Group>& groups, int max_rows,
                         int64_t own_cost) {
  CascadePlan p{{}, std::max(1, max_rows / G)};
  std::vector<char> grouped(B, 0);
  const int threads = at::get_num_threads();
  auto chunk_tasks = [&](int per) {
    int64_t c = 0;
    for (const Group& gr : groups) c += ((int64_t)gr.rows.size() + per - 1) / per;
    return c * Hkv;
  };
  while (chunk_tasks(p.per) < threads && (p.per / 2) * G >= 16) p.per /= 2;
  for (int g = 0; g < (int)groups.size(); ++g) {
    const Group& gr = groups[g];
    const int k = (int)gr.rows.size();
    for (int64_t b : gr.rows) grouped[b] = 1;
    for (int r0 = 0; r0 < k; r0 += p.per) {
      const int r1 = std::min(k, r0 + p.per);
      int64_t own = 0;
      for (int r = r0; r < r1; ++r) own += lens[gr.rows[r]] - gr.P;
      for (int h = 0; h < Hkv; ++h) p.tasks.push_back(CascadeTask{gr.P * (r1 - r0) + own_cost * own + 16 * (r1 - r0), g, h, r0, r1});
    }
  }
  for (int64_t b = 0; b < B; ++b)
    if (!grouped[b])
      for (int h = 0; h < Hkv; ++h) p.tasks.push_back(CascadeTask{own_cost * lens[b] + 16, -1, h, (int32_t)b, (int32_t)b + 1});
  std::stable_sort(p.tasks.begin(), p.tasks.end(), [](const CascadeTask& x, const CascadeTask& y) { return x.cost > y.cost; });
  return p;
}

#ifdef SGL_AMX_ATTN
// One grouped row's own keys slots[0 .. L) for the G heads of one KV head (kh / vh: the head's K /
// V row of slot 0), continuing the tiles' online softmax of its rows r0 .. r0 + G - 1 in w (after
// A::walk over the shared keys); the G outputs go to out (q's dtype, D values each, head stride
// D). The tiles' bf16 query (pre-scaled by scale * log2(e)) meets each K row on VDPBF16PS
// (float32 sums, 4 keys per horizontal reduction, the G heads per K row load), scores in log2
// units (soft-capped as on the tiles); per head m = max(tiles' max, own max), weights 2^(s - m)
// (exp2_deg3) summed in float32 and rounded to bf16 as on the tiles, then acc = acc_tiles
// 2^(m_tiles - m) + P V (values_bf16's key-pair VDPBF16PS) over l = l_tiles 2^(m_tiles - m) +
// sum p. sc: scratch of G * L + 1 floats. next / nL: the next row's own slots (checked), whose K
// and V rows are prefetched one key per key scored here (a row's few keys are scattered in the
// pool: without it each row would start on cache misses). False on a slot outside [0, S).
template <int NB, int G>
bool own_keys(const sglite_amx_attn::Work& w, int r0, int D, const uint16_t* kh, int64_t s0k, const uint16_t* vh,
              int64_t s0v, const int32_t* slots, int64_t L, int64_t S, float softcap, float* sc, void* out, bool out_bf16,
              const int32_t* next, int64_t nL) {
  namespace A = sglite_amx_attn;
  for (int64_t t = 0; t < L; ++t)
    if (slots[t] < 0 || slots[t] >= S) return false;
  auto prefetch_next = [&](int64_t t) {
    if (t < nL && next[t] >= 0 && next[t] < S) {
      prefetch_row(kh + next[t] * s0k, D);
      prefetch_row(vh + next[t] * s0v, D);
    }
  };
  __m512bh qv[G][NB];
  for (int g = 0; g < G; ++g)
    for (int b = 0; b < NB; ++b) qv[g][b] = (__m512bh)_mm512_loadu_si512(w.q + (size_t)(r0 + g) * A::kMaxDp + 32 * b);
  __mmask32 mk[NB];
  for (int b = 0; b < NB; ++b) mk[b] = mask32(D - 32 * b);
  auto dots = [&](int64_t t, __m512 (&a)[G]) {  // the G heads' lane sums of key t
    if (t + kPrefetch < L) prefetch_row(kh + slots[t + kPrefetch] * s0k, D);
    prefetch_next(t);
    key_dots<NB, G>(qv, kh + slots[t] * s0k, mk, a);
  };
  int64_t t = 0;
  for (; t + 4 <= L; t += 4) {
    __m512 a0[G], a1[G], a2[G], a3[G];
    dots(t, a0);
    dots(t + 1, a1);
    dots(t + 2, a2);
    dots(t + 3, a3);
    for (int g = 0; g < G; ++g) _mm_storeu_ps(sc + g * L + t, hsum4(a0[g], a1[g], a2[g], a3[g]));
  }
  for (; t < L; ++t) {
    __m512 a[G];
    prefetch_next(t);
    key_dots<NB, G>(qv, kh + slots[t] * s0k, mk, a);
    for (int g = 0; g < G; ++g) sc[g * L + t] = _mm512_reduce_add_ps(a[g]);
  }
  for (; t < nL; ++t) prefetch_next(t);
  if (softcap > 0.f) {  // on log2-unit scores, as on the tiles
    const float cap = softcap * A::kLog2e, inv = 1.f / cap;
    for (int64_t i = 0; i < G * L; ++i) sc[i] = cap * std::tanh(sc[i] * inv);
  }
  float alpha[G], inv[G];
  for (int g = 0; g < G; ++g) {  // max; weights, their sum; bf16 weights in place (values_bf16's layout)
    float* s = sc + g * L;
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    for (t = 0; t + 16 <= L; t += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + t));
    const __mmask16 tail = (__mmask16)((1u << (L - t)) - 1);
    if (tail) vmx = _mm512_mask_max_ps(vmx, tail, vmx, _mm512_maskz_loadu_ps(tail, s + t));
    const float mo = w.m[r0 + g], m = std::max(mo, _mm512_reduce_max_ps(vmx));
    const __m512 vm = _mm512_set1_ps(m);
    __m512 vs = _mm512_setzero_ps();
    uint16_t* pb = reinterpret_cast<uint16_t*>(s);
    for (t = 0; t + 16 <= L; t += 16) {
      const __m512 e = sglite_simd::exp2_deg3(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm));
      vs = _mm512_add_ps(vs, e);
      _mm256_storeu_si256((__m256i*)(pb + t), (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (tail) {
      const __m512 e = _mm512_maskz_mov_ps(tail, sglite_simd::exp2_deg3(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), vm)));
      vs = _mm512_add_ps(vs, e);
      _mm256_mask_storeu_epi16(pb + t, tail, (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (L & 1) pb[L] = 0;
    alpha[g] = mo == m ? 1.f : (mo == -INFINITY ? 0.f : std::exp2(mo - m));
    inv[g] = 1.f / (w.l[r0 + g] * alpha[g] + _mm512_reduce_add_ps(vs));
  }
  __m512 acc[G][2 * NB];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * NB; ++c) acc[g][c] = _mm512_setzero_ps();
  for (t = 0; t < L; t += 2) {
    const bool two = t + 1 < L;
    if (t + kPrefetch < L) prefetch_row(vh + slots[t + kPrefetch] * s0v, D);
    if (t + 1 + kPrefetch < L) prefetch_row(vh + slots[t + 1 + kPrefetch] * s0v, D);
    const uint16_t* v0 = vh + slots[t] * s0v;
    const uint16_t* v1 = two ? vh + slots[t + 1] * s0v : nullptr;
    __m512bh lo[NB], hi[NB];
    for (int b = 0; b < NB; ++b) {
      const __m512i x = load_bf16(v0 + 32 * b, D - 32 * b);
      const __m512i y = two ? load_bf16(v1 + 32 * b, D - 32 * b) : _mm512_setzero_si512();
      lo[b] = (__m512bh)_mm512_unpacklo_epi16(x, y);
      hi[b] = (__m512bh)_mm512_unpackhi_epi16(x, y);
    }
    for (int g = 0; g < G; ++g) {
      uint32_t pw;
      std::memcpy(&pw, reinterpret_cast<const uint16_t*>(sc + g * L) + t, 4);
      const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pw);
      for (int b = 0; b < NB; ++b) {
        acc[g][2 * b] = _mm512_dpbf16_ps(acc[g][2 * b], lo[b], p);
        acc[g][2 * b + 1] = _mm512_dpbf16_ps(acc[g][2 * b + 1], hi[b], p);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float pv[32 * NB];
    for (int b = 0; b < NB; ++b) {  // lane i of lo: dim 32 b + 8 (i / 4) + i % 4; of hi: that + 4
      alignas(64) float tl[16], th[16];
      _mm512_store_ps(tl, acc[g][2 * b]);
      _mm512_store_ps(th, acc[g][2 * b + 1]);
      for (int i = 0; i < 16; ++i) {
        pv[32 * b + 8 * (i / 4) + i % 4] = tl[i];
        pv[32 * b + 8 * (i / 4) + i % 4 + 4] = th[i];
      }
    }
    const float* ar = w.acc + (size_t)(r0 + g) * A::kAld;
    const __m512 va = _mm512_set1_ps(alpha[g]), vi = _mm512_set1_ps(inv[g]);
    for (int d = 0; d < D; d += 16) {
      const __mmask16 m = D - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - d)) - 1);
      const __m512 y = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_loadu_ps(ar + d), va, _mm512_load_ps(pv + d)), vi);
      if (out_bf16) _mm256_mask_storeu_epi16((uint16_t*)out + (int64_t)g * D + d, m, (__m256i)_mm512_cvtneps_pbh(y));
      else _mm512_mask_storeu_ps((float*)out + (int64_t)g * D + d, m, y);
    }
  }
  return true;
}

using OwnKeys = bool (*)(const sglite_amx_attn::Work&, int, int, const uint16_t*, int64_t, const uint16_t*, int64_t,
                         const int32_t*, int64_t, int64_t, float, float*, void*, bool, const int32_t*, int64_t);
// own_keys for a padded head dim of 64 or 128 and G <= 8; nullptr otherwise (attend with a Prefix).
template <int... Gs> OwnKeys pick_own(int Dp32, int G, std::integer_sequence<int, Gs...>) {
  OwnKeys f = nullptr;
  ((G == Gs + 1 ? (void)(f = Dp32 == 64 ? &own_keys<2, Gs + 1> : Dp32 == 128 ? &own_keys<4, Gs + 1> : nullptr) : (void)0), ...);
  return f;
}

// Cascade decode on a bf16 pool, one fork/join: a task is either a chunk of a group (one KV head,
// up to 64 / G of its rows) or one (row, KV head) of a row outside every group. A chunk attends
// the group's shared keys [0, P) once on the AMX tiles, its queries the chunk's rows x the G heads
// (amx_attention.h), then each of its rows' own keys [P, len) on AVX-512, continuing the tiles'
// online softmax in place (own_keys; other head dims or G > 8: attend, merging with the tiles'
// unnormalised outputs, maxima and sums through a Prefix): no partials leave the thread, no
// second pass waits for the first, no B x Hq partials buffer. Threads claim tasks from one
// counter, the costliest first (longest-processing-time order: chunks, then the other rows by
// length), so the last tasks claimed are the short ones. A row's result depends only on its own
// query, keys and its group's P (tile rows never mix), not on the chunking or the thread count.
// The split of the shared keys changes a row's rounding with the batch (not batch-invariant:
// callers in deterministic mode pass cascade_min 0).
void run_cascade(const Job<uint16_t>& j, int64_t B, int Hkv, int64_t max_len, const std::vector<Group>& groups) {
  namespace A = sglite_amx_attn;
  const int G = j.G, D = j.D, Dp32 = (D + 31) & ~31;
  // own keys on AVX-512 weigh 4 shared keys on the tiles; rows never mix on the tiles, so the
  // chunking changes no result
  const CascadePlan plan = plan_cascade(j.lens, B, Hkv, G, groups, A::kMaxRows, 4);
  const std::vector<CascadeTask>& tasks = plan.tasks;
  const int threads = at::get_num_threads();
  const Tiled<uint16_t> tiled = pick_tiled<uint16_t>(j.Dp, G);
  const OwnKeys own = pick_own(Dp32, G, std::make_integer_sequence<int, 8>{});
  std::atomic<bool> bad{false};
  std::atomic<int64_t> next{0};
  const int64_t n = (int64_t)tasks.size();
  const int workers = (int)std::max<int64_t>(1, std::min<int64_t>(threads, n));
  auto body = [&](int64_t) {
    std::unique_ptr<A::Work> w;  // made on the first chunk this thread claims
    std::vector<float> qf((size_t)G * j.Dp), sc((size_t)G * max_len + 1), acc((size_t)G * j.Dp + 2 * G);
    std::vector<float> mn(G);
    std::vector<int32_t> own_slots;
    for (int64_t i; !bad.load(std::memory_order_relaxed) && (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      const CascadeTask& t = tasks[i];
      if (t.g < 0) {
        if (!attend(j, tiled, t.r0, t.h, qf.data(), sc.data(), acc.data())) bad = true;
        continue;
      }
      if (!w) {
        w = std::make_unique<A::Work>();
        sglite_tiles::configure();
      }
      const Group& gr = groups[t.g];
      const int R = (t.r1 - t.r0) * G;
      A::begin(*w, R, Dp32);
      for (int r = 0; r < R; ++r) {
        const int64_t b = gr.rows[t.r0 + r / G];
        const int64_t off = b * j.qs0 + (int64_t)(t.h * G + r % G) * j.qs1;
        w->qpos[r] = INT32_MAX;
        if (j.q_bf16) A::set_query(*w, r, (const uint16_t*)j.q + off, D, j.scale);
        else A::set_query(*w, r, (const float*)j.q + off, D, j.scale);
      }
      const int32_t* slots = j.rt + j.rows[gr.rows[0]] * j.rts0;
      // the chunk's own keys (scattered decode slots: DRAM latency-bound when read row by row)
      // prefetched into L2 from inside the tile walk's compute, spread over its steps
      own_slots.clear();
      for (int i2 = t.r0; i2 < t.r1; ++i2) {
        const int64_t b = gr.rows[i2];
        const int32_t* rs = j.rt + j.rows[b] * j.rts0;
        own_slots.insert(own_slots.end(), rs + gr.P, rs + j.lens[b]);
      }
      A::RowPrefetch pf = A::RowPrefetch::head(j.k + t.h * j.ks1, j.ks0, j.v + t.h * j.vs1, j.vs0, j.S, D);
      pf.slots = own_slots.data();
      pf.n = (int)own_slots.size();
      {  // spread over the walk's prefetch steps: one per 16-key score tile and per 16-row softmax step
        const int64_t nb = (gr.P + A::KB - 1) / A::KB;
        const int64_t steps = std::max<int64_t>(1, (gr.P + 15) / 16 + nb * ((R + 15) / 16));
        pf.per = (int)std::max<int64_t>(1, (pf.n + steps - 1) / steps);
      }
      if (!A::walk(*w, R, D, Dp32, j.k + t.h * j.ks1, j.ks0, j.v + t.h * j.vs1, j.vs0, slots, j.S, 0, gr.P, gr.P, gr.P, 0,
                   j.softcap, &pf)) {
        bad = true;
        break;
      }
      pf.per = pf.n;
      pf.step();  // whatever the walk left (a short prefix)
      for (int i2 = t.r0; i2 < t.r1; ++i2) {  // each row's own keys, continuing its tile rows
        const int64_t b = gr.rows[i2];
        const int r = (i2 - t.r0) * G;
        bool ok;
        if (own) {
          const size_t esz = j.out_bf16 ? 2 : 4;
          const int64_t nb = i2 + 1 < t.r1 ? gr.rows[i2 + 1] : -1;
          ok = own(*w, r, D, j.k + t.h * j.ks1, j.ks0, j.v + t.h * j.vs1, j.vs0, j.rt + j.rows[b] * j.rts0 + gr.P,
                   j.lens[b] - gr.P, j.S, j.softcap, sc.data(), (char*)j.out + esz * ((b * j.Hq + (int64_t)t.h * G) * D),
                   j.out_bf16, nb < 0 ? nullptr : j.rt + j.rows[nb] * j.rts0 + gr.P, nb < 0 ? 0 : j.lens[nb] - gr.P);
        } else {
          for (int g = 0; g < G; ++g) mn[g] = A::m_natural(*w, r + g);
          const Prefix pre{w->acc + (size_t)r * A::kAld, A::kAld, mn.data(), w->l + r};
          ok = attend(j, tiled, b, t.h, qf.data(), sc.data(), acc.data(), gr.P, &pre);
        }
        if (!ok) bad = true;
      }
    }
    if (w) _tile_release();
  };
  sglite_pool::Pool::get().run(workers, workers, body);
  TORCH_CHECK_INDEX(!bad, "decode_attention: req_to_token holds a slot outside the pool [0, ", j.S, ")");
}
#endif

// The groups as one int64 tensor: [count, then per group P, its row count k, its k batch rows]
// (decode_attention's `groups` argument: a caller that attends many layers over one batch finds
// them once).
at::Tensor shared_prefix_groups_op(const at::Tensor& rt, const at::Tensor& rows, const at::Tensor& lens, int64_t min_shared) {
  TORCH_CHECK_VALUE(rt.dim() == 2 && rt.scalar_type() == at::kInt && rt.stride(1) == 1 && rows.scalar_type() == at::kLong
                    && lens.scalar_type() == at::kLong && rows.is_contiguous() && lens.is_contiguous() && rows.numel() == lens.numel(),
                    "shared_prefix_groups: req_to_token int32 [R, Lmax], req_pool_indices / seq_lens contiguous int64 [B]");
  const int64_t B = rows.numel();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK_VALUE(rows.data_ptr<int64_t>()[b] >= 0 && rows.data_ptr<int64_t>()[b] < rt.size(0) && lens.data_ptr<int64_t>()[b] >= 1
                      && lens.data_ptr<int64_t>()[b] <= rt.size(1), "shared_prefix_groups: row ", b, " outside the table");
  const auto groups = shared_prefix_groups(rt.data_ptr<int32_t>(), rt.stride(0), rows.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                           B, std::max<int64_t>(1, min_shared));
  std::vector<int64_t> flat{(int64_t)groups.size()};
  for (const auto& g : groups) {
    flat.push_back(g.P);
    flat.push_back((int64_t)g.rows.size());
    flat.insert(flat.end(), g.rows.begin(), g.rows.end());
  }
  at::Tensor out = at::empty({(int64_t)flat.size()}, rows.options());
  std::memcpy(out.data_ptr<int64_t>(), flat.data(), sizeof(int64_t) * flat.size());
  return out;
}

// The inverse, checked against the batch: each group >= 2 distinct rows in [0, B), P >= 1 and
// shorter than each of its rows' lengths.
std::vector<Group> groups_from(const at::Tensor& t, const int64_t* lens, int64_t B) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous() && t.numel() >= 1,
                    "decode_attention: groups must be shared_prefix_groups' int64 tensor");
  const int64_t* p = t.data_ptr<int64_t>();
  const int64_t n = t.numel(), count = p[0];
  std::vector<Group> out;
  int64_t i = 1;
  std::vector<char> seen(B, 0);
  for (int64_t g = 0; g < count; ++g) {
    TORCH_CHECK_VALUE(i + 2 <= n && p[i + 1] >= 2 && i + 2 + p[i + 1] <= n, "decode_attention: malformed groups tensor");
    Group gr{p[i], std::vector<int64_t>(p + i + 2, p + i + 2 + p[i + 1])};
    for (int64_t b : gr.rows) {
      TORCH_CHECK_VALUE(b >= 0 && b < B && !seen[b] && gr.P >= 1 && gr.P < lens[b], "decode_attention: groups disagree with the batch");
      seen[b] = 1;
    }
    i += 2 + p[i + 1];
    out.push_back(std::move(gr));
  }
  TORCH_CHECK_VALUE(i == n, "decode_attention: malformed groups tensor");
  return out;
}
