// Prometheus file-based service discovery for a rack's workers: the coordinator knows which
// workers are alive and where they serve metrics (RegisterRequest.metrics_address), so it
// keeps a file_sd file listing them; Prometheus (deploy/prometheus/prometheus.yml) watches
// the folder. Under Slurm, where every worker gets the same flags (--metrics-listen
// HOST:0), this is how the bound ports of a job's workers reach Prometheus.
//
// Format: [{"targets": ["host:port", ...], "labels": {"rackrun_role": "worker"}}], targets
// sorted. Written atomically (temporary file + rename) and only when the set changes. Not
// thread-safe: the coordinator's ticker thread calls Update.
#ifndef RACKRUN_COORDINATOR_PROMETHEUS_TARGETS_H_
#define RACKRUN_COORDINATOR_PROMETHEUS_TARGETS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "rackrun/v1/job_service.pb.h"

namespace rackrun::coordinator {

class PrometheusTargets {
 public:
  explicit PrometheusTargets(std::string path) : path_(std::move(path)) {}

  // Rewrites the file when the metrics endpoints of the workers that are not LOST or GONE
  // differ from the last written set (the first call always writes, so an empty rack gives
  // an empty list). The error names the file.
  absl::Status Update(const rackrun::v1::ListWorkersResponse& workers);

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool written_ = false;
  std::vector<std::string> last_;
};

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_PROMETHEUS_TARGETS_H_
