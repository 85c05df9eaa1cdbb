// CoordinatorServer: the rackrun-coordinator process minus argv: opens the state folder
// (database, role tokens, automatic TLS certificates and join tokens), starts gRPC (JobService,
// RackControl, health, reflection) with health NOT_SERVING, replays the stored state, then reports
// SERVING and ticks the Rack.
#ifndef RACKRUN_COORDINATOR_SERVER_H_
#define RACKRUN_COORDINATOR_SERVER_H_

#include <grpcpp/server.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/auth.h"
#include "coordinator/job_store.h"
#include "coordinator/observability.h"
#include "coordinator/prometheus_targets.h"
#include "coordinator/rack.h"
#include "coordinator/services.h"

namespace rackrun::coordinator {

// Whether the coordinator serves TLS: kAuto = on unless --listen is a loopback address.
enum class TlsMode { kAuto, kOn, kOff };

struct ServerOptions {
  std::string listen = "127.0.0.1:7070";  // port 0: any free port (see port())
  std::string state_dir;                  // created when missing
  std::string token_file;                 // empty: <state_dir>/token, created at first start
  TlsMode tls = TlsMode::kAuto;
  // Plaintext on a non-loopback address: allowed only with this, and warned about.
  bool insecure = false;
  // User-supplied certificate and key (instead of the automatic ones).
  std::string tls_cert, tls_key, tls_client_ca;
  std::vector<std::string> tls_sans;  // extra names for the automatic server certificate
  // Certificates expiring within this are warned about at start and daily.
  absl::Duration cert_warn_ahead = absl::Hours(24 * 30);
  Rack::Options rack;
  // Calls that hold a server thread while they wait (services.h).
  CallLimits limits;
  int64_t tick_ms = 20;
  // A connection that has not finished its TLS handshake (in plaintext: sent its HTTP/2
  // preface) this long after connecting is closed, so idle connections cannot hold the
  // process's file descriptors for gRPC's default two minutes.
  int64_t handshake_timeout_ms = 10000;
  // Test seam: hold health at NOT_SERVING this long after replaying (0 in production).
  int64_t serving_delay_ms = 0;
  // Prometheus endpoint and built-in dashboard (observability.h); empty addresses = off.
  ObservabilityOptions observability;
  // Prometheus file-based service discovery: this file lists the live workers' metrics
  // endpoints (rewritten atomically when the set changes); empty = off.
  std::string prometheus_targets;
};

// How the coordinator serves: the credentials and what to tell the operator.
struct TlsSetup {
  std::shared_ptr<grpc::ServerCredentials> credentials;
  std::string summary;  // for the banner: "TLS, automatic CA ...", "insecure: ..."
  bool tls = false;
  bool insecure_remote = false;    // plaintext on a non-loopback address (--insecure)
  std::string ca_sha256;           // automatic CA only
  std::vector<std::string> notes;  // certificates made or re-issued, join token files
  // (what, when it expires, what to do) for the expiry warnings.
  struct Expiry {
    std::string what;
    absl::Time expires;
    std::string fix;
  };
  std::vector<Expiry> expiries;
};

// Decides plaintext or TLS for `options` (the loopback rule, --tls, --insecure), makes or
// re-issues the automatic certificates (re-issuing the server certificate when `renew`,
// also the CA when it is about to expire) and writes the join-token files of `tokens`.
// Errors name the flag or file and the fix.
absl::StatusOr<TlsSetup> SetUpTls(const ServerOptions& options, const RoleTokens& tokens,
                                  bool renew);

// The expiry warnings of `setup` at `now` (ServerOptions::cert_warn_ahead ahead).
std::vector<std::string> ExpiryWarnings(const TlsSetup& setup, absl::Time now,
                                        absl::Duration ahead);

class CoordinatorServer {
 public:
  // Starts serving; returns once health says SERVING. Errors name the flag or file.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(const ServerOptions& options);
  ~CoordinatorServer();

  int port() const { return port_; }
  int metrics_port() const {
    return observability_ != nullptr ? observability_->metrics_port() : 0;
  }
  int dashboard_port() const {
    return observability_ != nullptr ? observability_->dashboard_port() : 0;
  }
  const std::string& token_file() const { return token_file_; }
  const TlsSetup& tls() const { return tls_; }
  std::string db_path() const { return options_.state_dir + "/coordinator.db"; }

  // Health NOT_SERVING, streams ended, server stopped (in-flight unary calls get up to
  // 2 s), database closed. Idempotent.
  void Shutdown();

 private:
  explicit CoordinatorServer(const ServerOptions& options) : options_(options) {}

  // Start's steps, in order: the state folder, role tokens and TLS; the job store, the rack
  // and its services, metrics and the dashboard; the gRPC server (health NOT_SERVING);
  // the replay, then SERVING; the ticker (detection, scheduling, metrics, expiry checks).
  absl::Status SetUpStateAndCredentials();
  absl::Status OpenState();
  absl::Status Listen();
  absl::Status ReplayAndServe();
  void StartTicker();

  ServerOptions options_;
  std::string token_file_;
  TlsSetup tls_;
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
