// CoordinatorServer: the rackrun-coordinator process minus argv: opens the state folder
// (database, token), starts gRPC (JobService, RackControl, health, reflection) with health
// NOT_SERVING, replays the stored state, then reports SERVING and ticks the Rack.
#ifndef RACKRUN_COORDINATOR_SERVER_H_
#define RACKRUN_COORDINATOR_SERVER_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "coordinator/auth.h"
#include "coordinator/job_store.h"
#include "coordinator/observability.h"
#include "coordinator/prometheus_targets.h"
#include "coordinator/rack.h"
#include "coordinator/services.h"

namespace rackrun::coordinator {

struct ServerOptions {
  std::string listen = "127.0.0.1:7070";  // port 0: any free port (see port())
  std::string state_dir;                  // created when missing
  std::string token_file;                 // empty: <state_dir>/token, created at first start
  std::string tls_cert, tls_key, tls_client_ca;
  Rack::Options rack;
  int64_t tick_ms = 20;
  // Test seam: hold health at NOT_SERVING this long after replaying (0 in production).
  int64_t serving_delay_ms = 0;
  // Prometheus endpoint and built-in dashboard (observability.h); empty addresses = off.
  ObservabilityOptions observability;
  // Prometheus file-based service discovery: this file lists the live workers' metrics
  // endpoints (rewritten atomically when the set changes); empty = off.
  std::string prometheus_targets;
};

class CoordinatorServer {
 public:
  // Starts serving; returns once health says SERVING. Errors name the flag or file.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(const ServerOptions& options);
  ~CoordinatorServer();

  int port() const { return port_; }
  int metrics_port() const { return observability_ != nullptr ? observability_->metrics_port() : 0; }
  int dashboard_port() const { return observability_ != nullptr ? observability_->dashboard_port() : 0; }
  const std::string& token_file() const { return token_file_; }
  std::string db_path() const { return options_.state_dir + "/coordinator.db"; }

  // Health NOT_SERVING, streams ended, server stopped (in-flight unary calls get up to
  // 2 s), database closed. Idempotent.
  void Shutdown();

 private:
  explicit CoordinatorServer(const ServerOptions& options) : options_(options) {}

  ServerOptions options_;
  std::string token_file_;
  int port_ = 0;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<TokenAuth> auth_;
  ServingGate gate_;
  std::unique_ptr<Rack> rack_;
  std::unique_ptr<JobServiceImpl> job_service_;
  std::unique_ptr<RackControlImpl> rack_control_;
  std::unique_ptr<Observability> observability_;  // outlives server_ (its interceptors)
  std::unique_ptr<grpc::Server> server_;
  std::atomic<bool> stop_{false};
  std::thread ticker_;
  std::unique_ptr<PrometheusTargets> targets_;  // when options_.prometheus_targets
  bool shut_down_ = false;
};

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_SERVER_H_
