// One attempt of one job on this worker (its rank r of R): check that the spec's paths lead
// inside the worker's allowed roots and are usable here and that the job fits this machine,
// build the attempt's data channel from the coordinator's bootstrap (the channel
// resources.channel names, comm/channel_factory.h), build the trainer (resuming from the
// newest checkpoint when asked), run it with progress reports, and tear everything down
// whatever happens, so the worker is ready for the next job without a restart.
//
// Thread-safety: Run() on the worker's job thread; RequestStop, Status are callable from
// any thread (the assignment stream, the heartbeat thread, a signal watcher).
#ifndef RACKRUN_WORKER_JOB_RUNNER_H_
#define RACKRUN_WORKER_JOB_RUNNER_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "comm/data_channel.h"
#include "rackrun/v1/rack_control.pb.h"
#include "rpc/phase.h"
#include "runtime/trainer.h"
#include "runtime/training_session.h"
#include "worker/connection.h"
#include "worker/coordinator_plan_source.h"
#include "worker/training_metrics.h"

namespace rackrun::worker {

struct JobRunnerOptions {
  std::string worker_id;
  std::string host;
  int threads = -1;  // compute threads; -1 = the spec's resources.threads
  // --device cuda:N: the GPU of resources.device: cuda jobs and of NCCL channels; -1 = cpu.
  int cuda_device = -1;
  // After a failure caused by a peer (a broken or timed-out channel) or a stop this rank
  // did not ask for, how long to wait for the coordinator's cancel before reporting: the
  // coordinator then blames the culprit it detected, not this victim.
  std::chrono::milliseconds victim_grace{3000};
  // Prometheus registry of the worker's --metrics-listen exporter; null = no metrics.
  prometheus::Registry* metrics = nullptr;
  double peak_flops = 0;  // per device, for MFU; 0 = no MFU series
  // Resolved folders the spec's file paths must lead into (jobspec/path_confinement.h);
  // empty = unconfined.
  std::vector<std::string> allowed_roots;
};

// The trainer's phase as the heartbeat says it (the same names as runtime::TrainPhaseName).
rpc::Phase WorkerPhase(runtime::TrainPhase phase);

// What a heartbeat says about the attempt.
struct JobStatus {
  // The trainer's phase (WorkerPhase), kStarting, kConnecting (in the data channel's
  // rendezvous, waiting for its peers), kCollective (blocked in one), kReporting (training
  // is over on this rank or never started: the rank delivers its pending progress and
  // result, which may wait for a coordinator that is restarting; step is then the last step)
  rpc::Phase phase = rpc::Phase::kStarting;
  int64_t step = 0;
  comm::ChannelProgress collectives;
  double step_time_s = 0;
};

class JobRunner {
 public:
  JobRunner(Connection& connection, rackrun::v1::RunJob assignment, JobRunnerOptions options);
  ~JobRunner();

  // Runs the attempt to its end and returns the result every rank reports. From the end
  // of training (or of a failed start) on, Status() says phase "reporting" at the last step.
  rackrun::v1::AttemptResult Run();

  // Stop at the next step boundary (every rank of the attempt stops at the same one).
  void RequestStop(runtime::StopReason reason);
  JobStatus Status() const;

  const rackrun::v1::RunJob& assignment() const { return assignment_; }

 private:
  class Reporter;
  class ProgressObserver;

  // The attempt's steps, in the order RunAttempt takes them. Each returns its failure as a
  // Status; a step that fails because of a peer waits for the coordinator's cancel first.
  rackrun::v1::AttemptResult RunAttempt();
  absl::Status CheckPaths() const;
  absl::Status CheckFits() const;
  // The attempt's data channel (null for one rank), from the coordinator's rendezvous.
  absl::StatusOr<std::unique_ptr<comm::DataChannel>> Connect();
  absl::StatusOr<std::unique_ptr<comm::DataChannel>> MakeChannel();
  // The coordinator as the plan source (balancer.mode: coordinator); null otherwise.
  std::unique_ptr<CoordinatorPlanSource> MakePlanSource();
  // The trainer, resumed as the assignment says; `stage` is where a failure happened.
  absl::StatusOr<std::unique_ptr<runtime::TrainingSession>> StartSession(
      comm::DataChannel* channel, runtime::PlanSource* plan_source, runtime::SessionStage* stage);
  void StartMetrics(runtime::Trainer& trainer, CoordinatorPlanSource* plan_source);
  // Runs the trainer, published to RequestStop/Status while it runs (Attach, Detach);
  // `trained_to_the_end` says whether it finished every step.
  rackrun::v1::AttemptResult Train(runtime::Trainer& trainer, comm::DataChannel* channel,
                                   bool* trained_to_the_end);
  void Attach(runtime::Trainer& trainer, comm::DataChannel* channel);
  // Withdraws what Attach published and enters kReporting at `step`; returns the stop this
  // rank was asked for. Idempotent.
  runtime::StopReason Detach(int64_t step);
  rackrun::v1::AttemptResult ResultOf(const absl::StatusOr<runtime::TrainSummary>& summary,
                                      rpc::Phase phase, int64_t step,
                                      runtime::StopReason requested);
  rackrun::v1::AttemptResult FailedResult(const absl::Status& status, rpc::Phase phase) const;
  // "worker W on host H", for messages.
  std::string Who() const;
  // The phase (and the step) Status() reports while no trainer is attached.
  void SetStage(rpc::Phase stage, std::optional<int64_t> step = std::nullopt);
  // Waits up to victim_grace for a cancel from the coordinator.
  void WaitForCancel();

  Connection& connection_;
  rackrun::v1::RunJob assignment_;
  JobRunnerOptions options_;
  std::unique_ptr<Reporter> reporter_;

  mutable std::mutex mu_;
  std::condition_variable cancelled_cv_;
  runtime::Trainer* trainer_ = nullptr;  // guarded by mu_; alive while Run trains
  TrainingMetrics* metrics_ = nullptr;   // guarded by mu_; while Run trains
  // The attempt's series outlive Run (their last values stay visible) until this runner is
  // destroyed, which the worker does before the next job's runner is made.
  std::unique_ptr<TrainingMetrics> training_metrics_;
  comm::DataChannel* channel_ = nullptr;                        // guarded by mu_
  runtime::StopReason requested_ = runtime::StopReason::kNone;  // guarded by mu_
  bool cancelled_by_coordinator_ = false;                       // guarded by mu_
  rpc::Phase stage_ = rpc::Phase::kStarting;  // guarded by mu_; the phase while trainer_ is not set
  int64_t stage_step_ = 0;                    // guarded by mu_; the step while trainer_ is not set
  std::atomic<double> step_time_s_{0};
};

}  // namespace rackrun::worker

#endif  // RACKRUN_WORKER_JOB_RUNNER_H_
