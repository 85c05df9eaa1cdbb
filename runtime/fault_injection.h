// FaultInjection: one fault the end-to-end tests inject into expert-parallel training at
// one rank, MoE layer and microbatch, to check that the job stops naming the culprit.
//
// Kinds (docs/failure-model.md lists the tests that use them):
//   plan_hash  the rank's plan fingerprint is perturbed: the ranks disagree on the plan;
//   stall      the rank sleeps past the data channel's timeout before the load exchange;
//   exit       the rank's process ends (_Exit(3)) there.
//
// Parsed once where a process starts — `rackrun train` and `rackrun-worker` read
// RACKRUN_FAULT ("KIND:rank=R,layer=L,microbatch=M") with FromEnvironment, so a malformed
// value is refused before anything runs — and handed down as an object, like the plan
// source: TrainerOptions::faults -> ExpertParallelOptions::faults (not owned; null = none).
// Immutable after parsing; thread-compatible.
#ifndef RACKRUN_RUNTIME_FAULT_INJECTION_H_
#define RACKRUN_RUNTIME_FAULT_INJECTION_H_

#include <cstdint>
#include <optional>
#include <string_view>

#include "absl/status/statusor.h"

namespace rackrun::runtime {

enum class FaultKind { kPlanHash, kStall, kExit };

class FaultInjection {
 public:
  // The environment variable FromEnvironment reads.
  static constexpr const char* kVariable = "RACKRUN_FAULT";

  // "KIND:rank=R,layer=L,microbatch=M" (all three keys, any order). InvalidArgument names
  // RACKRUN_FAULT, the value and the expected form.
  static absl::StatusOr<FaultInjection> Parse(std::string_view value);
  // RACKRUN_FAULT when set (Parse's errors), nullopt when not.
  static absl::StatusOr<std::optional<FaultInjection>> FromEnvironment();

  // True when this fault is of `kind` and due on `rank` at MoE layer `layer` in
  // microbatch `microbatch` (the expert-parallel group's count).
  bool Due(FaultKind kind, int rank, int layer, int64_t microbatch) const {
    return kind == kind_ && rank == rank_ && layer == layer_ && microbatch == microbatch_;
  }

  FaultKind kind() const { return kind_; }
  int rank() const { return rank_; }
  int layer() const { return layer_; }
  int64_t microbatch() const { return microbatch_; }

 private:
  FaultInjection() = default;

  FaultKind kind_ = FaultKind::kPlanHash;
  int rank_ = -1;
  int layer_ = -1;
  int64_t microbatch_ = -1;
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_FAULT_INJECTION_H_
