// The restart policy of a job (spec.restart): which failures restart it, how often, and
// after what backoff. One definition for every party: ApplySpecDefaults and
// ValidateJobSpec (jobspec/spec.h) fill in and check spec.restart with the functions
// below, and the coordinator restarts attempts by the RestartPolicy they give.
//
// Defaults: max_attempts 1 (never restart), on {worker_lost, hang, worker_cancelled}
// (what the job did not cause; a job's own error is not retried unless listed), backoff
// 1 s, doubling per further attempt.
#ifndef RACKRUN_JOBSPEC_RESTART_POLICY_H_
#define RACKRUN_JOBSPEC_RESTART_POLICY_H_

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rackrun/v1/job_service.pb.h"
#include "rackrun/v1/job_spec.pb.h"

namespace rackrun::jobspec {

// Fills the zeros and the empty list of `restart` with the defaults above.
void ApplyRestartDefaults(rackrun::v1::RestartSpec& restart);

// Checks a defaulted spec.restart: max_attempts >= 1, known failure kinds in `on`, a
// finite backoff_s >= 0. InvalidArgument naming `restart.<field>` otherwise.
absl::Status ValidateRestart(const rackrun::v1::RestartSpec& restart);

// "worker_lost", "hang", "error", "worker_cancelled": the words of spec.restart.on, and
// the `reason` label of the coordinator's failure metrics. "unspecified" for others.
std::string FailureKindName(rackrun::v1::FailureKind kind);
// The kind a word of spec.restart.on names; nullopt for an unknown word.
std::optional<rackrun::v1::FailureKind> FailureKindOf(std::string_view name);

// spec.restart with its defaults, as the coordinator applies it. A default-constructed
// policy never restarts.
struct RestartPolicy {
  int max_attempts = 1;
  std::set<rackrun::v1::FailureKind> on;
  double backoff_s = 1.0;

  bool Restarts(rackrun::v1::FailureKind kind) const { return on.count(kind) > 0; }
  // Delay before attempt `next_attempt` (2, 3, ...): backoff_s * 2^(next_attempt - 2),
  // at most an hour.
  int64_t BackoffMs(int next_attempt) const;
};

// The policy of `spec` (defaults applied to a copy of spec.restart first);
// ValidateRestart's InvalidArgument when spec.restart is invalid.
absl::StatusOr<RestartPolicy> RestartPolicyOf(const rackrun::v1::JobSpec& spec);

}  // namespace rackrun::jobspec

#endif  // RACKRUN_JOBSPEC_RESTART_POLICY_H_
