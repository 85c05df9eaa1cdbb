// Authentication of the coordinator's callers: the cluster token (every RPC of JobService
// and RackControl carries `authorization: Bearer <token>`) and the server's TLS
// credentials.
#ifndef RACKRUN_COORDINATOR_AUTH_H_
#define RACKRUN_COORDINATOR_AUTH_H_

#include <memory>
#include <string>
#include <string_view>

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include "absl/status/statusor.h"

namespace rackrun::coordinator {

// Reads the token from `path` (surrounding whitespace ignored). When the file does not
// exist and `create` is set, writes 32 random bytes as 64 hex digits there first, with
// mode 0600, atomically (written to a temporary file, then linked into place, so two
// coordinators starting at once agree on one token and nobody reads half a token).
// InvalidArgument for an empty token file, FailedPrecondition for a token file readable
// by group or others.
absl::StatusOr<std::string> LoadOrCreateToken(const std::string& path, bool create);

// Checks the `authorization` metadata of a call against the token.
class TokenAuth {
 public:
  explicit TokenAuth(std::string token) : token_(std::move(token)) {}

  // True when `header` is exactly "Bearer <token>" (compared in constant time).
  bool Matches(std::string_view header) const;

  // OK, or UNAUTHENTICATED saying what is missing, for the call's metadata.
  grpc::Status Check(const grpc::ServerContext& context) const;

 private:
  std::string token_;
};

// TLS when cert and key are given (client certificates required when client_ca is given),
// insecure otherwise. InvalidArgument naming the flag for a missing or unreadable file,
// or for a key without a cert.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const std::string& tls_cert, const std::string& tls_key, const std::string& tls_client_ca);

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_AUTH_H_
