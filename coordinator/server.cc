#include "coordinator/server.h"

#include <sys/stat.h>

#include <chrono>
#include <filesystem>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_builder.h>

#include "absl/strings/str_cat.h"

namespace rackrun::coordinator {

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(const ServerOptions& options) {
  std::unique_ptr<CoordinatorServer> s(new CoordinatorServer(options));
  if (options.state_dir.empty()) return absl::InvalidArgumentError("--state-dir: required");
  std::error_code ec;
  std::filesystem::create_directories(options.state_dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("--state-dir: cannot create '", options.state_dir, "': ", ec.message()));
  }
  chmod(options.state_dir.c_str(), 0700);
  const bool default_token = options.token_file.empty();
  s->token_file_ = default_token ? options.state_dir + "/token" : options.token_file;
  absl::StatusOr<std::string> token = LoadOrCreateToken(s->token_file_, default_token);
  if (!token.ok()) return absl::InvalidArgumentError(absl::StrCat("--token-file: ", token.status().message()));
  s->auth_ = std::make_unique<TokenAuth>(*token);
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds =
      MakeServerCredentials(options.tls_cert, options.tls_key, options.tls_client_ca);
  if (!creds.ok()) return creds.status();

  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(s->db_path());
  if (!store.ok()) return store.status();
  s->store_ = *std::move(store);
  s->rack_ = std::make_unique<Rack>(s->store_.get(), SystemClock(), options.rack);
  s->job_service_ = std::make_unique<JobServiceImpl>(s->rack_.get(), s->auth_.get(), &s->gate_);
  s->rack_control_ = std::make_unique<RackControlImpl>(s->rack_.get(), s->auth_.get(), &s->gate_);

  absl::StatusOr<std::unique_ptr<Observability>> observability = Observability::Start(options.observability, s->rack_.get());
  if (!observability.ok()) return observability.status();
  s->observability_ = *std::move(observability);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, *creds, &s->port_);
  builder.RegisterService(s->job_service_.get());
  builder.RegisterService(s->rack_control_.get());
  // Keepalive: pings every 10 s find dead peers on an idle connection (a worker's
  // Assignments stream), and clients may ping every 5 s without data.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  if (auto interceptors = s->observability_->InterceptorFactories(); !interceptors.empty()) {
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
  }
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("--listen: cannot listen on ", options.listen,
                                               " (address in use, or not HOST:PORT)"));
  }
  grpc::HealthCheckServiceInterface* health = s->server_->GetHealthCheckService();
  health->SetServingStatus(false);

  // Replay, the one place that reads the store at start; then serve.
  if (absl::Status st = s->rack_->Initialize(); !st.ok()) {
    s->Shutdown();
    return st;
  }
  if (options.serving_delay_ms > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(options.serving_delay_ms));
  }
  s->gate_.Open();
  health->SetServingStatus(true);
  if (!options.prometheus_targets.empty()) {
    s->targets_ = std::make_unique<PrometheusTargets>(options.prometheus_targets);
    if (absl::Status st = s->targets_->Update(s->rack_->workers().List(false)); !st.ok()) {
      s->Shutdown();
      return st;
    }
  }
  CoordinatorServer* self = s.get();
  s->ticker_ = std::thread([self] {
    while (!self->stop_) {
      self->rack_->Tick();
      self->observability_->Refresh();
      // A write error (disk full) is retried at the next tick; serving goes on.
      if (self->targets_ != nullptr) (void)self->targets_->Update(self->rack_->workers().List(false));
      std::this_thread::sleep_for(std::chrono::milliseconds(self->options_.tick_ms));
    }
  });
  return s;
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
