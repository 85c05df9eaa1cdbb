// The invariant checker every plan must pass (tests run it on thousands of inputs; the
// runtime runs it on every plan it executes).
#ifndef RACKRUN_PLANNER_INVARIANTS_H_
#define RACKRUN_PLANNER_INVARIANTS_H_

#include "absl/status/status.h"
#include "planner/plan.h"

namespace rackrun::planner {

struct InvariantOptions {
  // Masters stay at their home rank (ultraep, none). EPLB re-places masters, so false.
  bool masters_at_home = true;
  // Each rank holds at most capacity_per_rank() instances. `ideal` is an unconstrained
  // bound and is checked with this off.
  bool enforce_slot_budget = true;
  // A master keeps at least one token of a non-zero expert load.
  bool master_keeps_a_token = false;
};

// Ok, or FailedPrecondition naming the first violated invariant with the expert, rank or
// source involved: shapes, token conservation per (src, e), quota = column sum of the split,
// non-negative quotas and splits, slot budget, no two instances of an expert on one rank,
// domain confinement, instance grouping/order, fan-out schedule delivers each replica once.
absl::Status CheckPlanInvariants(const Domain& domain, const LoadMatrix& loads, const Plan& plan,
                                 const InvariantOptions& options = {});

}  // namespace rackrun::planner

#endif  // RACKRUN_PLANNER_INVARIANTS_H_
