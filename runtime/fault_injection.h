// FaultInjection: one fault the end-to-end tests inject into expert-parallel training at
// one rank, MoE layer and microbatch, to check that the job stops naming the culprit.
//
// Kinds (docs/failure-model.md lists the tests that use them):
//   plan_hash  the rank's plan fingerprint is perturbed: the ranks disagree on the plan;
//   stall      the rank sleeps past the data channel's timeout before the load exchange;
//   exit       the rank's process ends (_Exit(3)) there.
//
// Read from one place: the process's fault (ProcessFaultInjection), which the layer that
// injects, ExpertParallelGroup, takes when it is created. The main()s of `rackrun train`
// and `rackrun-worker` set it once at start from RACKRUN_FAULT
// ("KIND:rank=R,layer=L,microbatch=M"; InstallFaultInjectionFromEnvironment), so a
// malformed value is refused before anything runs, naming the variable; nothing below a
// main() reads the environment. A test injects for its own scope (ScopedFaultInjection).
// A FaultInjection is immutable after parsing; the process's fault is set and read under a
// lock.
#ifndef RACKRUN_RUNTIME_FAULT_INJECTION_H_
#define RACKRUN_RUNTIME_FAULT_INJECTION_H_

#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
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

// The fault this process injects; nullopt (the default) = none. Thread-safe.
std::optional<FaultInjection> ProcessFaultInjection();
// Replaces the process's fault (a main() at start; tests through ScopedFaultInjection).
// Groups created before keep the fault they took.
void SetProcessFaultInjection(std::optional<FaultInjection> fault);
// RACKRUN_FAULT (FaultInjection::FromEnvironment) as the process's fault: none when unset;
// InvalidArgument naming the variable, the value and the expected form when malformed
// (then nothing is set).
absl::Status InstallFaultInjectionFromEnvironment();

// Sets `fault` as the process's fault while it lives and restores the previous one (tests).
class ScopedFaultInjection {
 public:
  explicit ScopedFaultInjection(std::optional<FaultInjection> fault)
      : previous_(ProcessFaultInjection()) {
    SetProcessFaultInjection(std::move(fault));
  }
  ~ScopedFaultInjection() { SetProcessFaultInjection(std::move(previous_)); }
  ScopedFaultInjection(const ScopedFaultInjection&) = delete;
  ScopedFaultInjection& operator=(const ScopedFaultInjection&) = delete;

 private:
  std::optional<FaultInjection> previous_;
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_FAULT_INJECTION_H_
