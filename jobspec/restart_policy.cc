#include "jobspec/restart_policy.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "jobspec/field_checks.h"

namespace rackrun::jobspec {
namespace {

using rackrun::v1::FailureKind;

// The words of spec.restart.on, in the order messages list them.
constexpr std::pair<std::string_view, FailureKind> kFailureKinds[] = {
    {"worker_lost", rackrun::v1::WORKER_LOST},
    {"hang", rackrun::v1::HANG},
    {"error", rackrun::v1::ERROR},
    {"worker_cancelled", rackrun::v1::WORKER_CANCELLED},
};

}  // namespace

void ApplyRestartDefaults(rackrun::v1::RestartSpec& restart) {
  if (restart.max_attempts() == 0) restart.set_max_attempts(1);
  if (restart.on().empty()) {
    for (const char* kind : {"worker_lost", "hang", "worker_cancelled"}) restart.add_on(kind);
  }
  if (restart.backoff_s() == 0) restart.set_backoff_s(1);
}

absl::Status ValidateRestart(const rackrun::v1::RestartSpec& restart) {
  if (absl::Status s = AtLeast("restart.max_attempts", restart.max_attempts(), 1,
                               "1 = never restart; 0 = the default 1");
      !s.ok()) {
    return s;
  }
  for (const std::string& kind : restart.on()) {
    if (!FailureKindOf(kind).has_value()) {
      return FieldError("restart.on",
                        absl::StrCat("unknown failure kind '", kind,
                                     "'; choose from worker_lost, hang, error, worker_cancelled"));
    }
  }
  if (restart.backoff_s() < 0 || !std::isfinite(restart.backoff_s())) {
    return FieldError("restart.backoff_s", "must be a finite number of seconds >= 0");
  }
  return absl::OkStatus();
}

std::string FailureKindName(FailureKind kind) {
  for (const auto& [name, k] : kFailureKinds) {
    if (k == kind) return std::string(name);
  }
  return "unspecified";
}

std::optional<FailureKind> FailureKindOf(std::string_view name) {
  for (const auto& [n, kind] : kFailureKinds) {
    if (n == name) return kind;
  }
  return std::nullopt;
}

int64_t RestartPolicy::BackoffMs(int next_attempt) const {
  const double s = backoff_s * std::pow(2.0, std::max(0, next_attempt - 2));
  return static_cast<int64_t>(std::min(s, 3600.0) * 1000.0);
}

absl::StatusOr<RestartPolicy> RestartPolicyOf(const rackrun::v1::JobSpec& spec) {
  rackrun::v1::RestartSpec restart = spec.restart();
  ApplyRestartDefaults(restart);
  if (absl::Status s = ValidateRestart(restart); !s.ok()) return s;
  RestartPolicy p;
  p.max_attempts = restart.max_attempts();
  p.backoff_s = restart.backoff_s();
  for (const std::string& kind : restart.on()) p.on.insert(*FailureKindOf(kind));
  return p;
}

}  // namespace rackrun::jobspec
