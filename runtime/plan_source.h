// Where the rebalancing plan of every (microbatch, MoE layer) comes from (docs/design.md
// section 4.3). Two sources, one seam:
// - InBandPlanSource: every rank allgathers the exact loads over the job's data channel
//   and solves the same plan with the job's policy (the planner is deterministic, so every
//   rank gets the bit-identical plan).
// - the coordinator (worker/coordinator_plan_source.h): each rank streams its row of loads
//   to the rack coordinator over gRPC; the coordinator solves and streams the plan back.
// The expert-parallel executor checks the invariants of whatever plan it gets and compares
// fingerprints across ranks, so a source that hands ranks different plans is caught. A
// source whose Solve exchanges data among the ranks anyway (in-band: the load allgather)
// carries each rank's fingerprint of its previous plan along (carries_fingerprints()), so
// the comparison costs no collective of its own and happens one plan later; other sources
// leave it to the executor's own allgather.
//
// Contract: Solve is collective over the group: every rank calls it for the same
// (microbatch, layer, training) in the same order, from one thread.
#ifndef RACKRUN_RUNTIME_PLAN_SOURCE_H_
#define RACKRUN_RUNTIME_PLAN_SOURCE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/data_channel.h"
#include "planner/plan.h"
#include "planner/planner.h"

namespace rackrun::runtime {

class PlanSource {
 public:
  struct Request {
    int64_t microbatch = 0;
    int layer = 0;
    // Training microbatches plan with the training planner's history (EPLB); evaluation
    // ones with a separate planner of the same policy.
    bool training = true;
    std::span<const int64_t> local_loads;  // this rank's tokens per logical expert
    // This rank's fingerprint of the plan it solved before this one (any 64-bit value; 0
    // before the first), carried to every rank by sources that carries_fingerprints().
    uint64_t previous_fingerprint = 0;
  };

  virtual ~PlanSource() = default;
  virtual const char* name() const = 0;

  // Fills `loads` with every rank's row (ranks x experts) and `plan` with the plan every
  // rank executes. On error both are unspecified and the job must stop; the message says
  // what failed (the caller adds rank, layer and microbatch).
  virtual absl::Status Solve(const Request& request, planner::LoadMatrix* loads,
                             planner::Plan* plan) = 0;

  // The planners' state between microbatches (EPLB's history of training and of evaluation
  // microbatches: planner::SavePlannerStates), identical on every rank of a domain, for
  // checkpoints; empty when the policy keeps none. Collective-free,
  // but a source may fetch it (the coordinator keeps it in coordinator mode), so it can
  // fail; called between Solves. RestoreState as planner::Planner::RestoreState
  // (FailedPrecondition: saved for other settings; DataLoss: malformed), before the first
  // Solve.
  virtual absl::StatusOr<std::string> SaveState() { return std::string(); }
  virtual absl::Status RestoreState(std::string_view state);

  // True when Solve carries Request::previous_fingerprint to every rank; the last Solve's
  // values (one per rank, rank order) are then carried_fingerprints().
  virtual bool carries_fingerprints() const { return false; }
  virtual std::span<const uint64_t> carried_fingerprints() const { return {}; }

  // Seconds the last Solve spent in its exchange with the other ranks or the coordinator,
  // waiting for them included (in-band: the load allgather; coordinator: row sent -> plan
  // received, so the coordinator's solve too). The rest of Solve is this rank's own work.
  double last_exchange_seconds() const { return last_exchange_s_; }

 protected:
  double last_exchange_s_ = 0;
};

class InBandPlanSource final : public PlanSource {
 public:
  // InvalidArgument naming balancer.policy when `policy` is unknown. The channel must
  // outlive the source.
  static absl::StatusOr<std::unique_ptr<InBandPlanSource>> Create(
      comm::DataChannel& channel, const planner::Domain& domain, std::string_view policy,
      const planner::PlannerOptions& options);

  const char* name() const override { return "inband"; }
  absl::Status Solve(const Request& request, planner::LoadMatrix* loads,
                     planner::Plan* plan) override;
  absl::StatusOr<std::string> SaveState() override {
    return planner::SavePlannerStates(*train_, *eval_);
  }
  absl::Status RestoreState(std::string_view state) override {
    return planner::RestorePlannerStates(state, *train_, *eval_);
  }
  // The fingerprint rides in the load allgather: each rank's row is its loads and one word.
  bool carries_fingerprints() const override { return true; }
  std::span<const uint64_t> carried_fingerprints() const override { return carried_; }

 private:
  explicit InBandPlanSource(comm::DataChannel& channel) : channel_(channel) {}

  comm::DataChannel& channel_;
  std::unique_ptr<planner::Planner> train_, eval_;
  std::vector<int64_t> row_, rows_;  // allgather buffers: experts + 1 words per rank
  std::vector<uint64_t> carried_;
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_PLAN_SOURCE_H_
