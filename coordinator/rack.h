// Rack: the coordinator's state machine, joining the concerns that each live in their own
// class (Jobs, Workers, the scheduler, Rendezvous, Planning) into the operations the
// services call. Every compound operation runs under one lock, in a fixed order (Rack ->
// Jobs -> Workers), so a failure, a result and a cancel of the same attempt never
// interleave.
//
// Tick() does the periodic work: failure detection (Workers::Detect), the re-attach
// grace after a restart (Jobs::ExpireReattach), and FIFO scheduling. The server calls it
// every few milliseconds; tests call it after moving their fake clock.
//
// Thread safety: all methods are thread-safe.
#ifndef RACKRUN_COORDINATOR_RACK_H_
#define RACKRUN_COORDINATOR_RACK_H_

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "coordinator/clock.h"
#include "coordinator/job_store.h"
#include "coordinator/jobs.h"
#include "coordinator/planning.h"
#include "coordinator/rendezvous.h"
#include "coordinator/sync.h"
#include "coordinator/workers.h"
#include "rackrun/v1/job_service.pb.h"
#include "rackrun/v1/rack_control.pb.h"

namespace rackrun::coordinator {

class Rack {
 public:
  struct Options {
    Workers::Options workers;
    Jobs::Options jobs;
    // Bootstrap.timeout_ms: bound on the data channel's blocking waits and rendezvous.
    int64_t channel_timeout_ms = 120000;
  };

  Rack(JobStore* store, Clock clock, Options options);

  // Replays the store: every job not ended and the Jobs::Options::max_ended_in_memory that
  // ended last (older ended jobs are read from it when asked for). Call once, before serving.
  absl::Status Initialize();

  Jobs& jobs() { return jobs_; }
  Workers& workers() { return workers_; }
  Rendezvous& rendezvous() { return rendezvous_; }
  Planning& planning() { return planning_; }
  const Options& options() const { return options_; }

  // Cancels the job; its running ranks get CancelJob on their streams.
  absl::StatusOr<rackrun::v1::Job> Cancel(const std::string& job_id, const std::string& reason);

  // Registers a worker; when it names an in-flight job that is still running as that
  // (attempt, rank), re-attaches it (job_attached = true) and it stays BUSY. A worker whose
  // id came from another job store (req.store_id) gets a new id and no job attached.
  absl::StatusOr<rackrun::v1::RegisterResponse> Register(const rackrun::v1::RegisterRequest& req);

  // Whether `store_id` (a worker's RegisterRequest.store_id, or a run's RunJob.store_id sent
  // back) is another job store's: worker ids and job numbers from a store this coordinator
  // does not have (it came back with its database lost or replaced, and numbers from 1
  // again) are not its own, even where they look alike. 0 (unknown) is not.
  bool OtherStore(uint64_t store_id) const;
  // NotFound when OtherStore(store_id), naming worker `id` (the worker registers again) or
  // the run (job_id, attempt) that the call is about.
  absl::Status CheckWorkerStore(uint64_t store_id, const std::string& id) const;
  absl::Status CheckRunStore(uint64_t store_id, const std::string& job_id, int attempt) const;

  // Progress (rank 0), checkpoints (rank 0) and results (every rank). A result makes the
  // worker IDLE. `stop` in the response: the attempt is no longer running. A report from a
  // worker the rank was not placed on is refused (Jobs::CheckReporter).
  absl::StatusOr<rackrun::v1::ReportResponse> Report(const rackrun::v1::ReportRequest& req);

  // Detection, re-attach expiry, scheduling.
  void Tick();

  // Wakes every waiter (streams, watchers, rendezvous); later calls are refused.
  void Shutdown();

 private:
  void EndAttempt(const Jobs::Ended& ended, const std::string& job_id, int attempt,
                  const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartJobs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  JobStore* const store_;
  const Clock clock_;
  const Options options_;
  Jobs jobs_;
  Workers workers_;
  Rendezvous rendezvous_;
  Planning planning_;
  std::mutex mu_;
};

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_RACK_H_
