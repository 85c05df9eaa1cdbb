// Workers: membership of the rack's worker daemons, and the bookkeeping of failure
// detection that names the culprit, not a victim.
//
// A worker registers (id "w-<n>", or its old id when it re-registers), keeps one
// Assignments stream open (OpenStream/NextAssignment/CloseStream), heartbeats, and
// deregisters. Detect() takes a snapshot of the busy workers of every running attempt not
// reported yet and asks the failure detector's rules (failure_detector.h: lost, hang (a),
// (b), (c)) for at most one finding per attempt; it marks lost workers LOST and reports an
// attempt once. Times come from the injected clock.
//
// Thread safety: all methods are thread-safe.
#ifndef RACKRUN_COORDINATOR_WORKERS_H_
#define RACKRUN_COORDINATOR_WORKERS_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/clock.h"
#include "coordinator/failure_detector.h"
#include "coordinator/sync.h"
#include "rackrun/v1/job_service.pb.h"
#include "rackrun/v1/rack_control.pb.h"
#include "rpc/phase.h"

namespace rackrun::coordinator {

// A worker the scheduler may use.
struct IdleWorker {
  std::string worker_id;
  std::string host;
  int pid = 0;
  int launcher_rank = -1;
  std::string data_address;  // empty: host
  std::vector<std::string> channels;
  std::string rack;       // its rack label (RegisterRequest.rack); empty = none
  bool gpu = false;       // it registered a GPU (RegisterRequest.gpu): it may run cuda jobs
  int64_t gpu_bytes = 0;  // that GPU's memory (Gpu.total_bytes; 0 = not reported)
};

class Workers {
 public:
  struct Options {
    int64_t heartbeat_interval_ms = 1000;
    int64_t heartbeat_timeout_ms = 5000;
    int64_t hang_timeout_ms = 60000;
    // Rule (b) for phase "starting" (before the data channel and training): building the
    // model and reading data take longer on big jobs and loaded machines than a step.
    int64_t start_timeout_ms = 600000;
    // Workers LOST or GONE this long are forgotten (a worker that comes back registers
    // anew), and at most this many are kept, the longest ended forgotten first: a
    // crash-looping worker registers a new id at each start, and the list must not grow
    // without end.
    int64_t forget_after_ms = 3600000;
    int max_ended = 1024;
    // Live workers (not LOST or GONE) at most: a registration that would add one more is
    // refused (ResourceExhausted naming --max-workers). Each live worker holds a server
    // thread with its Assignments stream, so a launcher that starts workers without end
    // (or a leaked worker token) cannot starve the coordinator's other calls of threads.
    int max_live = 4096;
  };

  // `next_number` hands out worker numbers that never repeat (the store's counter).
  Workers(Clock clock, Options options, std::function<absl::StatusOr<int64_t>()> next_number);

  const Options& options() const { return options_; }

  // Registers a worker (InvalidArgument naming `host` or `rack` for a bad one;
  // ResourceExhausted when Options::max_live workers are live and this is not one of them). With
  // req.worker_id set, that id is kept (re-register after a coordinator restart or after
  // being declared lost); otherwise a new one is assigned, never one a worker here holds
  // (after a coordinator came back with a new job store, whose numbers start again, its
  // old workers keep theirs).
  // The worker starts IDLE; the caller marks it busy when it re-attaches to its job. A
  // worker that registers naming a job (req.job_id) and is not re-attached to it is still
  // stopping that attempt: it is IDLE but not placeable (not in Idle()) until a heartbeat
  // says it runs no job.
  absl::StatusOr<std::string> Register(const rackrun::v1::RegisterRequest& req);

  // NotFound when the worker is unknown, LOST or GONE (it must register again). A worker
  // that is not BUSY here and names a job is still stopping an ended attempt: not placeable
  // (as after Register) until a heartbeat names none. `resp` (when given) says whether its
  // Assignments stream is closed here (stream_closed: a live worker whose connection died
  // under it; it opens a new stream) or stalled (stream_stalled: an assignment written into
  // the open stream is not acknowledged by the heartbeats (assignments_received)
  // StallAfterMs() after it was written; said once per such wait).
  absl::Status Heartbeat(const rackrun::v1::HeartbeatRequest& req,
                         rackrun::v1::HeartbeatResponse* resp = nullptr);

  // GONE; its stream is ended. NotFound when unknown.
  absl::Status Deregister(const std::string& worker_id);

  // The Assignments stream: OpenStream returns a generation (a newer stream for the same
  // worker supersedes the older one, whose NextAssignment then returns Cancelled).
  // NextAssignment waits up to `max_wait` and returns nullopt when nothing came.
  // CloseStream with the generation marks the stream closed (the worker is lost at the
  // next Detect when it is still registered and not GONE).
  absl::StatusOr<int64_t> OpenStream(const std::string& worker_id);
  absl::StatusOr<std::optional<rackrun::v1::Assignment>> NextAssignment(
      const std::string& worker_id, int64_t generation, absl::Duration max_wait);
  void CloseStream(const std::string& worker_id, int64_t generation);

  // Queues an assignment for the worker's stream (dropped for GONE or unknown workers),
  // numbered (Assignment.sequence) from 1 after each registration.
  void Push(const std::string& worker_id, const rackrun::v1::Assignment& a);
  // The run last pushed to a BUSY worker for the attempt it is busy with; nullopt when it
  // is not busy or none was pushed for that attempt. A worker that registers again without
  // naming that attempt never got the run (it died with a stream) or still has it queued:
  // the rack sends it again.
  std::optional<rackrun::v1::RunJob> BusyRun(const std::string& worker_id) const;

  // The worker runs (job, attempt, rank): BUSY. SetIdle: IDLE again (if not LOST/GONE)
  // when it is on that job (or any job when job_id is empty). SetDraining: the same, but
  // DRAINING: its attempt ended DRAINED because it shuts down, so the scheduler never
  // places another attempt on it between that report and its Deregister.
  void SetBusy(const std::string& worker_id, const std::string& job_id, int attempt, int rank);
  void SetIdle(const std::string& worker_id, const std::string& job_id);
  void SetDraining(const std::string& worker_id, const std::string& job_id);

  // Registered, IDLE workers with an open stream that are not still stopping an ended
  // attempt (see Register).
  std::vector<IdleWorker> Idle() const;
  // Workers with a GPU that run a job now (BUSY): a cuda job that finds no idle GPU worker
  // may be waiting for one of these (scheduler.h's Unplaced says so).
  int BusyGpuWorkers() const;

  // Placement details of a worker (for RankPlacement); NotFound when unknown.
  absl::StatusOr<rackrun::v1::RankPlacement> Placement(const std::string& worker_id) const;

  // Failures found now by the rules of failure_detector.h (see the header comment), the
  // closed streams first. Lost workers become LOST; an attempt is reported once. Ended
  // workers past Options::forget_after_ms or beyond Options::max_ended are forgotten.
  std::vector<Finding> Detect();

  rackrun::v1::ListWorkersResponse List(bool include_gone) const;
  // The attempts Detect keeps a verdict mark for: those a worker is busy with (a bound for
  // the tests: the marks of ended attempts are forgotten).
  int AttemptsTracked() const;

  // Ends every stream (NextAssignment returns Cancelled).
  void Shutdown();

  // How long an assignment written into an open stream may go unacknowledged before the
  // stream counts as stalled: a heartbeat round trip (rpc/liveness.h's late_after: the
  // interval plus one heartbeat's deadline) plus one interval.
  int64_t StallAfterMs() const;

 private:
  // A new id "w-N" from next_number_, skipping ids a worker here holds.
  absl::StatusOr<std::string> NewId();

  struct Info {
    rackrun::v1::Worker
        w;  // id, host, pid, launcher_rank, device, channels, state, job, rank, step, phase
    std::string data_address;
    rpc::Phase phase = rpc::Phase::kIdle;  // w.phase parsed
    int attempt = 0;
    int64_t last_heartbeat_ms = 0;
    int64_t phase_age_ms = 0;  // as reported in the last heartbeat
    int64_t entered = 0;
    int64_t completed = 0;
    int64_t blocked_n = 0;  // collective it was last seen blocked in (0: none)
    int64_t blocked_since_ms = 0;
    bool stream_open = false;
    bool stream_seen = false;  // a stream was opened since registration
    int64_t stream_closed_ms = 0;
    int64_t generation = 0;
    std::deque<rackrun::v1::Assignment> outbox;
    std::optional<rackrun::v1::RunJob> run;  // the last run pushed (see BusyRun)
    // Assignment sequence numbers since registration: the last pushed, the last handed to
    // the stream's writer, the last the heartbeats acknowledged, and since when the
    // stream has had written and unacknowledged ones (or when that was last said).
    int64_t pushed = 0;
    int64_t written = 0;
    int64_t acknowledged = 0;
    int64_t unacknowledged_since_ms = 0;
    // The job it said it still runs when it registered, until SetBusy re-attaches it or a
    // heartbeat says it runs none: a re-registered worker whose attempt ended meanwhile
    // (a partition, a coordinator restart) is stopping it and must not be placed yet.
    std::string stopping_job;
    int64_t ended_ms = 0;  // when it became LOST or GONE
  };

  Info* Find(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ok when `id` is live already or one more live worker fits Options::max_live.
  absl::Status CheckRoomLocked(const std::string& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // SetIdle and SetDraining: `to` is IDLE or DRAINING.
  void Release(const std::string& worker_id, const std::string& job_id,
               rackrun::v1::WorkerState to);
  // The worker as the detection rules see it.
  static RankSnapshot SnapshotOf(const Info& w);
  // LOST or GONE from `now` on.
  static void End(Info& w, rackrun::v1::WorkerState state, int64_t now);
  // Detect's last step: forgets ended workers by Options::forget_after_ms and max_ended.
  void ForgetEnded(int64_t now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Clock clock_;
  const Options options_;
  const std::function<absl::StatusOr<int64_t>()> next_number_;
  mutable std::mutex mu_;
  std::condition_variable cv_;  // outbox pushes, stream changes, shutdown
  std::map<std::string, Info> workers_ ABSL_GUARDED_BY(mu_);
  int64_t generations_ ABSL_GUARDED_BY(mu_) = 0;  // the last stream generation given
  std::map<std::pair<std::string, int>, bool> reported_ ABSL_GUARDED_BY(mu_);  // attempts named
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_WORKERS_H_
