// Portable scalar math shared by sglite's C++ kernels: the loops their AVX-512 paths fall back to
// (no AVX-512 in the build, or a head size the vector code does not cover). Spliced into each
// source by sglite.kernels.cpu_build.read_source (so the build tag hashes it too). Needs <cstdint>
// and <cstring>.
#pragma once

namespace sglite_scalar {
// A float, unchanged; or bf16 bits -> float32 (exact: the bits become the float's top half).
inline float widen(float x) { return x; }
inline float widen(uint16_t x) { uint32_t u = uint32_t(x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
// float8 e4m3fn bits -> float32, exact (sign, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0:
// subnormal m * 2^-9; 0x7F / 0xFF: NaN)
inline float widen(uint8_t x) {
  const uint32_t sign = uint32_t(x & 0x80u) << 24, e = (x >> 3) & 0xFu, m = x & 7u;
  float f;
  if (e == 0) {
    f = (float)m * (1.0f / 512.0f);
    if (sign) f = -f;
    return f;
  }
  const uint32_t u = (e == 15 && m == 7) ? (sign | 0x7FC00000u) : (sign | ((e + 120u) << 23) | (m << 20));
  std::memcpy(&f, &u, 4);
  return f;
}

// sum_d a[d] * b[d] over D floats: eight partial sums (element d of each full 8-slice goes to sum
// d % 8, the tail to sum 0), then added in order 0..7. One fixed order for a given D.
inline float dot(const float* a, const float* b, int D) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int d = 0;
  for (; d + 8 <= D; d += 8)
    for (int i = 0; i < 8; ++i) s[i] += a[d + i] * b[d + i];
  for (; d < D; ++d) s[0] += a[d] * b[d];
  float t = 0;
  for (float x : s) t += x;
  return t;
}

// y[d] += w * x[d] for d in [0, D).
inline void axpy(float w, const float* x, float* y, int D) {
  for (int d = 0; d < D; ++d) y[d] += w * x[d];
}
}  // namespace sglite_scalar
