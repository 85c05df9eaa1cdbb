// Coordinator-mode planning (balancer.mode: coordinator) as a runtime::PlanSource: for
// each (microbatch, MoE layer) this rank streams its row of exact loads to the rack
// coordinator on its RackControl.Plans stream, naming its expert-parallel domain, and
// receives the plan the coordinator solved from the rows of that domain's ranks (with the
// relay fan-out schedule and its fingerprint). The plan is the domain's: G ranks, this
// rank at index rank % G, as the domain's in-band source would solve it. The executor then
// checks the invariants and compares fingerprints across the domain, exactly as for
// in-band plans.
//
// Checkpoints: the planners' history (eplb's, of training and of evaluation microbatches)
// lives in the coordinator. SaveState asks for the domain's (a LoadRow with state_request;
// the state comes back in PlanReply.planner_state chunks), so the checkpoint holds it as an
// in-band one does; RestoreState sends a checkpoint's state (restore_state chunks) before
// any loads, and the coordinator restores the domain's planners before their first plan:
// a resumed job plans as the uninterrupted one, its evaluations included.
//
// Not thread-safe: the training thread of one rank uses it.
#ifndef RACKRUN_WORKER_COORDINATOR_PLAN_SOURCE_H_
#define RACKRUN_WORKER_COORDINATOR_PLAN_SOURCE_H_

#include <grpcpp/client_context.h>
#include <grpcpp/support/sync_stream.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>

#include "runtime/plan_source.h"
#include "worker/connection.h"

namespace rackrun::worker {

class CoordinatorPlanSource final : public runtime::PlanSource {
 public:
  // `rank` is the job's rank; `expert_parallel` the ranks per domain (G >= 1, from
  // jobspec::ExpertParallelLayoutOf): this rank plans in domain rank / G.
  CoordinatorPlanSource(Connection& connection, std::string job_id, int attempt, int rank,
                        int expert_parallel)
      : connection_(connection),
        job_id_(std::move(job_id)),
        attempt_(attempt),
        rank_(rank),
        domain_(rank / std::max(1, expert_parallel)),
        domain_rank_(rank % std::max(1, expert_parallel)) {}
  ~CoordinatorPlanSource() override;

  const char* name() const override { return "coordinator"; }
  absl::Status Solve(const Request& request, planner::LoadMatrix* loads,
                     planner::Plan* plan) override;
  // Unavailable when the stream broke; the coordinator's error otherwise (RestoreState:
  // FailedPrecondition for a state saved with other settings, DataLoss for bad bytes).
  absl::StatusOr<std::string> SaveState() override;
  absl::Status RestoreState(std::string_view state) override;

  // Called with the seconds of every round trip (metrics); on the training thread.
  void set_on_round_trip(std::function<void(double)> f) { on_round_trip_ = std::move(f); }
  // Round trips so far and their summed seconds (this rank's view: row sent -> plan in).
  int64_t round_trips() const { return round_trips_; }
  double round_trip_s() const { return round_trip_s_; }

 private:
  // Opens the attempt's stream when none is open.
  void OpenStream();
  // A row, naming job, attempt, rank and domain on the stream's first.
  rackrun::v1::LoadRow NewRow();
  // Ends the stream after `what` (write failed, ended): Unavailable naming the coordinator.
  absl::Status Broken(const std::string& what);

  Connection& connection_;
  std::string job_id_;
  int attempt_;
  int rank_;
  int domain_;       // rank / G
  int domain_rank_;  // rank % G: this rank's row of the domain's plan
  // Declared before the stream: the stream is destroyed first, its channel after it.
  std::shared_ptr<Connection::Stub> stub_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<rackrun::v1::LoadRow, rackrun::v1::PlanReply>> stream_;
  bool first_ = true;
  std::function<void(double)> on_round_trip_;
  int64_t round_trips_ = 0;
  double round_trip_s_ = 0;
};

}  // namespace rackrun::worker

#endif  // RACKRUN_WORKER_COORDINATOR_PLAN_SOURCE_H_
