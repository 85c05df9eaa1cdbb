// Replay: exact per-(microbatch, layer) loads played through balancing policies, the
// figures `rackrun plan` prints. Every entry is planned by every policy in turn, each plan
// is checked with the invariant checker, and per policy the replay collects: rank
// imbalance before (masters only) and after balancing, replicas, replica fan-out bytes and
// the cost model's direct and relay times, re-placement bytes, the simulated MoE layer time
// against the force-balanced ideal, solve time, and a fingerprint of all its plans.
//
// The cost model follows the policies' traits: a policy whose replicas stay resident
// (eplb) moves weights only when it replans, counted as re-placement and, when
// ReplayOptions::replacement_exposed, as exposed time; every other policy fans replica
// weights out for every plan, and the simulated time includes the part of the relay
// fan-out not hidden behind dispatch; a bound (ideal) is charged no fan-out.
//
// Pure C++: the caller reads the entries (TraceReader, LoadGenerator) and prints. Not
// thread-safe.
#ifndef RACKRUN_PLANNER_REPLAY_H_
#define RACKRUN_PLANNER_REPLAY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "planner/plan.h"
#include "planner/planner.h"
#include "planner/simulator.h"
#include "planner/trace.h"

namespace rackrun::planner {

struct ReplayOptions {
  // Names from Policies(), in the order the results are reported.
  std::vector<std::string> policies;
  // Redundant slots per rank; ranks and masters per rank come from the first entry.
  int slots = 2;
  // The policies' knobs; expert_bytes also sizes the fan-out and the re-placement.
  PlannerOptions planner;
  // The simulator's and the fan-out cost model's hardware.
  HardwareModel hardware;
  // Whether re-placement transfers (eplb's) add to the simulated layer time.
  bool replacement_exposed = true;
  // The first `warmup` microbatches are planned (policies with history need them) but
  // left out of every statistic except solve_us.
  int64_t warmup = 0;
};

// One policy's figures. The vectors hold one value per measured entry, in entry order.
struct PolicyReplay {
  std::string policy;
  std::vector<double> before;             // rank imbalance (max/mean) with masters only
  std::vector<double> after;              // rank imbalance under the plan
  std::vector<double> replicas;           // replica instances
  std::vector<double> fanout_bytes;       // replica weights fanned out by this plan
  std::vector<double> direct_ms;          // cost model: that fan-out direct from the masters
  std::vector<double> relay_ms;           // ... and along the relay schedule
  std::vector<double> percent;            // PercentOfIdeal of the entry's simulated time
  std::vector<double> solve_us;           // every entry, warm-up included: SolveInto's wall time
  int64_t replacement_bytes = 0;          // Planner::last_replacement_bytes, summed
  double layer_s = 0;                     // simulated layer time, summed
  double ideal_s = 0;                     // force-balanced ideal layer time, summed
  LayerTime parts;                        // simulated time's parts, summed
  uint64_t plan_hash = kFingerprintSeed;  // PlanFingerprint chained over every plan
};

class Replay {
 public:
  explicit Replay(ReplayOptions options);
  ~Replay();
  Replay(Replay&&) noexcept;
  Replay& operator=(Replay&&) noexcept;

  // Plans `entry` with every policy. The first entry fixes the domain and makes the
  // planners (Domain::Validate's and MakePlanner's errors). A solve error keeps its code
  // and an invariant violation is FailedPrecondition, both prefixed "policy P, microbatch
  // M, layer L: ". After an error the replay must not be used further.
  absl::Status Add(const TraceEntry& entry);

  // Valid after the first Add.
  const Domain& domain() const { return domain_; }
  // Entries measured (after the warm-up).
  int64_t entries() const { return entries_; }
  // Distinct microbatches seen, and those measured; distinct layers measured.
  size_t microbatches() const { return microbatches_.size(); }
  size_t measured_microbatches() const { return measured_microbatches_.size(); }
  size_t layers() const { return layers_.size(); }
  // One per ReplayOptions::policies once the first entry was added, in that order.
  const std::vector<PolicyReplay>& results() const { return results_; }

  // The entry the last successful Add planned: whether it was measured and, when it was,
  // its force-balanced ideal and each policy's simulated layer time (results() order).
  struct LastEntry {
    bool measured = false;
    LayerTime ideal;
    std::vector<LayerTime> policies;
  };
  const LastEntry& last() const { return last_; }

 private:
  struct Run;  // a policy's planner and its reusable plans

  absl::Status Start(const TraceEntry& entry);

  ReplayOptions options_;
  bool started_ = false;
  FanoutOptions direct_;
  FanoutOptions relay_;
  Domain domain_;
  std::vector<Run> runs_;
  std::vector<PolicyReplay> results_;
  LastEntry last_;
  int64_t entries_ = 0;
  std::set<int64_t> microbatches_;
  std::set<int64_t> measured_microbatches_;
  std::set<int> layers_;
};

}  // namespace rackrun::planner

#endif  // RACKRUN_PLANNER_REPLAY_H_
