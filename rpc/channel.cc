#include "rpc/channel.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/support/channel_arguments.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "rpc/join_token.h"

namespace rackrun::rpc {

std::shared_ptr<grpc::Channel> CoordinatorChannel(
    const std::string& address, const std::shared_ptr<grpc::ChannelCredentials>& credentials,
    const CoordinatorChannelOptions& options) {
  const auto ms = [](std::chrono::milliseconds d) {
    return static_cast<int>(std::min<int64_t>(d.count(), INT32_MAX));
  };
  grpc::ChannelArguments args;
  const std::optional<LivenessTimings>& live = options.liveness;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, live ? ms(live->keepalive_time) : 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, live ? ms(live->keepalive_timeout) : 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
              live ? ms(live->initial_reconnect_backoff) : 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, live ? ms(live->max_reconnect_backoff) : 1000);
  if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  if (options.connection_id != 0) args.SetInt("rackrun.connection_id", options.connection_id);
  if (options.generation != 0) args.SetInt("rackrun.generation", options.generation);
  return grpc::CreateCustomChannel(address, credentials, args);
}

absl::StatusOr<CoordinatorClientChannel> OpenCoordinatorChannel(
    const std::string& address, const std::string& token_file, const TlsFiles& tls,
    const CoordinatorChannelOptions& options) {
  absl::StatusOr<ClusterToken> token = LoadClusterToken(token_file);
  if (!token.ok()) return token.status();
  std::string ca_pem;
  if (!token->ca_sha256.empty() && tls.ca.empty()) {
    // Retry only what a coordinator that is still starting causes (Unavailable).
    const auto give_up = std::chrono::steady_clock::now() + options.ca_fetch_patience;
    std::chrono::milliseconds backoff{200};
    absl::StatusOr<std::string> ca;
    while (true) {
      ca = FetchPinnedCa(address, token->ca_sha256, std::chrono::milliseconds(5000));
      if (ca.ok() || ca.status().code() != absl::StatusCode::kUnavailable ||
          std::chrono::steady_clock::now() + backoff >= give_up) {
        break;
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
    }
    if (!ca.ok()) {
      return absl::Status(ca.status().code(), absl::StrCat("join token from ", token->source,
                                                           ": cannot fetch the coordinator's CA: ",
                                                           ca.status().message()));
    }
    ca_pem = *std::move(ca);
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      CoordinatorCredentials(tls, ca_pem);
  if (!credentials.ok()) return credentials.status();
  std::shared_ptr<grpc::Channel> channel = CoordinatorChannel(address, *credentials, options);
  return CoordinatorClientChannel{*std::move(token), std::move(channel), *std::move(credentials)};
}

}  // namespace rackrun::rpc
