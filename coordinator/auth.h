// Authentication and authorization of the coordinator's callers: bearer tokens (every RPC
// of JobService and RackControl carries `authorization: Bearer <token>`), the role each
// token grants, and the server's TLS credentials.
//
// Roles, one token file each in the state folder (created at first start, mode 0600):
//   token-readonly  kReadOnly: JobService Get, List, Watch, ListWorkers
//   token-user      kUser:     those, and JobService Submit and Cancel
//   token-worker    kWorker:   those reads, and every RackControl call
//   token           kAdmin:    everything (the single token of earlier versions, kept as
//                              the user+worker token so existing set-ups keep working)
// A call with no or an unknown token is UNAUTHENTICATED; one whose token's role may not
// make it is PERMISSION_DENIED naming the role it needs. Either way nothing changes.
#ifndef RACKRUN_COORDINATOR_AUTH_H_
#define RACKRUN_COORDINATOR_AUTH_H_

#include <grpcpp/security/auth_metadata_processor.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace rackrun::coordinator {

// Reads the token from `path` (surrounding whitespace ignored). When the file does not
// exist and `create` is set, writes 32 random bytes as 64 hex digits there first, with
// mode 0600, atomically (written to a temporary file, then linked into place, so two
// coordinators starting at once agree on one token and nobody reads half a token).
// The file is read as rpc::ReadTokenFile reads every token file: InvalidArgument for an
// empty, oversized or non-regular one (naming what it is: a directory, a FIFO),
// FailedPrecondition for one open to group or others (with the chmod command).
absl::StatusOr<std::string> LoadOrCreateToken(const std::string& path, bool create);

enum class Role { kReadOnly, kUser, kWorker, kAdmin };
// "read-only", "user", "worker", "admin".
const char* RoleName(Role role);

// What a call needs: reading job and worker state, changing jobs (Submit, Cancel), or
// taking part in the rack as a worker (RackControl).
enum class Access { kRead, kJobs, kRack };
bool RoleMay(Role role, Access access);

// The token of each role; an empty one grants nothing.
struct RoleTokens {
  std::string admin, user, worker, readonly;
};

// The role tokens of a state folder: `admin_file` (the --token-file, or STATE_DIR/token)
// and STATE_DIR/token-user, token-worker, token-readonly, each loaded or created as by
// LoadOrCreateToken (the admin one created only when `create_admin`). Errors name the file.
absl::StatusOr<RoleTokens> LoadOrCreateRoleTokens(const std::string& state_dir,
                                                  const std::string& admin_file, bool create_admin);

// Checks the `authorization` metadata of a call against the role tokens.
class TokenAuth {
 public:
  explicit TokenAuth(RoleTokens tokens) : tokens_(std::move(tokens)) {}
  // One token with every right (the admin token alone).
  explicit TokenAuth(std::string admin_token) { tokens_.admin = std::move(admin_token); }

  // True when `header` is exactly "Bearer <token>" (compared in constant time).
  static bool Matches(std::string_view header, const std::string& token);
  // The role whose token `header` carries, if any (every token compared).
  std::optional<Role> RoleOf(std::string_view header) const;

  // OK when the call carries a token whose role grants `access`; UNAUTHENTICATED saying
  // what is missing, or PERMISSION_DENIED naming `method` and the role it needs.
  grpc::Status Check(const grpc::ServerContext& context, Access access,
                     std::string_view method) const;

 private:
  RoleTokens tokens_;
};

// Refuses a call at its headers, before gRPC waits for its request message, when it
// carries no token or one of no role (UNAUTHENTICATED, the words of TokenAuth::Check).
// Without it a peer with no token could open calls that never send their message and hold
// them: about 12 KB of the coordinator's memory each (10,000 streams took it from 22 to
// 146 MB; `node tools/probes/pending_streams.js`). Calls to gRPC's health and reflection
// services pass without a token; what a token's role may do is still checked per method.
// gRPC runs it on TLS credentials only (ServerCredentials::SetAuthMetadataProcessor); on
// plaintext, which the coordinator serves on loopback alone unless --insecure, the
// handlers' check is the only one.
class TokenGate : public grpc::AuthMetadataProcessor {
 public:
  explicit TokenGate(RoleTokens tokens) : auth_(std::move(tokens)) {}
  // Runs on gRPC's own thread: a few comparisons, nothing that blocks.
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed, OutputMetadata* response) override;
  // The methods every caller may make without a token (`path` is "/service/method").
  static bool Open(std::string_view path);

 private:
  const TokenAuth auth_;
};

// TLS when cert and key are given (client certificates required when client_ca is given),
// insecure otherwise. Every file is checked first (rpc/tls_material.h): InvalidArgument
// naming the flag and the file for one that is missing, not a regular file, empty or not
// parsed by OpenSSL, a key that is not the certificate's, or a key without a cert.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const std::string& tls_cert, const std::string& tls_key, const std::string& tls_client_ca);

// TLS presenting `chain_pem` (server certificate first) with `key_pem`: the automatic
// certificates (certificates.h). Client certificates as above when client_ca is given.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentialsFromPem(
    const std::string& chain_pem, const std::string& key_pem, const std::string& tls_client_ca);

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_AUTH_H_
