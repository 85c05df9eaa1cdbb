#include "coordinator/observability.h"

#include <algorithm>
#include <set>
#include <string>

#include "coordinator/jobs.h"
#include "jobspec/restart_policy.h"

namespace rackrun::coordinator {

namespace {

// The dashboard's views of the Rack.
class RackSource final : public metrics::DashboardSource {
 public:
  explicit RackSource(Rack* rack) : rack_(rack) {}
  absl::StatusOr<rackrun::v1::ListJobsResponse> ListJobs() override {
    rackrun::v1::ListJobsRequest req;
    req.set_page_size(1000);
    return rack_->jobs().List(req);
  }
  absl::StatusOr<rackrun::v1::Job> GetJob(const std::string& job_id) override {
    return rack_->jobs().Get(job_id);
  }
  absl::Status Events(const std::string& job_id, int64_t after_seq,
                      std::vector<rackrun::v1::JobEvent>* out, bool* done) override {
    return rack_->jobs().WaitEvents(job_id, after_seq, absl::ZeroDuration(), out, done);
  }
  rackrun::v1::ListWorkersResponse ListWorkers() override {
    return rack_->workers().List(/*include_gone=*/true);
  }

 private:
  Rack* const rack_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Observability>> Observability::Start(
    const ObservabilityOptions& options, Rack* rack) {
  std::unique_ptr<Observability> o(new Observability());
  o->options_ = options;
  o->rack_ = rack;
  if (!options.metrics_listen.empty()) {
    absl::StatusOr<std::unique_ptr<metrics::MetricsExporter>> e =
        metrics::MetricsExporter::Start(options.metrics_listen);
    if (!e.ok()) return e.status();
    o->exporter_ = *std::move(e);
    o->metrics_ = std::make_unique<metrics::CoordinatorMetrics>(o->exporter_->registry());
    o->rpc_ = std::make_unique<metrics::RpcMetrics>(o->exporter_->registry());
    metrics::CoordinatorMetrics* m = o->metrics_.get();
    rack->planning().SetSolveObserver([m](const std::string& job_id, int domain, double s) {
      m->ObservePlanSolve(job_id, domain, s);
    });
  }
  if (!options.dashboard_listen.empty()) {
    o->source_ = std::make_unique<RackSource>(rack);
    absl::StatusOr<std::unique_ptr<metrics::Dashboard>> d = metrics::Dashboard::Start(
        {options.dashboard_listen, options.dashboard_assets, options.dashboard_allow_remote},
        o->source_.get(),
        options.dashboard_allow_remote ? options.dashboard_token_ok
                                       : metrics::Dashboard::TokenCheck());
    if (!d.ok()) return d.status();
    o->dashboard_ = *std::move(d);
  }
  return o;
}

Observability::~Observability() {
  StopDashboard();
  if (metrics_ != nullptr) rack_->planning().SetSolveObserver(nullptr);
}

std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
Observability::InterceptorFactories() {
  if (rpc_ == nullptr) return {};
  return rpc_->InterceptorFactories();
}

void Observability::StopDashboard() { dashboard_.reset(); }

void Observability::ObserveJob(const rackrun::v1::Job& job, Tracked& t) {
  for (const rackrun::v1::Attempt& a : job.attempts()) {
    if (a.number() > t.attempts_started && a.started_unix_ms() > 0) {
      int64_t queued_since = job.created_unix_ms();
      if (a.number() > 1 && a.number() - 2 < job.attempts_size()) {
        queued_since = job.attempts(a.number() - 2).finished_unix_ms();
      }
      metrics_->ObserveQueueWait(std::max<int64_t>(0, a.started_unix_ms() - queued_since) / 1000.0);
      t.attempts_started = a.number();
    }
    if (a.number() > t.failures_seen && a.state() == rackrun::v1::FAILED && a.has_failure()) {
      const bool restarted = a.number() < job.attempts_size() || job.state() == rackrun::v1::QUEUED;
      metrics_->ObserveFailure(jobspec::FailureKindName(a.failure().kind()), restarted);
      t.failures_seen = a.number();
    }
  }
}

void Observability::Refresh() {
  if (metrics_ == nullptr) return;
  const auto now = std::chrono::steady_clock::now();
  if (baseline_taken_ && now - last_refresh_ < std::chrono::milliseconds(options_.refresh_ms))
    return;
  last_refresh_ = now;
  rackrun::v1::ListJobsRequest req;
  req.set_page_size(1000);
  absl::StatusOr<rackrun::v1::ListJobsResponse> list = rack_->jobs().List(req);
  if (list.ok()) {
    std::vector<rackrun::v1::Job> jobs(list->jobs().begin(), list->jobs().end());
    metrics_->ObserveJobs(jobs);
    for (const rackrun::v1::Job& j : jobs) {
      auto [it, inserted] = tracked_.try_emplace(j.id());
      Tracked& t = it->second;
      const bool changed = inserted || t.state != j.state() || t.restarts != j.restarts();
      t.state = j.state();
      t.restarts = j.restarts();
      if (!changed) continue;
      absl::StatusOr<rackrun::v1::Job> full = rack_->jobs().Get(j.id());
      if (!full.ok()) continue;
      if (!baseline_taken_) {
        // Jobs from before this start (replayed): their past is not counted again.
        t.attempts_started = full->attempts_size();
        for (const rackrun::v1::Attempt& a : full->attempts()) {
          if (a.state() == rackrun::v1::FAILED) t.failures_seen = a.number();
        }
        continue;
      }
      ObserveJob(*full, t);
    }
    // A job that left the newest 1000 never comes back to them: its marks go.
    std::set<std::string> listed;
    for (const rackrun::v1::Job& j : jobs) listed.insert(j.id());
    std::erase_if(tracked_, [&listed](const auto& entry) { return !listed.contains(entry.first); });
  }
  metrics_->ObserveWorkers(rack_->workers().List(/*include_gone=*/true));
  baseline_taken_ = true;
}

}  // namespace rackrun::coordinator
