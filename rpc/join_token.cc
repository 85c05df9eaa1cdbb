#include "rpc/join_token.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace rackrun::rpc {
namespace {

constexpr char kFix[] = "copy the whole of the coordinator's STATE_DIR/join-token-ROLE again";

std::string OpenSslError() {
  const unsigned long e = ERR_get_error();
  if (e == 0) return "unknown TLS error";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  ERR_clear_error();
  return buf;
}

std::string DerSha256(X509* cert) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (X509_digest(cert, EVP_sha256(), md, &n) != 1) return "";
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(md), n));
}

std::string ToPem(X509* cert) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new(BIO_s_mem()), BIO_free);
  if (bio == nullptr || PEM_write_bio_X509(bio.get(), cert) != 1) return "";
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

// The socket under the CA fetch's TLS connection: OpenSSL's own socket BIO writes with
// write(2), and a write to a peer that has closed the connection (anything but a
// coordinator, accepting and closing) raised SIGPIPE and killed the worker or the CLI
// with no message. This one sends with MSG_NOSIGNAL and keeps the errno of a failure for
// the message.
struct SocketState {
  int fd = -1;
  int error = 0;     // errno of the last failed send or receive
  bool eof = false;  // the peer closed the connection
};

int SocketWrite(BIO* bio, const char* data, int size) {
  auto* state = static_cast<SocketState*>(BIO_get_data(bio));
  BIO_clear_retry_flags(bio);
  ssize_t n = 0;
  do {
    n = ::send(state->fd, data, static_cast<size_t>(size), MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) state->error = errno;
  return n < 0 ? -1 : static_cast<int>(n);
}

int SocketRead(BIO* bio, char* data, int size) {
  auto* state = static_cast<SocketState*>(BIO_get_data(bio));
  BIO_clear_retry_flags(bio);
  ssize_t n = 0;
  do {
    n = ::recv(state->fd, data, static_cast<size_t>(size), 0);
  } while (n < 0 && errno == EINTR);
  if (n < 0) state->error = errno;
  if (n == 0) state->eof = true;
  return n < 0 ? -1 : static_cast<int>(n);
}

long SocketControl(BIO* /*bio*/, int command, long /*number*/, void* /*pointer*/) {
  return command == BIO_CTRL_FLUSH ? 1 : 0;  // nothing is buffered here
}

BIO_METHOD* SocketMethod() {
  static BIO_METHOD* method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "rackrun socket");
    if (m != nullptr) {
      BIO_meth_set_write(m, SocketWrite);
      BIO_meth_set_read(m, SocketRead);
      BIO_meth_set_ctrl(m, SocketControl);
    }
    return m;
  }();
  return method;
}

// A connected TCP socket to host:port within `timeout`, or Unavailable.
absl::StatusOr<int> Connect(const std::string& host, const std::string& port,
                            std::chrono::milliseconds timeout, const std::string& address) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve '", host, "' of ", address, ": ", gai_strerror(rc)));
  }
  std::string error = "no address";
  int fd = -1;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    timeval tv{};
    tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
    tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));  // bounds connect() too
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    error = std::strerror(errno);
    close(fd);
    fd = -1;
  }
  freeaddrinfo(found);
  if (fd < 0)
    return absl::UnavailableError(absl::StrCat("cannot connect to ", address, ": ", error));
  return fd;
}

}  // namespace

std::string FormatJoinToken(const std::string& ca_sha256, const std::string& secret) {
  return absl::StrCat(kJoinTokenPrefix, ca_sha256, "::", secret);
}

absl::StatusOr<std::optional<JoinToken>> ParseJoinToken(absl::string_view text,
                                                        const std::string& source) {
  const size_t sep = text.find("::");
  const bool prefixed = absl::StartsWith(text, kJoinTokenPrefix);
  if (!prefixed && sep == absl::string_view::npos) return std::nullopt;
  if (!prefixed) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": this looks like a join token ('::' inside) but does not start with '",
        kJoinTokenPrefix, "'; a rackrun join token is ", kJoinTokenPrefix,
        "<CA SHA-256>::<secret>: ", kFix));
  }
  if (sep == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": the join token has no '::' between the CA hash and the secret: ", kFix));
  }
  const absl::string_view hash =
      text.substr(kJoinTokenPrefix.size(), sep - kJoinTokenPrefix.size());
  const absl::string_view secret = text.substr(sep + 2);
  bool hex = hash.size() == 64;
  for (char c : hash) hex = hex && absl::ascii_isxdigit(static_cast<unsigned char>(c));
  if (!hex) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": the join token's CA hash must be 64 hex digits between '",
                     kJoinTokenPrefix, "' and '::' (it has ", hash.size(), " characters",
                     hex ? "" : ", not all hex digits", "): ", kFix));
  }
  if (secret.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": the join token has no secret after '::': ", kFix));
  }
  for (char c : secret) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c)) || c == ':') {
      return absl::InvalidArgumentError(
          absl::StrCat(source,
                       ": the join token's secret contains whitespace or ':' (two tokens pasted "
                       "together?): ",
                       kFix));
    }
  }
  return JoinToken{absl::AsciiStrToLower(std::string(hash)), std::string(secret)};
}

absl::StatusOr<std::string> CertificateSha256(const std::string& pem) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), BIO_free);
  std::unique_ptr<X509, decltype(&X509_free)> cert(
      bio != nullptr ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr,
      X509_free);
  if (cert == nullptr) {
    ERR_clear_error();
    return absl::InvalidArgumentError("no PEM certificate (-----BEGIN CERTIFICATE-----)");
  }
  return DerSha256(cert.get());
}

absl::StatusOr<std::string> FetchPinnedCa(const std::string& address, const std::string& ca_sha256,
                                          std::chrono::milliseconds timeout) {
  const size_t colon = address.rfind(':');
  int port_number = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port_number) || port_number < 1 ||
      port_number > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", address, "' is not HOST:PORT; a join token needs the coordinator's HOST:PORT"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  absl::StatusOr<int> fd = Connect(host, address.substr(colon + 1), timeout, address);
  if (!fd.ok()) return fd.status();

  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()),
                                                        SSL_CTX_free);
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(ctx != nullptr ? SSL_new(ctx.get()) : nullptr,
                                                SSL_free);
  if (ssl == nullptr) {
    close(*fd);
    return absl::InternalError(absl::StrCat("TLS set-up: ", OpenSslError()));
  }
  // Trust nothing here: the pin below decides. ALPN h2 as gRPC servers expect.
  SSL_set_verify(ssl.get(), SSL_VERIFY_NONE, nullptr);
  static const unsigned char kAlpn[] = {2, 'h', '2'};
  SSL_set_alpn_protos(ssl.get(), kAlpn, sizeof(kAlpn));
  in6_addr ip;
  if (inet_pton(AF_INET, host.c_str(), &ip) != 1 && inet_pton(AF_INET6, host.c_str(), &ip) != 1) {
    SSL_ctrl(ssl.get(), SSL_CTRL_SET_TLSEXT_HOSTNAME, TLSEXT_NAMETYPE_host_name,
             const_cast<char*>(host.c_str()));
  }
  SocketState socket_state{*fd};
  BIO* bio = SocketMethod() != nullptr ? BIO_new(SocketMethod()) : nullptr;
  if (bio == nullptr) {
    close(*fd);
    return absl::InternalError(absl::StrCat("TLS set-up: ", OpenSslError()));
  }
  BIO_set_data(bio, &socket_state);
  BIO_set_init(bio, 1);
  SSL_set_bio(ssl.get(), bio, bio);  // owned by ssl from here
  const int rc = SSL_connect(ssl.get());
  std::string matched;
  bool handshake = rc == 1;
  std::string error;
  if (handshake) {
    STACK_OF(X509)* chain = SSL_get_peer_cert_chain(ssl.get());
    for (int i = 0; chain != nullptr && i < sk_X509_num(chain); ++i) {
      X509* cert = sk_X509_value(chain, i);
      if (DerSha256(cert) == ca_sha256) {
        matched = ToPem(cert);
        break;
      }
    }
    SSL_shutdown(ssl.get());
  } else {
    error = OpenSslError();
  }
  ssl.reset();
  close(*fd);
  if (!handshake) {
    // What happened on the wire says more than OpenSSL's queue, which is often empty.
    std::string what;
    if (socket_state.eof || socket_state.error == ECONNRESET || socket_state.error == EPIPE) {
      what = absl::StrCat(address, " closed the connection during the TLS handshake");
    } else if (socket_state.error == EAGAIN || socket_state.error == EWOULDBLOCK) {
      what = absl::StrCat(address, " did not answer the TLS handshake within ", timeout.count(),
                          " ms");
    } else if (socket_state.error != 0) {
      what = absl::StrCat("no TLS handshake with ", address, " (",
                          std::strerror(socket_state.error), ")");
    } else {
      what = absl::StrCat("no TLS handshake with ", address, " (", error, ")");
    }
    return absl::UnavailableError(absl::StrCat(
        what,
        "; expected a rackrun coordinator's TLS port there (its --listen address). A join "
        "token needs a coordinator serving TLS (--tls on, or a non-loopback --listen); for a "
        "plaintext one use the bare token file STATE_DIR/token-ROLE"));
  }
  if (matched.empty()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "no certificate presented by ", address, " has the join token's CA hash ",
        ca_sha256.substr(0, 16),
        "...: the join token belongs to another coordinator (or one that renewed its CA), "
        "or something in between answers instead; get a fresh one from its "
        "STATE_DIR/join-token-ROLE"));
  }
  return matched;
}

}  // namespace rackrun::rpc
