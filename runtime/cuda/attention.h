// GpuAttention: runtime/layers/attention.h's sublayer body on a GPU (pre-norm RMSNorm -> QKV
// projection -> rotary embedding -> causal multi-head softmax attention with document masks
// -> output projection), forward and backward, with the CPU layer's parameters and
// conventions (same shapes: norm [C], wqkv [C x 3C], wo [C x C]; same packed batch and
// doc_start rule). The core is attention_kernels.h's flash-style kernels (on tensor cores in
// bf16 or TF32 when the job computes in them, on CUDA cores in fp32); the projections run
// through MatMul in the job's precision.
//
// The weights live in device memory the caller owns (the GPU model's parameter buffer); the
// layer keeps its activations for the backward (q/k/v after rotation, the attention output,
// one log-sum-exp per query row and head, the inverse rms; the normed input is computed again
// from u, which the caller keeps: AttentionScratch).
//
// Supported head dims: 16, 32, 64, 128 (Create says which, naming model.width / model.heads).
// Not run on a GPU yet: checked against the CPU layer by runtime/cuda/attention_test.cc.
#ifndef RACKRUN_RUNTIME_CUDA_ATTENTION_H_
#define RACKRUN_RUNTIME_CUDA_ATTENTION_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/cuda/attention_kernels.h"
#include "runtime/cuda/device.h"
#include "runtime/cuda/matmul.h"
#include "runtime/cuda/phase_clock.h"

namespace rackrun::runtime::cuda {

// A layer's weights and their gradients, in device memory (gradients accumulate).
struct AttentionWeights {
  const float* norm = nullptr;
  const float* wqkv = nullptr;
  const float* wo = nullptr;
  float* dnorm = nullptr;
  float* dwqkv = nullptr;
  float* dwo = nullptr;
};

// What a layer writes and reads within one Forward or within one Backward and keeps nowhere
// between them, so the layers of a model share one (GpuModel does), as they run one after
// another on the compute stream. Must outlive the layers given it. The normed input
// [tokens x C] (the forward's; the backward computes it again from u by the same kernel, for
// the qkv projection's weight gradient) and the gradients of the attention output, qkv and the
// normed input ([tokens x C], [tokens x 3C], [tokens x C]). A layer keeps between its passes
// qkv (rotated), the attention output, the log-sum-exps and the inverse rms; u is the caller's.
struct AttentionScratch {
  AttentionScratch(Device* device, const std::string& name);
  DeviceTensor<float> xn, dattn, dqkv, dxn;
};

class GpuAttention {
 public:
  // `matmul` (and `scratch`, when given) must outlive the layer. Without `scratch` the layer
  // has its own. InvalidArgument for a head dim the kernels lack.
  static absl::StatusOr<std::unique_ptr<GpuAttention>> Create(
      Device* device, MatMul* matmul, int width, int heads, int max_seq, double rope_theta,
      const std::string& name, AttentionWeights weights, AttentionScratch* scratch = nullptr);

  // out [tokens x C] = body(u), tokens = batch * seq (device pointers). `u` and `doc_start`
  // (device, [tokens]) must stay valid until Backward.
  absl::Status Forward(const float* u, int batch, int seq, const int32_t* doc_start, float* out);
  // du = J^T dout (overwritten); parameter gradients accumulated.
  absl::Status Backward(const float* dout, float* du);
  // Marks the projections as gemm and the core as attention on `clock` (null: none).
  void set_clock(PhaseClock* clock) { clock_ = clock; }

 private:
  GpuAttention(Device* device, MatMul* matmul, int width, int heads, int max_seq,
               const std::string& name, AttentionWeights weights, AttentionScratch* scratch);
  absl::Status Check(cudaError_t e, const char* what) const;
  // Tensor cores in bf16 or TF32 when the job computes in them (model.precision), fp32 CUDA
  // cores for fp32 (attention_kernels.h).
  attention::Cores Cores() const;

  Device* device_;
  MatMul* matmul_;
  int width_, heads_, head_dim_, max_seq_;
  std::string name_;
  AttentionWeights w_;
  PhaseClock* clock_ = nullptr;
  DeviceTensor<float> rope_cos_, rope_sin_;  // [max_seq x head_dim / 2]
  // State of the last Forward.
  const float* u_ = nullptr;
  const int32_t* doc_start_ = nullptr;
  int batch_ = 0, seq_ = 0;
  DeviceTensor<float> inv_rms_, qkv_, attn_, lse_;
  // Scratch: its own or the model's (AttentionScratch), then the small ones.
  std::unique_ptr<AttentionScratch> own_scratch_;
  AttentionScratch* scratch_;
  DeviceTensor<float>& xn_;
  DeviceTensor<float>& dattn_;
  DeviceTensor<float>& dqkv_;
  DeviceTensor<float>& dxn_;
  DeviceTensor<float> delta_, partial_;
};

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_ATTENTION_H_
