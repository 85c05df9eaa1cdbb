// Observability: the coordinator's Prometheus series (--metrics-listen) and its built-in
// dashboard (--dashboard-listen), wired onto the Rack without changing its logic:
// gRPC calls are counted by a server interceptor, plan solves by Planning's solve
// observer, and everything else comes from snapshots Refresh() takes of Jobs and Workers
// (the server's ticker calls it; it works at most every refresh_ms). metrics/README.md
// lists the series and the dashboard's views.
//
// Thread safety: Refresh runs on the ticker thread only; the rest is thread-safe.
#ifndef RACKRUN_COORDINATOR_OBSERVABILITY_H_
#define RACKRUN_COORDINATOR_OBSERVABILITY_H_

#include <grpcpp/support/server_interceptor.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/rack.h"
#include "metrics/coordinator_metrics.h"
#include "metrics/dashboard.h"
#include "metrics/exporter.h"
#include "metrics/rpc_metrics.h"

namespace rackrun::coordinator {

struct ObservabilityOptions {
  std::string metrics_listen;    // empty: no metrics endpoint
  std::string dashboard_listen;  // empty: no dashboard
  std::string dashboard_assets = RACKRUN_DASHBOARD_ASSETS;
  bool dashboard_allow_remote = false;
  // With --dashboard-allow-remote: which ?token= values may read the dashboard's views
  // (the server passes "any role's token"); unset: no token asked.
  std::function<bool(const std::string& token)> dashboard_token_ok;
  int64_t refresh_ms = 500;
};

class Observability {
 public:
  // Errors name the flag (address, loopback rule, missing assets).
  static absl::StatusOr<std::unique_ptr<Observability>> Start(const ObservabilityOptions& options,
                                                              Rack* rack);
  ~Observability();

  // For ServerBuilder::experimental().SetInterceptorCreators; empty without metrics.
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
  InterceptorFactories();
  void Refresh();
  // Stops the dashboard (its views read the Rack); call before the Rack shuts down.
  void StopDashboard();

  int metrics_port() const { return exporter_ != nullptr ? exporter_->port() : 0; }
  int dashboard_port() const { return dashboard_ != nullptr ? dashboard_->port() : 0; }

 private:
  struct Tracked {
    rackrun::v1::JobState state = rackrun::v1::JOB_STATE_UNSPECIFIED;
    int64_t restarts = 0;
    int attempts_started = 0;  // attempts whose queue wait was observed
    int failures_seen = 0;     // failed attempts counted
  };
  void ObserveJob(const rackrun::v1::Job& job, Tracked& t);

  ObservabilityOptions options_;
  Rack* rack_ = nullptr;
  std::unique_ptr<metrics::MetricsExporter> exporter_;
  std::unique_ptr<metrics::CoordinatorMetrics> metrics_;
  std::unique_ptr<metrics::RpcMetrics> rpc_;
  std::unique_ptr<metrics::DashboardSource> source_;
  std::unique_ptr<metrics::Dashboard> dashboard_;
  std::map<std::string, Tracked> tracked_;  // by job id: the newest 1000 listed
  bool baseline_taken_ = false;
  std::chrono::steady_clock::time_point last_refresh_{};
};

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_OBSERVABILITY_H_
