#include "planner/invariants.h"

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "planner/plan.h"

namespace rackrun::planner {
namespace {

absl::Status Violation(const std::string& what) {
  return absl::FailedPreconditionError(absl::StrCat("plan invariant violated: ", what));
}

// Shapes: the plan is ranks x experts, and its first, quota and split arrays agree.
absl::Status CheckShape(const Plan& plan, int ranks, int experts) {
  const size_t n = plan.instances.size();
  if (plan.ranks != ranks || plan.experts != experts) {
    return Violation(absl::StrCat("shape: plan is ", plan.ranks, " ranks x ", plan.experts,
                                  " experts, domain is ", ranks, " x ", experts));
  }
  if (plan.first.size() != static_cast<size_t>(experts) + 1 || plan.first[0] != 0) {
    return Violation(absl::StrCat("shape: first has ", plan.first.size(),
                                  " entries (need experts + 1, starting at 0)"));
  }
  if (static_cast<size_t>(plan.first[static_cast<size_t>(experts)]) != n) {
    return Violation(
        absl::StrCat("shape: first[experts] = ", plan.first[static_cast<size_t>(experts)],
                     " but there are ", n, " instances"));
  }
  if (plan.quota.size() != n) {
    return Violation(absl::StrCat("shape: ", plan.quota.size(), " quotas for ", n, " instances"));
  }
  if (absl::Status status = ValidateSplitShape(plan); !status.ok()) {
    return Violation(absl::StrCat("shape: ", status.message()));
  }
  return absl::OkStatus();
}

// Grouping, order, confinement, one master per expert, no duplicate per rank, and (when
// asked) the slot budget.
absl::Status CheckInstances(const Domain& domain, const Plan& plan,
                            const std::vector<int64_t>& totals, const InvariantOptions& options) {
  const int ranks = domain.ranks;
  const int experts = domain.experts();
  std::vector<int> per_rank(static_cast<size_t>(ranks), 0);
  for (int e = 0; e < experts; ++e) {
    const int begin = plan.first[static_cast<size_t>(e)];
    const int end = plan.first[static_cast<size_t>(e) + 1];
    if (end <= begin) {
      return Violation(absl::StrCat("expert ", e, " has no instance (first[", e, "] = ", begin,
                                    ", first[", e + 1, "] = ", end, ")"));
    }
    for (int i = begin; i < end; ++i) {
      const ExpertInstance& instance = plan.instances[static_cast<size_t>(i)];
      if (instance.expert != e) {
        return Violation(absl::StrCat("grouping: instance ", i, " is of expert ", instance.expert,
                                      " but lies in expert ", e, "'s range"));
      }
      if (instance.rank < 0 || instance.rank >= ranks) {
        return Violation(absl::StrCat("domain confinement: expert ", e, " has an instance on rank ",
                                      instance.rank, " outside [0, ", ranks, ")"));
      }
      if (instance.master != (i == begin)) {
        return Violation(absl::StrCat(
            "order: expert ", e, " must have exactly one master, first; instance ", i, " on rank ",
            instance.rank, " is ", instance.master ? "a master" : "a replica"));
      }
      if (i > begin + 1 && plan.instances[static_cast<size_t>(i) - 1].rank >= instance.rank) {
        return Violation(absl::StrCat(
            "order: replicas of expert ", e, " must be in strictly ascending rank (rank ",
            instance.rank, " follows rank ", plan.instances[static_cast<size_t>(i) - 1].rank, ")"));
      }
      if (i > begin && plan.instances[static_cast<size_t>(begin)].rank == instance.rank) {
        return Violation(absl::StrCat("duplicate instance: expert ", e,
                                      " has two instances on rank ", instance.rank));
      }
      ++per_rank[static_cast<size_t>(instance.rank)];
      if (plan.quota[static_cast<size_t>(i)] < 0) {
        return Violation(absl::StrCat("negative quota ", plan.quota[static_cast<size_t>(i)],
                                      " for expert ", e, " on rank ", instance.rank));
      }
    }
    const ExpertInstance& master = plan.instances[static_cast<size_t>(begin)];
    if (options.masters_at_home && master.rank != domain.home_rank(e)) {
      return Violation(absl::StrCat("master of expert ", e, " is on rank ", master.rank,
                                    ", not its home rank ", domain.home_rank(e)));
    }
    if (options.master_keeps_a_token && totals[static_cast<size_t>(e)] > 0 &&
        plan.quota[static_cast<size_t>(begin)] < 1) {
      return Violation(absl::StrCat("master of expert ", e, " on rank ", master.rank,
                                    " keeps no token of a load of ",
                                    totals[static_cast<size_t>(e)]));
    }
  }
  if (options.enforce_slot_budget) {
    for (int r = 0; r < ranks; ++r) {
      if (per_rank[static_cast<size_t>(r)] > domain.capacity_per_rank()) {
        return Violation(absl::StrCat("slot budget: rank ", r, " holds ",
                                      per_rank[static_cast<size_t>(r)], " instances, capacity is ",
                                      domain.capacity_per_rank(), " (masters + slots)"));
      }
    }
  }
  return absl::OkStatus();
}

// Splits: non-negative, conserve tokens per (src, e), columns sum to quotas. An
// unreplicated expert's instance takes every source's tokens (its column is the loads'),
// so its quota must be the expert's total.
absl::Status CheckSplits(const LoadMatrix& loads, const Plan& plan,
                         const std::vector<int64_t>& totals, int ranks, int experts) {
  for (int e = 0; e < experts; ++e) {
    const int begin = plan.first[static_cast<size_t>(e)];
    const int end = plan.first[static_cast<size_t>(e) + 1];
    if (end - begin == 1) {
      if (plan.quota[static_cast<size_t>(begin)] != totals[static_cast<size_t>(e)]) {
        return Violation(absl::StrCat("quota of expert ", e, " on rank ",
                                      plan.instances[static_cast<size_t>(begin)].rank, " is ",
                                      plan.quota[static_cast<size_t>(begin)],
                                      " but its only instance takes every source's tokens, ",
                                      totals[static_cast<size_t>(e)]));
      }
      continue;
    }
    for (int src = 0; src < ranks; ++src) {
      int64_t sum = 0;
      for (int i = begin; i < end; ++i) {
        const int64_t x = plan.split_at(loads, src, i);
        if (x < 0) {
          return Violation(absl::StrCat("negative split ", x, " from source ", src, " to expert ",
                                        e, " on rank ",
                                        plan.instances[static_cast<size_t>(i)].rank));
        }
        sum += x;
      }
      if (sum != loads.at(src, e)) {
        return Violation(absl::StrCat("token conservation: source ", src, " routed ",
                                      loads.at(src, e), " tokens to expert ", e,
                                      " but the split sends ", sum));
      }
    }
    for (int i = begin; i < end; ++i) {
      const int64_t* column =
          plan.split.data() + static_cast<size_t>(plan.split_column[static_cast<size_t>(i)]) *
                                  static_cast<size_t>(ranks);
      int64_t sum = 0;
      for (int src = 0; src < ranks; ++src) sum += column[src];
      if (sum != plan.quota[static_cast<size_t>(i)]) {
        return Violation(absl::StrCat(
            "quota of expert ", e, " on rank ", plan.instances[static_cast<size_t>(i)].rank, " is ",
            plan.quota[static_cast<size_t>(i)], " but its split column sums to ", sum));
      }
    }
  }
  return absl::OkStatus();
}

// Fan-out: every replica receives its expert exactly once, from the master (stage 0) or
// from a rank that received it at stage 0 (stage 1); nothing else is sent.
absl::Status CheckFanout(const Plan& plan, int experts) {
  const size_t n = plan.instances.size();
  std::vector<int> received(n, 0);
  auto instance_on = [&plan](int e, int rank) {
    for (int i = plan.first[static_cast<size_t>(e)]; i < plan.first[static_cast<size_t>(e) + 1];
         ++i) {
      if (plan.instances[static_cast<size_t>(i)].rank == rank) return i;
    }
    return -1;
  };
  for (const WeightTransfer& t : plan.fanout.transfers) {
    if (t.expert < 0 || t.expert >= experts) {
      return Violation(absl::StrCat("fan-out: transfer of unknown expert ", t.expert));
    }
    const int dst = instance_on(t.expert, t.dst_rank);
    if (dst < 0 || dst == plan.first[static_cast<size_t>(t.expert)]) {
      return Violation(absl::StrCat("fan-out: expert ", t.expert, " sent to rank ", t.dst_rank,
                                    ", which holds no replica of it"));
    }
    const int master_rank =
        plan.instances[static_cast<size_t>(plan.first[static_cast<size_t>(t.expert)])].rank;
    if (t.stage == 0) {
      if (t.src_rank != master_rank) {
        return Violation(absl::StrCat("fan-out: stage-0 transfer of expert ", t.expert,
                                      " leaves rank ", t.src_rank, ", not the master's rank ",
                                      master_rank));
      }
    } else if (t.stage == 1) {
      bool relay_has_it = false;
      for (const WeightTransfer& in : plan.fanout.transfers) {
        relay_has_it |= in.stage == 0 && in.expert == t.expert && in.dst_rank == t.src_rank;
      }
      if (!relay_has_it) {
        return Violation(absl::StrCat("fan-out: rank ", t.src_rank, " forwards expert ", t.expert,
                                      " without receiving it at stage 0"));
      }
    } else {
      return Violation(absl::StrCat("fan-out: transfer of expert ", t.expert, " has stage ",
                                    t.stage, " (only 0 and 1 exist)"));
    }
    ++received[static_cast<size_t>(dst)];
  }
  for (size_t i = 0; i < n; ++i) {
    if (plan.instances[i].master) continue;
    if (received[i] != 1) {
      return Violation(absl::StrCat("fan-out: replica of expert ", plan.instances[i].expert,
                                    " on rank ", plan.instances[i].rank, " receives its weights ",
                                    received[i], " times (need exactly once)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckPlanInvariants(const Domain& domain, const LoadMatrix& loads, const Plan& plan,
                                 const InvariantOptions& options) {
  if (absl::Status status = ValidateLoads(domain, loads); !status.ok()) return status;
  const int ranks = domain.ranks;
  const int experts = domain.experts();
  if (absl::Status status = CheckShape(plan, ranks, experts); !status.ok()) return status;
  const std::vector<int64_t> totals = loads.ExpertTotals();
  if (absl::Status status = CheckInstances(domain, plan, totals, options); !status.ok()) {
    return status;
  }
  if (absl::Status status = CheckSplits(loads, plan, totals, ranks, experts); !status.ok()) {
    return status;
  }
  return CheckFanout(plan, experts);
}

}  // namespace rackrun::planner
