#include "jobspec/balancer.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rackrun::jobspec {

namespace {

constexpr BalancerModeTraits kModes[] = {
    {BalancerMode::kInBand, "inband"},
    {BalancerMode::kCoordinator, "coordinator"},
};
static_assert(kModes[0].name == kDefaultBalancerMode);

// "a, b or c".
std::string OneOfList(const std::vector<std::string>& choices) {
  if (choices.size() <= 1) return choices.empty() ? std::string() : choices[0];
  return absl::StrCat(
      absl::StrJoin(std::vector<std::string>(choices.begin(), choices.end() - 1), ", "), " or ",
      choices.back());
}

}  // namespace

std::span<const BalancerModeTraits> BalancerModes() { return kModes; }

const BalancerModeTraits* FindBalancerMode(std::string_view name) {
  for (const BalancerModeTraits& m : kModes) {
    if (m.name == name) return &m;
  }
  return nullptr;
}

std::string BalancerModeChoices() {
  std::vector<std::string> choices;
  for (const BalancerModeTraits& m : kModes) choices.emplace_back(m.name);
  return OneOfList(choices);
}

BalancerMode BalancerModeOf(const rackrun::v1::JobSpec& spec) {
  const std::string& name = spec.balancer().mode();
  const BalancerModeTraits* mode = FindBalancerMode(name.empty() ? kDefaultBalancerMode : name);
  return mode != nullptr ? mode->mode : kModes[0].mode;
}

bool PlannedByCoordinator(const rackrun::v1::JobSpec& spec) {
  return BalancerModeOf(spec) == BalancerMode::kCoordinator;
}

std::string TrainingPolicyChoices() {
  std::vector<std::string> choices = {std::string(kDefaultBalancerPolicy)};
  for (const planner::PolicyTraits& p : planner::Policies()) {
    if (p.for_training && p.name != kDefaultBalancerPolicy) choices.emplace_back(p.name);
  }
  return OneOfList(choices);
}

absl::StatusOr<BalancerSetup> BalancerSetupOf(const rackrun::v1::JobSpec& spec, int ranks) {
  const rackrun::v1::BalancerSpec& b = spec.balancer();
  const rackrun::v1::ModelSpec& m = spec.model();
  const int experts = m.moe().experts();
  if (ranks <= 0 || experts <= 0 || experts % ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat("model.moe.experts: ", experts,
                                                   " experts cannot be sharded over ", ranks,
                                                   " ranks; use a multiple of resources.ranks"));
  }
  BalancerSetup s;
  s.domain = {ranks, experts / ranks, b.slots()};
  if (absl::Status st = s.domain.Validate(); !st.ok()) return st;
  s.policy = planner::FindPolicy(b.policy());
  if (s.policy == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("balancer.policy: unknown planner policy '",
                                                   b.policy(),
                                                   "'; valid policies: ", planner::PolicyNames()));
  }
  s.planner.eps = b.eps();
  s.planner.min_replica_tokens = b.min_replica_tokens();
  s.planner.locality_aware_split = b.locality();
  s.planner.eplb_window = b.eplb_window();
  s.planner.eplb_interval = b.eplb_interval();
  // A SwiGLU expert: w1 and w3 (width x hidden) and w2 (hidden x width), float32, as
  // runtime's SwigluExperts holds them (expert_floats()).
  s.planner.expert_bytes =
      3 * int64_t{m.width()} * m.moe().expert_hidden() * static_cast<int64_t>(sizeof(float));
  s.invariants = s.policy->invariants();
  s.shared_slots = b.shared_slots();
  return s;
}

}  // namespace rackrun::jobspec
