// Elementwise math for the CPU kernels, written so that loops over it vectorise.
#ifndef RACKRUN_RUNTIME_CPU_MATH_H_
#define RACKRUN_RUNTIME_CPU_MATH_H_

#include <bit>
#include <cmath>
#include <cstdint>

namespace rackrun::runtime::cpu {

// exp(x). float: range reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6
// polynomial (Cephes expf coefficients) scaled by 2^n built in the exponent bits; relative
// error below 2e-7 (a few ulp), inputs clamped to [-87.3, 88.3]. Plain arithmetic and
// bit casts only, so GCC vectorises the calling loop (std::exp is a libm call per element).
// double: std::exp, since the fp64 build exists for exact gradient checks.
inline float Exp(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}
inline double Exp(double x) { return std::exp(x); }

template <typename T>
T Sigmoid(T x) {
  return T(1) / (T(1) + Exp(-x));
}

}  // namespace rackrun::runtime::cpu

#endif  // RACKRUN_RUNTIME_CPU_MATH_H_
