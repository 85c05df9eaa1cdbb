// ExpertInstances: where one MoE layer's expert instances on one rank keep their weights and
// compute. The device seam of expert parallelism (docs/design.md section 4.2):
// ExpertParallelExecutor (expert_parallel.h) decides (the plan, the fan-out, the dispatch
// layout, which batch runs when, the order replica gradients are added in) and moves every
// byte between ranks through the job's channel, from host buffers (from device buffers where both
// sides allow: device rows, weights and gradients, below); an ExpertInstances holds the
// rank's masters (its shard) and the working copies of the replica slots, and runs the SwiGLU
// batches on them.
//
//   HostExpertInstances            the CPU engine: computes in place on the host, replicas from
//                                  the executor's host slot store, their gradients into it;
//   cuda::DeviceExpertInstances    a GPU: expert rows, replica weights and replica gradients
//                                  cross through host memory unless kept on the device
//                                  (runtime/cuda/expert_instances.h).
//
// Call order per microbatch, from one thread: BeginForward; Forward over the masters'
// batches, then (after SlotsArrived where replica weights moved) over the replicas'; later
// BeginBackward and Backward in the same split. ReadMaster and AddToMaster come between
// microbatches' compute (fan-out sends, replica gradients reaching their masters).
//
// Batches are the rank's expert-row buffer cut by instance, one per instance (dispatch
// layout, comm/token_dispatch.h): rows [offset, offset + rows) of `in`, `out`, `dy`, `dx`.
//
// Device rows (optional): instances computing on a GPU may keep the dispatch's rows there
// (device_rows() non-null), and the executor does so when its channel takes device buffers
// (DataChannel::takes_device_buffers), with the replica weights and gradients too (device
// weights and gradients, below). The executor then dispatches into, and combines
// from, the buffers Rows hands out, packing with device_rows(), and passes those buffers to
// BeginForward, Forward, BeginBackward and Backward: no row crosses to the host. A pass over
// the masters may then return before its GPU work is done (the replicas' pass, which follows,
// waits for both, running `between`); the stream orders the combine after them.
#ifndef RACKRUN_RUNTIME_EXPERT_INSTANCES_H_
#define RACKRUN_RUNTIME_EXPERT_INSTANCES_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/token_dispatch.h"
#include "runtime/layers/moe.h"
#include "runtime/tensor.h"

namespace rackrun::runtime {

class ExpertInstances {
 public:
  struct Batch {
    int64_t offset = 0;
    int64_t rows = 0;
    int master = -1;  // local index of this rank's master expert, or -1 for a replica
    int slot = -1;    // the replica's slot, or -1 for a master
  };
  // The executor's host slot store of this layer: weights [slots x expert_floats], each w13
  // then w2; gradients the same shape (this microbatch's, zeroed by the executor).
  struct Slots {
    const float* weights = nullptr;
    float* grads = nullptr;
  };

  virtual ~ExpertInstances() = default;

  // The shard: logical experts [first, first + count) of width C and hidden F.
  virtual int first() const = 0;
  virtual int count() const = 0;
  virtual int width() const = 0;
  virtual int hidden() const = 0;
  int64_t expert_floats() const { return 3 * static_cast<int64_t>(width()) * hidden(); }

  // Master `local`'s weights, w13 then w2, into dst [expert_floats] (host): what fan-out sends.
  virtual absl::Status ReadMaster(int local, float* dst) = 0;
  // Slots [0, count) of `weights` (host, the store's) now hold the replica weights the next
  // replica batches run with.
  virtual absl::Status SlotsArrived(const float* weights, int count) = 0;
  // The microbatch's expert rows `in` [rows x C] (host); the caller keeps them until Backward.
  virtual absl::Status BeginForward(const float* in, int64_t rows) = 0;
  // The output rows (host) of the batches whose instance is a master (masters = true) or a
  // replica. `between` runs on the calling thread between batches (the fan-out's progress).
  // Which batches run side by side depends on all of `batches`, not on `masters`.
  virtual absl::Status Forward(std::span<const Batch> batches, bool masters, Slots slots,
                               float* out, absl::FunctionRef<void()> between) = 0;
  // The output gradients `dy` [rows x C] (host, the rows of BeginForward); kept until the
  // last Backward.
  virtual absl::Status BeginBackward(const float* dy, int64_t rows) = 0;
  // dx rows of the chosen batches overwritten (host); masters' weight gradients accumulated
  // where the instances keep them, replicas' into slots.grads.
  virtual absl::Status Backward(std::span<const Batch> batches, bool masters, Slots slots,
                                float* dx, absl::FunctionRef<void()> between) = 0;
  // A replica's weight gradient g [expert_floats] (host) added to master `local`'s.
  virtual absl::Status AddToMaster(int local, const float* g) = 0;
  // Device rows (above): the mover, or null when the rows live on the host.
  virtual comm::RowMover* device_rows() { return nullptr; }
  // The buffer of `rows` x width() floats for the rows `which` names, in the mover's memory,
  // valid until the next Rows call for the same rows after the pass (forward: kIn and kOut,
  // backward: kDy and kDx). Only where device_rows() is non-null.
  enum class RowsOf { kIn, kOut, kDy, kDx };
  virtual absl::StatusOr<float*> Rows(RowsOf which, int64_t rows) {
    (void)which;
    (void)rows;
    return absl::UnimplementedError("these expert instances keep their rows on the host");
  }
  // Device weights (with device rows, over the same channel): the fan-out sends masters'
  // weights from, and receives replicas' weights into, device memory. FanoutStaging hands out
  // room for `experts` masters' weights (ReadMaster's `dst` then lies in it and stays on the
  // device); SlotWeights sizes the slots' device store for `slots` slots and returns it (the
  // fan-out receives there, and SlotsArrived is then given it and copies nothing). Only where
  // device_rows() is non-null. A replicas' pass has finished on the device when it returns, so
  // the slots may be written as soon as it has.
  virtual absl::StatusOr<float*> FanoutStaging(int experts) {
    (void)experts;
    return absl::UnimplementedError(
        "these expert instances keep their weights' copies on the host");
  }
  virtual absl::StatusOr<float*> SlotWeights(int slots) {
    (void)slots;
    return absl::UnimplementedError(
        "these expert instances keep their weights' copies on the host");
  }
  // Device gradients (with device weights): the replicas' gradients are sent from, and the
  // masters' receive them into, device memory. SlotGradients sizes device buffer `buffer` (0
  // or 1: the executor's gradient buffers, by layer parity where slots are shared) for `slots`
  // slots and zeroes it in the device's order; given as Slots::grads, Backward fills it on the
  // device. GradientStaging hands out room for `count` received gradients (AddToMaster's `g`
  // then lies in it, and the add copies nothing), after the adds from it issued before.
  virtual absl::StatusOr<float*> SlotGradients(int buffer, int slots) {
    (void)buffer;
    (void)slots;
    return absl::UnimplementedError("these expert instances keep their gradients on the host");
  }
  virtual absl::StatusOr<float*> GradientStaging(int count) {
    (void)count;
    return absl::UnimplementedError("these expert instances keep their gradients on the host");
  }
  // The masters' weights were just updated (an optimizer step, issued): ReadMaster may read
  // them without waiting for work issued after this. Whoever writes the masters' weights
  // after the first call calls it again (ExpertParallelGroup::WeightsChanged does).
  virtual absl::Status WeightsChanged() { return absl::OkStatus(); }
};

// On the host, in place over a MoE layer's SwigluExperts (not owned; it must outlive this):
// batches run as LocalExpertExecutor's (RunExpertBatches), so results do not depend on which
// rank runs an instance.
class HostExpertInstances final : public ExpertInstances {
 public:
  explicit HostExpertInstances(SwigluExperts<float>* experts) : experts_(experts) {}

  int first() const override { return experts_->first(); }
  int count() const override { return experts_->count(); }
  int width() const override { return experts_->width(); }
  int hidden() const override { return experts_->hidden(); }
  absl::Status ReadMaster(int local, float* dst) override;
  absl::Status SlotsArrived(const float*, int) override { return absl::OkStatus(); }
  absl::Status BeginForward(const float* in, int64_t rows) override;
  absl::Status Forward(std::span<const Batch> batches, bool masters, Slots slots, float* out,
                       absl::FunctionRef<void()> between) override;
  absl::Status BeginBackward(const float* dy, int64_t rows) override;
  absl::Status Backward(std::span<const Batch> batches, bool masters, Slots slots, float* dx,
                        absl::FunctionRef<void()> between) override;
  absl::Status AddToMaster(int local, const float* g) override;

 private:
  // Calls body(b) for the chosen batches with the threading of one pass over all of them.
  void ForEach(std::span<const Batch> batches, bool masters, absl::FunctionRef<void()> between,
               absl::FunctionRef<void(const Batch&)> body);

  SwigluExperts<float>* experts_;
  const float* in_ = nullptr;
  const float* dy_ = nullptr;
  std::vector<int64_t> offsets_;
  std::vector<int> cold_;
  Tensor<float> h13_, act_, dh13_, dact_;
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_EXPERT_INSTANCES_H_
