// PhaseClock: where a training step spends its device time, by phase, from CUDA events on the
// compute stream (no synchronisation until Collect). A layer marks the phase its next work
// belongs to; the time between two marks counts to the earlier one. The split the step
// benchmark and the worker's metrics report (issue 35: GEMM, attention, streams, routing,
// optimizer; "other" holds norms, the embedding and the loss).
#ifndef RACKRUN_RUNTIME_CUDA_PHASE_CLOCK_H_
#define RACKRUN_RUNTIME_CUDA_PHASE_CLOCK_H_

#include <array>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/cuda/device.h"

namespace rackrun::runtime::cuda {

enum class Phase : int { kGemm, kAttention, kStreams, kRouting, kOptimizer, kOther };
inline constexpr int kPhases = 6;
// "gemm", "attention", "streams", "routing", "optimizer", "other".
const char* PhaseName(Phase phase);

using PhaseTimes = std::array<double, kPhases>;  // milliseconds, indexed by Phase

class PhaseClock {
 public:
  explicit PhaseClock(Device* device) : device_(device) {}

  // From here on the compute stream's work counts to `phase`. A failure to record is kept
  // for Collect (marks never stop the work they time).
  void Mark(Phase phase);
  // Milliseconds per phase from the first Mark to now (a last event is recorded and waited
  // for); the marks start over.
  absl::StatusOr<PhaseTimes> Collect();

 private:
  Device* device_;
  std::vector<Event> events_;  // reused step to step
  std::vector<Phase> phases_;
  size_t used_ = 0;
  absl::Status error_;
};

// Marks `phase` on `clock` when there is one (layers hold a nullable clock).
inline void MarkPhase(PhaseClock* clock, Phase phase) {
  if (clock != nullptr) clock->Mark(phase);
}

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_PHASE_CLOCK_H_
