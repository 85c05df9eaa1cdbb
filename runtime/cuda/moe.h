// GpuMoe: runtime/layers/moe.h's MoeLayer<float> on a GPU, forward and backward, with the CPU
// layer's parameters (norm [C], router [C x E], experts.w13 [E x C x 2F], experts.w2
// [E x F x C], shared.{w13,w2} when on; the buffer router_bias [E]) and numerics (softmax
// router, top-k of score + bias with ties to the lower expert, renormalised gates, the
// Switch auxiliary loss through the mean scores, DeepSeek-V3's selection-bias step):
//
//   RMSNorm -> router GEMM -> RouterForward -> ExpertCounts -> the E counts (and, with the aux
//   loss, the E score sums) copied to pinned host memory, an event behind them
//   -> issued while that copy is in flight: ExpertOffsets, SlotRows, DispatchRows (the
//      permutation from the counts in device memory), the shared expert (GEMM, SwiGLU, GEMM)
//   -> the host waits on the event; the planner solves this microbatch's plan from the counts
//   -> per plan batch (expert instance): GEMM x W13 -> SwiGLU (one launch over all rows) ->
//      per batch: GEMM act W2 -> CombineRows (+ the shared expert's output)
//
// So the device-to-host copy and the host's wait overlap the dispatch and the shared expert:
// the host blocks once per layer, when the device has nothing left to run but the expert
// GEMMs, which need the plan's row counts. Every output is computed by the same operations
// in the same order as with the wait first (the shared expert writes `out`, the combine adds
// to it, as before): the same numbers bit for bit. The backward waits for nothing on the
// host; its one upload (the aux loss's E gradients, from pageable memory) may be made
// synchronous with the host by CUDA, as pageable copies may (not measured).
//
// The backward starts by computing again what the forward wrote into the model's shared
// scratch (MoeScratch): the normed input, then, for local experts, the activations from the
// kept h13 and the expert outputs by the same W2 GEMM (the gates' gradients need them), and
// after the W2 backward the dispatched rows by the same gather. The same kernels on the same
// inputs: the same numbers. It costs one W2 GEMM more (a ninth of the expert GEMMs' work, fwd +
// bwd) and two memory-bound passes, and saves 52 KiB a token a layer at c1024.
//
// The plan is UltraEP's (planner/): on one GPU the policy is `none` (every expert's tokens to
// its one instance), and expert_permutation.h turns plan + loads into the batches whose rows
// each expert GEMM takes. The device dispatches by expert order before the plan exists; after
// the wait the layer checks that the plan's batches are that order (an Internal error
// otherwise: a plan with replicas on one GPU needs the plan's permutation on the device, not
// built). Under expert parallelism (SetExecutor, below) the executor plans over all ranks, and
// its token dispatch (host-staged) carries out the plan's split, replicas included.
//
// The expert GEMMs (MatMul::ExpertsLinear / ExpertsLinearBackward) run on one of two paths,
// chosen per layer (expert_gemm_path; new layers take DefaultExpertGemmPath()):
//   per_expert  one cuBLASLt call per expert and matrix, algorithms per power-of-two bucket
//               of the row count (MatMul's rows_vary): the default, the path measured first;
//   grouped     one cuBLAS grouped GEMM per matrix (forward W13, W2; backward dW and dX of
//               each), experts without rows left out (grouped_gemm.h). Not run on a GPU.
// Neither uses a CUDA graph: the row counts change every microbatch.
//
// Weights and gradients live in device memory the caller owns; the bias too. The pinned
// buffers (E int32 + E doubles) are allocated once per layer by Create.
// Not run on a GPU yet: checked against MoeLayer<float> by runtime/cuda/moe_test.cc.
#ifndef RACKRUN_RUNTIME_CUDA_MOE_H_
#define RACKRUN_RUNTIME_CUDA_MOE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/planner.h"
#include "runtime/cuda/device.h"
#include "runtime/cuda/expert_instances.h"
#include "runtime/cuda/expert_permutation.h"
#include "runtime/cuda/grouped_gemm.h"
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

// The expert-GEMM path GpuMoe::Create gives new layers (process-wide; per_expert unless set):
// the step benchmark sets it to run both paths side by side, since the engine builds its
// layers itself. Thread-safe.
void SetDefaultExpertGemmPath(ExpertGemmPath path);
ExpertGemmPath DefaultExpertGemmPath();

// What a layer writes and reads within one Forward or within one Backward and keeps nowhere
// between them (the expert-parallel exchange included: it runs in the compute stream's
// order), so the layers of a model share one (GpuModel does), as they run one after another
// on that stream. Must outlive the layers given it.
//
// Forward: the normed input [tokens x C]; the dispatched rows [tokens x top-k rows of C], then,
// once the W13 GEMM has read them, the expert outputs in the same rows; the activations
// [rows of F] (the shared expert's [tokens x Fs] first). Backward: the same recomputed where
// they were (the normed input from u by the same kernel, the activations from the kept h13,
// the expert outputs by the same W2 GEMM, the dispatched rows by the same gather: the
// forward's numbers), and the gradients of the expert outputs, h13, the activations, the
// dispatched rows and the normed input. A layer keeps between its passes only h13 (rows of
// 2F; the shared expert's too), its input u (the caller's), the router's scores, gates and
// choices, the slot rows and, under expert parallelism, the expert outputs (computed on other
// ranks). At c1024 (8192 tokens, top-4, C = F = 1024) a layer keeps 32 KiB a token
// where it kept 84 KiB.
struct MoeScratch {
  MoeScratch(Device* device, const std::string& name);
  DeviceTensor<float> xn, rows, act;
  DeviceTensor<float> dexpert_out, dh13, dact, ddispatched, dxn;
};

class GpuMoe {
 public:
  // The config as MoeLayer's. A layer holding a shard (local_experts in (0, experts); w13, w2
  // and their gradients then hold the shard's experts) runs only under an expert-parallel
  // executor (SetExecutor). `matmul` (and `scratch`, when given) must outlive the layer;
  // without `scratch` the layer has its own.
  static absl::StatusOr<std::unique_ptr<GpuMoe>> Create(Device* device, MatMul* matmul,
                                                        const MoeLayerConfig& config,
                                                        const std::string& name, MoeWeights weights,
                                                        MoeScratch* scratch = nullptr);

  // out [tokens x C] = body(u) (device). `u` must stay valid until Backward. The host waits
  // once, on the counts' copy, after issuing the dispatch and the shared expert.
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
  ExpertGemmPath expert_gemm_path() const { return path_; }
  void set_expert_gemm_path(ExpertGemmPath path) { path_ = path; }

  // Expert parallelism, host-staged (runtime/expert_parallel.h): the executor plans over every
  // rank's loads and runs this rank's instances through a DeviceExpertInstances over shard().
  // Forward then queues the dispatched rows' copy to pinned host memory after the counts'
  // wait, lets the executor prepare the pass (its load exchange, plan and fan-out) while they
  // travel, waits for them, hands them to the executor and queues its outputs' copy back
  // before the combine (Backward mirrors it); the aux loss and the bias step use the
  // executor's counts over all ranks.
  void SetExecutor(std::unique_ptr<ExpertExecutor<float>> executor) {
    executor_ = std::move(executor);
  }
  bool sharded() const;
  // This layer's experts in device memory (the whole layer when not sharded).
  ExpertShard shard() const;
  const MoeLayerConfig& config() const { return config_; }

 private:
  // The counts (and the score sums) on their way to the host, and the event behind them.
  struct HostCopies {
    PinnedBuffer<int32_t> counts;
    PinnedBuffer<double> score_sums;
    Event ready;
  };
  GpuMoe(Device* device, MatMul* matmul, const MoeLayerConfig& config, const std::string& name,
         MoeWeights weights, std::unique_ptr<planner::Planner> planner, HostCopies host,
         MoeScratch* scratch);
  absl::Status Check(cudaError_t e, const char* what) const;
  // Forward's steps: the copies to the host (with the score sums when aux_loss_coef > 0) and
  // their event; the device-side permutation (offsets, slot rows, dispatched rows); after the
  // wait, the plan, its batches and their check; the aux loss from the copied sums.
  absl::Status CopyCountsToHost(int64_t tokens);
  absl::Status DispatchOnDevice(int64_t tokens);
  absl::Status CountsFromHost();  // the wait on the counts' copy; counts_ and offsets_
  absl::Status PlanFromCounts();  // CountsFromHost, then the one-GPU plan and its batches
  // Expert parallelism's expert step through the executor, forward and backward.
  absl::Status ExpertsForwardOnRanks();
  absl::Status ExpertsBackwardOnRanks();
  // Their common path: `prepare`, then `run` from `from` into `to` where the executor keeps the
  // rows on the device (ExpertExecutor::device_rows); otherwise `from` to the host while
  // `prepare` runs, `run` over the host rows, its output up into `to`.
  absl::Status OnRanks(const DeviceTensor<float>& from, DeviceTensor<float>* to,
                       absl::FunctionRef<absl::Status()> prepare,
                       absl::FunctionRef<absl::Status(const float*, float*)> run);
  // The executor's counts over all ranks, or this layer's own.
  const std::vector<int64_t>& global_counts() const;
  void AuxLossFromSums(int64_t tokens);
  // The expert FFN over the rows of every batch: the dispatched rows in rows_, the expert
  // outputs out in rows_ (h13 kept for the backward).
  absl::Status ExpertsForward();
  // h13 (local experts) or the expert outputs (expert parallelism) for `slots` rows.
  absl::Status ReserveExpertRows(int64_t slots);
  // SwiGLU and the W2 GEMM: the activations and the expert outputs (into rows_) from h13; in
  // the forward, and again in the backward.
  absl::Status ExpertOutputsFromH13();
  absl::Status ExpertsBackward();
  // The backward's start: the normed input again (from u, the forward's kernel) and, for local
  // experts, the activations and the expert outputs.
  absl::Status RecomputeForBackward();
  // Where the expert outputs are: rows_ (local experts), expert_out_ (expert parallelism).
  float* ExpertOutputs() { return executor_ != nullptr ? expert_out_.data() : rows_.data(); }
  // The shared expert on every token: forward into out (overwritten), backward into dxn
  // (overwritten).
  absl::Status SharedForward(float* out);
  absl::Status SharedBackward(const float* dout);
  // The shared expert's activations from its h13, into act_ (the scratch's).
  absl::Status SharedActivations();

  Device* device_;
  MatMul* matmul_;
  MoeLayerConfig config_;
  std::string name_;
  MoeWeights w_;
  std::unique_ptr<planner::Planner> planner_;
  HostCopies host_;
  ExpertGemmPath path_;
  PhaseClock* clock_ = nullptr;
  std::unique_ptr<ExpertExecutor<float>> executor_;  // expert parallelism, or null
  PinnedBuffer<float> host_rows_, host_out_;         // its host staging
  Event rows_ready_;                                 // the rows' copy to host_rows_

  // State of the last Forward.
  const float* u_ = nullptr;
  int64_t tokens_ = 0;
  std::vector<int64_t> counts_, offsets_;
  std::vector<ExpertBatch> batches_;
  std::vector<double> slot_fraction_;
  double aux_loss_ = 0;
  DeviceTensor<float> inv_rms_, scores_, weights_, h13_, expert_out_;
  DeviceTensor<int32_t> selected_, counts_d_, global_counts_d_;
  DeviceTensor<int64_t> offsets_d_, slot_row_, slot_scratch_;
  DeviceTensor<double> column_partial_, column_sums_;
  DeviceTensor<float> shared_h13_;
  // Scratch: its own or the model's (MoeScratch), then the small ones.
  std::unique_ptr<MoeScratch> own_scratch_;
  MoeScratch* scratch_;
  DeviceTensor<float>& xn_;
  DeviceTensor<float>& rows_;
  DeviceTensor<float>& act_;
  DeviceTensor<float>& dexpert_out_;
  DeviceTensor<float>& dh13_;
  DeviceTensor<float>& dact_;
  DeviceTensor<float>& ddispatched_;
  DeviceTensor<float>& dxn_;
  DeviceTensor<float> dweights_, dscores_, aux_grad_, partial_;
};

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_MOE_H_
