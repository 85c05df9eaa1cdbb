// The `eplb` baseline: DeepSeek's Expert Parallelism Load Balancer (github
// deepseek-ai/EPLB, eplb.py), global policy, driven by a moving average of past loads.
#ifndef RACKRUN_PLANNER_EPLB_PLANNER_H_
#define RACKRUN_PLANNER_EPLB_PLANNER_H_

#include <cstdint>
#include <map>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/fanout.h"
#include "planner/plan.h"
#include "planner/planner.h"
#include "planner/quota_planner.h"

namespace rackrun::planner {

// eplb.py's placement for one layer: physical expert p lives on GPU p / (num_physical /
// num_gpus) and is replica phy_rank[p] of logical expert phy_to_log[p]; log_count[e] is
// how many physical experts logical expert e has.
struct EplbPlacement {
  std::vector<int32_t> phy_to_log;
  std::vector<int32_t> phy_rank;
  std::vector<int32_t> log_count;

  friend bool operator==(const EplbPlacement&, const EplbPlacement&) = default;
};

// eplb.py's rebalance_experts(weight[None], num_physical, num_groups=1, num_nodes=1,
// num_gpus), i.e. its global load-balance policy for one layer, with the same float32
// arithmetic and tie-breaking:
//  - replicate_experts: each redundant slot goes to argmax(weight / count) in float32;
//    ties to the lowest expert id (torch's max returns the first maximal index);
//  - balanced_packing of the physical experts (weight / count each): heaviest first,
//    each into the lightest pack that is not full, pack weights accumulated in float32;
//    equal weights are ordered as torch's default CPU sort orders them (libstdc++'s
//    std::sort over (weight, index) pairs, reproduced with the same call; checked against
//    eplb.py's output by the golden test), equally light packs go to the lowest pack index
//    (Python's min);
//    with one physical expert per GPU the packing is the identity, as in eplb.py.
// Requires num_gpus > 0, num_physical a multiple of num_gpus and >= weight.size().
EplbPlacement EplbRebalance(const std::vector<float>& weight, int num_physical, int num_gpus);

// Plans with EplbRebalance over ranks * (masters + slots) physical experts on `ranks`
// GPUs (one node, one group: the domain is one NVLink rack), from the mean per-expert load
// of the last `eplb_window` microbatches of the same layer, recomputed every
// `eplb_interval` microbatches:
//  - microbatch 0 of a layer has no history: the placement is the home placement (masters
//    only, as `none`);
//  - the first replan is at the first microbatch with history (microbatch 1), then every K
//    microbatches (1, 1+K, 1+2K, ...); in between the placement is kept;
//  - loads reach the history only after planning (EPLB never sees the current loads).
// Tokens of an expert are split evenly over its physical replicas (tot / count each, the
// tot % count leftover to the lowest replica ranks); eplb.py may put two replicas of one
// expert on the same GPU: they become one instance carrying both shares. Per source, the
// quotas are filled by QuotaSplit (the same dispatcher as every policy). plan.fanout brings
// every non-master instance the master's current weights (in training they change every
// step, so it is planned every microbatch, like ultraep's). The instance
// holding replica 0 is the expert's master (first in the plan, source of the fan-out). A
// replan re-places every expert, masters included: last_replacement_bytes() is
// expert_bytes times the number of (expert, rank) instances of the new placement that the
// previous placement did not have.
class EplbPlanner final : public Planner {
 public:
  EplbPlanner(const Domain& domain, const PlannerOptions& options);

  std::string_view name() const override { return "eplb"; }
  absl::StatusOr<Plan> Solve(const LoadMatrix& loads, int layer) override;
  absl::Status SolveInto(const LoadMatrix& loads, int layer, Plan* plan) override;
  int64_t last_replacement_bytes() const override { return last_replacement_bytes_; }

  // Whether the last Solve recomputed the placement.
  bool last_replanned() const { return last_replanned_; }

  // Per layer: microbatch counter, load window and placement; tagged with the domain,
  // window and interval it was made for.
  std::string SaveState() const override;
  absl::Status RestoreState(std::string_view state) override;

 private:
  struct LayerState {
    int64_t microbatch = 0;
    std::vector<int64_t> window;      // ring buffer: eplb_window x experts totals
    std::vector<int64_t> window_sum;  // per expert
    int64_t window_count = 0;
    EplbPlacement placement;
  };
  LayerState& StateFor(int layer);
  void BuildPlan(const LoadMatrix& loads, const EplbPlacement& placement, Plan* plan);

  Domain domain_;
  PlannerOptions options_;
  FanoutScheduler fanout_;
  QuotaSplit split_;
  std::map<int, LayerState> layers_;
  int64_t last_replacement_bytes_ = 0;
  bool last_replanned_ = false;
  std::vector<int64_t> totals_;
  std::vector<int32_t> holders_;  // scratch: (rank, phy_rank) of one expert
};

}  // namespace rackrun::planner

#endif  // RACKRUN_PLANNER_EPLB_PLANNER_H_
