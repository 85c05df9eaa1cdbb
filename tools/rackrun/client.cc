#include "tools/rackrun/client.h"

#include <grpc/support/log.h>

#include <cstdlib>
#include <random>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "rpc/channel.h"

namespace rackrun::cli {
namespace {

// gRPC writes its own diagnostics (connection failures, ...) to stderr; the CLI says what
// went wrong in one line instead. GRPC_VERBOSITY set by the user turns them back on.
void QuietGrpcLogs() {
  if (std::getenv("GRPC_VERBOSITY") == nullptr) gpr_set_log_function([](gpr_log_func_args*) {});
}

// HOST:PORT with a port in 1..65535 ([v6]:PORT too); gRPC target URIs (dns:, unix:,
// ipv4:, ...) pass unchecked.
bool IsValidAddress(const std::string& a) {
  if (absl::StrContains(a, ":/") || absl::StartsWith(a, "unix:")) return true;
  const size_t colon = a.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  int port = 0;
  return absl::SimpleAtoi(a.substr(colon + 1), &port) && port >= 1 && port <= 65535;
}

// A short reason from gRPC's connection error text, e.g. "connection refused".
std::string ConnectReason(const std::string& m, bool tls) {
  const auto has = [&](const char* s) { return absl::StrContains(absl::AsciiStrToLower(m), s); };
  if (has("connection refused")) return "connection refused";
  if (has("dns resolution failed") || has("name not found") || has("domain name")) {
    return "cannot resolve the host name";
  }
  if (has("ssl") || has("handshake failed") || has("certificate")) {
    return "TLS handshake failed: the coordinator and --tls-ca / --tls-cert do not match "
           "(plaintext vs TLS, or an untrusted certificate)";
  }
  if (has("socket closed") || has("connection reset") || has("end of tcp stream")) {
    return tls ? "the connection was closed"
               : "the connection was closed; if the coordinator uses TLS, use its join token "
                 "(STATE_DIR/join-token-user) or pass --tls-ca";
  }
  if (has("no route to host")) return "no route to host";
  if (has("network is unreachable")) return "network unreachable";
  if (has("timed out") || has("timeout")) return "connection timed out";
  if (has("failed to connect") || has("handshaker shutdown")) return "cannot connect";
  std::string one_line = m;
  for (char& c : one_line) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return one_line.size() > 160 ? one_line.substr(0, 160) + "..." : one_line;
}

std::string CodeName(grpc::StatusCode code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

}  // namespace

void ConnectionFlags::Declare(flags::FlagSet& flag_set) {
  flag_set.Section(
      "connection (every job command)",
      "  The token comes from $RACKRUN_TOKEN, else the file $RACKRUN_TOKEN_FILE, else\n"
      "  ~/.rackrun/token (written by rackrun-coordinator with its default --state-dir). A join\n"
      "  token (STATE_DIR/join-token-user, rr1-<CA hash>::<secret>) also brings TLS: the CA is\n"
      "  fetched from the coordinator and checked against the hash; no --tls-ca needed.\n"
      "  Roles: token-user submits and cancels; token-readonly only looks.\n");
  flag_set.String("--coordinator", &coordinator, "HOST:PORT", "the rack coordinator")
      .Default(absl::StrCat("$RACKRUN_COORDINATOR, else ", kDefaultCoordinator));
  flag_set.String("--tls-ca", &tls_ca, "FILE",
                  "use TLS, trusting the server certificates signed by FILE (PEM)");
  flag_set.String("--tls-cert", &tls_cert, "FILE",
                  "use TLS with this client certificate (coordinator --tls-client-ca); needs "
                  "--tls-key");
  flag_set.String("--tls-key", &tls_key, "FILE", "its private key");
  flag_set.String("--tls-server-name", &tls_server_name, "NAME",
                  "the name to check the server certificate against");
}

bool IsRetryable(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE ||
         status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

absl::StatusOr<std::unique_ptr<CoordinatorClient>> CoordinatorClient::Create(
    const ConnectionFlags& flags) {
  QuietGrpcLogs();
  std::unique_ptr<CoordinatorClient> c(new CoordinatorClient());
  std::string from = "--coordinator";
  c->address_ = flags.coordinator;
  if (c->address_.empty()) {
    const char* env = std::getenv("RACKRUN_COORDINATOR");
    if (env != nullptr && *env != '\0') {
      c->address_ = env;
      from = "RACKRUN_COORDINATOR";
    } else {
      c->address_ = kDefaultCoordinator;
    }
  }
  if (!IsValidAddress(c->address_)) {
    return absl::InvalidArgumentError(
        absl::StrCat(from, ": '", c->address_,
                     "' is not a coordinator address; give HOST:PORT, e.g. ", kDefaultCoordinator));
  }
  c->tls_ = !flags.tls_ca.empty() || !flags.tls_cert.empty();
  rpc::CoordinatorChannelOptions options;
  if (c->tls_) options.tls_server_name = flags.tls_server_name;
  absl::StatusOr<rpc::CoordinatorClientChannel> open = rpc::OpenCoordinatorChannel(
      c->address_, /*token_file=*/"", {flags.tls_ca, flags.tls_cert, flags.tls_key}, options);
  if (!open.ok()) return open.status();
  c->token_ = open->token.token;
  c->token_source_ = open->token.source;
  c->tls_ = c->tls_ || !open->token.ca_sha256.empty();
  c->channel_ = open->channel;
  c->stub_ = rackrun::v1::JobService::NewStub(c->channel_);
  return c;
}

std::unique_ptr<grpc::ClientContext> CoordinatorClient::NewContext(bool deadline) const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->AddMetadata("authorization", "Bearer " + token_);
  if (deadline) ctx->set_deadline(std::chrono::system_clock::now() + kCallTimeout);
  return ctx;
}

grpc::Status CoordinatorClient::WithRetry(
    const std::function<grpc::Status(grpc::ClientContext*)>& call, const RetryPolicy& policy,
    const std::function<void(const grpc::Status&)>& on_retry) {
  const auto give_up = std::chrono::steady_clock::now() + policy.budget;
  std::chrono::milliseconds backoff = policy.initial_backoff;
  bool told = false;
  for (;;) {
    std::unique_ptr<grpc::ClientContext> ctx = NewContext();
    grpc::Status s = call(ctx.get());
    if (s.ok() || !IsRetryable(s)) return s;
    const auto now = std::chrono::steady_clock::now();
    if (now >= give_up) return s;
    if (!told && on_retry) on_retry(s);
    told = true;
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(backoff, give_up - now));
    backoff = std::min(backoff * 2, policy.max_backoff);
  }
}

bool CoordinatorClient::PlaintextOffLoopback() const {
  if (tls_ || absl::StartsWith(address_, "unix:")) return false;
  std::string host = address_.substr(0, address_.rfind(':'));
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  return !(absl::StartsWith(host, "127.") || host == "::1" || host == "localhost");
}

std::string CoordinatorClient::DescribeError(const grpc::Status& status) const {
  std::string line = Describe(status);
  // With gRPC's own diagnostics on (GRPC_VERBOSITY), also its message, unabridged.
  if (std::getenv("GRPC_VERBOSITY") != nullptr && !status.ok()) {
    absl::StrAppend(&line, " [grpc: ", status.error_message(), "]");
  }
  return line;
}

std::string CoordinatorClient::Describe(const grpc::Status& status) const {
  const std::string& m = status.error_message();
  const std::string code = CodeName(status.error_code());
  switch (status.error_code()) {
    case grpc::StatusCode::OK:
      return "ok";
    case grpc::StatusCode::UNAVAILABLE:
      // The coordinator's own UNAVAILABLE (replaying its state, shutting down) starts with
      // "the coordinator"; anything else comes from the connection.
      if (absl::StartsWith(m, "the coordinator")) {
        return absl::StrCat("the coordinator at ", address_, " is not serving (", m, ")");
      }
      return absl::StrCat(
          "cannot reach the coordinator at ", address_, " (", ConnectReason(m, tls_),
          "); start rackrun-coordinator or set --coordinator / RACKRUN_COORDINATOR");
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return absl::StrCat("the coordinator at ", address_, " did not answer within ",
                          kCallTimeout.count(),
                          " s; check that it runs there and that --coordinator / "
                          "RACKRUN_COORDINATOR names it");
    case grpc::StatusCode::UNAUTHENTICATED:
      return absl::StrCat("the coordinator refused the token from ", token_source_,
                          " (UNAUTHENTICATED: ", m,
                          "); use the token file of the coordinator's --state-dir "
                          "(RACKRUN_TOKEN_FILE) or set RACKRUN_TOKEN");
    case grpc::StatusCode::PERMISSION_DENIED:
      return absl::StrCat("the coordinator at ", address_, " denied the call with the token from ",
                          token_source_, " (", m,
                          "); use a token of that role (STATE_DIR/token-ROLE or join-token-ROLE) "
                          "in RACKRUN_TOKEN_FILE, or check the client certificate");
    case grpc::StatusCode::INVALID_ARGUMENT:
      return absl::StrCat("the coordinator rejected the request: ", m);
    case grpc::StatusCode::NOT_FOUND:
      return absl::StrCat(m, "; 'rackrun list' shows the jobs");
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::OUT_OF_RANGE:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return m;
    case grpc::StatusCode::UNIMPLEMENTED:
      return absl::StrCat("the server at ", address_, " does not serve rackrun.v1.JobService (", m,
                          "); is --coordinator the address of a rackrun-coordinator?");
    case grpc::StatusCode::CANCELLED:
      return absl::StrCat("the call to the coordinator at ", address_, " was cancelled (", m, ")");
    default:
      return absl::StrCat("the coordinator at ", address_, " failed the call (", code, ": ", m,
                          "); see its log");
  }
}

std::string NewRequestId() {
  std::random_device rd;
  uint8_t b[16];
  for (int i = 0; i < 16; i += 4) {
    const uint32_t r = rd();
    std::memcpy(b + i, &r, 4);
  }
  b[6] = static_cast<uint8_t>((b[6] & 0x0F) | 0x40);  // version 4
  b[8] = static_cast<uint8_t>((b[8] & 0x3F) | 0x80);  // RFC 4122 variant
  return absl::StrFormat("%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                         b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                         b[12], b[13], b[14], b[15]);
}

}  // namespace rackrun::cli
