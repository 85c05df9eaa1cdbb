// Test support: central-difference gradient checks for the fp64 build of a layer.
#ifndef RACKRUN_RUNTIME_LAYERS_GRADIENT_CHECK_H_
#define RACKRUN_RUNTIME_LAYERS_GRADIENT_CHECK_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/layers/parameter.h"
#include "runtime/tensor.h"

namespace rackrun::runtime::testing {

// Central difference of `loss` with respect to *x.
template <typename Loss>
double CentralDifference(double* x, Loss&& loss, double eps) {
  const double saved = *x;
  *x = saved + eps;
  const double plus = loss();
  *x = saved - eps;
  const double minus = loss();
  *x = saved;
  return (plus - minus) / (2 * eps);
}

// Compares analytic[i] with the numeric derivative for up to `samples` indices spread
// over [0, n). Tolerance: |a - n| <= atol + rtol * max(|a|, |n|).
template <typename Loss>
void ExpectGradientMatches(const std::string& what, double* x, const double* analytic, int64_t n,
                           Loss&& loss, int samples = 24, double eps = 1e-5, double atol = 1e-7,
                           double rtol = 1e-5) {
  const int64_t step = std::max<int64_t>(1, n / samples);
  double worst = 0;
  for (int64_t i = (n > samples ? step / 2 : 0); i < n; i += step) {
    const double numeric = CentralDifference(x + i, loss, eps);
    const double err = std::abs(numeric - analytic[i]);
    worst = std::max(worst, err);
    EXPECT_LE(err, atol + rtol * std::max(std::abs(numeric), std::abs(analytic[i])))
        << what << "[" << i << "]: analytic " << analytic[i] << " numeric " << numeric;
  }
  (void)worst;
}

// Deterministic pseudo-random fill in [-scale, scale].
inline void FillUniform(double* x, int64_t n, uint64_t seed, double scale) {
  NormalInit rng(seed);
  for (int64_t i = 0; i < n; ++i) x[i] = scale * std::tanh(rng.Next());
}

inline double Dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Gradient check of every parameter of a layer: `params` are the layer's parameters
// (grads already accumulated by one backward of `loss`).
template <typename Loss>
void ExpectParameterGradientsMatch(const std::vector<ParamRef<double>>& params, Loss&& loss,
                                   int samples = 16) {
  for (const auto& p : params) {
    std::vector<double> grad(p.grad, p.grad + p.size);
    ExpectGradientMatches(p.name, p.value, grad.data(), p.size, loss, samples);
  }
}

}  // namespace rackrun::runtime::testing

#endif  // RACKRUN_RUNTIME_LAYERS_GRADIENT_CHECK_H_
