#include "planner/baseline_planners.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/plan.h"

namespace rackrun::planner {

absl::StatusOr<Plan> NoBalancePlanner::Solve(const LoadMatrix& loads, int layer) {
  Plan plan;
  if (absl::Status status = SolveInto(loads, layer, &plan); !status.ok()) return status;
  return plan;
}

absl::Status NoBalancePlanner::SolveInto(const LoadMatrix& loads, int /*layer*/, Plan* plan) {
  // Masters only: each quota is its expert's total.
  if (absl::Status status = ValidatedExpertTotals(domain_, loads, &plan->quota); !status.ok()) {
    return status;
  }
  const int experts = domain_.experts();
  plan->ranks = domain_.ranks;
  plan->experts = experts;
  plan->instances.resize(static_cast<size_t>(experts));
  plan->first.resize(static_cast<size_t>(experts) + 1);
  for (int e = 0; e < experts; ++e) {
    plan->instances[static_cast<size_t>(e)] = ExpertInstance{e, domain_.home_rank(e), true};
    plan->first[static_cast<size_t>(e)] = e;
  }
  plan->first[static_cast<size_t>(experts)] = experts;
  split_.Fill(loads, plan);
  plan->fanout.transfers.clear();
  return absl::OkStatus();
}

absl::StatusOr<Plan> GreedyPlanner::Solve(const LoadMatrix& loads, int layer) {
  Plan plan;
  if (absl::Status status = SolveInto(loads, layer, &plan); !status.ok()) return status;
  return plan;
}

absl::Status GreedyPlanner::SolveInto(const LoadMatrix& loads, int /*layer*/, Plan* plan) {
  if (absl::Status status = ValidatedExpertTotals(domain_, loads, &totals_); !status.ok()) {
    return status;
  }
  replicas_.clear();
  greedy_.Run(domain_, totals_, options_.allow_zero_master_quota ? 0 : 1, 1, 0, &replicas_);
  assembler_.Build(domain_, loads, totals_, replicas_, plan);
  return absl::OkStatus();
}

IdealPlanner::IdealPlanner(const Domain& domain, const PlannerOptions& options)
    : domain_(domain),
      options_(options),
      fanout_(options.fanout),
      split_(options.locality_aware_split, options.split_rounding) {}

absl::StatusOr<Plan> IdealPlanner::Solve(const LoadMatrix& loads, int layer) {
  Plan plan;
  if (absl::Status status = SolveInto(loads, layer, &plan); !status.ok()) return status;
  return plan;
}

absl::Status IdealPlanner::SolveInto(const LoadMatrix& loads, int /*layer*/, Plan* plan) {
  if (absl::Status status = ValidatedExpertTotals(domain_, loads, &totals_); !status.ok()) {
    return status;
  }
  const int ranks = domain_.ranks;
  const int experts = domain_.experts();
  int64_t total = 0;
  for (const int64_t t : totals_) total += t;
  room_.resize(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    room_[static_cast<size_t>(r)] = total / ranks + (r < total % ranks ? 1 : 0);
  }
  // Masters keep what fits in their rank's share.
  left_.resize(static_cast<size_t>(experts));
  plan->ranks = ranks;
  plan->experts = experts;
  plan->instances.clear();
  plan->quota.clear();
  plan->first.assign(static_cast<size_t>(experts) + 1, 0);
  std::vector<int64_t> master_quota(static_cast<size_t>(experts));
  for (int e = 0; e < experts; ++e) {
    int64_t& room = room_[static_cast<size_t>(domain_.home_rank(e))];
    const int64_t keep = std::min(totals_[static_cast<size_t>(e)], room);
    room -= keep;
    master_quota[static_cast<size_t>(e)] = keep;
    left_[static_cast<size_t>(e)] = totals_[static_cast<size_t>(e)] - keep;
  }
  // The rest is poured into ranks with room, in ascending rank order.
  int target = 0;
  for (int e = 0; e < experts; ++e) {
    plan->instances.push_back(ExpertInstance{e, domain_.home_rank(e), true});
    plan->quota.push_back(master_quota[static_cast<size_t>(e)]);
    int64_t left = left_[static_cast<size_t>(e)];
    while (left > 0) {
      while (room_[static_cast<size_t>(target)] == 0) ++target;
      const int64_t q = std::min(left, room_[static_cast<size_t>(target)]);
      plan->instances.push_back(ExpertInstance{e, target, false});
      plan->quota.push_back(q);
      room_[static_cast<size_t>(target)] -= q;
      left -= q;
    }
    plan->first[static_cast<size_t>(e) + 1] = static_cast<int32_t>(plan->instances.size());
  }
  split_.Fill(loads, plan);
  fanout_.Schedule(*plan, &plan->fanout);
  return absl::OkStatus();
}

}  // namespace rackrun::planner
