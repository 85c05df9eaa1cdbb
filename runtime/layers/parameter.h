// Trainable parameters: a value tensor and its gradient, named for checkpoints, plus the
// deterministic initialiser every layer draws from.
#ifndef RACKRUN_RUNTIME_LAYERS_PARAMETER_H_
#define RACKRUN_RUNTIME_LAYERS_PARAMETER_H_

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "runtime/residual/residual_streams.h"
#include "runtime/tensor.h"

namespace rackrun::runtime {

// ParamRef (name, value, grad, size) is the residual component's: one view type for
// optimizers and checkpoints across the model. `grad` is null for non-trainable state
// (buffers such as the aux-loss-free router bias).
template <typename T>
struct Parameter {
  std::string name;
  Tensor<T> value;
  Tensor<T> grad;

  void Allocate(std::string param_name, std::initializer_list<int64_t> shape) {
    name = std::move(param_name);
    value.Resize(shape);
    grad.Resize(shape);
    value.Zero();
    grad.Zero();
  }
  ParamRef<T> Ref() {
    std::vector<int64_t> shape;
    for (int i = 0; i < value.rank(); ++i) shape.push_back(value.dim(i));
    return ParamRef<T>{name, value.data(), grad.data(), value.size(), std::move(shape)};
  }
};

// Gaussian draws from a fixed-algorithm generator (mt19937_64 + Box-Muller written out),
// so a seed gives the same weights with any standard library.
class NormalInit {
 public:
  explicit NormalInit(uint64_t seed) : engine_(seed) {}

  double Next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    // Two uniforms in (0, 1] from the top 53 bits.
    const double u1 = (static_cast<double>(engine_() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(engine_() >> 11) * 0x1.0p-53;
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * 3.14159265358979323846 * u2;
    spare_ = radius * std::sin(angle);
    has_spare_ = true;
    return radius * std::cos(angle);
  }

  template <typename T>
  void Fill(Tensor<T>& t, double stddev) {
    for (int64_t i = 0; i < t.size(); ++i) t[i] = static_cast<T>(stddev * Next());
  }

 private:
  std::mt19937_64 engine_;
  bool has_spare_ = false;
  double spare_ = 0;
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_LAYERS_PARAMETER_H_
