// How a worker daemon reaches its rack coordinator's RackControl service: the channel
// (rpc/channel.h: TLS or plaintext, keepalive on), the cluster token (rpc/credentials.h)
// sent as `authorization: Bearer <token>` on every call, and a deadline on every unary
// call. The worker's own: the CLI talks to JobService through tools/rackrun/client.h, and
// the daemons benchmark borrows this one only to drive the worker's CoordinatorPlanSource.
// Thread-safe after Create.
#ifndef RACKRUN_WORKER_CONNECTION_H_
#define RACKRUN_WORKER_CONNECTION_H_

#include <chrono>
#include <memory>
#include <string>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>

#include "absl/status/statusor.h"
#include "rackrun/v1/rack_control.grpc.pb.h"

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
  // InvalidArgument naming the flag or file when the token or a TLS file cannot be read.
  static absl::StatusOr<std::unique_ptr<Connection>> Create(const ConnectionOptions& options);

  // A context with the token and, when `timeout` is positive, a deadline that far ahead.
  std::unique_ptr<grpc::ClientContext> NewContext(std::chrono::milliseconds timeout) const;
  std::unique_ptr<grpc::ClientContext> NewContext() const { return NewContext(call_timeout_); }

  rackrun::v1::RackControl::Stub& stub() { return *stub_; }
  const std::string& address() const { return address_; }
  const std::string& token_source() const { return token_source_; }

 private:
  Connection() = default;

  std::string address_;
  std::string token_;
  std::string token_source_;
  std::chrono::milliseconds call_timeout_{10000};
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<rackrun::v1::RackControl::Stub> stub_;
};

// grpc::Status -> absl::Status with the same code and message.
absl::Status FromGrpc(const grpc::Status& status);

}  // namespace rackrun::worker

#endif  // RACKRUN_WORKER_CONNECTION_H_
