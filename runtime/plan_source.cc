#include "runtime/plan_source.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace rackrun::runtime {

absl::Status PlanSource::RestoreState(std::string_view state) {
  if (state.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("the ", name(), " plan source keeps no balancer history here"));
}

absl::StatusOr<std::unique_ptr<InBandPlanSource>> InBandPlanSource::Create(
    comm::DataChannel& channel, const planner::Domain& domain, std::string_view policy,
    const planner::PlannerOptions& options) {
  std::unique_ptr<InBandPlanSource> source(new InBandPlanSource(channel));
  for (auto* p : {&source->train_, &source->eval_}) {
    absl::StatusOr<std::unique_ptr<planner::Planner>> planner =
        planner::MakePlanner(policy, domain, options);
    if (!planner.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("balancer.policy: ", planner.status().message()));
    }
    *p = *std::move(planner);
  }
  return source;
}

absl::Status InBandPlanSource::Solve(const Request& request, planner::LoadMatrix* loads,
                                     planner::Plan* plan) {
  const int64_t experts = static_cast<int64_t>(request.local_loads.size());
  if (loads->ranks != channel_.size() || loads->experts != experts) {
    *loads = planner::LoadMatrix(channel_.size(), static_cast<int>(experts));
  }
  if (absl::Status s = channel_.Allgather(request.local_loads.data(), loads->counts.data(),
                                          experts, comm::DataType::kInt64);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("exchanging expert loads: ", s.message()));
  }
  planner::Planner& planner = request.training ? *train_ : *eval_;
  if (absl::Status s = planner.SolveInto(*loads, request.layer, plan); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("planning: ", s.message()));
  }
  return absl::OkStatus();
}

void LoadsFromPlan(const planner::Plan& plan, planner::LoadMatrix* loads) {
  *loads = planner::LoadMatrix(plan.ranks, plan.experts);
  const int n = plan.num_instances();
  for (int src = 0; src < plan.ranks; ++src) {
    for (int e = 0; e < plan.experts; ++e) {
      int64_t sum = 0;
      for (int i = plan.first[static_cast<size_t>(e)]; i < plan.first[static_cast<size_t>(e) + 1];
           ++i) {
        sum += plan.split[static_cast<size_t>(src) * static_cast<size_t>(n) +
                          static_cast<size_t>(i)];
      }
      loads->at(src, e) = sum;
    }
  }
}

}  // namespace rackrun::runtime
