// CoordinatorMetrics: the rack coordinator's Prometheus series (docs/design.md section 9):
// jobs by state, queue wait, attempt failures and restarts by reason, the progress step of
// running jobs, workers by state, each worker's heartbeat age, phase and reported step
// time, and coordinator-mode plan solve times. The coordinator feeds it snapshots
// (ObserveJobs/ObserveWorkers, about once a second) and events (queue waits, failures,
// plan solves); this class only keeps the series in shape (it drops the series of jobs
// and workers that are gone, so label sets stay bounded by what the rack holds).
//
// Labels: state, reason (a FailureKind name as in spec.restart.on), job_id, rank, worker
// (a worker id, bounded by the rack's size), phase, domain (an expert-parallel domain of a
// running job, bounded by its ranks). Never expert ids.
//
// Thread safety: all methods are thread-safe.
#ifndef RACKRUN_METRICS_COORDINATOR_METRICS_H_
#define RACKRUN_METRICS_COORDINATOR_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "rackrun/v1/job_service.pb.h"

namespace rackrun::metrics {

class CoordinatorMetrics {
 public:
  explicit CoordinatorMetrics(prometheus::Registry& registry);

  // Every job the coordinator holds (List's shape: no spec, no attempts): jobs by state,
  // and rackrun_job_progress_step{job_id} for the RUNNING ones (their series end with them).
  void ObserveJobs(const std::vector<rackrun::v1::Job>& jobs);
  // Every worker, GONE ones included: workers by state, and per live worker heartbeat age,
  // phase and last reported step time.
  void ObserveWorkers(const rackrun::v1::ListWorkersResponse& workers);
  // A job's attempt started after `seconds` queued (restart backoff included).
  void ObserveQueueWait(double seconds);
  // An attempt failed with `reason` (FailureKindName); `restarted`: the policy restarts it.
  void ObserveFailure(const std::string& reason, bool restarted);
  // Coordinator mode: one plan of expert-parallel domain `domain` solved (its last row in
  // -> reply queued): rackrun_plan_solve_seconds{job_id, domain}, removed with the job's
  // other series when it no longer runs.
  void ObservePlanSolve(const std::string& job_id, int domain, double seconds);

 private:
  std::mutex mu_;
  prometheus::Family<prometheus::Gauge>& jobs_;
  prometheus::Family<prometheus::Gauge>& progress_step_;
  prometheus::Family<prometheus::Histogram>& queue_wait_;
  prometheus::Family<prometheus::Counter>& failures_;
  prometheus::Family<prometheus::Counter>& restarts_;
  prometheus::Family<prometheus::Gauge>& workers_;
  prometheus::Family<prometheus::Gauge>& heartbeat_age_;
  prometheus::Family<prometheus::Gauge>& worker_step_;
  prometheus::Family<prometheus::Gauge>& worker_phase_;
  prometheus::Family<prometheus::Histogram>& plan_solve_;
  prometheus::Histogram* queue_wait_all_ = nullptr;
  std::map<std::string, prometheus::Gauge*> progress_;                   // by job id
  std::map<std::pair<std::string, int>, prometheus::Histogram*> solve_;  // by job id, domain
  struct WorkerSeries {
    prometheus::Gauge* age = nullptr;
    prometheus::Gauge* step = nullptr;
    prometheus::Gauge* phase = nullptr;
    std::string phase_name, job_id;
    int rank = -1;
  };
  std::map<std::string, WorkerSeries> worker_series_;  // by worker id
};

}  // namespace rackrun::metrics

#endif  // RACKRUN_METRICS_COORDINATOR_METRICS_H_
