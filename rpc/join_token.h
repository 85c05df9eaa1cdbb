// Join tokens: one string that lets a worker or a user reach a coordinator that serves TLS
// with its automatic CA (coordinator/certificates.h) without copying the CA by hand, as
// kubeadm's --discovery-token-ca-cert-hash and k3s's `K10<hash>::` tokens do.
//
//   rr1-<SHA-256 of the CA certificate (DER), 64 hex digits>::<secret>
//
// The secret is the role's bearer token (STATE_DIR/token-worker, ...); the hash pins the
// CA. A client given a join token opens one TLS connection to the coordinator without
// trusting anything, takes the certificate chain the server presents, keeps the one
// certificate whose hash equals the pin (FetchPinnedCa), and from then on verifies the
// server against that CA with ordinary TLS (hostname and chain checked by gRPC). Someone
// in between can present any chain, but none of its certificates has the pinned hash.
#ifndef RACKRUN_RPC_JOIN_TOKEN_H_
#define RACKRUN_RPC_JOIN_TOKEN_H_

#include <chrono>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rackrun::rpc {

inline constexpr absl::string_view kJoinTokenPrefix = "rr1-";

struct JoinToken {
  std::string ca_sha256;  // 64 lowercase hex digits
  std::string secret;     // the bearer token
};

// "rr1-<hash>::<secret>".
std::string FormatJoinToken(const std::string& ca_sha256, const std::string& secret);

// nullopt when `text` is a plain bearer token (no "rr1-" prefix and no "::"); the parts of
// a well-formed join token; InvalidArgument naming `source` (the flag, variable or file it
// came from) and the fix for anything in between (the secret is never echoed).
absl::StatusOr<std::optional<JoinToken>> ParseJoinToken(absl::string_view text,
                                                        const std::string& source);

// The SHA-256 of the first certificate in `pem`, DER-encoded, as 64 lowercase hex digits.
// InvalidArgument when `pem` holds no certificate.
absl::StatusOr<std::string> CertificateSha256(const std::string& pem);

// Connects to `address` (HOST:PORT, [V6]:PORT), completes a TLS handshake trusting
// nothing, and returns (PEM) the certificate of the presented chain whose SHA-256 is
// `ca_sha256`. Unavailable when the address cannot be reached or the handshake fails
// (e.g. the coordinator serves plaintext); PermissionDenied when no certificate matches;
// InvalidArgument for an address that is not HOST:PORT. Each attempt is bounded by
// `timeout`.
absl::StatusOr<std::string> FetchPinnedCa(const std::string& address, const std::string& ca_sha256,
                                          std::chrono::milliseconds timeout);

}  // namespace rackrun::rpc

#endif  // RACKRUN_RPC_JOIN_TOKEN_H_
