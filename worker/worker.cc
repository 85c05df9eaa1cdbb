#include "worker/worker.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "comm/channel_factory.h"
#include "comm/data_address.h"
#include "jobspec/device.h"
#include "rpc/liveness.h"
#include "rpc/phase.h"
#include "runtime/cpu/blas.h"
#include "runtime/cuda/device_probe.h"

namespace rackrun::worker {
namespace {

bool Retryable(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::UNAVAILABLE ||
         s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

// The coordinator refused the worker's token (UNAUTHENTICATED) or its role
// (PERMISSION_DENIED): at start the worker exits, later it drains first (Worker::Refused).
bool IsRefusal(absl::StatusCode code) {
  return code == absl::StatusCode::kUnauthenticated || code == absl::StatusCode::kPermissionDenied;
}

// A result is the one report that must not be lost (the coordinator waits for every rank's),
// and sending it again is harmless (a repeated result changes nothing): it is given up only
// on an answer that says the coordinator will never take it. A call cut by a coordinator
// that dies or restarts can end in CANCELLED, UNKNOWN or INTERNAL as well as UNAVAILABLE,
// and a store error (INTERNAL, ABORTED) or a full server (RESOURCE_EXHAUSTED) passes.
// NOT_FOUND is final: a serving coordinator has replayed its store, and it does not know
// the job, attempt or rank (a report needs no registration). Before, it was retried every
// 300 ms for ever, and a worker whose coordinator came back with its job store replaced
// never ran another job.
bool ReportRetryable(const grpc::Status& s) {
  switch (s.error_code()) {
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::OUT_OF_RANGE:
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::UNIMPLEMENTED:
    case grpc::StatusCode::ALREADY_EXISTS:
      return false;
    default:
      return true;
  }
}

// A device error (jobspec/device.h's parser, runtime/cuda/device_probe.h's checks, which
// speak of the job spec's field) told as the flag's: "--device cuda:0: <cause>".
absl::Status DeviceFlagError(const absl::Status& s, const std::string& value) {
  std::string cause(s.message());
  constexpr absl::string_view kField = "resources.device: ";
  if (absl::StartsWith(cause, kField)) cause.erase(0, kField.size());
  cause = absl::StrReplaceAll(cause, {{"resources.device: cpu", "--device cpu"}});
  return absl::Status(s.code(), absl::StrCat("--device ", value, ": ", cause));
}

}  // namespace

absl::StatusOr<std::optional<rackrun::v1::Gpu>> ProbeWorkerDevice(std::string* device,
                                                                  int local_rank) {
  absl::StatusOr<jobspec::DeviceSpec> spec = jobspec::ParseDevice(*device);
  if (!spec.ok()) return DeviceFlagError(spec.status(), *device);
  if (!spec->is_cuda()) {
    *device = "cpu";
    return std::nullopt;
  }
  // One worker per GPU: plain cuda is the local rank's, as a job spec's cuda is.
  absl::StatusOr<runtime::cuda::GpuInfo> info =
      runtime::cuda::CheckDevice(*spec, local_rank, /*ranks_here=*/1);
  if (!info.ok()) return DeviceFlagError(info.status(), *device);
  *device = absl::StrCat("cuda:", info->index);
  rackrun::v1::Gpu gpu;
  gpu.set_index(info->index);
  gpu.set_name(info->name);
  gpu.set_total_bytes(info->total_bytes);
  gpu.set_compute_major(info->major);
  gpu.set_compute_minor(info->minor);
  return gpu;
}

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(const WorkerOptions& options) {
  std::unique_ptr<Worker> w(new Worker(options));
  if (w->options_.host.empty()) {
    char name[256] = {};
    if (::gethostname(name, sizeof(name) - 1) != 0)
      return absl::InternalError("gethostname failed");
    w->options_.host = name;
  }
  if (w->options_.data_address.empty()) w->options_.data_address = w->options_.host;
  // A GPU that is not usable here refuses the start, before the coordinator hears of it.
  absl::StatusOr<std::optional<rackrun::v1::Gpu>> probed =
      ProbeWorkerDevice(&w->options_.device, w->options_.local_rank);
  if (!probed.ok()) return probed.status();
  w->gpu_ = *std::move(probed);
  if (w->gpu_.has_value()) {
    std::printf("rackrun-worker: device %s: %s, %.1f GiB, compute capability %d.%d\n",
                w->options_.device.c_str(), w->gpu_->name().c_str(),
                static_cast<double>(w->gpu_->total_bytes()) / (1 << 30), w->gpu_->compute_major(),
                w->gpu_->compute_minor());
  }
  // Per-job data channels listen on this address only (and announce it to the peers).
  if (comm::IsWildcardAddress(w->options_.data_address)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--data-address: '", w->options_.data_address,
        "' is every interface; data channels listen only on the one address the peers reach "
        "this worker on: give that address (on a trusted network, see docs/daemons.md)"));
  }
  if (w->options_.allowed_roots.empty()) {
    std::printf(
        "rackrun-worker: no --allowed-roots: jobs may read and write every path this process "
        "(uid %d) can; list the job folders with --allowed-roots DIR[,DIR...] to confine them\n",
        static_cast<int>(::geteuid()));
  } else {
    std::printf("rackrun-worker: jobs confined to %s\n",
                absl::StrJoin(w->options_.allowed_roots, ", ").c_str());
  }
  // What the UCX channel will use of the data address, said at start and at registration
  // (`rackrun workers`): UCX's TCP transport takes its interface's first address.
  if (std::getenv("UCX_NET_DEVICES") == nullptr) {
    absl::StatusOr<comm::UcxInterface> ucx = comm::UcxInterfaceOf(w->options_.data_address);
    if (!ucx.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--data-address: ", ucx.status().message()));
    }
    if (!ucx->name.empty()) w->ucx_address_ = absl::StrCat(ucx->address, " on ", ucx->name);
    if (!ucx->name.empty() && ucx->address != w->options_.data_address) {
      std::printf(
          "rackrun-worker: the UCX data channel uses %s on %s, not --data-address %s: UCX's "
          "TCP transport takes an interface's first address (the Gloo channel uses %s)\n",
          ucx->address.c_str(), ucx->name.c_str(), w->options_.data_address.c_str(),
          w->options_.data_address.c_str());
    }
  }
  // The channels this worker can build: every one of this build's, a GPU channel only
  // with a CUDA device.
  const bool gpu = w->gpu_.has_value();
  for (const comm::ChannelTraits& c : comm::kChannels) {
    if (comm::ChannelBuilt(c.kind) && (gpu || !c.needs_gpu)) w->channels_.emplace_back(c.name);
  }
  absl::StatusOr<std::unique_ptr<Connection>> connection = Connection::Create(options.connection);
  if (!connection.ok()) return connection.status();
  w->connection_ = *std::move(connection);
  if (!options.metrics_listen.empty()) {
    absl::StatusOr<std::unique_ptr<metrics::MetricsExporter>> exporter =
        metrics::MetricsExporter::Start(options.metrics_listen);
    if (!exporter.ok()) return exporter.status();
    w->exporter_ = *std::move(exporter);
    std::string host;
    int port = 0;
    (void)metrics::SplitHostPort(options.metrics_listen, "--metrics-listen", &host, &port);
    std::printf("rackrun-worker: metrics on http://%s:%d/metrics\n", host.c_str(),
                w->exporter_->port());
    // What Prometheus should scrape: the listen address, or this host's name when it
    // listens on every interface.
    const bool wildcard = host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]";
    w->metrics_address_ =
        absl::StrCat(wildcard ? w->options_.host : host, ":", w->exporter_->port());
  }
  return w;
}

Worker::~Worker() {
  Shutdown();
  StopThreads();
}

void Worker::StopThreads() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    if (stream_context_ != nullptr) stream_context_->TryCancel();
  }
  cv_.notify_all();
  if (stream_thread_.joinable()) stream_thread_.join();
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
}

std::string Worker::worker_id() const {
  std::lock_guard<std::mutex> lock(mu_);
  return worker_id_;
}

Worker::Registered Worker::registered() const {
  std::lock_guard<std::mutex> lock(mu_);
  return Registered{worker_id_, store_id_};
}

absl::Status Worker::Register(bool again) {
  std::lock_guard<std::mutex> serial(register_mu_);
  rackrun::v1::RegisterRequest request;
  request.set_host(options_.host);
  request.set_pid(static_cast<int32_t>(::getpid()));
  request.set_launcher_rank(options_.launcher_rank);
  request.set_launcher_size(options_.launcher_size);
  request.set_local_rank(options_.local_rank);
  request.set_device(options_.device);
  for (const std::string& c : channels_) request.add_channels(c);
  request.set_data_address(options_.data_address);
  request.set_ucx_address(ucx_address_);
  request.set_threads(options_.threads);
  request.set_metrics_address(metrics_address_);
  request.set_rack(options_.rack);
  if (gpu_.has_value()) *request.mutable_gpu() = *gpu_;
  std::shared_ptr<JobRunner> running;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (again) {
      request.set_worker_id(worker_id_);
      request.set_store_id(store_id_);
    }
    running = running_;
    // The coordinator numbers assignments from 1 again after this registration; a
    // heartbeat sent meanwhile acknowledges none rather than some of the new ones.
    assignments_received_ = 0;
  }
  if (again && running != nullptr) {
    const rackrun::v1::RunJob& job = running->assignment();
    request.set_job_id(job.job_id());
    request.set_attempt(job.attempt());
    request.set_rank(job.rank());
    request.set_step(running->Status().step);
  }
  rackrun::v1::RegisterResponse response;
  std::unique_ptr<grpc::ClientContext> context = connection_->NewContext();
  const grpc::Status s = connection_->stub()->Register(context.get(), request, &response);
  if (!s.ok()) return FromGrpc(s);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (again && store_id_ != 0 && response.store_id() != store_id_) {
      std::fprintf(stderr,
                   "rackrun-worker: the coordinator has another job store (lost or replaced): "
                   "registered as %s (was %s)\n",
                   response.worker_id().c_str(), worker_id_.c_str());
    }
    worker_id_ = response.worker_id();
    store_id_ = response.store_id();
  }
  // The heartbeat deadline, keepalive and reconnect backoff follow the coordinator's
  // heartbeat interval and timeout (rpc/liveness.h); a coordinator older than the timeout
  // field has the default 5 s.
  const rpc::LivenessTimings current = connection_->liveness();
  connection_->SetLiveness(response.heartbeat_interval_ms() > 0
                               ? std::chrono::milliseconds(response.heartbeat_interval_ms())
                               : current.interval,
                           std::chrono::milliseconds(response.heartbeat_timeout_ms() > 0
                                                         ? response.heartbeat_timeout_ms()
                                                         : 5000));
  if (again && running != nullptr && !response.job_attached()) {
    std::fprintf(stderr, "rackrun-worker: the coordinator no longer runs job %s; stopping it\n",
                 running->assignment().job_id().c_str());
    running->RequestStop(runtime::StopReason::kCancel);
  }
  return absl::OkStatus();
}

bool Worker::RegisterAgain(absl::StatusCode* told) {
  const absl::Status s = Register(/*again=*/true);
  if (s.ok()) {
    if (*told != absl::StatusCode::kOk) {
      std::fprintf(stderr, "rackrun-worker: registered again with %s\n",
                   connection_->address().c_str());
      *told = absl::StatusCode::kOk;
    }
    return true;
  }
  if (IsRefusal(s.code())) {
    Refused(s);
  } else if (s.code() != *told && s.code() != absl::StatusCode::kUnavailable &&
             s.code() != absl::StatusCode::kDeadlineExceeded &&
             s.code() != absl::StatusCode::kCancelled) {
    // Not the coordinator being away (the heartbeats say that) nor this worker stopping: a
    // refusal it may lift (its --max-workers, a rack label it now rejects). Said once a
    // kind; tried every 200 ms.
    std::fprintf(stderr,
                 "rackrun-worker: registering again with %s failed (%s): %s; trying again "
                 "every 200 ms\n",
                 connection_->address().c_str(), absl::StatusCodeToString(s.code()).c_str(),
                 std::string(s.message()).c_str());
    *told = s.code();
  }
  return false;
}

void Worker::StreamLoop() {
  bool first = true;
  absl::StatusCode told = absl::StatusCode::kOk;  // RegisterAgain's: the failure last said
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) return;
    }
    if (!first) {
      // The stream broke: the coordinator restarted or the network hiccupped. Register
      // again (re-attaching the in-flight job) once it answers.
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      if (!RegisterAgain(&told)) continue;
    }
    first = false;
    rackrun::v1::AssignmentsRequest request;
    const Registered me = registered();
    request.set_worker_id(me.worker_id);
    request.set_store_id(me.store_id);
    std::unique_ptr<grpc::ClientContext> context =
        connection_->NewContext(std::chrono::milliseconds(0));
    // On a channel (and TCP connection) of its own, which the heartbeats' renewals leave
    // alone (connection.h): nothing of the unary calls is in flight on it when a link goes
    // down, so no retransmission backoff builds up that could get it dropped.
    const std::shared_ptr<Connection::Stub> stub = connection_->stream_stub();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) return;
      stream_context_ = context.get();
      stream_stub_ = stub;
      ++stream_epoch_;
    }
    std::unique_ptr<grpc::ClientReader<rackrun::v1::Assignment>> reader =
        stub->Assignments(context.get(), request);
    rackrun::v1::Assignment a;
    while (reader->Read(&a)) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        assignments_received_ = std::max(assignments_received_, a.sequence());
      }
      if (a.has_run()) {
        std::lock_guard<std::mutex> lock(mu_);
        if (HasRunLocked(a.run())) {
          std::fprintf(stderr, "rackrun-worker: job %s attempt %d was sent again; it is here\n",
                       a.run().job_id().c_str(), a.run().attempt());
          continue;
        }
        queue_.push_back(a.run());
        cv_.notify_all();
      } else if (a.has_cancel()) {
        std::shared_ptr<JobRunner> running;
        {
          std::lock_guard<std::mutex> lock(mu_);
          running = running_;
          // A queued attempt that was cancelled before it started is dropped, and reported
          // (by the job thread: a report may retry for a while) so that the coordinator
          // frees this worker: it waits for a result from every rank it assigned.
          for (auto it = queue_.begin(); it != queue_.end(); ++it) {
            if (it->job_id() == a.cancel().job_id() && it->attempt() == a.cancel().attempt()) {
              cancelled_unstarted_.push_back(*it);
              queue_.erase(it);
              cv_.notify_all();
              break;
            }
          }
          // Taken from the queue but not running yet: RunJob stops it as it starts.
          if (taken_.has_value() && taken_->job_id() == a.cancel().job_id() &&
              taken_->attempt() == a.cancel().attempt()) {
            taken_cancelled_ = true;
          }
        }
        if (running != nullptr && running->assignment().job_id() == a.cancel().job_id() &&
            running->assignment().attempt() == a.cancel().attempt()) {
          running->RequestStop(runtime::StopReason::kCancel);
        }
      }
    }
    const grpc::Status ended = reader->Finish();
    std::lock_guard<std::mutex> lock(mu_);
    stream_context_ = nullptr;
    stream_stub_.reset();
    if (!stopped_) {
      // The coordinator reads a closed stream as this process's exit, unless heartbeats
      // say otherwise: say why it ended.
      std::fprintf(stderr, "rackrun-worker: the assignment stream from %s ended (%s): %s\n",
                   connection_->address().c_str(),
                   absl::StatusCodeToString(FromGrpc(ended).code()).c_str(),
                   ended.error_message().c_str());
    }
  }
}

void Worker::HeartbeatLoop() {
  using Clock = std::chrono::steady_clock;
  auto phase_since = Clock::now();
  std::optional<rpc::Phase> last_phase;  // none before the first heartbeat
  std::string last_attempt;
  int64_t last_step = -1, last_completed = -1;
  // A run of heartbeats that missed their deadline: when the first was sent, how many.
  Clock::time_point missing_since;
  int missed = 0;
  auto next = Clock::now() + connection_->liveness().interval;
  while (true) {
    std::shared_ptr<JobRunner> running;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_until(lock, next, [&] { return stopped_; });
      if (stopped_) return;
      running = running_;
    }
    const rpc::LivenessTimings live = connection_->liveness();
    const auto start = Clock::now();
    next = start + live.interval;
    rackrun::v1::HeartbeatRequest request;
    const Registered me = registered();
    request.set_worker_id(me.worker_id);
    request.set_store_id(me.store_id);
    rpc::Phase phase = rpc::Phase::kIdle;
    if (running != nullptr) {
      const JobStatus st = running->Status();
      request.set_job_id(running->assignment().job_id());
      request.set_attempt(running->assignment().attempt());
      request.set_step(st.step);
      request.set_collectives_entered(st.collectives.collectives_entered);
      request.set_collectives_completed(st.collectives.collectives_completed);
      request.set_step_time_s(st.step_time_s);
      phase = st.phase;
      // Any progress (another attempt, a new phase, step or completed collective) restarts
      // the phase age: a new attempt that reports the phase the last one ended in (the
      // heartbeat may never have seen the worker idle in between) is not charged for it.
      const std::string attempt =
          absl::StrCat(running->assignment().job_id(), "/", running->assignment().attempt());
      if (attempt != last_attempt || phase != last_phase || st.step != last_step ||
          st.collectives.collectives_completed != last_completed) {
        last_attempt = attempt;
        phase_since = Clock::now();
        last_step = st.step;
        last_completed = st.collectives.collectives_completed;
      }
    } else if (phase != last_phase) {
      phase_since = Clock::now();
      last_attempt.clear();
    }
    last_phase = phase;
    request.set_phase(rpc::PhaseName(phase));
    request.set_phase_age_ms(
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - phase_since).count());
    rackrun::v1::HeartbeatResponse response;
    int64_t epoch = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      epoch = stream_epoch_;
      request.set_assignments_received(assignments_received_);
    }
    // A deadline well below the heartbeat timeout (rpc/liveness.h): a heartbeat queued on
    // a connection that retransmits into a cut link misses it, and the next one goes over
    // a new connection, at once (the deadline is at least the interval).
    const std::shared_ptr<Connection::Stub> stub = connection_->stub();
    std::unique_ptr<grpc::ClientContext> context = connection_->NewContext(live.heartbeat_deadline);
    const grpc::Status s = stub->Heartbeat(context.get(), request, &response);
    if (s.ok() || !Retryable(s)) {
      if (missed > 0) {
        SayHeartbeatsAnswered(s, Clock::now() - missing_since, missed);
        missed = 0;
      }
      if (s.error_code() == grpc::StatusCode::NOT_FOUND) (void)Register(/*again=*/true);
      if (const absl::Status refused = FromGrpc(s); IsRefusal(refused.code())) Refused(refused);
      if (s.ok() && (response.stream_closed() || response.stream_stalled())) {
        ReopenStream(epoch, /*stalled=*/!response.stream_closed());
      }
      continue;
    }
    if (missed++ == 0) {
      missing_since = start;
      std::fprintf(stderr,
                   "rackrun-worker: a heartbeat to %s failed (%s); retrying over a new "
                   "connection every %.2f s\n",
                   connection_->address().c_str(), s.error_message().c_str(),
                   std::chrono::duration<double>(live.retry_period).count());
    }
    connection_->Renew(stub);
    next = start + live.retry_period;
  }
}

void Worker::SayHeartbeatsAnswered(const grpc::Status& s,
                                   std::chrono::steady_clock::duration missing, int missed) const {
  // Answered, but not necessarily taken: say what the answer was.
  const std::string answer =
      s.ok() ? std::string()
             : absl::StrCat(", answered ", absl::StatusCodeToString(FromGrpc(s).code()), ": ",
                            s.error_message());
  std::fprintf(stderr,
               "rackrun-worker: heartbeats to %s reach it again after %.1f s (%d missed)%s\n",
               connection_->address().c_str(), std::chrono::duration<double>(missing).count(),
               missed, answer.c_str());
}

bool Worker::HasRunLocked(const rackrun::v1::RunJob& run) const {
  const auto same = [&](const rackrun::v1::RunJob& j) {
    return j.job_id() == run.job_id() && j.attempt() == run.attempt();
  };
  return std::any_of(queue_.begin(), queue_.end(), same) || (taken_.has_value() && same(*taken_)) ||
         (running_ != nullptr && same(running_->assignment()));
}

void Worker::ReopenStream(int64_t epoch, bool stalled) {
  std::lock_guard<std::mutex> lock(mu_);
  // A newer stream than the one the heartbeat answered about needs nothing.
  if (stopped_ || stream_context_ == nullptr || epoch != stream_epoch_) return;
  if (stalled) {
    std::fprintf(stderr,
                 "rackrun-worker: the coordinator %s says an assignment it wrote into the "
                 "assignment stream has not arrived (%lld received); opening a new stream "
                 "over a new connection\n",
                 connection_->address().c_str(), static_cast<long long>(assignments_received_));
    connection_->Renew(stream_stub_);  // its TCP connection is stuck
  } else {
    std::fprintf(stderr,
                 "rackrun-worker: the coordinator %s saw the assignment stream close while it "
                 "is open here (its connection died); opening a new one\n",
                 connection_->address().c_str());
  }
  stream_context_->TryCancel();  // StreamLoop registers again and opens a new stream
}

void Worker::ReportUnstarted(const std::vector<rackrun::v1::RunJob>& jobs,
                             rackrun::v1::AttemptResult::Outcome outcome, const char* message) {
  for (const rackrun::v1::RunJob& job : jobs) {
    rackrun::v1::AttemptResult r;
    r.set_outcome(outcome);
    r.set_message(message);
    ReportResult(job, r);
    std::printf("rackrun-worker: %s: job %s attempt %d: %s\n", worker_id().c_str(),
                job.job_id().c_str(), job.attempt(), message);
    std::fflush(stdout);
  }
}

void Worker::ReportResult(const rackrun::v1::RunJob& job,
                          const rackrun::v1::AttemptResult& result) {
  rackrun::v1::ReportRequest request;
  request.set_worker_id(worker_id());
  request.set_store_id(job.store_id());
  request.set_job_id(job.job_id());
  request.set_attempt(job.attempt());
  request.set_rank(job.rank());
  *request.mutable_result() = result;
  const auto start = std::chrono::steady_clock::now();
  const auto give_up = start + options_.patience;
  for (int tries = 1;; ++tries) {
    rackrun::v1::ReportResponse response;
    std::unique_ptr<grpc::ClientContext> context = connection_->NewContext();
    const grpc::Status s = connection_->stub()->Report(context.get(), request, &response);
    if (s.ok()) {
      if (tries > 1) {
        std::fprintf(
            stderr,
            "rackrun-worker: the result of job %s attempt %d reached the coordinator "
            "after %d tries (%.1f s)\n",
            job.job_id().c_str(), job.attempt(), tries,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      return;
    }
    if (!ReportRetryable(s) || std::chrono::steady_clock::now() > give_up) {
      std::fprintf(stderr,
                   "rackrun-worker: could not report the result of job %s attempt %d (%s): %s%s\n",
                   job.job_id().c_str(), job.attempt(),
                   absl::StatusCodeToString(FromGrpc(s).code()).c_str(), s.error_message().c_str(),
                   s.error_code() == grpc::StatusCode::NOT_FOUND
                       ? "; the coordinator does not know that attempt (its job store was "
                         "replaced?), so the result is dropped"
                       : "");
      return;
    }
    if (tries == 1) {
      std::fprintf(
          stderr,
          "rackrun-worker: reporting the result of job %s attempt %d: %s (%s); "
          "trying again every 300 ms for up to %lld s\n",
          job.job_id().c_str(), job.attempt(), s.error_message().c_str(),
          absl::StatusCodeToString(FromGrpc(s).code()).c_str(),
          static_cast<long long>(
              std::chrono::duration_cast<std::chrono::seconds>(options_.patience).count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
}

absl::Status Worker::Serve() {
  absl::StatusOr<bool> registered = RegisterAtStart();
  if (!registered.ok()) return registered.status();
  if (!*registered) return absl::OkStatus();  // shut down while waiting for the coordinator
  std::printf("rackrun-worker: registered as %s with %s (host %s, pid %d, launcher rank %d, %s)\n",
              worker_id().c_str(), connection_->address().c_str(), options_.host.c_str(),
              static_cast<int>(::getpid()), options_.launcher_rank, options_.device.c_str());
  std::printf("rackrun-worker: kernels: %s\n", runtime::cpu::BlasDescription().c_str());
  std::fflush(stdout);
  stream_thread_ = std::thread([this] { StreamLoop(); });
  heartbeat_thread_ = std::thread([this] { HeartbeatLoop(); });
  start_delay_ = options_.start_delay;
  while (std::optional<rackrun::v1::RunJob> job = NextJob()) RunJob(*job);
  Leave();
  std::lock_guard<std::mutex> lock(mu_);
  return refused_.value_or(absl::OkStatus());
}

absl::Status Worker::RefusalStatus(const absl::Status& s) const {
  const std::string from = absl::StrCat(" the token from ", connection_->token_source());
  const std::string fix =
      "; use the token file of the coordinator's --state-dir (--token-file) or set "
      "RACKRUN_TOKEN";
  if (s.code() == absl::StatusCode::kPermissionDenied) {
    return absl::PermissionDeniedError(absl::StrCat("the coordinator at ", connection_->address(),
                                                    " denied", from, " (", s.message(), ")", fix,
                                                    " (a worker needs the worker role)"));
  }
  return absl::UnauthenticatedError(absl::StrCat("the coordinator at ", connection_->address(),
                                                 " refused", from, " (", s.message(), ")", fix));
}

void Worker::Refused(const absl::Status& s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (refused_.has_value()) return;
    refused_ = RefusalStatus(s);
    std::fprintf(stderr, "rackrun-worker: %s; shutting down\n",
                 std::string(refused_->message()).c_str());
  }
  Shutdown();
}

absl::StatusOr<bool> Worker::RegisterAtStart() {
  const auto give_up = std::chrono::steady_clock::now() + options_.patience;
  bool told = false;
  while (true) {
    absl::Status s = Register(/*again=*/false);
    if (s.ok()) return true;
    if (IsRefusal(s.code())) return RefusalStatus(s);
    if (s.code() != absl::StatusCode::kUnavailable &&
        s.code() != absl::StatusCode::kDeadlineExceeded) {
      return s;
    }
    if (std::chrono::steady_clock::now() > give_up) {
      return absl::UnavailableError(absl::StrCat(
          "cannot reach the coordinator at ", connection_->address(), " (", s.message(),
          "); start rackrun-coordinator or set --coordinator / RACKRUN_COORDINATOR"));
    }
    if (!told) {
      std::fprintf(stderr, "rackrun-worker: waiting for the coordinator at %s ...\n",
                   connection_->address().c_str());
      told = true;
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (cv_.wait_for(lock, std::chrono::milliseconds(500), [&] { return draining_; })) {
      return false;
    }
  }
}

void Worker::ReportCancelledUnstarted() {
  std::vector<rackrun::v1::RunJob> cancelled;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled.swap(cancelled_unstarted_);
  }
  ReportUnstarted(cancelled, rackrun::v1::AttemptResult::CANCELLED, "cancelled before it started");
}

std::optional<rackrun::v1::RunJob> Worker::NextJob() {
  while (true) {
    ReportCancelledUnstarted();
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return draining_ || !queue_.empty() || !cancelled_unstarted_.empty(); });
    if (draining_) return std::nullopt;  // queued attempts are reported back by Leave
    if (queue_.empty()) {
      // The first attempt was cancelled before this thread took it: the delay is spent.
      start_delay_ = std::chrono::milliseconds(0);
      continue;
    }
    if (start_delay_.count() > 0) {
      // Ends early when the attempt is cancelled (its report then goes at once).
      cv_.wait_for(lock, std::exchange(start_delay_, {}),
                   [&] { return draining_ || queue_.empty(); });
      if (draining_) return std::nullopt;
      if (queue_.empty()) continue;  // cancelled while it waited
    }
    rackrun::v1::RunJob job = queue_.front();
    queue_.pop_front();
    taken_ = job;  // still "here" for a run sent again, until RunJob makes it running_
    taken_cancelled_ = false;
    return job;
  }
}

JobRunnerOptions Worker::RunnerOptions() const {
  JobRunnerOptions ro;
  ro.worker_id = worker_id();
  ro.host = options_.host;
  ro.threads = options_.threads;
  ro.victim_grace = options_.victim_grace;
  ro.metrics = exporter_ != nullptr ? &exporter_->registry() : nullptr;
  ro.peak_flops = options_.peak_flops;
  ro.allowed_roots = options_.allowed_roots;
  if (absl::StartsWith(options_.device, "cuda:")) {
    (void)absl::SimpleAtoi(options_.device.substr(5), &ro.cuda_device);
  }
  return ro;
}

void Worker::RunJob(const rackrun::v1::RunJob& job) {
  finished_.reset();  // the previous job's metrics series go before this job's come
  auto runner = std::make_shared<JobRunner>(*connection_, job, RunnerOptions());
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = runner;
    taken_.reset();
    if (std::exchange(taken_cancelled_, false)) runner->RequestStop(runtime::StopReason::kCancel);
    if (draining_) runner->RequestStop(runtime::StopReason::kDrain);
  }
  std::printf("rackrun-worker: %s: job %s attempt %d, rank %d of %d\n", worker_id().c_str(),
              job.job_id().c_str(), job.attempt(), job.rank(), job.ranks());
  std::fflush(stdout);
  const rackrun::v1::AttemptResult result = runner->Run();
  ReportResult(job, result);
  std::printf("rackrun-worker: %s: job %s attempt %d: %s%s%s\n", worker_id().c_str(),
              job.job_id().c_str(), job.attempt(),
              rackrun::v1::AttemptResult::Outcome_Name(result.outcome()).c_str(),
              result.message().empty() ? "" : ": ", result.message().c_str());
  std::fflush(stdout);
  std::lock_guard<std::mutex> lock(mu_);
  running_.reset();
  finished_ = runner;
}

void Worker::Leave() {
  ReportCancelledUnstarted();
  // Drained: attempts assigned but never started are handed back.
  std::vector<rackrun::v1::RunJob> unstarted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    unstarted.assign(queue_.begin(), queue_.end());
    queue_.clear();
  }
  ReportUnstarted(unstarted, rackrun::v1::AttemptResult::DRAINED,
                  "the worker shut down before the attempt started");
  // The stream and heartbeat end before the worker deregisters: a heartbeat after it would be
  // answered NOT_FOUND and register the leaving worker again (IDLE until it was lost).
  StopThreads();
  rackrun::v1::DeregisterRequest request;
  const Registered me = registered();
  request.set_worker_id(me.worker_id);
  request.set_store_id(me.store_id);
  request.set_reason("shutdown (signal)");
  rackrun::v1::DeregisterResponse response;
  std::unique_ptr<grpc::ClientContext> context = connection_->NewContext();
  const grpc::Status s = connection_->stub()->Deregister(context.get(), request, &response);
  if (s.ok()) {
    std::printf("rackrun-worker: %s: deregistered, exiting\n", worker_id().c_str());
  } else {
    std::printf("rackrun-worker: %s: could not deregister (%s), exiting\n", worker_id().c_str(),
                s.error_message().c_str());
  }
  std::fflush(stdout);
}

void Worker::Shutdown() {
  std::shared_ptr<JobRunner> running;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_) return;
    draining_ = true;
    running = running_;
  }
  cv_.notify_all();
  if (running != nullptr) running->RequestStop(runtime::StopReason::kDrain);
}

}  // namespace rackrun::worker
