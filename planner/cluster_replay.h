// The replay at cluster scale: D domains (racks of EP G), each with its own load stream and
// its own planners, composed into training steps with the data-parallel gradient
// all-reduce (cluster.h). What `rackrun plan --domains D` prints.
//
// Every domain is a Replay (replay.h) of its own: its own planners (eplb's history is per
// domain), its own plans from its own loads, checked by the invariant checker. A planner
// solve therefore sees one domain's G x E loads whatever D is; its cost is constant in D,
// and the per-domain solve times are kept to show it. Per domain, measured microbatches
// are grouped in entry order into steps of ClusterModel::microbatches_per_step; the job's
// step s takes every domain's step s (cluster.h, JobStep).
//
// Pure C++; the caller generates or reads the entries. Not thread-safe.
#ifndef RACKRUN_PLANNER_CLUSTER_REPLAY_H_
#define RACKRUN_PLANNER_CLUSTER_REPLAY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "planner/cluster.h"
#include "planner/replay.h"
#include "planner/trace.h"

namespace rackrun::planner {

// One policy's steps (or the force-balanced ideal's, policy "ideal step").
struct PolicySteps {
  std::string policy;
  std::vector<StepTime> steps;  // the job's step s, s = 0.. in order
  StepTime mean;                // every field averaged over the steps
};

class ClusterReplay {
 public:
  // `topk` turns a source rank's routed (token, expert) pairs into tokens for the dense
  // part (loads' row sums / topk).
  ClusterReplay(ReplayOptions replay, ClusterModel model, int topk);

  // Plans one entry of `domain` (0 .. model.domains - 1) with every policy. A domain's
  // entries come microbatch-major, as a training step produces them; domains may
  // interleave. Errors: InvalidArgument for a domain out of range or loads whose shape
  // differs from the first entry's, Replay::Add's errors prefixed "domain d: ".
  absl::Status Add(int domain, const TraceEntry& entry);

  // After the last Add: closes the last step. InvalidArgument when a domain's measured
  // microbatches are not a whole number of steps or domains measured different counts.
  absl::Status Finish();

  const ClusterModel& model() const { return model_; }
  const Replay& domain(int d) const { return domains_[static_cast<size_t>(d)].replay; }
  int domains() const { return static_cast<int>(domains_.size()); }

  // After any Add. Per policy (ReplayOptions::policies order) its figures over every
  // domain, concatenated in domain order (sums summed; plan_hash is domain 0's chained
  // with each further domain's), so one domain gives exactly Replay's results.
  std::vector<PolicyReplay> Merged() const;
  // Valid after Finish: per policy, then the ideal last; and the step's all-reduce.
  const std::vector<PolicySteps>& steps() const { return steps_; }
  const GradientReduce& reduce() const { return reduce_; }

 private:
  struct DomainRun {
    Replay replay;
    int64_t microbatch = -1;  // of the microbatch being collected
    // Per policy, then the ideal: the current microbatch and the current step's.
    std::vector<MicrobatchLayers> current;
    std::vector<std::vector<MicrobatchLayers>> step;
    std::vector<std::vector<StepTime>> done;  // per policy (+ideal): its steps
  };

  void CloseMicrobatch(DomainRun& run);

  ReplayOptions options_;
  ClusterModel model_;
  int topk_;
  std::vector<DomainRun> domains_;
  int shape_ranks_ = 0;  // of the first entry added, which every domain's must match
  int shape_experts_ = 0;
  GradientReduce reduce_;
  std::vector<PolicySteps> steps_;
};

}  // namespace rackrun::planner

#endif  // RACKRUN_PLANNER_CLUSTER_REPLAY_H_
