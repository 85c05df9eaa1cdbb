// LM head and next-token cross-entropy: logits = x W (W is [width x vocab]),
// loss = mean over counted tokens of -log softmax(logits)[target]. Targets < 0 are not
// counted (padding).
#ifndef RACKRUN_RUNTIME_LAYERS_LM_HEAD_H_
#define RACKRUN_RUNTIME_LAYERS_LM_HEAD_H_

#include <cstdint>
#include <string>

#include "runtime/layers/parameter.h"
#include "runtime/tensor.h"

namespace rackrun::runtime {

template <typename T>
class LmHead {
 public:
  LmHead(int width, int vocab, const std::string& name);

  Parameter<T>& weight() { return weight_; }

  // Returns the mean cross-entropy (in double) and the number of counted tokens.
  double Forward(const T* x, const int32_t* targets, int64_t rows, int64_t* counted);
  // dx = d(grad_scale * loss)/dx (overwritten); accumulates grad_scale * dW.
  void Backward(const T* x, T grad_scale, T* dx);

 private:
  int width_;
  int vocab_;
  Parameter<T> weight_;
  // Per-microbatch state from Forward.
  int64_t rows_ = 0;
  int64_t counted_ = 0;
  const int32_t* targets_ = nullptr;
  Tensor<T> logits_;  // softmax probabilities after Forward
  Tensor<double> row_loss_;
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_LAYERS_LM_HEAD_H_
