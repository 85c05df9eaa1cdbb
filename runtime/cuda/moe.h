// GpuMoe: runtime/layers/moe.h's MoeLayer<float> on a GPU, forward and backward, with the CPU
// layer's parameters (norm [C], router [C x E], experts.w13 [E x C x 2F], experts.w2
// [E x F x C], shared.{w13,w2} when on; the buffer router_bias [E]) and numerics (softmax
// router, top-k of score + bias with ties to the lower expert, renormalised gates, the
// Switch auxiliary loss through the mean scores, DeepSeek-V3's selection-bias step):
//
//   RMSNorm -> router GEMM -> RouterForward -> ExpertCounts -> [one device-to-host copy of
//   the E counts: the planner solves this microbatch's plan on the host] -> SlotRows (the
//   permutation, from the counts' prefix sums) -> DispatchRows -> per plan batch (expert
//   instance): GEMM x W13 -> SwiGLU (one launch over all rows) -> per batch: GEMM act W2 ->
//   CombineRows (+ the shared expert)
//
// The plan is UltraEP's (planner/): on one GPU the policy is `none` (every expert's tokens to
// its one instance), and expert_permutation.h turns plan + loads into the batches whose rows
// each expert GEMM takes. The expert GEMMs are issued back to back, one cuBLASLt call per
// expert and matrix, with algorithms chosen per power-of-two bucket of the row count
// (MatMul's rows_vary): the counts change every microbatch, so neither a CUDA graph of fixed
// shapes nor one heuristic per shape would be reused.
//
// Weights and gradients live in device memory the caller owns; the bias too.
// Not run on a GPU yet: checked against MoeLayer<float> by runtime/cuda/moe_test.cc.
#ifndef RACKRUN_RUNTIME_CUDA_MOE_H_
#define RACKRUN_RUNTIME_CUDA_MOE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/planner.h"
#include "runtime/cuda/device.h"
#include "runtime/cuda/expert_permutation.h"
#include "runtime/cuda/matmul.h"
#include "runtime/cuda/phase_clock.h"
#include "runtime/layers/moe.h"

namespace rackrun::runtime::cuda {

struct MoeWeights {
  const float* norm = nullptr;
  const float* router = nullptr;
  const float* w13 = nullptr;         // [E x C x 2F]
  const float* w2 = nullptr;          // [E x F x C]
  const float* shared_w13 = nullptr;  // [C x 2Fs] or null without a shared expert
  const float* shared_w2 = nullptr;   // [Fs x C]
  float* dnorm = nullptr;
  float* drouter = nullptr;
  float* dw13 = nullptr;
  float* dw2 = nullptr;
  float* dshared_w13 = nullptr;
  float* dshared_w2 = nullptr;
  float* bias = nullptr;  // [E], the aux-loss-free selection bias (updated in place)
};

class GpuMoe {
 public:
  // The config as MoeLayer's, holding every expert (local_experts 0 or experts: expert
  // shards across GPUs are not built yet). `matmul` must outlive the layer.
  static absl::StatusOr<std::unique_ptr<GpuMoe>> Create(Device* device, MatMul* matmul,
                                                        const MoeLayerConfig& config,
                                                        const std::string& name,
                                                        MoeWeights weights);

  // out [tokens x C] = body(u) (device). `u` must stay valid until Backward. Synchronises
  // the compute stream once (the counts for the planner).
  absl::Status Forward(const float* u, int64_t tokens, float* out);
  // du overwritten; gradients of grad_scale * (upstream loss + aux loss) accumulated.
  absl::Status Backward(const float* dout, float grad_scale, float* du);
  // DeepSeek-V3's bias step from the last Forward's counts (no-op at rate 0).
  absl::Status UpdateSelectionBias();

  // Per-expert routed-token counts of the last Forward (host; sum = tokens * top_k).
  const std::vector<int64_t>& counts() const { return counts_; }
  // The auxiliary loss of the last Forward (already multiplied by the coefficient).
  double aux_loss() const { return aux_loss_; }
  // Marks GEMMs (router, experts) as gemm and the rest as routing on `clock` (null: none).
  void set_clock(PhaseClock* clock) { clock_ = clock; }
  // The last Forward's plan batches (one per expert instance on this GPU).
  const std::vector<ExpertBatch>& batches() const { return batches_; }

 private:
  GpuMoe(Device* device, MatMul* matmul, const MoeLayerConfig& config, const std::string& name,
         MoeWeights weights, std::unique_ptr<planner::Planner> planner);
  absl::Status Check(cudaError_t e, const char* what) const;
  // Forward's steps: the counts to the host, the plan and its batches, the slot rows and the
  // dispatched rows; the aux loss (0 unless aux_loss_coef > 0) from the counts and scores.
  absl::Status PlanAndDispatch(int64_t tokens);
  absl::Status AuxLossForward(int64_t tokens);
  // The expert FFN over the rows of every batch (h13, act kept for the backward).
  absl::Status ExpertsForward();
  absl::Status ExpertsBackward();
  // The shared expert on every token: forward into out (overwritten), backward into dxn
  // (overwritten).
  absl::Status SharedForward(float* out);
  absl::Status SharedBackward(const float* dout);

  Device* device_;
  MatMul* matmul_;
  MoeLayerConfig config_;
  std::string name_;
  MoeWeights w_;
  std::unique_ptr<planner::Planner> planner_;
  PhaseClock* clock_ = nullptr;

  // State of the last Forward.
  const float* u_ = nullptr;
  int64_t tokens_ = 0;
  std::vector<int64_t> counts_, offsets_;
  std::vector<int32_t> counts_host_;
  std::vector<ExpertBatch> batches_;
  std::vector<double> slot_fraction_;
  double aux_loss_ = 0;
  DeviceTensor<float> xn_, inv_rms_, scores_, weights_, dispatched_, h13_, act_, expert_out_;
  DeviceTensor<int32_t> selected_, counts_d_;
  DeviceTensor<int64_t> offsets_d_, slot_row_;
  DeviceTensor<double> column_partial_, column_sums_;
  DeviceTensor<float> shared_h13_, shared_act_;
  // Backward scratch.
  DeviceTensor<float> dexpert_out_, dweights_, dscores_, aux_grad_, dh13_, dact_, ddispatched_,
      dxn_, partial_;
};

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_MOE_H_
