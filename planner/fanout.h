// Relay fan-out planning: how replica weights travel from masters to replicas, and the
// cost model that gives a schedule's completion time (docs/design.md section 3.9).
#ifndef RACKRUN_PLANNER_FANOUT_H_
#define RACKRUN_PLANNER_FANOUT_H_

#include <cstdint>
#include <vector>

#include "planner/plan.h"

namespace rackrun::planner {

enum class FanoutMode {
  kDirect,  // every master sends to each of its replicas itself
  kRelay,   // r = floor(sqrt(n)) relays forward chunks to the remaining leaves
};

struct FanoutOptions {
  FanoutMode mode = FanoutMode::kRelay;
  int min_destinations_for_relay = 4;  // relay only when one source has n >= 4 destinations
  int max_relays = 8;
  int min_gain = 2;  // relay only if n - max(r, ceil((n-r)/r)) >= min_gain
};

// Builds the fan-out schedule for `plan`'s replicas (one stage-0 transfer per destination
// in direct mode; stage 0 to relays and stage 1 from relays in relay mode). Deterministic.
FanoutSchedule PlanFanout(const Plan& plan, const FanoutOptions& options);

// The relay fan-out planner with reusable buffers, for callers that plan every
// microbatch (PlanFanout is the one-shot form). Experts are visited in descending number
// of destinations (ties: lower expert id), so the widest fan-outs pick relays first.
// Projected send bytes (counted in transfers, every expert has the same size) carry across
// experts of one schedule. Not thread-safe; one instance per thread.
class FanoutScheduler {
 public:
  explicit FanoutScheduler(const FanoutOptions& options = {}) : options_(options) {}
  const FanoutOptions& options() const { return options_; }

  // Overwrites `*schedule` (reusing its capacity) with the schedule for `plan`'s replicas:
  // from each expert's master instance (the first instance of the expert) to every other
  // instance of it.
  void Schedule(const Plan& plan, FanoutSchedule* schedule);

  // Relays used for one source with n destinations (0 = send directly), per the options.
  int RelaysFor(int destinations) const;

 private:
  FanoutOptions options_;
  std::vector<int32_t> order_;         // experts with replicas, widest first
  std::vector<int32_t> sends_;         // projected transfers sent per rank
  std::vector<uint8_t> relaying_;      // rank already relays for some expert
  std::vector<int32_t> dests_;         // scratch: destinations of one expert
  std::vector<int32_t> relay_leaves_;  // scratch: leaves assigned per relay
};

// Per-rank egress bandwidth and per-message latency; weights stream in chunks.
struct FanoutCostModel {
  double egress_bytes_per_s = 0;
  double latency_s = 0;
  int64_t chunk_bytes = 256 << 10;
};

struct FanoutCost {
  double seconds = 0;          // completion time of the whole schedule
  int64_t bytes = 0;           // total bytes sent over all links
  int64_t max_rank_bytes = 0;  // bytes sent by the busiest sender
};

// Completion time of `schedule` when every transfer carries `expert_bytes`: a sender's
// transfers share its egress; a relay forwards chunk c once it has received chunk c.
FanoutCost EstimateFanout(const FanoutSchedule& schedule, int ranks, int64_t expert_bytes,
                          const FanoutCostModel& model);

}  // namespace rackrun::planner

#endif  // RACKRUN_PLANNER_FANOUT_H_
