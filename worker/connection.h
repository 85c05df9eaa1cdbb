// How a worker daemon reaches its rack coordinator's RackControl service: the channel
// (rpc/channel.h: TLS or plaintext, keepalive on), the cluster token (rpc/credentials.h)
// sent as `authorization: Bearer <token>` on every call, and a deadline on every unary
// call. The worker's own: the CLI talks to JobService through tools/rackrun/client.h, and
// the daemons benchmark borrows this one only to drive the worker's CoordinatorPlanSource.
//
// The channel of the moment: stub() returns the stub of the current channel, and a call
// made on it goes over that channel's TCP connection. When a call finds that connection
// stalled (the heartbeat loop: a heartbeat missed its deadline or found the coordinator
// unavailable), Renew() replaces the channel with a new one, a new TCP connection with no
// retransmission backoff behind it, so later calls get through as soon as the link does
// (rpc/liveness.h says why and gives the bound). Calls and streams already made keep their
// channel alive through the stub they hold: a long-lived stream (Assignments, Plans) stays
// on its connection, which recovers by itself (its keepalive timeout outlasts the stall of
// a survivable cut) and is never cut by a renewal, so the coordinator never sees it close.
// The Assignments stream has a channel of its own (stream_stub), renewed only when the
// coordinator says the stream stalled (HeartbeatResponse.stream_stalled). SetLiveness (after
// Register) derives the keepalive and backoff from the coordinator's heartbeat interval
// and timeout.
//
// Thread-safe after Create.
#ifndef RACKRUN_WORKER_CONNECTION_H_
#define RACKRUN_WORKER_CONNECTION_H_

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/security/credentials.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "rackrun/v1/rack_control.grpc.pb.h"
#include "rpc/liveness.h"

namespace rackrun::worker {

struct ConnectionOptions {
  std::string coordinator;  // HOST:PORT
  std::string token_file;   // empty: rpc::LoadClusterToken's search
  std::string tls_ca, tls_cert, tls_key;
  std::chrono::milliseconds call_timeout{10000};
  // A join token: how long Create keeps trying to fetch the coordinator's CA.
  std::chrono::milliseconds ca_fetch_patience{0};
};

class Connection {
 public:
  using Stub = rackrun::v1::RackControl::Stub;

  // InvalidArgument naming the flag or file when the token or a TLS file cannot be read.
  static absl::StatusOr<std::unique_ptr<Connection>> Create(const ConnectionOptions& options);

  // A context with the token and, when `timeout` is positive, a deadline that far ahead.
  std::unique_ptr<grpc::ClientContext> NewContext(std::chrono::milliseconds timeout) const;
  std::unique_ptr<grpc::ClientContext> NewContext() const { return NewContext(call_timeout_); }

  // The current channel's stub. Hold it for as long as a call or stream made on it lives.
  std::shared_ptr<Stub> stub() const;
  // The stub of a channel for the Assignments stream alone (made with the timings of
  // SetLiveness, renewed only by Renew(stream stub)): a connection with nothing of the unary calls
  // in flight when a link goes down, so no retransmission backoff builds up on it (rpc/liveness.h).
  std::shared_ptr<Stub> stream_stub();

  // A call on `stub` found its connection stalled or the coordinator unavailable: later
  // calls go over a new channel (a new TCP connection). Nothing when `stub` is no longer
  // the current one (another caller renewed it already). True when it renewed. `stub`
  // may be the stream's (stream_stub): the next stream goes over a new channel (the
  // coordinator said an assignment written into the stream never arrived).
  bool Renew(const std::shared_ptr<Stub>& stub);

  // The coordinator's heartbeat interval and timeout (RegisterResponse): the timings of
  // rpc/liveness.h. When they differ from the ones in use, later calls go over a new
  // channel made with them. Before the first call: rpc::LivenessFor(1 s, 5 s), the
  // coordinator's defaults, with the fixed channel arguments of rpc/channel.h.
  void SetLiveness(std::chrono::milliseconds interval, std::chrono::milliseconds timeout);
  rpc::LivenessTimings liveness() const;

  const std::string& address() const { return address_; }
  const std::string& token_source() const { return token_source_; }

 private:
  Connection() = default;
  // A stub of a new channel (a TCP connection of its own) with the timings in use.
  std::shared_ptr<Stub> NewChannel() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::string address_;
  std::string token_;
  std::string token_source_;
  std::chrono::milliseconds call_timeout_{10000};
  std::shared_ptr<grpc::ChannelCredentials> credentials_;

  mutable std::mutex mu_;
  std::shared_ptr<Stub> stub_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Stub> stream_stub_ ABSL_GUARDED_BY(mu_);  // null: made at the next call
  std::optional<rpc::LivenessTimings> liveness_ ABSL_GUARDED_BY(mu_);  // none: fixed args
  int generation_ ABSL_GUARDED_BY(mu_) = 0;
};

// grpc::Status -> absl::Status with the same code and message.
absl::Status FromGrpc(const grpc::Status& status);

}  // namespace rackrun::worker

#endif  // RACKRUN_WORKER_CONNECTION_H_
