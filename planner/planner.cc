#include "planner/planner.h"

#include <cstdint>
#include <memory>
#include <optional>
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

namespace {

// "RRPLPAIR": a training state and an evaluation state, each after its length (8 bytes,
// little-endian as the planners' own states).
constexpr char kPairMagic[8] = {'R', 'R', 'P', 'L', 'P', 'A', 'I', 'R'};

void PutLength(std::string& out, uint64_t n) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
}

// The next length-prefixed part of `in` (advanced past it); nullopt when truncated.
std::optional<std::string_view> TakePart(std::string_view& in) {
  if (in.size() < 8) return std::nullopt;
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= static_cast<uint64_t>(static_cast<unsigned char>(in[i])) << (8 * i);
  in.remove_prefix(8);
  if (n > in.size()) return std::nullopt;
  const std::string_view part = in.substr(0, static_cast<size_t>(n));
  in.remove_prefix(static_cast<size_t>(n));
  return part;
}

}  // namespace

std::string SavePlannerStates(const Planner& training, const Planner& evaluation) {
  std::string train = training.SaveState();
  const std::string eval = evaluation.SaveState();
  if (eval.empty()) return train;
  std::string out(kPairMagic, sizeof(kPairMagic));
  PutLength(out, train.size());
  out += train;
  PutLength(out, eval.size());
  out += eval;
  return out;
}

absl::Status RestorePlannerStates(std::string_view state, Planner& training, Planner& evaluation) {
  if (!state.starts_with(std::string_view(kPairMagic, sizeof(kPairMagic)))) {
    return training.RestoreState(state);
  }
  std::string_view in = state.substr(sizeof(kPairMagic));
  const std::optional<std::string_view> train = TakePart(in);
  const std::optional<std::string_view> eval = train ? TakePart(in) : std::nullopt;
  if (!eval || !in.empty()) {
    return absl::DataLossError(absl::StrCat("planner states of ", state.size(),
                                            " bytes: truncated or with trailing bytes"));
  }
  // The training planner first (its error is the one a mismatched checkpoint names), rolled
  // back if the evaluation one refuses its state: both planners restored, or neither changed.
  const std::string train_before = training.SaveState();
  if (absl::Status s = training.RestoreState(*train); !s.ok()) return s;
  if (absl::Status s = evaluation.RestoreState(*eval); !s.ok()) {
    training.RestoreState(train_before).IgnoreError();  // its own state: cannot fail
    return absl::Status(s.code(), absl::StrCat("the evaluation planner's state: ", s.message()));
  }
  return absl::OkStatus();
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
