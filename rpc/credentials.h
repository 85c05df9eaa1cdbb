// How a client proves itself to the rack coordinator and checks the coordinator: the
// cluster token (sent as `authorization: Bearer <token>` on every call) and the channel
// credentials (plaintext, or TLS with the coordinator's CA and an optional client
// certificate). The one token and TLS path of every client: the worker daemon, the
// rackrun CLI and the daemons benchmark.
#ifndef RACKRUN_RPC_CREDENTIALS_H_
#define RACKRUN_RPC_CREDENTIALS_H_

#include <grpcpp/security/credentials.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace rackrun::rpc {

// The cluster token and where it came from (for messages): `token_file` when given, else
// RACKRUN_TOKEN, else the file named by RACKRUN_TOKEN_FILE, else ~/.rackrun/token (the
// coordinator's default state folder, so one machine needs no setting). Surrounding
// whitespace is dropped. FailedPrecondition naming the file and what to do when it cannot
// be read or is empty. A join token (rpc/join_token.h: rr1-<CA hash>::<secret>) is split:
// `token` is then its secret and `ca_sha256` its CA pin; a malformed one is
// InvalidArgument naming the source.
struct ClusterToken {
  std::string token;
  std::string source;     // "RACKRUN_TOKEN" or the file's path
  std::string ca_sha256;  // from a join token; empty for a bare token
};
absl::StatusOr<ClusterToken> LoadClusterToken(const std::string& token_file = "");

// Channel credentials: plaintext without files (and without ca_pem); TLS trusting `ca` (server
// roots, PEM) and/or presenting the client certificate `cert` with its key `key`. InvalidArgument
// naming the flag (--tls-ca, --tls-cert, --tls-key) for an unreadable file, a CA file with
// no certificate, or a certificate without its key (or a key without its certificate).
struct TlsFiles {
  std::string ca, cert, key;
};
// `ca_pem`, when given, is the trusted CA itself (e.g. the one a join token pinned,
// rpc/join_token.h) and takes the place of the file tls.ca.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> CoordinatorCredentials(
    const TlsFiles& tls, const std::string& ca_pem = "");

}  // namespace rackrun::rpc

#endif  // RACKRUN_RPC_CREDENTIALS_H_
