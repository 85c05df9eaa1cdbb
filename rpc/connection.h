// How a worker daemon reaches its rack coordinator: the gRPC channel (TLS or plaintext,
// keepalive on), the cluster token sent as `authorization: Bearer <token>` on every call,
// and a deadline on every unary call. LoadClusterToken and CoordinatorCredentials are the
// one token and TLS path of every client of the coordinator (the worker and the rackrun
// CLI; CMake target rackrun_connection). Thread-safe after Create.
#ifndef RACKRUN_RPC_CONNECTION_H_
#define RACKRUN_RPC_CONNECTION_H_

#include <chrono>
#include <memory>
#include <string>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/security/credentials.h>

#include "absl/status/statusor.h"
#include "rackrun/v1/rack_control.grpc.pb.h"

namespace rackrun::worker {

// The cluster token and where it came from (for messages): `token_file` when given, else
// RACKRUN_TOKEN, else the file named by RACKRUN_TOKEN_FILE, else ~/.rackrun/token (the
// coordinator's default state folder, so one machine needs no setting). Surrounding
// whitespace is dropped. FailedPrecondition naming the file and what to do when it cannot
// be read or is empty.
struct ClusterToken {
  std::string token;
  std::string source;  // "RACKRUN_TOKEN" or the file's path
};
absl::StatusOr<ClusterToken> LoadClusterToken(const std::string& token_file = "");

// Channel credentials: plaintext without files; TLS trusting `ca` (server roots, PEM)
// and/or presenting the client certificate `cert` with its key `key`. InvalidArgument
// naming the flag (--tls-ca, --tls-cert, --tls-key) for an unreadable file, a CA file with
// no certificate, or a certificate without its key (or a key without its certificate).
struct TlsFiles {
  std::string ca, cert, key;
};
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> CoordinatorCredentials(
    const TlsFiles& tls);

struct ConnectionOptions {
  std::string coordinator;  // HOST:PORT
  std::string token_file;   // empty: see above
  std::string tls_ca, tls_cert, tls_key;
  std::chrono::milliseconds call_timeout{10000};
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

#endif  // RACKRUN_RPC_CONNECTION_H_
