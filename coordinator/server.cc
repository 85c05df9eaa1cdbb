#include "coordinator/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_builder.h>
#include <netdb.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/file.h"
#include "coordinator/certificates.h"
#include "metrics/exporter.h"
#include "rpc/join_token.h"
#include "rpc/liveness.h"

namespace rackrun::coordinator {

namespace {

constexpr const char* kJoinTokenFiles[] = {"join-token", "join-token-user", "join-token-worker",
                                           "join-token-readonly"};

// Without the automatic CA, join tokens left from an earlier start would pin a CA that is
// not served: remove them, so that a client fails on a missing file, not on a handshake.
void RemoveJoinTokens(const std::string& state_dir) {
  for (const char* name : kJoinTokenFiles) unlink(absl::StrCat(state_dir, "/", name).c_str());
}

// Why gRPC could not serve on `listen` (it says nothing itself): a bind of our own tells an
// address in use or not this machine's from a failure elsewhere, so "address in use" is
// said only when it is.
std::string WhyNotListening(const std::string& listen) {
  std::string host;
  int port = 0;
  if (!metrics::SplitHostPort(listen, "--listen", &host, &port).ok()) return "not HOST:PORT";
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(),
                                 std::to_string(port).c_str(), &hints, &found);
      rc != 0) {
    return absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc));
  }
  std::string why = "gRPC could not start the server; its log above says why";
  const int fd = socket(found->ai_family, found->ai_socktype | SOCK_CLOEXEC, found->ai_protocol);
  if (fd >= 0) {
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as gRPC binds
    if (bind(fd, found->ai_addr, found->ai_addrlen) != 0) {
      if (errno == EADDRINUSE) {
        why = "address in use: another process (a second coordinator?) listens there";
      } else if (errno == EADDRNOTAVAIL) {
        why = "not an address of this machine";
      } else {
        why = std::strerror(errno);
      }
    }
    close(fd);
  }
  freeaddrinfo(found);
  return why;
}

}  // namespace

absl::StatusOr<TlsSetup> SetUpTls(const ServerOptions& options, const RoleTokens& tokens,
                                  bool renew) {
  TlsSetup out;
  std::string host;
  int port = 0;
  if (absl::Status s = metrics::SplitHostPort(options.listen, "--listen", &host, &port); !s.ok())
    return s;
  const bool loopback = metrics::IsLoopbackHost(host);
  const bool user_certs = !options.tls_cert.empty() || !options.tls_key.empty();
  if (options.insecure && options.tls == TlsMode::kOn) {
    return absl::InvalidArgumentError("--insecure and --tls=on contradict each other; give one");
  }
  if (user_certs && (options.tls == TlsMode::kOff || options.insecure)) {
    return absl::InvalidArgumentError(
        "--tls-cert/--tls-key with --tls=off or --insecure: drop the certificate flags to serve "
        "plaintext, or the others to serve TLS");
  }
  if (options.tls == TlsMode::kOff && !loopback && !options.insecure) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls=off: '", host,
                     "' is not a loopback address, so the tokens would cross the "
                     "network in clear text; add --insecure to accept that, or drop --tls=off"));
  }
  if (user_certs) {
    RemoveJoinTokens(options.state_dir);
    absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds =
        MakeServerCredentials(options.tls_cert, options.tls_key, options.tls_client_ca);
    if (!creds.ok()) return creds.status();
    out.credentials = *creds;
    out.tls = true;
    out.summary = absl::StrCat("TLS, certificate ", options.tls_cert);
    absl::StatusOr<std::string> pem = base::ReadWholeFile(options.tls_cert);
    absl::StatusOr<absl::Time> expires = pem.ok() ? CertificateExpiry(*pem) : pem.status();
    if (!expires.ok())
      return absl::InvalidArgumentError(absl::StrCat("--tls-cert: ", expires.status().message()));
    out.expiries.push_back({absl::StrCat("the server certificate ", options.tls_cert), *expires,
                            "replace it (--tls-cert) and restart the coordinator"});
    return out;
  }
  const bool tls = options.tls == TlsMode::kOn ||
                   (options.tls == TlsMode::kAuto && !loopback && !options.insecure);
  if (!tls) {
    if (!options.tls_client_ca.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca: needs TLS; drop --tls=off / --insecure");
    }
    RemoveJoinTokens(options.state_dir);
    out.credentials = grpc::InsecureServerCredentials();
    out.insecure_remote = !loopback;
    out.summary = loopback ? "plaintext on loopback"
                           : "INSECURE: plaintext on a network address (--insecure)";
    return out;
  }
  CertificateOptions co;
  co.sans = ServerSans(host, base::HostName(), options.tls_sans);
  co.renew_server = renew;
  co.renew_before = options.cert_warn_ahead;
  absl::StatusOr<ServerCertificates> certs = EnsureCertificates(options.state_dir, co);
  if (!certs.ok()) {
    return absl::Status(certs.status().code(),
                        absl::StrCat("--state-dir: ", certs.status().message()));
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds =
      MakeServerCredentialsFromPem(certs->chain_pem, certs->key_pem, options.tls_client_ca);
  if (!creds.ok()) return creds.status();
  out.credentials = *creds;
  out.tls = true;
  out.ca_sha256 = certs->ca_sha256;
  out.summary = absl::StrCat("TLS, automatic CA sha256 ", certs->ca_sha256.substr(0, 16),
                             "..., names ", absl::StrJoin(co.sans, ","));
  if (certs->ca_created) {
    out.notes.push_back(absl::StrCat("made a new CA: ", options.state_dir,
                                     "/ca.crt (every join token changes with it)"));
  }
  if (!certs->issued_because.empty()) {
    out.notes.push_back(absl::StrCat("issued the server certificate ", options.state_dir,
                                     "/server.crt (", certs->issued_because, ")"));
  }
  const std::string* secrets[] = {&tokens.admin, &tokens.user, &tokens.worker, &tokens.readonly};
  for (int i = 0; i < 4; ++i) {
    const char* name = kJoinTokenFiles[i];
    const std::string* secret = secrets[i];
    const std::string path = absl::StrCat(options.state_dir, "/", name);
    const std::string text = rpc::FormatJoinToken(certs->ca_sha256, *secret) + "\n";
    absl::StatusOr<std::string> have = base::ReadWholeFile(path);
    if (have.ok() && *have == text) continue;
    if (absl::Status s = WritePrivateFile(path, text); !s.ok()) return s;
  }
  const std::string renew_fix =
      absl::StrCat("run 'rackrun-coordinator --state-dir ", options.state_dir,
                   " --renew-certs' and restart the coordinator");
  out.expiries.push_back({"the coordinator's CA", certs->ca_expires,
                          renew_fix + ", then give workers and users the new join tokens"});
  out.expiries.push_back(
      {"the coordinator's server certificate", certs->server_expires, renew_fix});
  return out;
}

std::vector<std::string> ExpiryWarnings(const TlsSetup& setup, absl::Time now,
                                        absl::Duration ahead) {
  std::vector<std::string> out;
  for (const TlsSetup::Expiry& e : setup.expiries) {
    if (std::string w = ExpiryWarning(e.what, e.expires, now, ahead, e.fix); !w.empty())
      out.push_back(w);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const ServerOptions& options) {
  std::unique_ptr<CoordinatorServer> s(new CoordinatorServer(options));
  if (absl::Status st = s->SetUpStateAndCredentials(); !st.ok()) return st;
  if (absl::Status st = s->OpenState(); !st.ok()) return st;
  if (absl::Status st = s->Listen(); !st.ok()) return st;
  // Replay, the one place that reads the store at start; then serve.
  if (absl::Status st = s->ReplayAndServe(); !st.ok()) {
    s->Shutdown();
    return st;
  }
  s->StartTicker();
  return s;
}

absl::Status CoordinatorServer::SetUpStateAndCredentials() {
  if (options_.state_dir.empty()) return absl::InvalidArgumentError("--state-dir: required");
  std::error_code ec;
  std::filesystem::create_directories(options_.state_dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("--state-dir: cannot create '", options_.state_dir, "': ", ec.message()));
  }
  chmod(options_.state_dir.c_str(), 0700);
  const bool default_token = options_.token_file.empty();
  token_file_ = default_token ? options_.state_dir + "/token" : options_.token_file;
  absl::StatusOr<RoleTokens> tokens =
      LoadOrCreateRoleTokens(options_.state_dir, token_file_, default_token);
  if (!tokens.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(default_token ? "--state-dir: " : "--token-file / --state-dir: ",
                     tokens.status().message()));
  }
  absl::StatusOr<TlsSetup> tls = SetUpTls(options_, *tokens, /*renew=*/false);
  if (!tls.ok()) return tls.status();
  tls_ = *std::move(tls);
  if (tls_.tls) tls_.credentials->SetAuthMetadataProcessor(std::make_shared<TokenGate>(*tokens));
  auth_ = std::make_unique<TokenAuth>(*std::move(tokens));
  return absl::OkStatus();
}

absl::Status CoordinatorServer::OpenState() {
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(db_path());
  if (!store.ok()) return store.status();
  store_ = *std::move(store);
  rack_ = std::make_unique<Rack>(store_.get(), SystemClock(), options_.rack);
  job_service_ = std::make_unique<JobServiceImpl>(rack_.get(), auth_.get(), &gate_, kStreamPoll,
                                                  options_.limits);
  rack_control_ = std::make_unique<RackControlImpl>(rack_.get(), auth_.get(), &gate_, kStreamPoll,
                                                    options_.limits);
  ObservabilityOptions observability_options = options_.observability;
  // A dashboard beyond loopback is a read-only view: any role's token opens it.
  const TokenAuth* auth = auth_.get();
  observability_options.dashboard_token_ok = [auth](const std::string& token) {
    return !token.empty() && auth->RoleOf("Bearer " + token).has_value();
  };
  absl::StatusOr<std::unique_ptr<Observability>> observability =
      Observability::Start(observability_options, rack_.get());
  if (!observability.ok()) return observability.status();
  observability_ = *std::move(observability);
  return absl::OkStatus();
}

absl::Status CoordinatorServer::Listen() {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options_.listen, tls_.credentials, &port_);
  // The port is this coordinator's alone: gRPC binds with SO_REUSEPORT unless told not to,
  // and then a second coordinator (another state folder, same user) on the same address
  // started and took a share of the connections instead of being refused.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(
      GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
      static_cast<int>(std::clamp<int64_t>(options_.handshake_timeout_ms, 1, int64_t{1} << 30)));
  builder.RegisterService(job_service_.get());
  builder.RegisterService(rack_control_.get());
  // Keepalive: pings every 10 s find dead peers on an idle connection (a worker's
  // Assignments stream), and clients may ping every 5 s without data. A ping unanswered
  // (or data unacknowledged: gRPC sets TCP_USER_TIMEOUT to it) for max(20 s, 2 x heartbeat
  // timeout + interval) drops the connection (rpc/liveness.h: keepalive_timeout). That is
  // longer than the retransmission stall a cut the heartbeats survive leaves behind, so a
  // worker's stream outlives such a cut (its heartbeats meanwhile come over a new
  // connection: worker/connection.h); and a stream dropped for a stopped peer always
  // closes after its heartbeats were overdue, which the failure rules tell from a process
  // exit (failure_detector.h, StreamState).
  const Workers::Options& workers = options_.rack.workers;
  const rpc::LivenessTimings liveness =
      rpc::LivenessFor(std::chrono::milliseconds(workers.heartbeat_interval_ms),
                       std::chrono::milliseconds(workers.heartbeat_timeout_ms));
  const auto ms = [](std::chrono::milliseconds d) {
    return static_cast<int>(std::min<int64_t>(d.count(), INT32_MAX));
  };
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, ms(liveness.keepalive_time));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms(liveness.keepalive_timeout));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  if (auto interceptors = observability_->InterceptorFactories(); !interceptors.empty()) {
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
  }
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(absl::StrCat("--listen: cannot listen on ", options_.listen, " (",
                                               WhyNotListening(options_.listen), ")"));
  }
  server_->GetHealthCheckService()->SetServingStatus(false);
  return absl::OkStatus();
}

absl::Status CoordinatorServer::ReplayAndServe() {
  if (absl::Status st = rack_->Initialize(); !st.ok()) return st;
  if (options_.serving_delay_ms > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(options_.serving_delay_ms));
  }
  gate_.Open();
  server_->GetHealthCheckService()->SetServingStatus(true);
  if (!options_.prometheus_targets.empty()) {
    targets_ = std::make_unique<PrometheusTargets>(options_.prometheus_targets);
    if (absl::Status st = targets_->Update(rack_->workers().List(false)); !st.ok()) return st;
  }
  return absl::OkStatus();
}

void CoordinatorServer::StartTicker() {
  ticker_ = std::thread([this] {
    // Certificate expiry: warned at start (main) and once a day after.
    absl::Time next_expiry_check = absl::Now() + absl::Hours(24);
    while (!stop_) {
      if (absl::Now() >= next_expiry_check) {
        next_expiry_check = absl::Now() + absl::Hours(24);
        for (const std::string& w : ExpiryWarnings(tls_, absl::Now(), options_.cert_warn_ahead)) {
          std::fprintf(stderr, "rackrun-coordinator: warning: %s\n", w.c_str());
        }
      }
      rack_->Tick();
      observability_->Refresh();
      // A write error (disk full) is retried at the next tick; serving goes on.
      if (targets_ != nullptr) (void)targets_->Update(rack_->workers().List(false));
      std::this_thread::sleep_for(std::chrono::milliseconds(options_.tick_ms));
    }
  });
}

void CoordinatorServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  gate_.Close();
  if (server_ != nullptr) server_->GetHealthCheckService()->SetServingStatus(false);
  stop_ = true;
  if (ticker_.joinable()) ticker_.join();
  if (observability_ != nullptr) observability_->StopDashboard();
  if (rack_ != nullptr) rack_->Shutdown();
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server_->Wait();
  }
  observability_.reset();
  store_.reset();
}

CoordinatorServer::~CoordinatorServer() { Shutdown(); }

}  // namespace rackrun::coordinator
