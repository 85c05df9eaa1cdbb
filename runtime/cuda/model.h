// GpuModel: runtime/model.h's Model<float> on one GPU, forward and backward, op for op:
//   embedding -> residual streams (Expand) -> L blocks of [GpuAttention, GpuMoe], each body
//   read from and written into the streams -> Collapse -> final RMSNorm -> LM head ->
//   cross-entropy.
// Same parameters (names, shapes, order: Parameters() lists them as the host model does, with
// device pointers), same buffers (the MoE selection biases), same initial values (taken from
// the host model, which stays the checkpoint's view: CopyToHost / CopyFromHost), same batch
// layout (runtime/model.h's LayOutBatch).
//
// Residual modes on the GPU: vanilla, hc and mhc (8 streams at most), xhc, xhc_flash and
// xhc_flash4 (runtime/cuda/xhc.h, the state in fp32, or in bf16 under model.precision bf16;
// none has run on a GPU yet, all on the simulator). A mode the GPU lacks is refused by Create
// with an Unimplemented error naming it (device_probe.h's CheckGpuResidualMode).
//
// Precision (model.precision): every GEMM through MatMul (fp32, TF32 or bf16 inputs with fp32
// accumulation); parameters, gradients and activations fp32.
//
// Device time per phase (PhaseClock) for the step benchmark and the worker's metrics.
// Not run on a GPU yet: checked against Model<float> by runtime/cuda/model_test.cc and, through
// the trainer, by runtime/cuda/train_test.cc.
#ifndef RACKRUN_RUNTIME_CUDA_MODEL_H_
#define RACKRUN_RUNTIME_CUDA_MODEL_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/cuda/attention.h"
#include "runtime/cuda/device.h"
#include "runtime/cuda/matmul.h"
#include "runtime/cuda/moe.h"
#include "runtime/cuda/phase_clock.h"
#include "runtime/expert_parallel.h"
#include "runtime/model.h"

namespace rackrun::runtime::cuda {

class GpuModel {
 public:
  // Builds the GPU model of `host`'s configuration with `host`'s current values. A host model
  // holding an expert shard (expert_rank of expert_ranks) gives MoE layers holding that shard:
  // they run only once ExpertParallelLayers' executors are installed.
  static absl::StatusOr<std::unique_ptr<GpuModel>> Create(Device* device, Model<float>& host,
                                                          GemmPrecision precision);
  ~GpuModel();

  const ModelConfig& config() const { return config_; }
  GemmPrecision precision() const { return matmul_.precision(); }
  // Every parameter in the host model's order and names; value and grad are device pointers.
  std::vector<ParamRef<float>> Parameters();
  // The host model's values and buffers to the device, or back (values and buffers only).
  absl::Status CopyFromHost(Model<float>& host);
  absl::Status CopyToHost(Model<float>& host);
  absl::Status ZeroGrad();

  // The gradients (device) into the host model's, or back.
  absl::Status GradientsToHost(Model<float>& host);
  absl::Status GradientsFromHost(Model<float>& host);
  // Every MoE layer as an expert-parallel layer: its config, a DeviceExpertInstances over its
  // shard, and the install of the group's executor into it (host-staged, expert_instances.h).
  // `shared_slots`: the executor's slots are shared by all layers (ExpertParallelOptions::
  // share_slots), and so are their device copies.
  std::vector<ExpertParallelGroup::Layer> ExpertParallelLayers(bool shared_slots);

  // As Model::ForwardBackward / Evaluate (same arguments, same errors for bad input).
  absl::StatusOr<double> ForwardBackward(std::span<const int32_t> inputs,
                                         std::span<const int32_t> targets, int batch,
                                         std::span<const int32_t> segment_starts, float grad_scale);
  absl::StatusOr<double> Evaluate(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                                  int batch, std::span<const int32_t> segment_starts);

  const std::vector<std::vector<int64_t>>& expert_counts() const { return expert_counts_; }
  // The residual streams as the model drives them (model.cc's vanilla and XhcStreams drivers).
  class Residual;
  double aux_loss() const { return aux_loss_; }
  // The clock the model's and its layers' work marks (the engine adds the optimizer).
  PhaseClock& clock() { return clock_; }

 private:
  struct Slot {
    std::string name;
    int64_t offset = 0;  // floats into values_ / grads_
    int64_t size = 0;
    std::vector<int64_t> shape;
  };
  GpuModel(Device* device, const ModelConfig& config, GemmPrecision precision);
  absl::Status Init(Model<float>& host);
  float* Value(const std::string& name);
  float* Grad(const std::string& name);
  absl::Status Prepare(std::span<const int32_t> inputs, std::span<const int32_t> targets, int batch,
                       std::span<const int32_t> segment_starts);
  absl::StatusOr<double> Forward();
  absl::Status Backward(float grad_scale);
  absl::Status Check(cudaError_t e, const char* what) const;
  // Every parameter's value (or gradient: `grads`) between `host` and the device in `kind`'s
  // direction, on the compute stream, without waiting; Internal when the lists differ. The
  // buffers (the MoE layers' selection biases) the same way.
  absl::Status CopyParameters(Model<float>& host, bool grads, cudaMemcpyKind kind);
  absl::Status CopyBuffers(Model<float>& host, cudaMemcpyKind kind);

  Device* device_;
  ModelConfig config_;
  MatMul matmul_;
  PhaseClock clock_;
  std::vector<Slot> slots_;         // non-residual parameters, in host order
  std::vector<std::string> order_;  // every parameter name in host order
  DeviceTensor<float> values_, grads_, biases_;
  std::vector<std::string> bias_names_;
  std::unique_ptr<Residual> residual_;
  // The layers' scratch, one of each kind for all blocks (they run one at a time): attention's
  // gradients of its activations; MoE's too, and what its forward writes and its backward
  // recomputes (moe.h's MoeScratch).
  std::unique_ptr<AttentionScratch> attention_scratch_;
  std::unique_ptr<MoeScratch> moe_scratch_;
  std::vector<std::unique_ptr<GpuAttention>> attention_;
  std::vector<std::unique_ptr<GpuMoe>> moe_;

  // The microbatch.
  BatchLayout layout_;
  int64_t counted_ = 0;
  std::vector<int32_t> host_inputs_, embed_ids_;
  std::vector<int64_t> embed_first_, embed_order_;
  DeviceTensor<int32_t> inputs_, targets_, doc_start_, embed_ids_d_;
  DeviceTensor<int64_t> embed_first_d_, embed_order_d_;
  DeviceTensor<float> embedded_, collapsed_, final_, final_inv_rms_, logits_;
  // Each sublayer's body input (u: its layer reads it again in the backward) and one body
  // output for all (the residual streams' WriteOutput consumes it; what their backward needs
  // of it they keep themselves).
  std::vector<DeviceTensor<float>> body_in_;
  DeviceTensor<float> body_out_;
  DeviceTensor<double> row_loss_, loss_sum_;
  DeviceTensor<float> dfinal_, dcollapsed_, dbody_, dbody_out_, dembedded_, partial_;

  std::vector<std::vector<int64_t>> expert_counts_;
  double aux_loss_ = 0;
};

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_MODEL_H_
