// The `none`, `greedy` and `ideal` baselines.
#ifndef RACKRUN_PLANNER_BASELINE_PLANNERS_H_
#define RACKRUN_PLANNER_BASELINE_PLANNERS_H_

#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/plan.h"
#include "planner/planner.h"
#include "planner/quota_planner.h"

namespace rackrun::planner {

// `none`: masters only; every token is processed at its expert's home rank.
class NoBalancePlanner final : public Planner {
 public:
  explicit NoBalancePlanner(const Domain& domain) : domain_(domain) {}
  std::string_view name() const override { return "none"; }
  absl::StatusOr<Plan> Solve(const LoadMatrix& loads, int layer) override;
  absl::Status SolveInto(const LoadMatrix& loads, int layer, Plan* plan) override;

 private:
  Domain domain_;
  QuotaSplit split_;
};

// `greedy`: the plain greedy baseline: starting from masters only, move the largest
// instance of the heaviest rank into a free slot of the rank with most room and fill that
// rank to the mean, until the heaviest rank cannot shed load (GreedyRebalancer in
// quota_planner.h has the exact rule). Masters stay home and keep a token unless
// allow_zero_master_quota; slot budget as for ultraep.
class GreedyPlanner final : public Planner {
 public:
  GreedyPlanner(const Domain& domain, const PlannerOptions& options)
      : domain_(domain), options_(options), assembler_(options) {}
  std::string_view name() const override { return "greedy"; }
  absl::StatusOr<Plan> Solve(const LoadMatrix& loads, int layer) override;
  absl::Status SolveInto(const LoadMatrix& loads, int layer, Plan* plan) override;

 private:
  Domain domain_;
  PlannerOptions options_;
  PlanAssembler assembler_;
  GreedyRebalancer greedy_;
  std::vector<int64_t> totals_;
  std::vector<ReplicaQuota> replicas_;
};

// `ideal`: the force-balanced bound. Rank r processes exactly floor(W/G) tokens, plus one
// for the first W mod G ranks (W = all tokens, G = ranks), so max/mean is 1 up to integer
// rounding. It is a bound, not a deployable plan: replicas are unconstrained by the slot
// budget (check it with InvariantOptions::enforce_slot_budget = false) and a master may
// keep zero tokens. Its Plan: every master stays home and keeps as much of its expert as
// its rank's share allows (experts of a rank in ascending id); what does not fit is poured,
// experts in ascending id, into ranks with room left in ascending rank order, one replica
// per (expert, rank) it reaches. Split by QuotaSplit, fan-out by FanoutScheduler.
class IdealPlanner final : public Planner {
 public:
  IdealPlanner(const Domain& domain, const PlannerOptions& options);
  std::string_view name() const override { return "ideal"; }
  absl::StatusOr<Plan> Solve(const LoadMatrix& loads, int layer) override;
  absl::Status SolveInto(const LoadMatrix& loads, int layer, Plan* plan) override;

 private:
  Domain domain_;
  PlannerOptions options_;
  FanoutScheduler fanout_;
  QuotaSplit split_;
  std::vector<int64_t> totals_;
  std::vector<int64_t> room_;
  std::vector<int64_t> left_;
};

}  // namespace rackrun::planner

#endif  // RACKRUN_PLANNER_BASELINE_PLANNERS_H_
