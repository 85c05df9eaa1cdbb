#include "worker/connection.h"

#include <cstdlib>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "base/file.h"

namespace rackrun::worker {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path) {
  absl::StatusOr<std::string> text = base::ReadWholeFile(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", text.status().message()));
  }
  return text;
}

}  // namespace

absl::Status FromGrpc(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<std::unique_ptr<Connection>> Connection::Create(const ConnectionOptions& options) {
  std::unique_ptr<Connection> c(new Connection());
  c->address_ = options.coordinator;
  c->call_timeout_ = options.call_timeout;
  std::string token_file = options.token_file;
  if (token_file.empty()) {
    if (const char* token = std::getenv("RACKRUN_TOKEN"); token != nullptr && *token != '\0') {
      c->token_ = token;
      c->token_source_ = "RACKRUN_TOKEN";
    } else if (const char* file = std::getenv("RACKRUN_TOKEN_FILE");
               file != nullptr && *file != '\0') {
      token_file = file;
    } else {
      const char* home = std::getenv("HOME");
      token_file = absl::StrCat(home != nullptr ? home : "", "/.rackrun/token");
    }
  }
  if (c->token_.empty()) {
    absl::StatusOr<std::string> token = base::ReadWholeFile(token_file);
    if (!token.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot read the cluster token (", token.status().message(),
          "); pass --token-file with the coordinator's state-dir token file, or set "
          "RACKRUN_TOKEN"));
    }
    c->token_ = std::string(absl::StripAsciiWhitespace(*token));
    c->token_source_ = token_file;
    if (c->token_.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("the token file '", token_file, "' is empty"));
    }
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (!options.tls_ca.empty() || !options.tls_cert.empty()) {
    grpc::SslCredentialsOptions ssl;
    if (!options.tls_ca.empty()) {
      absl::StatusOr<std::string> ca = ReadPem("--tls-ca", options.tls_ca);
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *ca;
    }
    if (!options.tls_cert.empty()) {
      absl::StatusOr<std::string> cert = ReadPem("--tls-cert", options.tls_cert);
      if (!cert.ok()) return cert.status();
      absl::StatusOr<std::string> key = ReadPem("--tls-key", options.tls_key);
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = *cert;
      ssl.pem_private_key = *key;
    }
    credentials = grpc::SslCredentials(ssl);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  grpc::ChannelArguments args;
  // Keepalive: a dead coordinator (or a cut network) ends the assignment stream within
  // seconds instead of at the next TCP timeout.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Reconnect quickly after a coordinator restart.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  c->channel_ = grpc::CreateCustomChannel(c->address_, credentials, args);
  c->stub_ = rackrun::v1::RackControl::NewStub(c->channel_);
  return c;
}

std::unique_ptr<grpc::ClientContext> Connection::NewContext(
    std::chrono::milliseconds timeout) const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->AddMetadata("authorization", "Bearer " + token_);
  if (timeout.count() > 0) context->set_deadline(std::chrono::system_clock::now() + timeout);
  return context;
}

}  // namespace rackrun::worker
