#include "metrics/coordinator_metrics.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "metrics/buckets.h"

namespace rackrun::metrics {

namespace {
std::string Lower(const std::string& s) { return absl::AsciiStrToLower(s); }
}  // namespace

CoordinatorMetrics::CoordinatorMetrics(prometheus::Registry& r)
    : jobs_(prometheus::BuildGauge()
                .Name("rackrun_jobs")
                .Help("Jobs the coordinator holds, by state")
                .Register(r)),
      progress_step_(prometheus::BuildGauge()
                         .Name("rackrun_job_progress_step")
                         .Help("Last step rank 0 reported for a running job")
                         .Register(r)),
      queue_wait_(prometheus::BuildHistogram()
                      .Name("rackrun_job_queue_wait_seconds")
                      .Help("Seconds a job's attempt waited in the queue (from submission or the "
                            "previous attempt's end)")
                      .Register(r)),
      failures_(prometheus::BuildCounter()
                    .Name("rackrun_job_attempt_failures_total")
                    .Help("Failed attempts, by failure kind")
                    .Register(r)),
      restarts_(
          prometheus::BuildCounter()
              .Name("rackrun_job_restarts_total")
              .Help("Attempts the restart policy started again after a failure, by failure kind")
              .Register(r)),
      workers_(prometheus::BuildGauge()
                   .Name("rackrun_workers")
                   .Help("Registered workers, by state")
                   .Register(r)),
      heartbeat_age_(prometheus::BuildGauge()
                         .Name("rackrun_worker_heartbeat_age_seconds")
                         .Help("Seconds since a worker's last heartbeat")
                         .Register(r)),
      worker_step_(prometheus::BuildGauge()
                       .Name("rackrun_worker_step_seconds")
                       .Help("Duration of the last step a busy worker reported in its heartbeat "
                             "(stragglers stand out)")
                       .Register(r)),
      worker_phase_(
          prometheus::BuildGauge()
              .Name("rackrun_worker_phase")
              .Help(
                  "1 for the phase a worker reported in its last heartbeat (one series per worker)")
              .Register(r)),
      plan_solve_(prometheus::BuildHistogram()
                      .Name("rackrun_plan_solve_seconds")
                      .Help("Coordinator mode: seconds from a layer's last load row to its plan "
                            "reply (solve and checks), "
                            "per expert-parallel domain")
                      .Register(r)) {
  for (const char* state : {"queued", "running", "succeeded", "failed", "cancelled"}) {
    jobs_.Add({{"state", state}}).Set(0);
  }
  for (const char* state : {"idle", "busy", "lost", "draining", "gone"})
    workers_.Add({{"state", state}}).Set(0);
  queue_wait_all_ = &queue_wait_.Add(
      {}, std::vector<double>{0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600});
  for (const char* kind : {"worker_lost", "hang", "error", "worker_cancelled"}) {
    failures_.Add({{"reason", kind}});
    restarts_.Add({{"reason", kind}});
  }
}

void CoordinatorMetrics::ObserveJobs(const std::vector<rackrun::v1::Job>& jobs) {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, double> by_state = {
      {"queued", 0}, {"running", 0}, {"succeeded", 0}, {"failed", 0}, {"cancelled", 0}};
  std::set<std::string> running;
  for (const rackrun::v1::Job& j : jobs) {
    const std::string state = Lower(rackrun::v1::JobState_Name(j.state()));
    by_state[state] += 1;
    if (j.state() != rackrun::v1::RUNNING) continue;
    running.insert(j.id());
    auto it = progress_.find(j.id());
    if (it == progress_.end())
      it = progress_.emplace(j.id(), &progress_step_.Add({{"job_id", j.id()}})).first;
    it->second->Set(static_cast<double>(j.last_progress().step()));
  }
  for (const auto& [state, n] : by_state) jobs_.Add({{"state", state}}).Set(n);
  for (auto it = solve_.begin(); it != solve_.end();) {
    if (running.count(it->first.first) == 0) {
      plan_solve_.Remove(it->second);
      it = solve_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = progress_.begin(); it != progress_.end();) {
    if (running.count(it->first) == 0) {
      progress_step_.Remove(it->second);
      it = progress_.erase(it);
    } else {
      ++it;
    }
  }
}

void CoordinatorMetrics::ObserveWorkers(const rackrun::v1::ListWorkersResponse& workers) {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, double> by_state = {
      {"idle", 0}, {"busy", 0}, {"lost", 0}, {"draining", 0}, {"gone", 0}};
  std::set<std::string> live;
  for (const rackrun::v1::Worker& w : workers.workers()) {
    by_state[Lower(rackrun::v1::WorkerState_Name(w.state()))] += 1;
    if (w.state() == rackrun::v1::GONE) continue;
    live.insert(w.id());
    WorkerSeries& s = worker_series_[w.id()];
    if (s.age == nullptr) s.age = &heartbeat_age_.Add({{"worker", w.id()}});
    s.age->Set(w.heartbeat_age_s());
    const std::string phase = w.phase().empty() ? "idle" : w.phase();
    const bool busy = w.state() == rackrun::v1::BUSY && !w.job_id().empty();
    if (s.phase == nullptr || s.phase_name != phase) {
      if (s.phase != nullptr) worker_phase_.Remove(s.phase);
      s.phase = &worker_phase_.Add({{"worker", w.id()}, {"phase", phase}});
      s.phase->Set(1);
      s.phase_name = phase;
    }
    if (s.step != nullptr && (!busy || s.job_id != w.job_id() || s.rank != w.rank())) {
      worker_step_.Remove(s.step);
      s.step = nullptr;
    }
    if (busy) {
      if (s.step == nullptr) {
        s.step = &worker_step_.Add(
            {{"worker", w.id()}, {"job_id", w.job_id()}, {"rank", absl::StrCat(w.rank())}});
        s.job_id = w.job_id();
        s.rank = w.rank();
      }
      s.step->Set(w.step_time_s());
    }
  }
  for (const auto& [state, n] : by_state) workers_.Add({{"state", state}}).Set(n);
  for (auto it = worker_series_.begin(); it != worker_series_.end();) {
    if (live.count(it->first) == 0) {
      heartbeat_age_.Remove(it->second.age);
      if (it->second.phase != nullptr) worker_phase_.Remove(it->second.phase);
      if (it->second.step != nullptr) worker_step_.Remove(it->second.step);
      it = worker_series_.erase(it);
    } else {
      ++it;
    }
  }
}

void CoordinatorMetrics::ObserveQueueWait(double seconds) { queue_wait_all_->Observe(seconds); }

void CoordinatorMetrics::ObserveFailure(const std::string& reason, bool restarted) {
  failures_.Add({{"reason", reason}}).Increment();
  if (restarted) restarts_.Add({{"reason", reason}}).Increment();
}

void CoordinatorMetrics::ObservePlanSolve(const std::string& job_id, int domain, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::pair<std::string, int> key(job_id, domain);
  auto it = solve_.find(key);
  if (it == solve_.end()) {
    it =
        solve_
            .emplace(key, &plan_solve_.Add({{"job_id", job_id}, {"domain", std::to_string(domain)}},
                                           BalancingSecondsBuckets()))
            .first;
  }
  it->second->Observe(seconds);
}

}  // namespace rackrun::metrics
