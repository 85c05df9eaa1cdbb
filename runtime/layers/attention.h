// Attention sublayer body: pre-norm RMSNorm -> QKV projection -> rotary position
// embedding -> causal multi-head softmax attention -> output projection.
//
// Packed batch: the input is [batch * seq] token rows, each batch row its own sequence.
// Inside a row, documents are separated by `doc_start`: doc_start[t] is the index
// (within the row) of the first token of t's document, and token t attends only to
// keys j with doc_start[t] <= j <= t. Rotary positions are the index within the row;
// rotary attention depends only on relative positions, so a document starting mid-row
// sees exactly what it would see at the start of a row.
#ifndef RACKRUN_RUNTIME_LAYERS_ATTENTION_H_
#define RACKRUN_RUNTIME_LAYERS_ATTENTION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/layers/parameter.h"
#include "runtime/layers/rmsnorm.h"
#include "runtime/tensor.h"

namespace rackrun::runtime {

template <typename T>
class Attention {
 public:
  // `prefix` names the parameters: prefix.norm, prefix.wqkv, prefix.wo.
  Attention(int width, int heads, int max_seq, double rope_theta, const std::string& prefix);

  // wqkv ~ N(0, std), wo ~ N(0, out_std); norm gain 1.
  void Init(NormalInit& rng, double std, double out_std);
  std::vector<ParamRef<T>> Parameters();

  // out[tokens x width] = body(u). tokens = batch * seq, seq <= max_seq. The pointers
  // `u` and `doc_start` must stay valid until Backward.
  void Forward(const T* u, int batch, int seq, const int32_t* doc_start, T* out);
  // du = J^T dout (overwritten); parameter gradients accumulated.
  void Backward(const T* dout, T* du);

 private:
  void ApplyRope(T* qkv, int64_t tokens, int seq, bool inverse) const;

  int width_;
  int heads_;
  int head_dim_;
  int max_seq_;
  RmsNorm<T> norm_;
  Parameter<T> wqkv_;              // [width x 3 width]: q | k | v, heads contiguous within each
  Parameter<T> wo_;                // [width x width]
  Tensor<T> rope_cos_, rope_sin_;  // [max_seq x head_dim / 2]

  // State of the last Forward.
  const T* u_ = nullptr;
  const int32_t* doc_start_ = nullptr;
  int batch_ = 0;
  int seq_ = 0;
  Tensor<T> xn_;     // normed input
  Tensor<T> qkv_;    // q, k after rotary; v
  Tensor<T> probs_;  // [batch * heads x seq x seq]
  Tensor<T> attn_;   // [tokens x width] heads concatenated
  // Backward scratch.
  Tensor<T> dattn_, dqkv_, dxn_, dscores_;
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_LAYERS_ATTENTION_H_
