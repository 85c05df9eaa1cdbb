// DeviceExpertInstances: runtime/expert_instances.h's seam on a GPU. A rank's masters (its shard
// of a MoE layer's experts: w13 [count x C x 2F], w2 [count x F x C] and their gradients,
// device memory the caller owns) and device copies of its replica slots; ExpertParallelExecutor
// moves every byte between ranks through host memory and the job's channel (UCX, MPI, Gloo),
// so ranks on one GPU or on several, and any channel, work alike, except the token rows over a
// channel that takes device buffers (NCCL: device rows, below). Host-staged:
//
//   BeginForward    expert rows host -> device (one copy)
//   Forward         per batch: GEMM x W13 -> SwiGLU -> GEMM x W2 (MatMul, rows_vary), then
//                   the batch's output rows device -> pinned host memory, all issued at once;
//                   the host then runs `between` (the fan-out's progress) until an event says
//                   the pass is done, and copies the rows to the executor's buffer
//   SlotsArrived    the fanned-out replica weights host -> device (this layer's slot copies)
//   BeginBackward   output-gradient rows host -> device
//   Backward        the slot gradients zeroed before the replicas' batches; per batch: dW2 += act^T
//   dy, dact, SwiGLU backward, dW13 += x^T dh13, dx;
//                   dx rows as the forward's outputs; after replica batches, their slot
//                   gradients device -> host (what the executor sends to the masters)
//   ReadMaster      a master's weights device -> host (the fan-out's source); after the first
//                   WeightsChanged on a copy stream that waits (on the device) for the last
//                   optimizer step only, so the host does not wait for the work issued since
//                   (this microbatch's routing and dispatch, or a backward in flight); before
//                   it, after everything issued on the compute stream
//   AddToMaster     a replica gradient host -> device, added to the master's (fp32, in the
//                   executor's fixed order)
//
// Device rows (runtime/expert_instances.h): device_rows() is a DeviceRows (device_rows.h), and
// Rows hands out this layer's own device buffers (in, out, dy, dx above). Passed back, they are
// used in place: BeginForward and BeginBackward copy nothing, and the passes leave their rows
// on the device (no staging, and no wait at the end of the masters' pass: the replicas' pass
// waits for both, running `between`). Device weights: FanoutStaging and SlotWeights hand out
// device memory, ReadMaster into the first copies device to device, SlotsArrived given the
// second copies nothing. Device gradients: SlotGradients and GradientStaging hand out device
// memory; the replicas' pass copies their gradients into the first device to device, and
// AddToMaster from the second adds without a copy.
//
// Every call has finished with the executor's buffers when it returns, so the executor may reuse
// them at once: copies to the host are waited for, and copies from the host read the
// executor's pageable buffers, which CUDA stages before cudaMemcpyAsync returns (the host does
// not wait for their transfer: the GEMMs queue behind it, and the host goes on, e.g. to the
// fan-out's progress; a pinned source would need a wait). The numbers: each batch's GEMMs are
// MatMul's in the job's precision, as GpuMoe's per-expert path computes them.
//
// Memory: the slots' device copies (DeviceSlots) are per layer, or one set for all layers where
// the executor's host slots are shared (ExpertParallelOptions::share_slots): a layer uploads
// into them whenever its fan-out completes, so they always hold what the host store holds.
//
// Not run on a GPU yet: checked against the CPU expert-parallel layer by gpu_moe_test.
#ifndef RACKRUN_RUNTIME_CUDA_EXPERT_INSTANCES_H_
#define RACKRUN_RUNTIME_CUDA_EXPERT_INSTANCES_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "runtime/cuda/device.h"
#include "runtime/cuda/device_rows.h"
#include "runtime/cuda/matmul.h"
#include "runtime/expert_instances.h"

namespace rackrun::runtime::cuda {

// The shard's device memory (not owned).
struct ExpertShard {
  int first = 0;   // logical index of local expert 0
  int count = 0;   // local experts
  int width = 0;   // C
  int hidden = 0;  // F
  const float* w13 = nullptr;
  const float* w2 = nullptr;
  float* dw13 = nullptr;
  float* dw2 = nullptr;
};

// Device copies of replica slots: weights [slots x 3CF] (w13 then w2 each) and their gradients
// (one replica pass's, downloaded at its end), shared by the layers given the same one.
struct DeviceSlots {
  DeviceSlots(Device* device, const std::string& name)
      : weights(device, name + " replica slot weights"),
        grads(device, name + " replica slot gradients"),
        outgoing{{device, name + " replica gradients to send (even layers)"},
                 {device, name + " replica gradients to send (odd layers)"}} {}
  DeviceTensor<float> weights, grads;
  // Device gradients: the executor's two gradient buffers (SlotGradients).
  DeviceTensor<float> outgoing[2];
};

class DeviceExpertInstances final : public ExpertInstances {
 public:
  // `device` and `matmul` must outlive this; `name` prefixes tensor names and errors. `slots`:
  // the slots' device copies, shared with other layers (null: this layer's own).
  DeviceExpertInstances(Device* device, MatMul* matmul, const ExpertShard& shard,
                        const std::string& name, std::shared_ptr<DeviceSlots> slots = nullptr);

  int first() const override { return shard_.first; }
  int count() const override { return shard_.count; }
  int width() const override { return shard_.width; }
  int hidden() const override { return shard_.hidden; }
  absl::Status ReadMaster(int local, float* dst) override;
  absl::Status SlotsArrived(const float* weights, int count) override;
  absl::Status BeginForward(const float* in, int64_t rows) override;
  absl::Status Forward(std::span<const Batch> batches, bool masters, Slots slots, float* out,
                       absl::FunctionRef<void()> between) override;
  absl::Status BeginBackward(const float* dy, int64_t rows) override;
  absl::Status Backward(std::span<const Batch> batches, bool masters, Slots slots, float* dx,
                        absl::FunctionRef<void()> between) override;
  absl::Status AddToMaster(int local, const float* g) override;
  comm::RowMover* device_rows() override { return &rows_; }
  absl::StatusOr<float*> Rows(RowsOf which, int64_t rows) override;
  absl::StatusOr<float*> FanoutStaging(int experts) override;
  absl::StatusOr<float*> SlotWeights(int slots) override;
  absl::StatusOr<float*> SlotGradients(int buffer, int slots) override;
  absl::StatusOr<float*> GradientStaging(int count) override;
  // Records where the compute stream stands (just after the optimizer step).
  absl::Status WeightsChanged() override;

 private:
  absl::Status Check(cudaError_t e, const char* what) const;
  // `floats` floats from src to dst in `kind`'s direction, issued on `stream` (null: the
  // compute stream).
  absl::Status Copy(float* dst, const float* src, int64_t floats, cudaMemcpyKind kind,
                    const char* what, cudaStream_t stream = nullptr);
  // The host waits for the compute stream when `issued` is OK; otherwise `issued`.
  absl::Status Wait(const absl::Status& issued);
  // Records the pass's end, runs `between` until the GPU has reached it, then copies the chosen
  // batches' rows from the staging buffer into `host`; for rows left on the device (`host`
  // null), only the replicas' pass waits.
  absl::Status FinishPass(std::span<const Batch> batches, bool masters, float* host,
                          absl::FunctionRef<void()> between);
  // `t` sized for `experts` experts' floats, for the channel to write (see the .cc).
  absl::Status ResizeForChannel(DeviceTensor<float>& t, int experts);
  // The slots' weights and gradients for `slots` replicas; when the channel writes the
  // weights (`for_channel`), as ResizeForChannel. From host memory the copy is queued on the
  // compute stream behind every use of the old block, so no wait.
  absl::Status SizeSlots(int slots, bool for_channel);
  // Sizes the forward's (backward's) buffers for `rows` rows.
  absl::Status ResizeForward(int64_t rows);
  absl::Status ResizeBackward(int64_t rows);
  // The weights (and gradients) of batch b's instance on the device.
  const float* W13(const Batch& b) const;
  const float* W2(const Batch& b) const;
  float* DW13(const Batch& b);
  float* DW2(const Batch& b);

  Device* device_;
  MatMul* matmul_;
  ExpertShard shard_;
  std::string name_;
  int slot_count_ = 0;  // this layer's slots, as its last SlotsArrived said
  std::shared_ptr<DeviceSlots> slots_;
  DeviceTensor<float> in_, h13_, act_, out_, dy_, dh13_, dact_, dx_, grad_;
  DeviceRows rows_;
  DeviceTensor<float> fanout_;    // masters' weights to fan out (device weights)
  DeviceTensor<float> incoming_;  // replica gradients received (device gradients)
  Event added_;                   // after the last AddToMaster (null before)
  PinnedBuffer<float> staging_;   // a pass's output rows (or row gradients) on their way up
  Event pass_done_;
  Event weights_final_;  // recorded by WeightsChanged (null before)
  Stream reads_;         // ReadMaster's copies after it
};

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_EXPERT_INSTANCES_H_
