// The worker daemon (docs/design.md section 7.10): one per device. Registers with its rack's
// coordinator, keeps the assignment stream open, heartbeats what it is doing (job, step,
// phase, collectives entered/completed, step time), runs assigned attempts one at a time
// (JobRunner) and stays up for the next one; a failed job, a dead peer or a restarted
// coordinator never ends the worker.
//
// A short cut of the link: each heartbeat has a deadline well below the coordinator's
// heartbeat timeout (rpc/liveness.h); one that misses it, or finds the coordinator
// unavailable, renews the connection's channel and the next goes at once over a new TCP
// connection (connection.h), so heartbeats resume as soon as the link does, not after
// TCP's retransmission backoff on the old connection.
//
// Re-attach: when the coordinator restarts (the stream breaks, a heartbeat answers
// NOT_FOUND), the worker registers again with its id and its in-flight job and step; if
// the coordinator no longer wants that job (job_attached = false) the job is stopped.
// A stream whose connection died at the coordinator's end only (data sent into a cut link
// and never acknowledged) is reported by the heartbeats' answers (stream_closed): the
// worker ends it and registers again, and the coordinator sends again a run that was lost
// with it (a run that reaches the worker twice runs once).
//
// Shutdown (SIGTERM/SIGINT, via Shutdown()): the running job finishes its step, writes a
// checkpoint (when checkpoint.dir is set) and stops with every rank at the same step; the
// result is reported, the worker deregisters and Serve returns OK.
//
// Every attempt assigned to the worker gets a result report, whatever happens to it: an
// attempt cancelled while still queued (its peer failed before this worker started it)
// is reported CANCELLED, one still queued at shutdown DRAINED; the coordinator frees the
// worker for the next job on that report.
#ifndef RACKRUN_WORKER_WORKER_H_
#define RACKRUN_WORKER_WORKER_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "metrics/exporter.h"
#include "worker/connection.h"
#include "worker/job_runner.h"

namespace rackrun::worker {

struct WorkerOptions {
  ConnectionOptions connection;
  std::string host;          // default: this machine's hostname
  std::string data_address;  // where peers reach this worker's data channel; default host
  std::string rack;          // rack label (--rack, RACKRUN_RACK); empty = none
  // From the launcher (mpirun, srun, torchrun-style variables); -1/0 when started by hand.
  int launcher_rank = -1;
  int launcher_size = 0;
  int local_rank = 0;
  // --device: "cpu", "cuda" (the local rank's GPU) or "cuda:N"; Create probes it and
  // resolves cuda to cuda:N.
  std::string device = "cpu";
  int threads = -1;  // compute threads per job; -1 = the job spec's
  std::chrono::milliseconds victim_grace{3000};
  // Fault injection for tests (RACKRUN_WORKER_START_DELAY_MS): the job thread waits this
  // long before it starts the first attempt assigned to it, which leaves that attempt
  // queued for a cancel to find (one cancelled before the wait began spends the delay too:
  // later attempts never wait).
  std::chrono::milliseconds start_delay{0};
  // How long to keep retrying the coordinator before giving up at start and when a
  // result cannot be delivered.
  std::chrono::milliseconds patience{120000};
  // Prometheus exporter ("HOST:PORT"); empty = none. peak_flops: per device, for MFU.
  std::string metrics_listen;
  double peak_flops = 0;
  // --allowed-roots, resolved (jobspec/path_confinement.h): a job's file paths must lead
  // inside one of them; empty = unconfined (a notice at start says so).
  std::vector<std::string> allowed_roots;
};

// --device `*device` (cpu, cuda or cuda:N) checked on this machine for a worker of local
// rank `local_rank` (runtime/cuda/device_probe.h): nullopt for cpu; for a usable GPU its
// description for the registration, and *device resolved to cuda:N. An unusable one (no
// driver, no device, index out of range, compute capability too low, a build without the
// GPU engine) is an error naming --device and the cause.
absl::StatusOr<std::optional<rackrun::v1::Gpu>> ProbeWorkerDevice(std::string* device,
                                                                  int local_rank);

class Worker {
 public:
  static absl::StatusOr<std::unique_ptr<Worker>> Create(const WorkerOptions& options);
  ~Worker();

  // Registers and serves until Shutdown() has drained the worker (OK), the coordinator
  // stayed unreachable for `patience` at start (Unavailable with one actionable line), or it
  // refused the worker's token or role, at start or later (Unauthenticated or
  // PermissionDenied naming the token's source; a later refusal drains the worker first).
  absl::Status Serve();
  // Thread-safe; not async-signal-safe (call it from a thread that waits for signals).
  void Shutdown();

  // After Serve registered: the id the coordinator gave this worker.
  std::string worker_id() const;

 private:
  // The id and the coordinator's job store it came from (RegisterResponse.store_id; 0 from
  // a coordinator older than the field), read together: every call that names the worker
  // sends both, so that a coordinator with another store tells them apart.
  struct Registered {
    std::string worker_id;
    uint64_t store_id = 0;
  };
  Registered registered() const;

  explicit Worker(const WorkerOptions& options) : options_(options) {}

  // Register (or register again with the in-flight job). Serialised.
  absl::Status Register(bool again);
  // Serve's steps, in order. RegisterAtStart waits up to `patience` for the coordinator:
  // true once registered, false when shut down meanwhile.
  absl::StatusOr<bool> RegisterAtStart();
  // The next attempt to run (after the start delay, reporting the ones cancelled while
  // queued); nullopt once the worker drains.
  std::optional<rackrun::v1::RunJob> NextJob();
  // What a job runner gets from this worker's options (its device among them).
  JobRunnerOptions RunnerOptions() const;
  void RunJob(const rackrun::v1::RunJob& job);
  // After draining: reports what never started, stops the threads, deregisters.
  void Leave();
  void ReportCancelledUnstarted();
  void StreamLoop();
  // StreamLoop's Register(again): true once registered. A refused token ends the worker
  // (Refused); another failure that is not the coordinator being away is said once a kind
  // (`told`: the last said, kOk after a success, which is said too).
  bool RegisterAgain(absl::StatusCode* told);
  void HeartbeatLoop();
  // The log line when heartbeats are answered again after `missed` failed for `missing`.
  void SayHeartbeatsAnswered(const grpc::Status& s, std::chrono::steady_clock::duration missing,
                             int missed) const;
  // The coordinator says the stream open when heartbeat `epoch` was sent is closed there, or
  // (`stalled`) that an assignment it wrote into it never arrived: cancel it (StreamLoop
  // registers again and opens another; a stalled stream's channel is renewed first, since
  // its TCP connection is stuck).
  void ReopenStream(int64_t epoch, bool stalled);
  // `run`'s attempt is queued, being taken from the queue, or running here: the coordinator
  // sent it again after a stream broke or stalled (it resends only the attempt a worker is
  // busy with and did not name when it registered again; one that ended was reported, or
  // named while its report was on the way). Called with mu_ held.
  bool HasRunLocked(const rackrun::v1::RunJob& run) const;
  // Ends the stream and heartbeat threads (Serve before it deregisters, the destructor).
  void StopThreads();
  // The coordinator refused this registered worker's token (UNAUTHENTICATED) or its role
  // (PERMISSION_DENIED): its tokens changed (rotated, or a new state folder). Nothing this
  // worker sends will be taken, so it says so once and shuts down as on SIGTERM, and Serve
  // returns the refusal. Before, it went on for ever, silent, registered nowhere.
  void Refused(const absl::Status& s);
  // One line for a refused token or role: the address, the token's source, the fix.
  absl::Status RefusalStatus(const absl::Status& s) const;
  void ReportResult(const rackrun::v1::RunJob& job, const rackrun::v1::AttemptResult& result);
  // Reports attempts that never started (cancelled while queued, or queued at shutdown).
  void ReportUnstarted(const std::vector<rackrun::v1::RunJob>& jobs,
                       rackrun::v1::AttemptResult::Outcome outcome, const char* message);

  WorkerOptions options_;
  std::unique_ptr<Connection> connection_;
  std::unique_ptr<metrics::MetricsExporter> exporter_;
  std::string metrics_address_;  // HOST:PORT sent in Register; empty without an exporter
  std::vector<std::string> channels_;
  std::optional<rackrun::v1::Gpu> gpu_;  // --device's GPU; nullopt for cpu
  // What the UCX channel uses of --data-address ("ADDRESS on INTERFACE"), sent in Register;
  // empty for a host name or when UCX_NET_DEVICES decides.
  std::string ucx_address_;

  std::mutex register_mu_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string worker_id_;                  // guarded by mu_
  uint64_t store_id_ = 0;                  // guarded by mu_
  std::deque<rackrun::v1::RunJob> queue_;  // guarded by mu_
  // Cancelled while queued; the job thread reports them CANCELLED. Guarded by mu_.
  std::vector<rackrun::v1::RunJob> cancelled_unstarted_;
  // Taken from the queue by NextJob, until RunJob makes it running_. Guarded by mu_.
  std::optional<rackrun::v1::RunJob> taken_;
  bool taken_cancelled_ = false;         // guarded by mu_: a cancel for taken_ came meanwhile
  std::shared_ptr<JobRunner> running_;   // guarded by mu_
  std::shared_ptr<JobRunner> finished_;  // the last one (job thread only): its metrics stay
  bool draining_ = false;                // guarded by mu_
  std::optional<absl::Status> refused_;  // guarded by mu_: Refused's, Serve's result
  bool stopped_ = false;                 // guarded by mu_: threads end
  grpc::ClientContext* stream_context_ = nullptr;  // guarded by mu_
  std::shared_ptr<Connection::Stub> stream_stub_;  // guarded by mu_: the open stream's
  // The highest Assignment.sequence received since the last registration (heartbeats
  // acknowledge it; zeroed before each Register). Guarded by mu_.
  int64_t assignments_received_ = 0;
  int64_t stream_epoch_ = 0;  // guarded by mu_: streams opened (a heartbeat's answer about
                              // the stream applies to the one open when it was sent)
  std::thread stream_thread_, heartbeat_thread_;
  std::chrono::milliseconds start_delay_{0};  // job thread only: options_.start_delay, once
};

}  // namespace rackrun::worker

#endif  // RACKRUN_WORKER_WORKER_H_
