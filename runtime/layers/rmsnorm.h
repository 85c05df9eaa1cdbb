// RMSNorm with a learned per-channel gain: y = g * x / sqrt(mean(x^2) + eps), row-wise.
#ifndef RACKRUN_RUNTIME_LAYERS_RMSNORM_H_
#define RACKRUN_RUNTIME_LAYERS_RMSNORM_H_

#include <cstdint>
#include <string>

#include "runtime/layers/parameter.h"
#include "runtime/tensor.h"

namespace rackrun::runtime {

template <typename T>
class RmsNorm {
 public:
  static constexpr double kEpsilon = 1e-6;

  RmsNorm(int width, const std::string& name);

  Parameter<T>& gain() { return gain_; }
  int width() const { return width_; }

  // y[rows x width] = norm(x); remembers 1/rms per row for Backward.
  void Forward(const T* x, int64_t rows, T* y);
  // dx = d norm(x) / dx applied to dy (overwritten); gain gradient accumulated.
  // `x` and `rows` must be those of the last Forward.
  void Backward(const T* x, const T* dy, int64_t rows, T* dx);

 private:
  int width_;
  Parameter<T> gain_;
  Tensor<T> inv_rms_;
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_LAYERS_RMSNORM_H_
