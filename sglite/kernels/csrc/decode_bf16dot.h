// The decode attention's VDPBF16PS kernels for bf16 pools on AVX512-BF16 CPUs, spliced into
// cpu_attention.cpp inside its anonymous namespace after Job / Tiled / hsum4 / prefetch_row
// (contract: sglite/kernels/cpu_attention.py). Defines SGL_BF16DOT and pick_bf16 when the build
// targets AVX512-BF16.
#pragma once

#ifdef __AVX512BF16__
#define SGL_BF16DOT 1
// bf16 pools on AVX512-BF16 CPUs: the pre-scaled query and the softmax weights are rounded once to
// bf16 (round to nearest even) and the products run on VDPBF16PS (two bf16 pairs per float32 lane),
// summed in float32: a third of the instructions of widening K / V to float32 (the bf16 pool
// already holds them as bf16). The same rounding of the query as llama.cpp's CPU attention, which
// converts q to the cache type.
inline __mmask32 mask32(int rem) { return rem >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << rem) - 1); }
inline __m512i load_bf16(const uint16_t* p, int rem) {  // 32 values; those at and past rem are zero
  return _mm512_maskz_loadu_epi16(mask32(rem), p);
}

// a[g] = the G lane-sum vectors of one bf16 key row kr against the G bf16 queries qv[g][0 .. NB)
// (VDPBF16PS, float32 sums; hsum4 / a lane sum finishes each score); mk: the 32-value blocks' load
// masks (mask32(D - 32 b), made once per call). By value: the accumulators stay in registers
// (an address-taken array with a stride was kept on the stack).
template <int NB, int G>
inline void key_dots(const __m512bh (&qv)[G][NB], const uint16_t* kr, const __mmask32 (&mk)[NB], __m512 (&a)[G]) {
  __m512bh kv[NB];
  for (int b = 0; b < NB; ++b) kv[b] = (__m512bh)_mm512_maskz_loadu_epi16(mk[b], kr + 32 * b);
  for (int g = 0; g < G; ++g) {
    __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kv[0]);
    for (int b = 1; b < NB; ++b) x = _mm512_dpbf16_ps(x, qv[g][b], kv[b]);
    a[g] = x;
  }
}

template <int NB, int G>
void scores_bf16(const Job<uint16_t>& j, const int32_t* slots, int64_t L, int h, const float* qf, float* sc) {
  __m512bh qv[G][NB];
  for (int g = 0; g < G; ++g)
    for (int b = 0; b < NB; ++b)
      qv[g][b] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qf + g * j.Dp + 32 * b + 16), _mm512_loadu_ps(qf + g * j.Dp + 32 * b));
  const uint16_t* kh = j.k + h * j.ks1;
  const int64_t ks0 = j.ks0;
  __mmask32 mk[NB];  // the blocks' load masks, once per call
  for (int b = 0; b < NB; ++b) mk[b] = mask32(j.D - 32 * b);
  auto dots = [&](int64_t t, __m512 (&a)[G]) { key_dots<NB, G>(qv, kh + slots[t] * ks0, mk, a); };
  // the V rows too, into L2, as far ahead as the K rows: the values pass (values_bf16) then
  // starts on L2 hits instead of a cold DRAM stall per row (scattered decode slots)
  const char* vb = (const char*)(j.v + h * j.vs1);
  const int64_t vs0b = j.vs0 * 2;
  auto prefetch_v = [&](int64_t u) {
    for (int i = 0; i < j.D * 2; i += 64) _mm_prefetch(vb + slots[u] * vs0b + i, _MM_HINT_T1);
  };
  if (L >= 4)  // the first rows' V (the loop below fetches kPrefetch rows ahead of itself)
    for (int64_t u = 0; u < std::min<int64_t>(kPrefetch, L); ++u) prefetch_v(u);
  int64_t t = 0;
  for (; t + 4 <= L; t += 4) {
    __m512 a0[G], a1[G], a2[G], a3[G];
    if (t + kPrefetch + 3 < L) {
      for (int u = 0; u < 4; ++u) {
        prefetch_row(kh + slots[t + u + kPrefetch] * ks0, j.D);
        prefetch_v(t + u + kPrefetch);
      }
    } else {
      for (int u = 0; u < 4; ++u)
        if (t + u + kPrefetch < L) {
          prefetch_row(kh + slots[t + u + kPrefetch] * ks0, j.D);
          prefetch_v(t + u + kPrefetch);
        }
    }
    dots(t, a0);
    dots(t + 1, a1);
    dots(t + 2, a2);
    dots(t + 3, a3);
    for (int g = 0; g < G; ++g) _mm_storeu_ps(sc + g * L + t, hsum4(a0[g], a1[g], a2[g], a3[g]));
  }
  for (; t < L; ++t) {
    __m512 a[G];
    dots(t, a);
    for (int g = 0; g < G; ++g) sc[g * L + t] = _mm512_reduce_add_ps(a[g]);
  }
}

// Token pairs (t, t + 1): their V rows interleaved by VPUNPCKL/HWD meet the weight pair
// (p[t], p[t + 1]) in one VDPBF16PS per 16 output values; accumulator lane i of the "lo" half of
// 32-block b holds dimension 32 b + 8 (i / 4) + i % 4, the "hi" half that + 4 (reordered on store).
template <int NB, int G>
void values_bf16(const Job<uint16_t>& j, const int32_t* slots, int64_t L, int h, float* p, float* out) {
  __m512 acc[G][2 * NB];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * NB; ++c) acc[g][c] = _mm512_setzero_ps();
  // The weights rounded to bf16 once, in place over the float32 scratch (row g's bf16 values at
  // the start of its float row: each 16-value store lands on floats already read), a zero after an
  // odd row so the last pair's second weight is 0; the caller's scratch is consumed.
  for (int g = 0; g < G; ++g) {
    float* pf = p + g * L;
    uint16_t* pb = reinterpret_cast<uint16_t*>(pf);
    int64_t t = 0;
    for (; t + 16 <= L; t += 16) _mm256_storeu_si256((__m256i*)(pb + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(pf + t)));
    if (t < L) {
      const __mmask16 m = (__mmask16)((1u << (L - t)) - 1);
      const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, pf + t));
      _mm256_mask_storeu_epi16(pb + t, m, v);
    }
    if (L & 1) pb[L] = 0;
  }
  const uint16_t* vh = j.v + h * j.vs1;
  const int64_t vs0 = j.vs0;
  __mmask32 mk[NB];  // the blocks' load masks, once per call
  for (int b = 0; b < NB; ++b) mk[b] = mask32(j.D - 32 * b);
  const uint16_t* pb[G];  // row g's bf16 weights
  for (int g = 0; g < G; ++g) pb[g] = reinterpret_cast<const uint16_t*>(p + g * L);
  // one token pair: v1 == nullptr for the last token of an odd row (its weight pair's second is 0)
  auto pair = [&](int64_t t, const uint16_t* v0, const uint16_t* v1) {
    __m512bh lo[NB], hi[NB];
    for (int b = 0; b < NB; ++b) {
      const __m512i a = _mm512_maskz_loadu_epi16(mk[b], v0 + 32 * b);
      const __m512i c = v1 ? _mm512_maskz_loadu_epi16(mk[b], v1 + 32 * b) : _mm512_setzero_si512();
      lo[b] = (__m512bh)_mm512_unpacklo_epi16(a, c);
      hi[b] = (__m512bh)_mm512_unpackhi_epi16(a, c);
    }
    for (int g = 0; g < G; ++g) {
      uint32_t w;
      std::memcpy(&w, pb[g] + t, 4);  // (p[t], p[t + 1]) in bf16
      const __m512bh pw = (__m512bh)_mm512_set1_epi32((int)w);
      for (int b = 0; b < NB; ++b) {
        acc[g][2 * b] = _mm512_dpbf16_ps(acc[g][2 * b], lo[b], pw);
        acc[g][2 * b + 1] = _mm512_dpbf16_ps(acc[g][2 * b + 1], hi[b], pw);
      }
    }
  };
  int64_t t = 0;
  for (; t + 2 <= L; t += 2) {
    if (t + 1 + kPrefetch < L) {
      prefetch_row(vh + slots[t + kPrefetch] * vs0, j.D);
      prefetch_row(vh + slots[t + 1 + kPrefetch] * vs0, j.D);
    } else if (t + kPrefetch < L) {
      prefetch_row(vh + slots[t + kPrefetch] * vs0, j.D);
    }
    pair(t, vh + slots[t] * vs0, vh + slots[t + 1] * vs0);
  }
  if (t < L) pair(t, vh + slots[t] * vs0, nullptr);
  for (int g = 0; g < G; ++g)
    for (int b = 0; b < NB; ++b) {
      alignas(64) float tl[16], th[16];
      _mm512_store_ps(tl, acc[g][2 * b]);
      _mm512_store_ps(th, acc[g][2 * b + 1]);
      float* o = out + g * j.Dp + 32 * b;
      for (int i = 0; i < 16; ++i) {
        o[8 * (i / 4) + i % 4] = tl[i];
        o[8 * (i / 4) + i % 4 + 4] = th[i];
      }
    }
}

template <int NB, int... Gs> Tiled<uint16_t> pick_bf16(int G, std::integer_sequence<int, Gs...>) {
  Tiled<uint16_t> r{nullptr, nullptr};
  ((G == Gs + 1 ? (void)(r = Tiled<uint16_t>{&scores_bf16<NB, Gs + 1>, &values_bf16<NB, Gs + 1>}) : (void)0), ...);
  return r;
}
#endif
