#include "worker/job_runner.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "base/file.h"
#include "base/resource_failure.h"
#include "comm/channel_factory.h"
#include "data/token_source.h"
#include "jobspec/balancer.h"
#include "jobspec/data_blend.h"
#include "jobspec/device.h"
#include "jobspec/path_confinement.h"
#include "jobspec/spec.h"
#include "runtime/cuda/engine.h"
#include "runtime/job_config.h"
#include "runtime/training_session.h"
#include "worker/coordinator_plan_source.h"
#include "worker/rendezvous_client.h"

namespace rackrun::worker {
namespace {

using rackrun::v1::AttemptResult;

// Failures that another rank or the network caused: this rank is a victim.
bool PeerCaused(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable ||
         s.code() == absl::StatusCode::kDeadlineExceeded ||
         s.code() == absl::StatusCode::kFailedPrecondition ||
         s.code() == absl::StatusCode::kAborted;
}

// A GPU job's step figures for the coordinator (the dashboard's GPU charts).
rackrun::v1::DeviceProgress DeviceProgressOf(const runtime::DeviceStepStats& st) {
  rackrun::v1::DeviceProgress d;
  d.set_name(st.device);
  d.set_memory_in_use_bytes(st.memory_in_use_bytes);
  d.set_memory_peak_bytes(st.memory_peak_bytes);
  d.set_memory_reserved_bytes(st.memory_reserved_bytes);
  d.set_memory_total_bytes(st.memory_total_bytes);
  // DeviceStepStats::phase_names order: gemm, attention, streams, routing, optimizer, other.
  d.set_gemm_s(st.phase_ms[0] / 1e3);
  d.set_attention_s(st.phase_ms[1] / 1e3);
  d.set_streams_s(st.phase_ms[2] / 1e3);
  d.set_routing_s(st.phase_ms[3] / 1e3);
  d.set_optimizer_s(st.phase_ms[4] / 1e3);
  d.set_other_s(st.phase_ms[5] / 1e3);
  return d;
}

}  // namespace

// Sends progress and checkpoint reports to the coordinator off the training thread: a
// slow or restarting coordinator never slows a step. Progress is coalesced (only the
// newest pending one is sent); checkpoint events are all sent, in order.
class JobRunner::Reporter {
 public:
  Reporter(Connection& connection, const rackrun::v1::RunJob& job, const std::string& worker_id,
           JobRunner* runner)
      : connection_(connection), runner_(runner) {
    base_.set_worker_id(worker_id);
    base_.set_store_id(job.store_id());
    base_.set_job_id(job.job_id());
    base_.set_attempt(job.attempt());
    base_.set_rank(job.rank());
    thread_ = std::thread([this] { Loop(); });
  }
  ~Reporter() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Progress(const rackrun::v1::StepProgress& p) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      progress_ = p;
      has_progress_ = true;
    }
    cv_.notify_all();
  }
  void Checkpoint(const std::string& path) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      checkpoints_.push_back(path);
    }
    cv_.notify_all();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return done_ || has_progress_ || !checkpoints_.empty(); });
      // Drain what is pending even when done: the last step's progress matters.
      rackrun::v1::ReportRequest request = base_;
      if (!checkpoints_.empty()) {
        request.set_checkpoint(checkpoints_.front());
        checkpoints_.pop_front();
      } else if (has_progress_) {
        *request.mutable_progress() = progress_;
        has_progress_ = false;
      } else {
        return;  // done, nothing pending
      }
      lock.unlock();
      rackrun::v1::ReportResponse response;
      std::unique_ptr<grpc::ClientContext> context =
          connection_.NewContext(std::chrono::milliseconds(3000));
      const grpc::Status s = connection_.stub()->Report(context.get(), request, &response);
      if (s.ok() && response.stop()) runner_->RequestStop(runtime::StopReason::kCancel);
      lock.lock();
    }
  }

  Connection& connection_;
  JobRunner* runner_;
  rackrun::v1::ReportRequest base_;
  std::mutex mu_;
  std::condition_variable cv_;
  rackrun::v1::StepProgress progress_;
  bool has_progress_ = false;
  std::deque<std::string> checkpoints_;
  bool done_ = false;
  std::thread thread_;
};

// Rank 0's view of every step and checkpoint, forwarded to the Reporter.
class JobRunner::ProgressObserver final : public runtime::TrainObserver {
 public:
  ProgressObserver(JobRunner* runner, runtime::Trainer* trainer, bool lead)
      : runner_(runner), trainer_(trainer), lead_(lead) {}
  void OnStep(const runtime::StepRecord& r) override {
    runner_->step_time_s_.store(r.step_s);
    if (!lead_) return;
    rackrun::v1::StepProgress p;
    p.set_step(r.step);
    p.set_total_steps(r.total_steps);
    p.set_loss(r.loss);
    if (r.val_loss.has_value()) p.set_val_loss(*r.val_loss);
    p.set_tokens_per_s(r.step_s > 0 ? static_cast<double>(r.tokens) / r.step_s : 0);
    p.set_lr(r.lr);
    p.set_grad_norm(r.grad_norm);
    p.set_step_time_s(r.step_s);
    p.set_elapsed_s(r.elapsed_s);
    for (const double v : r.rank_imbalance_before) p.add_imbalance_before(v);
    for (const double v : r.rank_imbalance_after) p.add_imbalance_after(v);
    p.set_replicas(r.replicas);
    p.set_plan_s(r.plan_s);
    p.set_plan_exchange_s(r.plan_exchange_s);
    p.set_fanout_s(r.fanout_s);
    p.set_dispatch_s(r.dispatch_s);
    p.set_reduce_s(r.reduce_s);
    for (size_t d = 0; d < r.domains.size(); ++d) {
      const runtime::StepRecord::Domain& in = r.domains[d];
      rackrun::v1::DomainProgress* out = p.add_domains();
      out->set_domain(static_cast<int32_t>(d));
      out->set_first_rank(static_cast<int32_t>(d) * r.expert_parallel);
      out->set_ranks(r.expert_parallel);
      for (const double v : in.imbalance_before) out->add_imbalance_before(v);
      for (const double v : in.imbalance_after) out->add_imbalance_after(v);
      for (const double v : in.rank_tokens_before) out->add_rank_tokens_before(v);
      for (const double v : in.rank_tokens_after) out->add_rank_tokens_after(v);
    }
    if (const runtime::ExpertParallelGroup* ep = trainer_->expert_parallel(); ep != nullptr) {
      p.set_fanout_bytes(ep->stats().fanout_bytes);
    }
    if (runtime::DeviceEngine* engine = trainer_->device_engine(); engine != nullptr) {
      if (absl::StatusOr<runtime::DeviceStepStats> st = engine->StepStats(); st.ok()) {
        *p.mutable_device() = DeviceProgressOf(*st);
      }
    }
    // Expert-level detail for the dashboard's heatmap: a sampled stream, never metrics.
    const std::vector<std::vector<int64_t>>& counts = trainer_->model().expert_counts();
    const size_t cells = counts.empty() ? 0 : counts.size() * counts[0].size();
    if (cells <= 4096 || r.step % 10 == 0) {
      for (size_t layer = 0; layer < counts.size(); ++layer) {
        rackrun::v1::ExpertLoadSample* sample = p.add_expert_loads();
        sample->set_layer(static_cast<int32_t>(layer));
        for (const int64_t n : counts[layer]) sample->add_tokens(n);
      }
    }
    runner_->reporter_->Progress(p);
  }
  void OnCheckpoint(int64_t, const std::string& path) override {
    if (lead_) runner_->reporter_->Checkpoint(path);
  }

 private:
  JobRunner* runner_;
  runtime::Trainer* trainer_;
  bool lead_;
};

JobRunner::JobRunner(Connection& connection, rackrun::v1::RunJob assignment,
                     JobRunnerOptions options)
    : connection_(connection), assignment_(std::move(assignment)), options_(std::move(options)) {
  // resources.device: cuda runs on this worker's GPU (--device cuda:N: the coordinator placed
  // the job here because the worker has one), whatever index the spec named. A worker
  // without a GPU leaves the spec alone: the trainer's device check refuses it, naming why.
  rackrun::v1::JobSpec* spec = assignment_.mutable_spec();
  absl::StatusOr<jobspec::DeviceSpec> device = jobspec::ParseDevice(spec->resources().device());
  if (options_.cuda_device >= 0 && device.ok() && device->is_cuda()) {
    spec->mutable_resources()->set_device(absl::StrCat("cuda:", options_.cuda_device));
  }
}

JobRunner::~JobRunner() = default;

void JobRunner::RequestStop(runtime::StopReason reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (static_cast<int>(reason) > static_cast<int>(requested_)) requested_ = reason;
  if (reason == runtime::StopReason::kCancel) {
    cancelled_by_coordinator_ = true;
    cancelled_cv_.notify_all();
  }
  if (trainer_ != nullptr) trainer_->RequestStop(reason);
}

rpc::Phase WorkerPhase(runtime::TrainPhase phase) {
  switch (phase) {
    case runtime::TrainPhase::kIdle:
      return rpc::Phase::kIdle;
    case runtime::TrainPhase::kAgree:
      return rpc::Phase::kAgree;
    case runtime::TrainPhase::kData:
      return rpc::Phase::kData;
    case runtime::TrainPhase::kForwardBackward:
      return rpc::Phase::kForwardBackward;
    case runtime::TrainPhase::kReduce:
      return rpc::Phase::kReduce;
    case runtime::TrainPhase::kOptimizer:
      return rpc::Phase::kOptimizer;
    case runtime::TrainPhase::kEvaluate:
      return rpc::Phase::kEvaluate;
    case runtime::TrainPhase::kCheckpoint:
      return rpc::Phase::kCheckpoint;
  }
  return rpc::Phase::kOther;
}

JobStatus JobRunner::Status() const {
  JobStatus s;
  std::lock_guard<std::mutex> lock(mu_);
  s.step_time_s = step_time_s_.load();
  if (trainer_ == nullptr) {
    s.phase = stage_;
    s.step = stage_step_;
    return s;
  }
  s.step = trainer_->steps_done();
  s.phase = WorkerPhase(trainer_->phase());
  if (channel_ != nullptr) {
    s.collectives = channel_->progress();
    if (s.collectives.collectives_entered > s.collectives.collectives_completed) {
      s.phase = rpc::Phase::kCollective;
    }
  }
  if (metrics_ != nullptr) metrics_->SetPhase(rpc::PhaseName(s.phase));
  return s;
}

void JobRunner::SetStage(rpc::Phase stage, std::optional<int64_t> step) {
  std::lock_guard<std::mutex> lock(mu_);
  stage_ = stage;
  if (step.has_value()) stage_step_ = *step;
}

void JobRunner::WaitForCancel() {
  std::unique_lock<std::mutex> lock(mu_);
  cancelled_cv_.wait_for(lock, options_.victim_grace, [&] { return cancelled_by_coordinator_; });
}

absl::Status JobRunner::CheckPaths() const {
  const rackrun::v1::JobSpec& spec = assignment_.spec();
  // Confinement first, on every rank (all of them read the data, and the checkpoints when
  // resuming): nothing outside the allowed roots is opened, not even to test it.
  if (absl::Status s = jobspec::CheckSpecPathsConfined(
          spec, options_.allowed_roots,
          absl::StrCat(options_.host, ", worker ", options_.worker_id));
      !s.ok()) {
    return s;
  }
  const auto unusable = [&](const std::string& field, const std::string& path,
                            const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": cannot ", what, " '", path, "' on host ", options_.host, ": ",
        std::strerror(errno),
        "; paths in a submitted spec must be usable by every worker (a shared file system)"));
  };
  // Every dataset (data.train, data.validation, the blends' paths): each of its files.
  for (const auto& [field, path] : jobspec::DataPaths(spec)) {
    for (const std::string& file : data::DatasetFiles(*path)) {
      // Never a blocking open: a FIFO here would hold the worker for ever.
      absl::StatusOr<int> fd = base::OpenRegularFile(file, O_RDONLY, base::FileUse::kJob);
      if (!fd.ok()) {
        return absl::Status(
            fd.status().code() == absl::StatusCode::kPermissionDenied
                ? absl::StatusCode::kPermissionDenied
                : absl::StatusCode::kInvalidArgument,
            absl::StrCat(field, ": ", fd.status().message(), " on host ", options_.host,
                         "; paths in a submitted spec must be regular files usable by every "
                         "worker (a shared file system)"));
      }
      ::close(*fd);
    }
  }
  // Rank 0 writes checkpoints and logs: the nearest existing folder must be writable.
  if (assignment_.rank() == 0) {
    for (const auto& [field, path] :
         {std::pair<std::string, std::string>{"checkpoint.dir", spec.checkpoint().dir()},
          {"logging.json", std::filesystem::path(spec.logging().json()).parent_path().string()},
          {"logging.load_trace",
           std::filesystem::path(spec.logging().load_trace()).parent_path().string()}}) {
      if (path.empty()) continue;
      std::filesystem::path p(path);
      std::error_code ec;
      while (!p.empty() && !std::filesystem::exists(p, ec)) p = p.parent_path();
      if (p.empty()) p = ".";
      if (::access(p.c_str(), W_OK) != 0) return unusable(field, p.string(), "write into");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<comm::DataChannel>> JobRunner::MakeChannel() {
  const rackrun::v1::Bootstrap& b = assignment_.bootstrap();
  comm::ChannelSetup setup;
  setup.prefix = b.store_prefix();
  setup.rank = assignment_.rank();
  setup.size = assignment_.ranks();
  setup.channel.timeout = absl::Milliseconds(b.timeout_ms() > 0 ? b.timeout_ms() : 300000);
  setup.address = b.address();
  setup.label = Who();
  setup.device = std::max(0, options_.cuda_device);
  setup.host_buffers = true;  // the CPU trainer's buffers are host memory
  RendezvousClient store(connection_, assignment_.job_id(), assignment_.attempt(),
                         assignment_.store_id());
  return comm::CreateChannel(b.channel(), store, setup);
}

AttemptResult JobRunner::Run() {
  // An allocation failure anywhere in the attempt (the trainer's model, a checkpoint, a
  // collective's buffers) or a thread that cannot be started (the reporter, a channel's
  // transfer threads) fails the attempt with a message instead of ending the worker daemon
  // with std::terminate: the one place the attempt catches anything.
  absl::StatusOr<AttemptResult> result =
      base::CatchResourceFailures([this] { return RunAttempt(); });
  if (!result.ok()) {
    reporter_.reset();
    AttemptResult failed;
    failed.set_outcome(AttemptResult::FAILED);
    failed.set_message(absl::StrCat(Who(), ": ", result.status().message()));
    result = std::move(failed);
  }
  SetStage(rpc::Phase::kReporting, result->step());
  return *std::move(result);
}

// The attempt's result from the trainer's summary: its outcome, or the failure (a victim's
// after waiting for the coordinator's cancel, so the culprit is named first).
AttemptResult JobRunner::ResultOf(const absl::StatusOr<runtime::TrainSummary>& summary,
                                  rpc::Phase phase, int64_t step, runtime::StopReason requested) {
  AttemptResult result;
  result.set_step(step);
  if (!summary.ok()) {
    if (PeerCaused(summary.status())) WaitForCancel();
    result.set_outcome(AttemptResult::FAILED);
    result.set_message(std::string(summary.status().message()));
    result.set_phase(rpc::PhaseName(phase));
    return result;
  }
  result.set_checkpoint(summary->last_checkpoint);
  result.set_final_loss(summary->final_loss);
  if (summary->final_val_loss.has_value()) result.set_final_val_loss(*summary->final_val_loss);
  switch (summary->stopped) {
    case runtime::StopReason::kNone:
      result.set_outcome(AttemptResult::SUCCEEDED);
      break;
    case runtime::StopReason::kCancel:
      result.set_outcome(AttemptResult::CANCELLED);
      result.set_message(absl::StrCat("stopped at step ", step, " (cancelled)"));
      break;
    case runtime::StopReason::kDrain:
      if (requested == runtime::StopReason::kDrain) {
        result.set_outcome(AttemptResult::DRAINED);
        result.set_message(absl::StrCat("worker ", options_.worker_id, " on ", options_.host,
                                        " shut down; stopped at step ", step,
                                        summary->last_checkpoint.empty()
                                            ? std::string(" (no checkpoint.dir)")
                                            : " after a checkpoint"));
      } else {
        // A peer rank shuts down; it reports DRAINED and is the one named.
        WaitForCancel();
        result.set_outcome(AttemptResult::CANCELLED);
        result.set_message(
            absl::StrCat("stopped at step ", step, " because a peer rank shut down"));
      }
      break;
  }
  return result;
}

// The attempt, step by step; each step that fails ends it with FailedResult (a victim's
// failure after waiting for the coordinator's cancel, so that the culprit is named first).
AttemptResult JobRunner::RunAttempt() {
  reporter_ = std::make_unique<Reporter>(connection_, assignment_, options_.worker_id, this);
  if (absl::Status s = CheckPaths(); !s.ok()) return FailedResult(s, rpc::Phase::kStarting);
  if (absl::Status s = CheckFits(); !s.ok()) return FailedResult(s, rpc::Phase::kStarting);
  absl::StatusOr<std::unique_ptr<comm::DataChannel>> channel = Connect();
  if (!channel.ok()) return FailedResult(channel.status(), rpc::Phase::kConnecting);
  // Closing a channel may wait (up to its timeout) for the peers to close theirs, so that
  // this rank's last messages arrive (UCX's closing handshake, comm/ucx_channel.h). Only a
  // rank that trained to the end needs that; a failed or stopped one closes at once, so
  // that it never waits for peers that wait for the coordinator's verdict on it.
  bool trained_to_the_end = false;
  absl::Cleanup close_at_once = [&] {
    if (*channel != nullptr && !trained_to_the_end) (*channel)->set_timeout(absl::ZeroDuration());
  };
  std::unique_ptr<CoordinatorPlanSource> plan_source = MakePlanSource();
  runtime::SessionStage stage = runtime::SessionStage::kCreate;
  absl::StatusOr<std::unique_ptr<runtime::TrainingSession>> session =
      StartSession(channel->get(), plan_source.get(), &stage);
  if (!session.ok()) {
    return FailedResult(session.status(), stage == runtime::SessionStage::kResume
                                              ? rpc::Phase::kResuming
                                              : rpc::Phase::kStarting);
  }
  StartMetrics((*session)->trainer(), plan_source.get());
  const AttemptResult result = Train((*session)->trainer(), channel->get(), &trained_to_the_end);
  // Trainer first (its expert-parallel group uses the channel and the plan source), then
  // the plan stream, then the channel: the worker is ready for the next job.
  session->reset();
  plan_source.reset();
  channel->reset();
  reporter_.reset();  // sends what is pending (the last step's progress) first
  return result;
}

std::string JobRunner::Who() const {
  return absl::StrCat("worker ", options_.worker_id, " on host ", options_.host);
}

AttemptResult JobRunner::FailedResult(const absl::Status& status, rpc::Phase phase) const {
  AttemptResult result;
  result.set_outcome(AttemptResult::FAILED);
  result.set_message(std::string(status.message()));
  result.set_phase(rpc::PhaseName(phase));
  return result;
}

// What this machine cannot hold or run fails the attempt before anything is allocated
// (before the rendezvous, like unreadable paths: the peers are not left waiting).
absl::Status JobRunner::CheckFits() const {
  const rackrun::v1::JobSpec& spec = assignment_.spec();
  absl::StatusOr<jobspec::JobMemoryEstimate> fits = runtime::CheckJobFitsThisMachine(
      spec, std::max(1, assignment_.ranks()),
      /*ranks_here=*/std::max(1, assignment_.ranks_on_host()),
      options_.threads >= 0 ? options_.threads : spec.resources().threads());
  if (fits.ok()) return absl::OkStatus();
  return absl::Status(fits.status().code(),
                      absl::StrCat(fits.status().message(), " (", Who(), ")"));
}

absl::StatusOr<std::unique_ptr<comm::DataChannel>> JobRunner::Connect() {
  if (assignment_.ranks() <= 1) return nullptr;
  SetStage(rpc::Phase::kConnecting);
  absl::StatusOr<std::unique_ptr<comm::DataChannel>> made = MakeChannel();
  SetStage(rpc::Phase::kStarting);
  if (!made.ok() && PeerCaused(made.status())) WaitForCancel();
  return made;
}

std::unique_ptr<CoordinatorPlanSource> JobRunner::MakePlanSource() {
  if (!jobspec::PlannedByCoordinator(assignment_.spec())) return nullptr;
  // A layout that does not tile the ranks is refused by the trainer before any plan.
  absl::StatusOr<jobspec::ExpertParallelLayout> layout =
      jobspec::ExpertParallelLayoutOf(assignment_.spec(), assignment_.ranks());
  return std::make_unique<CoordinatorPlanSource>(
      connection_, assignment_.job_id(), assignment_.attempt(), assignment_.rank(),
      layout.ok() ? layout->expert_parallel : assignment_.ranks());
}

absl::StatusOr<std::unique_ptr<runtime::TrainingSession>> JobRunner::StartSession(
    comm::DataChannel* channel, runtime::PlanSource* plan_source, runtime::SessionStage* stage) {
  runtime::SessionOptions session_options;
  runtime::TrainerOptions& trainer_options = session_options.trainer;
  trainer_options.threads = options_.threads;
  trainer_options.plan_source = plan_source;
  trainer_options.device_engine = runtime::cuda::GpuEngineFactory();  // resources.device: cuda
  // The folder's owner: this job, across its attempts. A restarted attempt continues
  // this job's own checkpoints; Prepare checks outputs and claims the folder before the
  // first step.
  trainer_options.owner = absl::StrCat("job ", assignment_.job_id());
  session_options.resume_own_checkpoints = assignment_.resume();
  absl::StatusOr<std::unique_ptr<runtime::TrainingSession>> session =
      runtime::TrainingSession::Start(assignment_.spec(), channel, session_options, stage);
  if (!session.ok()) {
    // A failure a peer caused waits for the coordinator's cancel, so the culprit is named;
    // rank 0's refusal in Prepare is its own (the other ranks report it as rank 0's).
    const bool victim = PeerCaused(session.status()) &&
                        (*stage == runtime::SessionStage::kCreate ||
                         (*stage == runtime::SessionStage::kPrepare && assignment_.rank() != 0));
    if (victim) WaitForCancel();
  }
  return session;
}

// This job's Prometheus series on this rank (see training_metrics_), when the worker
// exports metrics.
void JobRunner::StartMetrics(runtime::Trainer& trainer, CoordinatorPlanSource* plan_source) {
  if (options_.metrics == nullptr) return;
  TrainingMetrics::Options o;
  o.job_id = assignment_.job_id();
  o.rank = assignment_.rank();
  o.ranks = assignment_.ranks();
  o.expert_parallel = trainer.expert_parallel_degree();
  o.flops_per_token = ModelFlopsPerToken(trainer.spec(), trainer.parameter_count());
  o.peak_flops = options_.peak_flops;
  o.total_steps = trainer.spec().training().steps();
  o.width = trainer.spec().model().width();
  o.group = trainer.expert_parallel();
  o.device = trainer.device_engine();
  training_metrics_ = std::make_unique<TrainingMetrics>(*options_.metrics, o);
  if (plan_source != nullptr) {
    TrainingMetrics* m = training_metrics_.get();
    plan_source->set_on_round_trip([m](double seconds) { m->ObservePlanRoundTrip(seconds); });
  }
}

AttemptResult JobRunner::Train(runtime::Trainer& trainer, comm::DataChannel* channel,
                               bool* trained_to_the_end) {
  Attach(trainer, channel);
  // Also when an exception unwinds: the pointers are withdrawn before the trainer is
  // destroyed, so RequestStop/Status on other threads never see a dead one.
  absl::Cleanup detach = [&] { (void)Detach(trainer.steps_done()); };
  ProgressObserver progress(this, &trainer, assignment_.rank() == 0);
  std::vector<runtime::TrainObserver*> observers = {&progress};
  if (training_metrics_ != nullptr) observers.push_back(training_metrics_.get());
  absl::StatusOr<runtime::TrainSummary> summary = trainer.Run(observers);
  const rpc::Phase phase = WorkerPhase(trainer.phase());
  const int64_t step = trainer.steps_done();
  std::move(detach).Cancel();
  const runtime::StopReason requested = Detach(step);
  *trained_to_the_end = summary.ok() && summary->stopped == runtime::StopReason::kNone;
  if (!*trained_to_the_end && channel != nullptr) channel->set_timeout(absl::ZeroDuration());
  return ResultOf(summary, phase, step, requested);
}

void JobRunner::Attach(runtime::Trainer& trainer, comm::DataChannel* channel) {
  std::lock_guard<std::mutex> lock(mu_);
  trainer_ = &trainer;
  channel_ = channel;
  metrics_ = training_metrics_.get();
  if (requested_ != runtime::StopReason::kNone) trainer_->RequestStop(requested_);
}

runtime::StopReason JobRunner::Detach(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  trainer_ = nullptr;
  channel_ = nullptr;
  metrics_ = nullptr;
  // Training is over on this rank: what follows (a victim's wait for the coordinator's
  // cancel, the teardown, the pending progress, then the result) is reporting, which the
  // coordinator allows longer than a training phase (coordinator/failure_detector.h, hang (b)).
  stage_ = rpc::Phase::kReporting;
  stage_step_ = step;
  return requested_;
}

}  // namespace rackrun::worker
