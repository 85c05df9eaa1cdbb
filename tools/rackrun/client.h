// The job client of the `rackrun` CLI: how the user commands (submit, status, watch,
// cancel, list, workers) reach the rack coordinator's JobService.
//
// - Address: --coordinator HOST:PORT, else RACKRUN_COORDINATOR, else 127.0.0.1:7070.
// - Token (sent as metadata `authorization: Bearer <token>` on every call): RACKRUN_TOKEN,
//   else the file named by RACKRUN_TOKEN_FILE, else ~/.rackrun/token (the token file of
//   the coordinator's default --state-dir, so one machine needs no setting).
// - TLS when --tls-ca (server roots) or --tls-cert/--tls-key (client certificate) is
//   given, or the token is a join token (rpc/join_token.h: the CA it pins is fetched and
//   trusted); plaintext otherwise. --tls-server-name overrides the name checked against the
//   server's certificate.
// - Every unary call has a deadline (kCallTimeout); the channel (rpc/channel.h) sends
//   keepalive pings so a Watch stream notices a dead coordinator.
// - Every failure becomes ONE line saying what happened and what to do (DescribeError),
//   written in one place for every status code.
//
// Not thread-safe: one CoordinatorClient per command invocation.
#ifndef RACKRUN_TOOLS_RACKRUN_CLIENT_H_
#define RACKRUN_TOOLS_RACKRUN_CLIENT_H_

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/status.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "flags/flags.h"
#include "rackrun/v1/job_service.grpc.pb.h"
#include "tools/rackrun/command.h"

namespace rackrun::cli {

inline constexpr std::chrono::seconds kCallTimeout{10};
inline constexpr const char* kDefaultCoordinator = "127.0.0.1:7070";

// The connection flags every job command accepts.
struct ConnectionFlags {
  std::string coordinator;  // empty: RACKRUN_COORDINATOR, then kDefaultCoordinator
  std::string tls_ca, tls_cert, tls_key, tls_server_name;

  // Declares them on `flag_set`, as its section "connection (every job command)".
  void Declare(flags::FlagSet& flag_set);
};

// How long Submit and Watch keep retrying a coordinator that is UNAVAILABLE (restarting,
// replaying its state) or does not answer in time, with exponential backoff.
struct RetryPolicy {
  std::chrono::milliseconds budget{30000};
  std::chrono::milliseconds initial_backoff{200};
  std::chrono::milliseconds max_backoff{3000};
};

// True for the codes after which the same call may succeed later (the coordinator is
// down, restarting or slow): UNAVAILABLE and DEADLINE_EXCEEDED.
bool IsRetryable(const grpc::Status& status);

class CoordinatorClient {
 public:
  // Resolves the address and the token and builds the channel (no network traffic yet).
  // On failure the status message is the one line to print (a bad address, a missing or
  // empty token file, an unreadable TLS file).
  static absl::StatusOr<std::unique_ptr<CoordinatorClient>> Create(const ConnectionFlags& flags);

  const std::string& address() const { return address_; }
  // True when calls go in clear text to an address that is not loopback (the coordinator
  // runs with --insecure): `rackrun workers` warns.
  bool PlaintextOffLoopback() const;

  // A context carrying the token and, when `deadline` is set, a deadline kCallTimeout
  // from now (streams that follow a job pass false and rely on keepalive).
  std::unique_ptr<grpc::ClientContext> NewContext(bool deadline = true) const;

  rackrun::v1::JobService::Stub& stub() { return *stub_; }

  // Runs `call` (a unary call with a fresh context each time) until it succeeds, fails
  // with a non-retryable code or `policy.budget` has passed; the last status is returned.
  // Before the first retry, `on_retry` (when set) is told the status that caused it.
  grpc::Status WithRetry(const std::function<grpc::Status(grpc::ClientContext*)>& call,
                         const RetryPolicy& policy,
                         const std::function<void(const grpc::Status&)>& on_retry = {});

  // The one line (without "rackrun: " and newline) that says what `status` means for a
  // call to this coordinator and what to do about it.
  std::string DescribeError(const grpc::Status& status) const;

 private:
  CoordinatorClient() = default;
  std::string Describe(const grpc::Status& status) const;

  std::string address_;
  std::string token_;
  std::string token_source_;  // "RACKRUN_TOKEN" or the token file's path
  bool tls_ = false;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<rackrun::v1::JobService::Stub> stub_;
};

// A fresh random request id for Submit (UUID version 4 text form).
std::string NewRequestId();

}  // namespace rackrun::cli

#endif  // RACKRUN_TOOLS_RACKRUN_CLIENT_H_
