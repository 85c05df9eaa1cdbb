// The series every process must export (name, type, label keys), checked against real
// scrapes by metrics_series_test and the daemons' end-to-end tests. This list is the
// metrics contract of metrics/README.md.
#ifndef RACKRUN_METRICS_EXPECTED_SERIES_H_
#define RACKRUN_METRICS_EXPECTED_SERIES_H_

#include <set>
#include <string>
#include <vector>

namespace rackrun::metrics {

struct ExpectedSeries {
  std::string name;
  std::string type;
  std::set<std::string> labels;  // label keys of every sample (histograms: plus "le" on _bucket)
};

// rackrun-coordinator (before any job: every family is present with its fixed label values).
inline const std::vector<ExpectedSeries>& CoordinatorSeries() {
  static const std::vector<ExpectedSeries> s = {
      {"rackrun_jobs", "gauge", {"state"}},
      {"rackrun_job_queue_wait_seconds", "histogram", {}},
      {"rackrun_job_attempt_failures_total", "counter", {"reason"}},
      {"rackrun_job_restarts_total", "counter", {"reason"}},
      {"rackrun_workers", "gauge", {"state"}},
      {"rackrun_grpc_server_calls_total", "counter", {"method", "code"}},
      {"rackrun_grpc_server_call_duration_seconds", "histogram", {"method", "code"}},
  };
  return s;
}

// rackrun-coordinator with registered workers and a running job.
inline const std::vector<ExpectedSeries>& CoordinatorRunningSeries() {
  static const std::vector<ExpectedSeries> s = {
      {"rackrun_worker_heartbeat_age_seconds", "gauge", {"worker"}},
      {"rackrun_worker_phase", "gauge", {"worker", "phase"}},
      {"rackrun_worker_step_seconds", "gauge", {"worker", "job_id", "rank"}},
      {"rackrun_job_progress_step", "gauge", {"job_id"}},
  };
  return s;
}

// rackrun-coordinator planning a running job in coordinator mode (balancer.mode:
// coordinator): one series per (job, expert-parallel domain), each domain solved on its own.
inline const std::vector<ExpectedSeries>& CoordinatorPlanningSeries() {
  static const std::vector<ExpectedSeries> s = {
      {"rackrun_plan_solve_seconds", "histogram", {"job_id", "domain"}},
  };
  return s;
}

// rackrun-worker, every rank of a running expert-parallel job (ranks > 1).
inline const std::vector<ExpectedSeries>& WorkerSeries() {
  static const std::vector<ExpectedSeries> s = {
      {"rackrun_train_step_duration_seconds", "histogram", {"job_id", "rank"}},
      {"rackrun_train_step", "gauge", {"job_id", "rank"}},
      {"rackrun_train_steps_target", "gauge", {"job_id", "rank"}},
      {"rackrun_train_tokens_total", "counter", {"job_id", "rank"}},
      {"rackrun_train_step_seconds_total", "counter", {"job_id", "rank"}},
      {"rackrun_train_loss", "gauge", {"job_id", "rank"}},
      {"rackrun_train_grad_norm", "gauge", {"job_id", "rank"}},
      {"rackrun_train_learning_rate", "gauge", {"job_id", "rank"}},
      {"rackrun_train_model_flops_per_second", "gauge", {"job_id", "rank"}},
      {"rackrun_train_mfu_ratio", "gauge", {"job_id", "rank"}},
      {"rackrun_device_peak_flops", "gauge", {"job_id", "rank"}},
      {"rackrun_train_phase", "gauge", {"job_id", "rank", "phase"}},
      {"rackrun_moe_plan_seconds", "histogram", {"job_id", "rank", "domain"}},
      {"rackrun_moe_plan_exchange_seconds", "histogram", {"job_id", "rank", "domain"}},
      {"rackrun_moe_fanout_seconds", "histogram", {"job_id", "rank", "domain"}},
      {"rackrun_moe_dispatch_seconds", "histogram", {"job_id", "rank", "domain"}},
      {"rackrun_moe_reduce_seconds", "histogram", {"job_id", "rank", "domain"}},
      {"rackrun_moe_balancing_seconds_total", "counter", {"job_id", "rank", "domain"}},
  };
  return s;
}

// rackrun-worker: only with an expert-parallel group (bytes) / only the first rank of each
// expert-parallel domain (per layer; rank 0 with one domain) / only after an evaluation /
// only in coordinator mode. Every rackrun_moe_* series carries domain (rank / G).
inline const std::vector<ExpectedSeries>& WorkerGroupSeries() {
  static const std::vector<ExpectedSeries> s = {
      {"rackrun_moe_fanout_bytes_total", "counter", {"job_id", "rank", "domain"}},
      {"rackrun_moe_reduce_bytes_total", "counter", {"job_id", "rank", "domain"}},
      {"rackrun_moe_dispatch_bytes_total", "counter", {"job_id", "rank", "domain"}},
  };
  return s;
}
inline const std::vector<ExpectedSeries>& WorkerLayerSeries() {
  static const std::vector<ExpectedSeries> s = {
      {"rackrun_moe_last_imbalance_before", "gauge", {"job_id", "domain", "layer"}},
      {"rackrun_moe_last_imbalance_after", "gauge", {"job_id", "domain", "layer"}},
      {"rackrun_moe_imbalance_before", "histogram", {"job_id", "domain", "layer"}},
      {"rackrun_moe_imbalance_after", "histogram", {"job_id", "domain", "layer"}},
      {"rackrun_moe_replicas", "gauge", {"job_id", "domain", "layer"}},
  };
  return s;
}
// rackrun-worker, every rank of a running job with resources.device: cuda (the GPU engine's
// figures after each step; phase: gemm, attention, streams, routing, optimizer, other).
inline const std::vector<ExpectedSeries>& WorkerGpuSeries() {
  static const std::vector<ExpectedSeries> s = {
      {"rackrun_gpu_memory_in_use_bytes", "gauge", {"job_id", "rank"}},
      {"rackrun_gpu_memory_peak_bytes", "gauge", {"job_id", "rank"}},
      {"rackrun_gpu_memory_reserved_bytes", "gauge", {"job_id", "rank"}},
      {"rackrun_gpu_memory_total_bytes", "gauge", {"job_id", "rank"}},
      {"rackrun_gpu_step_device_seconds", "gauge", {"job_id", "rank", "phase"}},
  };
  return s;
}
inline const std::vector<ExpectedSeries>& WorkerOptionalSeries() {
  static const std::vector<ExpectedSeries> s = {
      {"rackrun_train_validation_loss", "gauge", {"job_id", "rank"}},
      {"rackrun_moe_plan_round_trip_seconds", "histogram", {"job_id", "rank", "domain"}},
  };
  return s;
}

}  // namespace rackrun::metrics

#endif  // RACKRUN_METRICS_EXPECTED_SERIES_H_
