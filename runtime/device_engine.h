// The seam between the trainer and a device engine (the GPU engine, runtime/cuda/engine.h):
// the part of an optimizer step that computes (forward, backward, gradient norm, AdamW) on a
// device, while the trainer keeps its loop, data, logging, evaluation schedule and checkpoints.
// A job with resources.device: cpu never creates one: the CPU model and AdamW compute as they
// always have.
//
// Several ranks (expert parallelism): each rank's engine holds its shard; the MoE layers run
// under the trainer's ExpertParallelGroup (ExpertParallelLayers). The gradients are reduced
// over the ranks, measured and clipped where the channels can take them:
// - over channels that take device buffers (NCCL's; DataChannel::takes_device_buffers) they
//   stay on the device: packed there for each all-reduce (PackGradients, UnpackGradients),
//   measured tensor by tensor (GradSquares), scaled by the host's clipping factor in the
//   update (ScaleGradients);
// - over the others they cross to the host and back (StoreGradients, LoadGradients).
// (docs/design.md section 10.)
//
// State: the device holds the working copies of the parameters, buffers, gradients and AdamW
// moments. The trainer's CPU model and AdamW stay the checkpoint's view of them: StoreState
// copies the device state into them before a checkpoint is written, LoadState copies them to
// the device after a resume (and at creation), so checkpoints are the same file on every
// engine and a run moves between CPU and GPU by resuming.
//
// The engine lives in a library above the runtime (it uses the runtime's model as its
// oracle and its view), so the runtime never names it: the drivers hand its factory to the
// trainer in TrainerOptions::device_engine, as they hand the plan source.
#ifndef RACKRUN_RUNTIME_DEVICE_ENGINE_H_
#define RACKRUN_RUNTIME_DEVICE_ENGINE_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "jobspec/device.h"
#include "rackrun/v1/job_spec.pb.h"
#include "runtime/expert_parallel.h"
#include "runtime/model.h"
#include "runtime/optimizer.h"

namespace rackrun::runtime {

// The device figures of the last step (for logs, metrics and the step benchmark).
struct DeviceStepStats {
  std::string device;  // "NVIDIA H200 (cuda:0)"
  int64_t memory_in_use_bytes = 0;
  int64_t memory_peak_bytes = 0;  // since the engine was created
  // The peak of the bytes the engine asked for (memory_peak_bytes counts the caching
  // allocator's size classes, up to 12.5% more per block).
  int64_t memory_peak_requested_bytes = 0;
  // What the engine's caching allocator holds from the device: in use + cached for reuse.
  int64_t memory_reserved_bytes = 0;
  int64_t memory_total_bytes = 0;  // the device's
  // Device milliseconds of the last Step's phases: gemm, attention, streams, routing,
  // optimizer, other (the names in phase_names).
  std::array<double, 6> phase_ms{};
  static constexpr std::array<const char*, 6> phase_names = {"gemm",    "attention", "streams",
                                                             "routing", "optimizer", "other"};
};

class DeviceEngine {
 public:
  virtual ~DeviceEngine() = default;

  // "NVIDIA H200 (cuda:0), bf16" for the log.
  virtual std::string Describe() const = 0;

  // The host model's parameters and buffers and the host AdamW's moments and step to the
  // device, or back.
  virtual absl::Status LoadState(Model<float>& model, AdamW& adam) = 0;
  virtual absl::Status StoreState(Model<float>& model, AdamW& adam) = 0;

  // As Model<float>'s (same arguments, same errors for bad input).
  virtual absl::Status ZeroGrad() = 0;
  virtual absl::StatusOr<double> ForwardBackward(std::span<const int32_t> inputs,
                                                 std::span<const int32_t> targets, int batch,
                                                 std::span<const int32_t> segment_starts,
                                                 float grad_scale) = 0;
  virtual absl::StatusOr<double> Evaluate(std::span<const int32_t> inputs,
                                          std::span<const int32_t> targets, int batch,
                                          std::span<const int32_t> segment_starts) = 0;
  virtual const std::vector<std::vector<int64_t>>& expert_counts() const = 0;
  virtual double aux_loss() const = 0;

  // The global gradient norm (before clipping), in double in a fixed order; the clipping
  // factor (clip / norm when clip > 0 and the norm exceeds it, else 1) stays on the device
  // for the next OptimizerStep.
  virtual absl::StatusOr<double> GradNorm(double clip) = 0;
  // One AdamW step with learning rate `lr`, gradients scaled by that factor.
  virtual absl::Status OptimizerStep(double lr) = 0;

  // The last step's device figures (after OptimizerStep).
  virtual absl::StatusOr<DeviceStepStats> StepStats() = 0;
  // The allocations live when DeviceStepStats::memory_peak_requested_bytes was reached: what
  // each is for ("blocks.2.moe expert h13") and the bytes asked, largest first; they sum to
  // that peak. Apart from StepStats, which the worker asks every step: these are a few hundred
  // names to copy, for the benchmarks and a look at where the memory went.
  virtual std::vector<std::pair<std::string, int64_t>> MemoryPeakBlocks() { return {}; }

  // Expert parallelism (a job of several ranks), host-staged: the trainer reduces gradients
  // and computes the global norm on the host, as the CPU engine does.
  // The engine's MoE layers as expert-parallel layers (ExpertParallelGroup::Create installs
  // an executor in each); empty when the engine has none to offer. `shared_slots`: the group
  // shares one set of replica slots among the layers (ExpertParallelOptions::share_slots).
  virtual std::vector<ExpertParallelGroup::Layer> ExpertParallelLayers(bool /*shared_slots*/) {
    return {};
  }
  // The device's gradients into the host model's, or back. LoadGradients also makes the
  // next OptimizerStep apply them as given (the host has clipped them), not scaled by the
  // factor of a GradNorm.
  virtual absl::Status StoreGradients(Model<float>& model) = 0;
  virtual absl::Status LoadGradients(Model<float>& model) = 0;

  // Gradients kept on the device (several ranks over channels that take device buffers);
  // `tensors` are indices into Model<float>::Parameters() (the host AdamW's order).
  // True when the engine offers the calls below (the others answer Unimplemented).
  virtual bool reduces_gradients_on_device() const { return false; }
  // The gradients of `tensors`, one after another in that order, in one device buffer of
  // the engine's (valid until the next PackGradients), complete when this returns: a
  // channel on a stream of its own may read and write it.
  virtual absl::StatusOr<std::span<float>> PackGradients(std::span<const size_t> /*tensors*/) {
    return absl::UnimplementedError("this engine keeps no gradients on the device");
  }
  // The buffer of the last PackGradients back into the gradients of the same `tensors`.
  virtual absl::Status UnpackGradients(std::span<const size_t> /*tensors*/) {
    return absl::UnimplementedError("this engine keeps no gradients on the device");
  }
  // Each tensor's sum of squared gradients, in double (one entry per parameter).
  virtual absl::StatusOr<std::vector<double>> GradSquares() {
    return absl::UnimplementedError("this engine keeps no gradients on the device");
  }
  // The next OptimizerStep scales the gradients by `scale` (the host's clipping factor,
  // rounded to float as the CPU engine's AdamW rounds it), not by a GradNorm's factor.
  virtual absl::Status ScaleGradients(double /*scale*/) {
    return absl::UnimplementedError("this engine keeps no gradients on the device");
  }
};

// What a factory gets: the validated spec, the device it names for this rank, the host
// model (its configuration and initial values) and the AdamW settings.
struct DeviceEngineSetup {
  const rackrun::v1::JobSpec* spec = nullptr;
  jobspec::DeviceSpec device;
  int local_rank = 0;
  Model<float>* model = nullptr;
  AdamWConfig adamw;
};

using DeviceEngineFactory =
    std::function<absl::StatusOr<std::unique_ptr<DeviceEngine>>(const DeviceEngineSetup&)>;

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_DEVICE_ENGINE_H_
