#include "rpc/credentials.h"

#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "rpc/join_token.h"
#include "rpc/tls_material.h"

namespace rackrun::rpc {
namespace {

// Splits a join token into its secret and CA pin; a bare token passes unchanged.
absl::StatusOr<ClusterToken> SplitJoinToken(ClusterToken t) {
  absl::StatusOr<std::optional<JoinToken>> join = ParseJoinToken(t.token, t.source);
  if (!join.ok()) return join.status();
  if (join->has_value()) {
    t.token = (*join)->secret;
    t.ca_sha256 = (*join)->ca_sha256;
  }
  return t;
}

}  // namespace

absl::StatusOr<ClusterToken> LoadClusterToken(const std::string& token_file) {
  ClusterToken t;
  std::string path = token_file;
  if (path.empty()) {
    if (const char* env = std::getenv("RACKRUN_TOKEN"); env != nullptr && *env != '\0') {
      t.token = std::string(absl::StripAsciiWhitespace(env));
      t.source = "RACKRUN_TOKEN";
      return SplitJoinToken(std::move(t));
    }
    if (const char* env = std::getenv("RACKRUN_TOKEN_FILE"); env != nullptr && *env != '\0') {
      path = env;
    } else {
      const char* home = std::getenv("HOME");
      path = absl::StrCat(home != nullptr ? home : ".", "/.rackrun/token");
    }
  }
  t.source = path;
  // The coordinator's rule for its own token files (rpc/tls_material.h): a regular file,
  // small, not empty, readable by its owner only.
  absl::StatusOr<std::string> text = ReadTokenFile(path);
  if (!text.ok() && text.status().code() == absl::StatusCode::kNotFound) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no cluster token: ", text.status().message(),
        "; start rackrun-coordinator (it writes STATE_DIR/token-ROLE, and join-token-ROLE when it "
        "serves TLS), or point RACKRUN_TOKEN_FILE "
        "(a worker: --token-file) at its token file, or set RACKRUN_TOKEN"));
  }
  if (!text.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no cluster token: ", text.status().message(),
        text.status().code() == absl::StatusCode::kInvalidArgument
            ? "; use the token file of the coordinator's --state-dir or set RACKRUN_TOKEN"
            : ""));
  }
  t.token = *std::move(text);
  return SplitJoinToken(std::move(t));
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> CoordinatorCredentials(
    const TlsFiles& tls, const std::string& ca_pem) {
  if (!tls.key.empty() && tls.cert.empty()) {
    return absl::InvalidArgumentError("--tls-key: needs --tls-cert (the client certificate)");
  }
  if (!tls.cert.empty() && tls.key.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert: needs --tls-key (the certificate's private key)");
  }
  if (tls.ca.empty() && ca_pem.empty() && tls.cert.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  if (!ca_pem.empty()) {
    ssl.pem_root_certs = ca_pem;
  } else if (!tls.ca.empty()) {
    absl::StatusOr<std::string> ca = ReadCertificateFile("--tls-ca", tls.ca);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
  }
  if (!tls.cert.empty()) {
    absl::StatusOr<std::string> cert = ReadCertificateFile("--tls-cert", tls.cert);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key =
        ReadKeyFileFor("--tls-key", tls.key, "--tls-cert", tls.cert, *cert);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace rackrun::rpc
