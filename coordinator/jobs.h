// Jobs: the lifecycle of every job the coordinator accepted, its attempts, its events and
// its restarts (by the restart policy of jobspec/restart_policy.h). QUEUED -> RUNNING -> SUCCEEDED
// | FAILED | CANCELLED; a failed attempt that the policy restarts sends the job back to QUEUED
// (behind a backoff) and a new attempt resumes from the last checkpoint. Every change is committed
// to the JobStore before the call returns (and before it is visible in memory), so what a caller
// was told survives kill -9.
//
// Events: per job, seq 1, 2, ... without gaps. Watchers wait in WaitEvents.
//
// Jobs knows nothing about workers or streams: calls that end an attempt return the ranks
// whose workers still run it (`RankRef`), and the caller sends them CancelJob.
//
// Thread safety: all methods are thread-safe.
#ifndef RACKRUN_COORDINATOR_JOBS_H_
#define RACKRUN_COORDINATOR_JOBS_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/clock.h"
#include "coordinator/job_store.h"
#include "coordinator/sync.h"
#include "rackrun/v1/job_service.pb.h"
#include "rackrun/v1/rack_control.pb.h"

namespace rackrun::coordinator {

// One rank of an attempt and the worker that runs it.
struct RankRef {
  std::string worker_id;
  std::string job_id;
  int attempt = 0;
  int rank = 0;
};

// A job waiting to start, for the scheduler.
struct QueuedJob {
  std::string job_id;
  rackrun::v1::JobSpec spec;
  int64_t not_before_ms = 0;  // restart backoff
};

class Jobs {
 public:
  struct Options {
    // After a coordinator restart, how long a running attempt's workers have to
    // re-register before the missing ranks count as lost.
    int64_t reattach_grace_ms = 15000;
    // A rank named by a HANG verdict (a timeout rule) that reports its own failure within
    // this long after the verdict: its report replaces the verdict as the attempt's failure
    // (and the job's first failure), since a slow machine, not a hang, made it late.
    int64_t report_grace_ms = 30000;
    // Progress reports (rank 0 sends one per step, as fast as they are answered) become job
    // events at most once per this interval; the newest one kept back is in the job
    // (last_progress) and becomes an event before the job's next other event. A job keeps
    // at most max_progress_events of them, the oldest dropped (never the last before
    // another event, where a restart's checkpoint step is read): a month-long run's
    // history, its replay at start and a late watcher's catch-up stay bounded.
    int64_t progress_event_interval_ms = 1000;
    int max_progress_events = 1000;
    // The same bound once the job has ended (its history is kept for rackrun list,
    // status and watch; the run's own log has every step).
    int max_ended_progress_events = 100;
    // Ended jobs kept in memory, the last to end (or to be asked for) kept: the older ones
    // stay in the store only, and are read back when asked for (Get, Watch, List, a late
    // report). A coordinator's memory and its start then do not grow with every job it ever
    // ran; the store's file does.
    int max_ended_in_memory = 1000;
  };

  Jobs(JobStore* store, Clock clock, Options options);

  // Loads the persisted jobs: at the coordinator's start JobStore::LoadAll with
  // max_ended_in_memory (the jobs not ended and the last to end; others are read back when
  // asked for). Called once, before any other method. Running attempts wait for their
  // ranks to re-attach (Reattach) until reattach_grace_ms from now.
  absl::Status Initialize(std::vector<StoredJob> jobs);

  // Forgets from memory the ended jobs beyond Options::max_ended_in_memory, those that ended
  // (or were read back) first; they stay in the store. Called on the rack's tick.
  void ForgetEnded();
  // Jobs held in memory now (for the tests of that bound).
  int JobsInMemory() const;

  // Accepts a job (spec already defaulted and validated). Idempotent by request_id.
  absl::StatusOr<JobStore::InsertResult> Submit(const rackrun::v1::JobSpec& spec,
                                                const std::string& request_id);

  absl::StatusOr<rackrun::v1::Job> Get(const std::string& job_id) const;

  // Newest first; `state` UNSPECIFIED = all. Jobs without spec and attempts.
  // InvalidArgument for a malformed page token.
  absl::StatusOr<rackrun::v1::ListJobsResponse> List(const rackrun::v1::ListJobsRequest& req) const;

  struct Ended {
    rackrun::v1::Job job;
    std::vector<RankRef> to_cancel;  // ranks of the ended attempt that have not reported
  };

  // NotFound; FailedPrecondition when the job already ended.
  absl::StatusOr<Ended> Cancel(const std::string& job_id, const std::string& reason);

  // QUEUED jobs in FIFO order (creation order; restarted jobs keep their place).
  std::vector<QueuedJob> Queue() const;

  // A QUEUED job the scheduler cannot place (scheduler.h's Unplaced): `reason` becomes the
  // job's message and a message event, once per change of reason (the scheduler asks on
  // every tick). Nothing for a job that is not QUEUED or already says so.
  void NoteUnplaced(const std::string& job_id, const std::string& reason);

  // Starts the next attempt of a QUEUED job on `ranks` (rank i at index i). Returns it
  // (number, resume = number > 1). A non-empty `placement_note` (Placement::note: domains
  // that mix rack labels) becomes a message event of the attempt. FailedPrecondition when
  // the job is not QUEUED.
  absl::StatusOr<rackrun::v1::Attempt> StartAttempt(
      const std::string& job_id, const std::vector<rackrun::v1::RankPlacement>& ranks,
      const std::string& placement_note = "");

  // One rank's end of an attempt. Succeeded from every rank ends the job SUCCEEDED; each
  // rank's first SUCCEEDED is a stored RankDone event, so that after a coordinator restart
  // that rank is neither awaited (re-attach) nor asked for its result again, and a result
  // counts as the rank's re-attach (it may come before the rank registers again);
  // FAILED from a rank fails the attempt (kind ERROR naming it), DRAINED or an unasked
  // CANCELLED fails it with WORKER_CANCELLED. Results for an ended attempt change nothing,
  // with one exception: FAILED from the rank that a HANG verdict named, within
  // report_grace_ms of the verdict, replaces the verdict (kind ERROR, the rank's message,
  // the verdict kept in replaced_verdict); a job the verdict restarted and whose policy
  // does not restart on that error fails instead, if its next attempt has not started.
  // NotFound for an unknown job, attempt or rank.
  absl::StatusOr<Ended> RankResult(const std::string& job_id, int attempt, int rank,
                                   const rackrun::v1::AttemptResult& result);

  // Ends a running attempt with `failure` (the first failure of the job is kept), then
  // restarts the job per its policy or fails it. A failure for an attempt that already
  // ended returns an empty `to_cancel` and changes nothing (several detectors may name
  // the same attempt).
  absl::StatusOr<Ended> FailAttempt(const std::string& job_id, int attempt,
                                    const rackrun::v1::Failure& failure);

  // Rank 0's progress: last_progress and a progress event. Ignored for ended attempts.
  absl::Status Progress(const std::string& job_id, int attempt, const rackrun::v1::StepProgress& p);
  // A checkpoint written: a message event (its step is where the next attempt resumes).
  absl::Status Checkpoint(const std::string& job_id, int attempt, const std::string& path);

  // True while `attempt` is the job's running attempt.
  bool AttemptRunning(const std::string& job_id, int attempt) const;

  // Whether a report about (job, attempt, rank) may come from `worker_id`: Ok when the rank
  // was placed on that worker; NotFound for an unknown job, attempt or rank;
  // FailedPrecondition naming both workers otherwise (a worker that kept its job from a job
  // store this coordinator no longer has, whose job number and rank came back as another
  // job's, or one reporting for a rank not its own).
  absl::Status CheckReporter(const std::string& job_id, int attempt, int rank,
                             const std::string& worker_id) const;

  // A worker that re-registered naming (job, attempt, rank): Ok and the rank's placement
  // updated (its host, pid, addresses) when that attempt is still running on that worker
  // (placement.worker_id), FailedPrecondition otherwise: a rank never moves to another
  // worker (one that kept its job from a job store this coordinator no longer has, whose
  // number came back as another job's, must not take that job's rank).
  absl::Status Reattach(const std::string& job_id, int attempt, int rank,
                        const rackrun::v1::RankPlacement& placement);

  // Attempts whose re-attach grace passed with ranks missing fail with WORKER_LOST naming
  // them. Returns what to cancel.
  std::vector<Ended> ExpireReattach();

  // Appends the events with seq > after_seq to `out`, waiting up to `max_wait` for one.
  // `*done` is set when the job's terminal state event is among those returned or was
  // before after_seq. NotFound for an unknown job; Unavailable after Shutdown.
  absl::Status WaitEvents(const std::string& job_id, int64_t after_seq, absl::Duration max_wait,
                          std::vector<rackrun::v1::JobEvent>* out, bool* done) const;

  // Wakes every watcher; later WaitEvents return Unavailable.
  void Shutdown();

 private:
  struct Entry {
    rackrun::v1::Job job;
    std::vector<rackrun::v1::JobEvent> events;
    int64_t not_before_ms = 0;
    std::map<int, int> results;  // rank -> AttemptResult::Outcome of the current attempt
    std::set<int> awaiting_reattach;
    int64_t reattach_deadline_ms = 0;
    int64_t checkpoint_step = 0;    // step of the last checkpoint reported
    int progress_events = 0;        // in `events`
    int64_t progress_event_ms = 0;  // when the last one was committed
    // A progress report kept back (Progress), with its attempt, not an event yet.
    std::optional<rackrun::v1::JobEvent> progress_pending;
  };

  // Options::max_progress_events, or max_ended_progress_events once `job` has ended.
  int MaxProgressEvents(const rackrun::v1::Job& job) const;
  // Removes the events with these seqs (progress events) from `e`.
  static void DropEvents(Entry& e, const std::vector<int64_t>& seqs);
  // The job's entry, read back from the store when it ended and was forgotten from memory;
  // nullptr when there is no such job.
  Entry* Find(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Entry* Find(const std::string& job_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The placement of `rank` in attempt `attempt` of `e` (job `job_id`, as Find gave it):
  // NotFound naming the job, the attempt or the rank that is not there.
  static absl::StatusOr<const rackrun::v1::RankPlacement*> PlacementOf(const Entry* e,
                                                                       const std::string& job_id,
                                                                       int attempt, int rank);
  // A stored job as an entry: the attempt awaiting its ranks when it runs, the checkpoint
  // step and the progress count replayed from its events.
  Entry FromStore(StoredJob s, int64_t now) const;
  // Commits `next` and events (seq/job/time filled in here) and then applies them; a
  // progress report kept back goes first, and the oldest progress events beyond
  // Options::max_progress_events are dropped.
  absl::Status Commit(Entry& e, rackrun::v1::Job next, std::vector<rackrun::v1::JobEvent> events)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Ended> FailLocked(Entry& e, int attempt, rackrun::v1::Failure failure)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RankResult's exception for a late own report (see there). Ok and nothing changed when
  // the report does not qualify.
  absl::Status ReplaceVerdictLocked(Entry& e, int attempt, rackrun::v1::Failure own)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<RankRef> Unreported(const Entry& e, const rackrun::v1::Attempt& a) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  JobStore* const store_;
  const Clock clock_;
  const Options options_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;  // signalled on every committed event and on Shutdown
  // By job number (creation order). Mutable: a const lookup may read an ended job back
  // from the store (Find); memory is a cache of the store for ended jobs.
  mutable std::map<int64_t, Entry> jobs_ ABSL_GUARDED_BY(mu_);
  // The ended jobs in jobs_, the first to end (or to be read back) first (ForgetEnded).
  mutable std::deque<int64_t> ended_order_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

bool IsTerminal(rackrun::v1::JobState state);
// One line: "rank 1 (worker w-2 on host h, pid 42) lost in phase forward at step 7: ...".
std::string DescribeFailure(const rackrun::v1::Failure& f);

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_JOBS_H_
