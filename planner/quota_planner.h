// The `ultraep` policy: UltraEP's quota-driven exact-load planner (docs/design.md section 3),
// and the locality-first proportional token split every policy of this library uses.
#ifndef RACKRUN_PLANNER_QUOTA_PLANNER_H_
#define RACKRUN_PLANNER_QUOTA_PLANNER_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/fanout.h"
#include "planner/plan.h"
#include "planner/planner.h"

namespace rackrun::planner {

// Fills plan->split_column and the sparse plan->split (plan.h: columns for the instances of
// replicated experts only) from the plan's instances, first[] and quota[] so that every
// (src, e) row sums to loads(src, e) and every instance's column sums to its quota:
//  1. locality: a source's tokens for e go to an instance of e on the source's own rank
//     first, up to that instance's quota;
//     (skipped when constructed with locality_first = false);
//  2. the rest is split over the instances in proportion to their remaining quotas, one
//     instance at a time (every instance but the expert's first, which takes what is
//     left): an instance with remaining quota q out of R remaining tokens gets
//     floor(r_s * q / R) of each source's remaining r_s, and the q - sum(floor) leftover
//     tokens go one each to the sources with the largest remainders (r_s * q mod R),
//     ties to the lower source (kLargestRemainder, the design's rule); or, with
//     kCumulative, source s gets floor(C_s * q / R) - floor(C_(s-1) * q / R) where C_s is
//     the sum of r over sources 0..s (each share is still the floor or the ceiling of
//     r_s * q / R). Row and column sums stay exact and no entry is negative.
// Requires sum of quotas of e == total tokens of e. Reuses its buffers across calls; not
// thread-safe.
class QuotaSplit {
 public:
  explicit QuotaSplit(bool locality_first = true,
                      SplitRounding rounding = SplitRounding::kLargestRemainder)
      : locality_first_(locality_first), rounding_(rounding) {}

  void Fill(const LoadMatrix& loads, Plan* plan);

 private:
  // Computes the split of replicated expert e (k instances x ranks, instance-major) from
  // e's column of the loads into its columns of out->split (split_column set, split sized).
  // `loads_column` is e's column of the loads (ranks entries).
  void SplitExpert(const LoadMatrix& loads, int e, const double* loads_column, Plan* out);

  // kLargestRemainder for one instance column (remaining quota q of `left` remaining
  // tokens, inv = 1 / left): the floors with their remainder buckets (returns their sum),
  // then the leftover tokens to the largest remainders.
  int64_t FloorColumn(size_t g, int64_t q, int64_t left, double inv, double* remaining,
                      int64_t* col);
  void GiveLeftover(size_t g, int64_t q, int64_t left, double inv, int64_t leftover,
                    double* remaining, int64_t* col);
  // kCumulative for one instance column: remaining quota q of `left` remaining tokens.
  void CumulativeColumn(size_t g, int64_t q, int64_t left, int64_t* col);

  bool locality_first_;
  SplitRounding rounding_;
  std::vector<int32_t> replicated_;  // experts with more than one instance, ascending
  std::vector<double> columns_;      // the replicated experts' columns of the loads
  std::vector<double> remaining_;    // r_s of one expert
  std::vector<int64_t> quota_left_;  // remaining quota per instance of one expert
  std::vector<int64_t> local_;       // per instance of one expert: its locality tokens
  std::vector<uint8_t> written_;     // per instance of one expert: column written
  std::vector<double> floors_;       // kCumulative's floors per source
  std::vector<int32_t> bucket_;      // remainder bucket per source (-1: no remainder)
  struct TiedSource {
    int64_t remainder;  // r_s * q mod R
    int32_t source;
  };
  std::vector<TiedSource> tied_;  // sources in the boundary bucket
};

// A replica placed by a policy that keeps every master at home: `tokens` of `expert`'s
// load processed on `rank` (never the expert's home rank).
struct ReplicaQuota {
  int32_t expert;
  int32_t rank;
  int64_t tokens;
};

// Turns masters-at-home plus a list of replicas into a Plan: each master's quota is its
// expert's total minus its replicas' tokens; instances are grouped by expert, master first,
// replicas in ascending rank; the split is QuotaSplit's and the fan-out FanoutScheduler's.
// Requires every replica's expert/rank valid, no two replicas of an expert on one rank
// and no replica on its expert's home rank. Reuses its buffers; not thread-safe.
class PlanAssembler {
 public:
  explicit PlanAssembler(const PlannerOptions& options)
      : fanout_(options.fanout), split_(options.locality_aware_split, options.split_rounding) {}

  // `totals` = tokens per expert of `loads`.
  void Build(const Domain& domain, const LoadMatrix& loads, const std::vector<int64_t>& totals,
             const std::vector<ReplicaQuota>& replicas, Plan* plan);

 private:
  FanoutScheduler fanout_;
  QuotaSplit split_;
  std::vector<int32_t> replica_count_;
  std::vector<int64_t> exported_;
};

// The greedy rebalancer behind the `greedy` policy and ultraep's refinement pass. From a
// start (masters at home plus `*replicas`, e.g. none), with M = ceil(total / ranks), it
// repeats one move:
//  - r = the heaviest rank (ties: lower rank); stop when load(r) <= M;
//  - on r, its instances (masters and replicas) by tokens, largest first (ties: masters
//    before replicas, then lower expert), that can give a token: a master keeps `keep`
//    tokens (0 or 1), a replica 1;
//  - for the first such instance of expert e for which one exists, the target t = the rank
//    with the lowest load (ties: lower rank) among ranks with a free slot, load < M and no
//    instance of e; move q = min(load(r) - M, M - load(t), tokens the instance can give)
//    of e into a new replica of e on t (the rank with most room is filled to the mean),
//    unless q < min_tokens (then the next instance is tried);
//  - stop when no instance of r has such a target: the heaviest rank cannot shed load.
// Every move uses one slot, so there are at most ranks * slots_per_rank moves; each costs
// O(log ranks) heap work plus the replicas of the expert moved. Deterministic. New replicas
// are appended to `*replicas`, and a replica that gave tokens has its `tokens` lowered.
// Reuses its buffers; not thread-safe.
class GreedyRebalancer {
 public:
  // `totals` = tokens per expert; `*replicas` must satisfy PlanAssembler's requirements,
  // hold at most slots_per_rank replicas per rank, and leave every master >= keep tokens.
  // Returns the heaviest rank load after the moves.
  // A move of fewer than `min_tokens` tokens is not made (that instance is passed over).
  // M is max(level, ceil(total / ranks)): level 0 balances to the mean.
  int64_t Run(const Domain& domain, const std::vector<int64_t>& totals, int64_t keep,
              int64_t min_tokens, int64_t level, std::vector<ReplicaQuota>* replicas);

 private:
  std::vector<int64_t> load_;         // per rank
  std::vector<int64_t> master_left_;  // per expert: the master's tokens
  std::vector<int32_t> free_;         // per rank: free slots
  std::vector<int32_t> on_rank_;      // per rank: its replicas (indices), slots_per_rank each
  std::vector<int32_t> head_;         // per expert: its first replica (linked list), -1 none
  std::vector<int32_t> next_;         // per replica: the expert's next replica, -1 none
  std::vector<int32_t> stamp_;        // per rank: the last move that marked it as holding e
  std::vector<int32_t> over_;         // max-heap of ranks above M
  std::vector<int32_t> targets_;      // min-heap of ranks below M with a free slot
  std::vector<int32_t> aside_;
  struct Candidate {
    int64_t tokens;
    int32_t expert;
    int32_t replica;  // -1 for the master
  };
  std::vector<Candidate> candidates_;
  struct Level {   // one Run's settings
    int64_t mean;  // M
    int64_t keep;
    int64_t min_tokens;
    int slots;  // slots_per_rank
  };

  // Resets the buffers to masters at home plus `replicas`; returns the total tokens.
  int64_t Start(const Domain& domain, const std::vector<int64_t>& totals,
                const std::vector<ReplicaQuota>& replicas);
  int64_t Heaviest() const;  // the heaviest rank load
  // targets_' heap order (a min-heap by load, ties: lower rank).
  bool HeavierTarget(int32_t a, int32_t b) const;
  // candidates_ = the instances of rank r that can give tokens, largest first.
  void CollectCandidates(int32_t r, int masters, int slots, int64_t keep,
                         const std::vector<ReplicaQuota>& replicas);
  // One move of candidate c off rank rs to the lightest target without its expert (the
  // ranks passed over go back on targets_); false when there is none or q < min_tokens.
  bool MoveToTarget(const Domain& domain, const Candidate& c, size_t rs, const Level& level,
                    int32_t move, std::vector<ReplicaQuota>* replicas);
};

// UltraEP's planner. For each solve:
//  - binary-search an integer threshold T in [ceil(mean), max home load], trying
//    T = ceil(mean * (1 + eps)) first and stopping at relative precision eps;
//  - the oracle for T moves q = min(need, target slack, exportable) tokens of an
//    overloaded rank's expert to a replica on the target with the largest remaining slack
//    (free slot, no instance of the expert; ties to the lower rank); exports smaller than
//    min(min_replica_tokens, max(1, ceil(need / feasible targets))) are skipped (the floor
//    is lowered per expert so feasibility stays monotone in T);
//  - masters keep at least one token of a non-zero load unless allow_zero_master_quota;
//  - refinement (docs/design.md 3.4, PlannerOptions::refine, on by default), when the homes
//    exceed the first threshold tried, T0 = max(ceil(mean * (1 + eps)), ceil(mean)): three
//    candidates (a) the searched replicas plus GreedyRebalancer moves with level T0 (the
//    slots the search left free, each new replica filling its rank up to T0); (b)
//    GreedyRebalancer from masters alone with level T0; (c) the same with level 0, i.e.
//    the `greedy` policy's plan. The one with the lowest heaviest rank is kept (ties: the
//    earlier in that order, which has fewer replicas), so the
//    heaviest rank is never above either the threshold found or the `greedy` policy's
//    (with min_replica_tokens 1; refinement runs only when the homes exceed the first
//    threshold tried, so the bound is max(greedy's, ceil(mean * (1 + eps))));
//    Candidate (c) is computed first: (a) and (b) never end below the first threshold
//    tried, so when (c) does, it wins and the search, (a) and (b) are skipped (same plan);
//  - the split is QuotaSplit's; the fan-out schedule is FanoutScheduler's.
// After the first call of a given domain, SolveInto into a reused Plan does not allocate.
// Not thread-safe: one planner per thread (plans are deterministic, so every rank's own
// planner computes the same plan).
class QuotaPlanner final : public Planner {
 public:
  QuotaPlanner(const Domain& domain, const PlannerOptions& options);

  std::string_view name() const override { return "ultraep"; }
  absl::StatusOr<Plan> Solve(const LoadMatrix& loads, int layer) override;
  absl::Status SolveInto(const LoadMatrix& loads, int layer, Plan* plan) override;

  // Diagnostics of the last solve: the threshold the search chose and how many times the
  // oracle ran; both 0 when the search did not run (the homes are within the first
  // threshold tried, or refinement's greedy candidate ended below it and was kept).
  int64_t last_threshold() const { return last_threshold_; }
  int last_oracle_calls() const { return last_oracle_calls_; }

 private:
  using Export = ReplicaQuota;
  // Runs the oracle for threshold T; on success the exports are in *exports.
  bool Feasible(int64_t threshold, std::vector<Export>* exports);
  // SolveInto's steps: the masters-only load per rank (home_loads_) with its total and
  // maximum; the search's orders and buffers; the threshold search into best_exports_;
  // refinement's candidates (a) and (b) against (c), the greedy plan in greedy_exports_.
  void SumHomeLoads(int64_t* total, int64_t* max_load);
  void PrepareSearch(int64_t first_try);
  void Search(int64_t first_try, int64_t max_load);
  void Refine(int64_t keep, int64_t first_try, int64_t greedy_heaviest);

  Domain domain_;
  PlannerOptions options_;
  PlanAssembler assembler_;
  GreedyRebalancer greedy_;
  int64_t last_threshold_ = 0;
  int last_oracle_calls_ = 0;

  std::vector<int64_t> totals_;        // tokens per expert
  std::vector<int64_t> home_loads_;    // tokens per rank with masters only
  std::vector<int32_t> rank_order_;    // ranks by home load, heaviest first
  std::vector<int32_t> expert_order_;  // per rank, its experts heaviest first
  std::vector<int64_t> slack_;
  std::vector<int32_t> free_slots_;
  std::vector<int32_t> heap_;  // targets by (slack desc, rank asc)
  std::vector<int32_t> aside_;
  std::vector<Export> exports_;
  std::vector<Export> best_exports_;
  std::vector<Export> greedy_exports_;
};

}  // namespace rackrun::planner

#endif  // RACKRUN_PLANNER_QUOTA_PLANNER_H_
