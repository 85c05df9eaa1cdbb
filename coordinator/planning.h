// Planning: coordinator-mode planning (balancer.mode: coordinator) behind RackControl.Plans.
//
// A job of R ranks with parallelism.expert_parallel = G runs D = R / G expert-parallel
// domains; domain d is ranks d*G .. d*G+G-1 (jobspec::ExpertParallelLayoutOf). Per running
// attempt (Open .. Close) and per domain it keeps two planners made exactly as the
// runtime's expert-parallel group of that domain makes them (planner::MakePlanner with the
// spec's jobspec::BalancerSetup on G ranks, as runtime/trainer.cc does): one for training
// microbatches and one for evaluation ones, so eplb's history is the same as in-band. Each
// rank streams its LoadRow per (microbatch, layer, training), naming its domain; when the
// G rows of one domain are in, that domain's G x experts matrix is solved, the invariants
// checked, and the PlanReply (domain, plan, fingerprint, solve_s; or error) is queued for
// the streams of that domain's ranks only. Domains never wait for each other: a slow rank
// delays its own domain's plans and no other's.
//
// Checkpoints: the planners' state (eplb's history of training and of evaluation
// microbatches, planner::SavePlannerStates) lives here, so a row may ask for its domain's
// (LoadRow.state_request: the reply is the state in PlanReply.planner_state chunks, queued
// for that rank only) or restore it from a checkpoint (restore_state chunks: once the last
// is in, the domain's planners are restored before they plan any microbatch; every rank
// of the domain restores the same bytes, a rank whose bytes differ from an earlier rank's
// is DataLoss). The state a rank gets is the one after every plan it received: a domain's
// planners move on only when all its ranks' rows are in, and a rank asks before sending
// its next row.
//
// Thread safety: all methods are thread-safe.
#ifndef RACKRUN_COORDINATOR_PLANNING_H_
#define RACKRUN_COORDINATOR_PLANNING_H_

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/sync.h"
#include "jobspec/balancer.h"
#include "planner/plan.h"
#include "planner/planner.h"
#include "rackrun/v1/job_spec.pb.h"
#include "rackrun/v1/rack_control.pb.h"

namespace rackrun::coordinator {

class Planning {
 public:
  // Starts planning for the attempt of `ranks` ranks (no change when it is already open).
  // InvalidArgument when the ranks do not tile into domains (jobspec::ExpertParallelLayoutOf)
  // or the spec gives no balancer setup (jobspec::BalancerSetupOf).
  absl::Status Open(const std::string& job_id, int attempt, const rackrun::v1::JobSpec& spec,
                    int ranks);
  // Ends it: pending rows are dropped and the ranks' NextReply return Cancelled.
  void Close(const std::string& job_id, int attempt);

  // One rank's row (job, attempt, rank and domain set). FailedPrecondition when the attempt
  // does not plan here; InvalidArgument for a bad rank, a domain that is not the rank's,
  // a bad row size or a duplicate row, a state row with loads or both state_request and
  // restore_state, a restored state over kMaxPlannerStateBytes. A state that cannot be
  // restored (other settings: FailedPrecondition; malformed: DataLoss; training already
  // planned: FailedPrecondition) is no error here: the reply carries it (error,
  // error_code).
  absl::Status AddRow(const rackrun::v1::LoadRow& row);

  // The next reply for the rank, waiting up to `max_wait` (nullopt when none came).
  absl::StatusOr<std::optional<rackrun::v1::PlanReply>> NextReply(const std::string& job_id,
                                                                  int attempt, int rank,
                                                                  absl::Duration max_wait);

  void Shutdown();

  // The largest planner state a rank may restore (a bound on the bytes buffered per rank).
  static constexpr size_t kMaxPlannerStateBytes = size_t{1} << 30;

  // Metrics hook: called with (job id, domain, solve_s) after every solve (each domain's
  // plans are solved on their own), under Planning's lock (keep it cheap). Null to remove.
  // Thread-safe.
  using SolveObserver = std::function<void(const std::string& job_id, int domain, double solve_s)>;
  void SetSolveObserver(SolveObserver observer);

 private:
  struct Pending {
    planner::LoadMatrix loads;
    std::vector<bool> got;
    int count = 0;
  };
  // One expert-parallel domain's planners and the rows it waits for.
  struct DomainPlanning {
    std::unique_ptr<planner::Planner> train;
    std::unique_ptr<planner::Planner> eval;
    std::map<std::tuple<int64_t, int, bool>, Pending> pending;
    planner::Plan plan;                   // reused buffers
    bool planned = false;                 // a microbatch was planned: too late to restore
    std::optional<std::string> restored;  // the state the planners were restored from
  };
  struct Session {
    jobspec::BalancerSetup setup;                            // on G ranks: one domain's
    int expert_parallel = 1;                                 // G
    std::vector<DomainPlanning> domains;                     // D of them
    std::vector<std::deque<rackrun::v1::PlanReply>> outbox;  // per job rank (R = D x G)
    std::vector<std::string> restoring;  // per job rank: restore_state chunks so far
  };
  // A LoadRow's state_request or restore_state (AddRow's checks done).
  absl::Status StateRowLocked(Session& s, int domain, const rackrun::v1::LoadRow& row)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  using Key = std::pair<std::string, int>;

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, Session> sessions_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  SolveObserver solve_observer_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_PLANNING_H_
