// Core types of the UltraEP planner library: the exact load of one (microbatch, MoE
// layer), the balancing domain, and the rebalancing plan every rank executes.
//
// Pure C++ (Abseil for Status only): no gRPC, MPI, CUDA or I/O.
#ifndef RACKRUN_PLANNER_PLAN_H_
#define RACKRUN_PLANNER_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace rackrun::planner {

// The balancing domain: G ranks, each the home (master) of `masters_per_rank`
// consecutive logical experts, each with `slots_per_rank` redundant slots that can hold
// replicas of other ranks' experts. Rank r is home of experts
// [r * masters_per_rank, (r + 1) * masters_per_rank).
struct Domain {
  int ranks = 0;
  int masters_per_rank = 0;
  int slots_per_rank = 0;

  int experts() const { return ranks * masters_per_rank; }
  int home_rank(int expert) const { return expert / masters_per_rank; }
  // Instances a rank may hold at once: its masters plus its slots.
  int capacity_per_rank() const { return masters_per_rank + slots_per_rank; }

  // InvalidArgument naming the field when a count is not positive (slots may be 0).
  absl::Status Validate() const;
};

// Exact post-gating token counts: counts[src * experts + e] = tokens that source rank
// `src` routed to logical expert `e` in this (microbatch, layer).
struct LoadMatrix {
  int ranks = 0;
  int experts = 0;
  std::vector<int64_t> counts;

  LoadMatrix() = default;
  LoadMatrix(int ranks_in, int experts_in)
      : ranks(ranks_in),
        experts(experts_in),
        counts(static_cast<size_t>(ranks_in) * static_cast<size_t>(experts_in), 0) {}

  int64_t& at(int src, int e) { return counts[static_cast<size_t>(src) * experts + e]; }
  int64_t at(int src, int e) const { return counts[static_cast<size_t>(src) * experts + e]; }
  const int64_t* row(int src) const { return counts.data() + static_cast<size_t>(src) * experts; }

  // Tokens per logical expert, summed over sources.
  std::vector<int64_t> ExpertTotals() const;
  int64_t Total() const;
};

// Ok when `loads` fits `domain` (valid domain, ranks x experts shape, non-negative
// counts); InvalidArgument naming the field and the offending entry otherwise.
absl::Status ValidateLoads(const Domain& domain, const LoadMatrix& loads);

// ValidateLoads and LoadMatrix::ExpertTotals in one pass over the counts: on success
// *totals holds the tokens per expert (resized to the domain's experts). The per-entry
// check runs only when the pass sees a count outside [0, 2^40), so a valid matrix is read
// once; errors are ValidateLoads' (same messages).
absl::Status ValidatedExpertTotals(const Domain& domain, const LoadMatrix& loads,
                                   std::vector<int64_t>* totals);

// Per-rank work when every expert's tokens are processed at its home rank.
std::vector<int64_t> HomeRankLoads(const Domain& domain, const LoadMatrix& loads);

// One place where an expert runs: its master (the copy that owns weights and optimizer
// state) or a replica in a redundant slot that receives weights by fan-out.
struct ExpertInstance {
  int32_t expert = -1;
  int32_t rank = -1;
  bool master = false;

  friend bool operator==(const ExpertInstance&, const ExpertInstance&) = default;
};

// One weight transfer of the fan-out schedule. Stage 0 leaves the expert's master (or a
// relay that is also a destination); stage 1 is forwarded by a relay (`via` = the relay
// rank, also the sender). A relay forwards each chunk as soon as it has it.
struct WeightTransfer {
  int32_t expert = -1;
  int32_t src_rank = -1;
  int32_t dst_rank = -1;
  int32_t stage = 0;

  friend bool operator==(const WeightTransfer&, const WeightTransfer&) = default;
};

struct FanoutSchedule {
  std::vector<WeightTransfer> transfers;

  friend bool operator==(const FanoutSchedule&, const FanoutSchedule&) = default;
};

// The rebalancing plan for one (microbatch, layer). Every rank (and the coordinator)
// computes the bit-identical plan from the same loads.
//
// Layout: instances are grouped by expert. The instances of expert e are
// instances[first[e] .. first[e+1]); within an expert the master (if the policy keeps
// one) comes first, then replicas in ascending rank. quota[i] is the tokens instance i
// processes.
//
// The per-source split is sparse: it is stored only for replicated experts (more than one
// instance). Their instances, in instance order, own the columns of `split`: instance i
// with split_column[i] = c >= 0 receives split[c * ranks + src] of source src's tokens for
// its expert. An unreplicated expert's instance has split_column[i] = -1 and receives
// every source's tokens for its expert, i.e. the loads the plan was solved from, which is
// why split_at takes them. split_column is determined by first (IndexSplitColumns).
// Storage is ranks x (instances of replicated experts), not ranks x instances.
struct Plan {
  int ranks = 0;
  int experts = 0;
  std::vector<ExpertInstance> instances;
  std::vector<int32_t> first;         // size experts + 1
  std::vector<int64_t> quota;         // size instances.size()
  std::vector<int32_t> split_column;  // size instances.size(); -1: unreplicated expert
  std::vector<int64_t> split;         // size ranks * (columns: instances with split_column >= 0)
  FanoutSchedule fanout;              // weights master -> replicas (empty when no replicas)

  int num_instances() const { return static_cast<int>(instances.size()); }
  // Columns of `split`: instances of replicated experts.
  int num_split_columns() const { return ranks > 0 ? static_cast<int>(split.size()) / ranks : 0; }
  // Tokens of source `src` for instance `instance`'s expert that go to that instance.
  // `loads` must be the loads the plan was solved from (CheckPlanInvariants checks a plan
  // against them); indices are not checked.
  int64_t split_at(const LoadMatrix& loads, int src, int instance) const {
    const int32_t c = split_column[static_cast<size_t>(instance)];
    return c >= 0 ? split[static_cast<size_t>(c) * static_cast<size_t>(ranks) +
                          static_cast<size_t>(src)]
                  : loads.at(src, instances[static_cast<size_t>(instance)].expert);
  }
  // Tokens each rank processes under this plan.
  std::vector<int64_t> RankLoads() const;
  int num_replicas() const;

  friend bool operator==(const Plan&, const Plan&) = default;
};

// Sets plan->split_column from plan->first (which must run from 0 to instances.size(),
// ascending) and sizes plan->split to ranks x columns (new entries 0). Returns the number
// of columns. For code that builds plans by hand; the planners do this themselves.
int IndexSplitColumns(Plan* plan);

// InvalidArgument naming the field unless first runs ascending from 0 to
// instances.size() with experts + 1 entries, split_column is what IndexSplitColumns gives,
// and split has ranks x columns entries. Values are not checked (CheckPlanInvariants).
absl::Status ValidateSplitShape(const Plan& plan);

// The dense split, ranks x instances, source-major: dense[src * instances + i] =
// plan.split_at(loads, src, i). For tests and tools; O(ranks x instances).
std::vector<int64_t> DenseSplit(const Plan& plan, const LoadMatrix& loads);

// A 64-bit FNV-1a digest of every field of `plan` (shapes, instances, quotas, split columns
// and the sparse split, fan-out). Ranks that solve in-band compare digests to prove they
// execute the same plan. The loads are not part of it: an unreplicated expert's split is
// the loads, which every rank holds from the same allgather (or the coordinator's reply).
// `seed` continues a digest (chain plans: h = PlanFingerprint(next, h)).
inline constexpr uint64_t kFingerprintSeed = 0xcbf29ce484222325ULL;
uint64_t PlanFingerprint(const Plan& plan, uint64_t seed = kFingerprintSeed);

// max rank load / mean rank load; 1.0 for an all-zero load.
double Imbalance(const std::vector<int64_t>& rank_loads);

}  // namespace rackrun::planner

#endif  // RACKRUN_PLANNER_PLAN_H_
