// The one way a client opens its gRPC channel to the rack coordinator: the worker daemon,
// the rackrun CLI and the daemons benchmark. No network traffic until the first call.
//
// Channel arguments, and why:
// - Keepalive ping every 10 s, a dead peer declared after 5 s without the ack: a worker's
//   Assignments stream and Plans stream, and the CLI's Watch stream, are long-lived and
//   often carry no data for minutes (an idle worker, a quiet job); without pings a
//   coordinator that died without closing the connection (kill -9 of its host, a cut
//   network) would only be noticed at the next TCP timeout, minutes later. 10 s is twice
//   the interval the coordinator permits (coordinator/server.cc:
//   GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS 5000); pinging faster than
//   that makes the server close the connection (GOAWAY too_many_pings).
// - Pings also without calls and without data (max_pings_without_data 0): gRPC otherwise
//   stops after 2 pings on a stream that sends nothing, which is exactly the idle stream
//   that needs them.
// - Reconnect backoff from 100 ms up to 1 s (gRPC's defaults: 1 s up to 120 s): after a
//   coordinator restart the workers re-register within its re-attach grace and the CLI's
//   bounded retries (tools/rackrun/client.h RetryPolicy) find it again in about a
//   second. The minimum connect timeout (GRPC_ARG_MIN_RECONNECT_BACKOFF_MS) stays
//   gRPC's 20 s: a TLS handshake over a slow link must be allowed to finish.
// - A worker that knows its coordinator's heartbeat interval and timeout (after it
//   registered) passes `liveness` instead: the keepalive timeout and the reconnect
//   backoff then follow them (rpc/liveness.h says why: a short cut must not get a
//   long-lived stream dropped), and `generation` gives a renewed channel a TCP
//   connection of its own.
#ifndef RACKRUN_RPC_CHANNEL_H_
#define RACKRUN_RPC_CHANNEL_H_

#include <grpcpp/channel.h>
#include <grpcpp/security/credentials.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "rpc/credentials.h"
#include "rpc/liveness.h"

namespace rackrun::rpc {

struct CoordinatorChannelOptions {
  // TLS only: the name checked against the coordinator's certificate instead of the
  // address's host (the CLI's --tls-server-name). Empty: the host.
  std::string tls_server_name;
  // Channels with different ids never share a TCP connection (gRPC shares one between
  // channels with equal arguments). 0 for every client but a benchmark that simulates
  // many.
  int connection_id = 0;
  // A channel that replaces one whose connection stalled (worker/connection.h: Renew):
  // channels of different generations never share a TCP connection either.
  int generation = 0;
  // The keepalive timeout and reconnect backoff from these timings (rpc/liveness.h)
  // instead of the fixed ones above.
  std::optional<LivenessTimings> liveness;
  // With a join token (and no --tls-ca): how long to keep trying to reach the coordinator
  // for its CA (FetchPinnedCa) before giving up; 0 = one attempt. The worker passes its
  // --patience-s, so it may start before its coordinator.
  std::chrono::milliseconds ca_fetch_patience{0};
};

// A channel to `address` (HOST:PORT or a gRPC target URI) with `credentials`
// (rpc/credentials.h: CoordinatorCredentials) and the arguments above.
std::shared_ptr<grpc::Channel> CoordinatorChannel(
    const std::string& address, const std::shared_ptr<grpc::ChannelCredentials>& credentials,
    const CoordinatorChannelOptions& options = {});

// What a client calls the coordinator with: the cluster token to send and the channel,
// and the credentials it was made with (for more channels to the same coordinator).
struct CoordinatorClientChannel {
  ClusterToken token;
  std::shared_ptr<grpc::Channel> channel;
  std::shared_ptr<grpc::ChannelCredentials> credentials;
};
// LoadClusterToken(token_file), CoordinatorCredentials(tls), then CoordinatorChannel: the
// worker's and the CLI's set-up. Their errors, the token's first. A join token without
// tls.ca: the CA is fetched and checked against its pin first (rpc/join_token.h), the
// only network traffic before the first call; its errors name the token's source.
absl::StatusOr<CoordinatorClientChannel> OpenCoordinatorChannel(
    const std::string& address, const std::string& token_file, const TlsFiles& tls,
    const CoordinatorChannelOptions& options = {});

}  // namespace rackrun::rpc

#endif  // RACKRUN_RPC_CHANNEL_H_
