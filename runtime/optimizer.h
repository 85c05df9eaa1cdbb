// AdamW with decoupled weight decay, global gradient-norm clipping and the warmup +
// cosine learning-rate schedule.
//
// Update for one parameter p with gradient g at step t (1-based), as in PyTorch's AdamW:
//   m = beta1 m + (1 - beta1) g            v = beta2 v + (1 - beta2) g^2
//   p = p (1 - lr wd)                       (decay only where `decay` is set)
//   p = p - lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
// Moments are float; the bias corrections are computed in double.
//
// Weight decay applies to matrices (projections, experts, router, mapping weights) and
// the embedding; it does not apply to RMSNorm/LayerNorm gains, biases, or the scalar
// gates of the residual-stream mappings, because shrinking those towards zero changes
// what the layer computes rather than regularising it. `DecaysWeight(name)` encodes the
// rule on parameter names (see its comment).
#ifndef RACKRUN_RUNTIME_OPTIMIZER_H_
#define RACKRUN_RUNTIME_OPTIMIZER_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace rackrun::runtime {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

// Learning rate at optimizer step `step` (0-based): linear warmup from lr/warmup to lr
// over `warmup` steps, then cosine (or constant) down to min_lr at `total` steps.
struct LearningRateSchedule {
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup = 0;
  int64_t total = 1;
  bool cosine = true;

  double At(int64_t step) const;
};

// One parameter tensor as the optimizer sees it; the memory belongs to the model.
struct OptimizedTensor {
  std::string name;
  float* value = nullptr;
  const float* grad = nullptr;
  int64_t size = 0;
  bool decay = true;
};

// True when the parameter called `name` gets weight decay. Names are '.'-separated paths
// (for example "blocks.0.attn.wq"); the last component decides: no decay when it
// contains "norm", "gain" or "bias", or starts with "b_" or "a_" (mapping biases and
// gating scalars: b_pre, a_res, ...), or is "alpha"/"scale"; decay otherwise.
bool DecaysWeight(std::string_view name);

// Global L2 norm of all gradients, summed in double in a fixed order, so it does not
// depend on the thread count.
double GlobalGradNorm(const std::vector<OptimizedTensor>& tensors);

class AdamW {
 public:
  AdamW(AdamWConfig config, std::vector<OptimizedTensor> tensors);

  // One update with learning rate `lr`; gradients are multiplied by `grad_scale` first
  // (the clipping factor, 1 when not clipping). Thread-parallel over elements, and the
  // result does not depend on the thread count (element-wise arithmetic only).
  void Step(double lr, double grad_scale = 1.0);

  int64_t step() const { return step_; }
  const std::vector<OptimizedTensor>& tensors() const { return tensors_; }
  // Moment buffers of tensor i, for checkpoints.
  std::vector<float>& first_moment(size_t i) { return m_[i]; }
  std::vector<float>& second_moment(size_t i) { return v_[i]; }
  // Restores the step counter after loading moments from a checkpoint.
  void set_step(int64_t step) { step_ = step; }

 private:
  AdamWConfig config_;
  std::vector<OptimizedTensor> tensors_;
  std::vector<std::vector<float>> m_;
  std::vector<std::vector<float>> v_;
  int64_t step_ = 0;
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_OPTIMIZER_H_
