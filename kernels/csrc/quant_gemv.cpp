// Group-quantized weights on CPU: few-row GEMV straight on the codes, and dequantization (the
// GEMM path). Representation, contracts and measurements: sglite/kernels/quant_linear.py and
// sglite/kernels/quant_cpu.py. Two builds of this one source: with AVX-512-BF16 (VDPBF16PS on
// codes turned into exact bf16 integers) and a portable one (plain float loops).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define SGQ_AVX512 1
#endif

namespace {

constexpr int64_t BLK = 32;  // channels per packing block

// xs[m * G + g] = float32 sum of x[m, g * gs : (g + 1) * gs] (the offsets' factor)
void group_sums(const float* xf, int64_t M, int64_t K, int64_t gs, float* xs) {
  const int64_t G = K / gs;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float a = 0.f;
      for (int64_t i = 0; i < gs; ++i) a += xf[m * K + g * gs + i];
      xs[m * G + g] = a;
    }
}

// codes of one 32-block as floats (stored order), both widths
inline void decode_block(const uint8_t* q, int bits, int64_t kb, float* out) {
  if (bits == 8) {
    for (int i = 0; i < BLK; ++i) out[i] = (float)q[kb + i];
  } else {
    const uint8_t* p = q + kb / 2;
    for (int i = 0; i < 16; ++i) { out[i] = (float)(p[i] & 0xF); out[i + 16] = (float)(p[i] >> 4); }
  }
}

// portable GEMV: y[m, n] = sum_g s[n, g] * dot(x[m, group g], q[n, group g]) + sum_g mins[n, g] * xs[m, g]
void rows_portable(const float* xf, int64_t M, int64_t K, const uint8_t* q, int bits, const float* s,
                   const float* mn, const float* xs, int64_t gs, int64_t n0, int64_t n1, int64_t N, float* y) {
  const int64_t G = K / gs, rowb = K * bits / 8;
  std::vector<float> wq(gs), acc(M);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = q + n * rowb;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t b = 0; b < gs; b += BLK) decode_block(qr, bits, g * gs + b, wq.data() + b);
      const float sg = s[n * G + g];
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xf + m * K + g * gs;
        float d = 0.f;
        for (int64_t i = 0; i < gs; ++i) d += xr[i] * wq[i];
        acc[m] += sg * d;
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      float a = acc[m];
      if (mn)
        for (int64_t g = 0; g < G; ++g) a += mn[n * G + g] * xs[m * G + g];
      y[m * N + n] = a;
    }
  }
}

#ifdef SGQ_AVX512
inline __m512i lut4() {  // bf16 bit patterns of the integers 0..15 (words 16..31 unused)
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    float f = (float)(i & 15);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    t[i] = (uint16_t)(u >> 16);  // exact: small integers have <= 8 significant bits
  }
  return _mm512_load_si512(t);
}

// 32 codes of a 4-bit block (16 bytes: low nibbles = channels 0..15, high = 16..31) as bf16
inline __m512bh unpack4(const uint8_t* p, __m512i lut) {
  const __m256i w16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(w16), _mm256_srli_epi16(w16, 4), 1);
  z = _mm512_and_si512(z, _mm512_set1_epi16(0x0F));
  return (__m512bh)_mm512_permutexvar_epi16(z, lut);
}

// 32 codes of an 8-bit block as bf16 (integers <= 255 are exact in bf16)
inline __m512bh unpack8(const uint8_t* p) {
  const __m256i raw = _mm256_loadu_si256((const __m256i*)p);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(raw)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(raw, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// M rows of x as P bf16 planes (xp[(p * M + m) * K + k]; P = 1: bf16 x, P = 3: float32 x split
// exactly into hi + mid + lo) against weight rows n0..n1. Per group: the planes' VDPBF16PS
// products (exact in float32) summed into t, then acc += scale * t; two accumulators per row
// (even / odd groups) hide the FMA latency; offsets folded in as mins . xs; one horizontal sum.
template <int M, int P, int BITS>
void rows_avx(const uint16_t* xp, int64_t K, const uint8_t* q, const float* s, const float* mn,
              const float* xs, int64_t gs, int64_t n0, int64_t n1, int64_t N, float* y) {
  const int64_t G = K / gs, rowb = K * BITS / 8, bpg = gs / BLK;
  const __m512i lut = lut4();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = q + n * rowb;
    const float* sr = s + n * G;
    __m512 a0[M], a1[M];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m512 t[M];
      for (int m = 0; m < M; ++m) t[m] = _mm512_setzero_ps();
      for (int64_t b = 0; b < bpg; ++b) {
        const int64_t kb = (g * bpg + b) * BLK;
        const __m512bh w = BITS == 4 ? unpack4(qr + kb / 2, lut) : unpack8(qr + kb);
        for (int m = 0; m < M; ++m)
          for (int p = 0; p < P; ++p)
            t[m] = _mm512_dpbf16_ps(t[m], w, (__m512bh)_mm512_loadu_si512(xp + (p * M + m) * K + kb));
      }
      const __m512 sv = _mm512_set1_ps(sr[g]);
      if (g & 1)
        for (int m = 0; m < M; ++m) a1[m] = _mm512_fmadd_ps(t[m], sv, a1[m]);
      else
        for (int m = 0; m < M; ++m) a0[m] = _mm512_fmadd_ps(t[m], sv, a0[m]);
    }
    if (mn) {
      const float* mr = mn + n * G;
      for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 k = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1);
        const __m512 mv = _mm512_maskz_loadu_ps(k, mr + g);
        for (int m = 0; m < M; ++m) a1[m] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, xs + m * G + g), a1[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
  }
}

template <int P, int BITS>
void rows_avx_m(int64_t M, const uint16_t* xp, int64_t K, const uint8_t* q, const float* s, const float* mn,
                const float* xs, int64_t gs, int64_t n0, int64_t n1, int64_t N, float* y) {
  switch (M) {
#define SGQ_CASE(MM) case MM: rows_avx<MM, P, BITS>(xp, K, q, s, mn, xs, gs, n0, n1, N, y); break;
    SGQ_CASE(1) SGQ_CASE(2) SGQ_CASE(3) SGQ_CASE(4) SGQ_CASE(5) SGQ_CASE(6) SGQ_CASE(7) SGQ_CASE(8)
#undef SGQ_CASE
    default: TORCH_CHECK(false, "quant_gemv: 1..8 rows");
  }
}
#endif

void check_weight(const at::Tensor& q, const at::Tensor& s, const at::Tensor& mn, int64_t bits,
                  int64_t gs, int64_t K) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant: bits must be 4 or 8");
  TORCH_CHECK(gs > 0 && gs % BLK == 0 && K % gs == 0, "quant: group_size must be a multiple of 32 dividing K");
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous() && q.size(1) * 8 == K * bits,
              "quant: qweight must be contiguous uint8 [N, K * bits / 8]");
  const int64_t N = q.size(0), G = K / gs;
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.numel() == N * G, "quant: scales must be float32 [N, K / group_size]");
  if (mn.numel() > 0)  // an empty tensor stands for "no offsets" (cheaper to pass than None)
    TORCH_CHECK(mn.scalar_type() == at::kFloat && mn.is_contiguous() && mn.numel() == N * G,
                "quant: mins must be float32 [N, K / group_size]");
}

}  // namespace

// y [M, N] (x's dtype) = x [M, K] (bf16 or float32, 1 <= M <= 8, stored channel order) @ W_stored.T,
// accumulated in float32 and rounded once (bf16: round to nearest even)
at::Tensor quant_gemv(at::Tensor x, at::Tensor q, at::Tensor s, at::Tensor mn, int64_t bits,
                      int64_t gs) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 8, "quant_gemv: x must be [M <= 8, K]");
  const bool xbf = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(xbf || x.scalar_type() == at::kFloat, "quant_gemv: x bf16 or float32");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = K / gs;
  check_weight(q, s, mn, bits, gs, K);
  x = x.contiguous();
  // x as float32 (a view of x when it is float32), then the group sums
  std::vector<float> xbuf(xbf ? M * K : 0);
  const float* xf = xbf ? xbuf.data() : x.data_ptr<float>();
  if (xbf) {
    const at::BFloat16* b = x.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) xbuf[i] = (float)b[i];
  }
  std::vector<float> xs(M * G);
  group_sums(xf, M, K, gs, xs.data());
  at::Tensor y = at::empty({M, N}, x.options());
  std::vector<float> ybuf(xbf ? M * N : 0);
  float* yp = xbf ? ybuf.data() : y.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  const float* mp = mn.numel() > 0 ? mn.data_ptr<float>() : nullptr;
  const int64_t grain = std::max<int64_t>(16, (int64_t)(1 << 16) / std::max<int64_t>(K, 1));
#ifdef SGQ_AVX512
  const int P = xbf ? 1 : 3;
  std::vector<uint16_t> planes(xbf ? 0 : P * M * K);
  if (!xbf) {  // float32 x = hi + mid + lo, each bf16 (round to nearest even), exact but for <= 2^-24 |x|
    for (int64_t i = 0; i < M * K; ++i) {
      float r = xf[i];
      for (int p = 0; p < 3; ++p) {
        const c10::BFloat16 b(r);
        planes[(p * M) * K + i] = b.x;
        r -= (float)b;
      }
    }
  }
  const uint16_t* xp = xbf ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : planes.data();
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (bits == 4) {
      if (P == 1) rows_avx_m<1, 4>(M, xp, K, qp, sp, mp, xs.data(), gs, n0, n1, N, yp);
      else rows_avx_m<3, 4>(M, xp, K, qp, sp, mp, xs.data(), gs, n0, n1, N, yp);
    } else {
      if (P == 1) rows_avx_m<1, 8>(M, xp, K, qp, sp, mp, xs.data(), gs, n0, n1, N, yp);
      else rows_avx_m<3, 8>(M, xp, K, qp, sp, mp, xs.data(), gs, n0, n1, N, yp);
    }
  });
#else
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    rows_portable(xf, M, K, qp, (int)bits, sp, mp, xs.data(), gs, n0, n1, N, yp);
  });
#endif
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
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float buf[BLK];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t kb = 0; kb < K; kb += BLK) {
        const int64_t g = kb / gs;
        const float sg = sp[n * G + g], mg = mp ? mp[n * G + g] : 0.f;
        decode_block(qp + n * rowb, (int)bits, kb, buf);
        for (int i = 0; i < BLK; ++i) buf[i] = buf[i] * sg + mg;  // s * q exact: one rounding, the sum
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

bool quant_simd() {
#ifdef SGQ_AVX512
  return true;
#else
  return false;
#endif
}
