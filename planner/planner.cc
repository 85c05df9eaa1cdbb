#include "planner/planner.h"

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "planner/baseline_planners.h"
#include "planner/eplb_planner.h"
#include "planner/quota_planner.h"

namespace rackrun::planner {

absl::Status Planner::RestoreState(std::string_view state) {
  if (state.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("the '", std::string(name()),
                                                    "' policy keeps no state between microbatches, "
                                                    "but a state of ",
                                                    state.size(), " bytes was given"));
}

absl::StatusOr<std::unique_ptr<Planner>> MakePlanner(std::string_view policy, const Domain& domain,
                                                     const PlannerOptions& options) {
  if (absl::Status status = domain.Validate(); !status.ok()) return status;
  if (!(options.eps >= 0.0 && options.eps < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("planner.eps must be in [0, 1), got ", options.eps, "; the default is 0.01"));
  }
  if (options.min_replica_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("planner.min_replica_tokens must be >= 1, got ", options.min_replica_tokens));
  }
  if (options.eplb_window < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("planner.eplb_window must be >= 1 microbatch, got ", options.eplb_window));
  }
  if (options.eplb_interval < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("planner.eplb_interval must be >= 1 microbatch, got ", options.eplb_interval));
  }
  if (options.expert_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("planner.expert_bytes must be >= 0, got ", options.expert_bytes));
  }
  if (policy == "ultraep") return std::make_unique<QuotaPlanner>(domain, options);
  if (policy == "greedy") return std::make_unique<GreedyPlanner>(domain, options);
  if (policy == "eplb") return std::make_unique<EplbPlanner>(domain, options);
  if (policy == "none") return std::make_unique<NoBalancePlanner>(domain);
  if (policy == "ideal") return std::make_unique<IdealPlanner>(domain, options);
  return absl::InvalidArgumentError(absl::StrCat("unknown planner policy '", std::string(policy),
                                                 "'; valid policies: ", PolicyNames()));
}

namespace {

constexpr PolicyTraits kPolicies[] = {
    {.name = "ultraep"},
    {.name = "greedy", .for_training = false},
    {.name = "eplb",
     .needs_load_history = true,
     .replanning = Replanning::kEveryInterval,
     .split = TokenSplit::kEven,
     .masters_at_home = false,
     .resident_replicas = true,
     .shared_slots = false},
    {.name = "none", .split = TokenSplit::kMastersOnly},
    {.name = "ideal", .bound = true, .for_training = false},
};

}  // namespace

std::span<const PolicyTraits> Policies() { return kPolicies; }

const PolicyTraits* FindPolicy(std::string_view name) {
  for (const PolicyTraits& p : kPolicies) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

std::string PolicyNames() {
  std::string names;
  for (const PolicyTraits& p : kPolicies) {
    if (!names.empty()) names += ", ";
    names += p.name;
  }
  return names;
}

}  // namespace rackrun::planner
