#include "coordinator/auth.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <grpcpp/security/server_credentials.h>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace rackrun::coordinator {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": cannot read '", path, "': ", std::strerror(errno)));
  }
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

absl::Status WriteNewToken(const std::string& path) {
  unsigned char bytes[32];
  {
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return absl::InternalError(absl::StrCat("/dev/urandom: ", std::strerror(errno)));
    size_t got = 0;
    while (got < sizeof(bytes)) {
      const ssize_t n = read(fd, bytes + got, sizeof(bytes) - got);
      if (n <= 0) {
        close(fd);
        return absl::InternalError("/dev/urandom: short read");
      }
      got += static_cast<size_t>(n);
    }
    close(fd);
  }
  const std::string token =
      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes))) + "\n";
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot create '", tmp, "': ", std::strerror(errno)));
  fchmod(fd, 0600);  // whatever the umask
  bool ok = write(fd, token.data(), token.size()) == static_cast<ssize_t>(token.size()) && fsync(fd) == 0;
  close(fd);
  if (!ok) {
    unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat("cannot write '", tmp, "'"));
  }
  // link() fails with EEXIST when another process made the token first: use theirs.
  const int rc = link(tmp.c_str(), path.c_str());
  const int err = errno;
  unlink(tmp.c_str());
  if (rc != 0 && err != EEXIST) {
    return absl::InternalError(absl::StrCat("cannot create '", path, "': ", std::strerror(err)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> LoadOrCreateToken(const std::string& path, bool create) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    if (errno != ENOENT || !create) {
      return absl::InvalidArgumentError(absl::StrCat("token file '", path, "': ", std::strerror(errno)));
    }
    if (absl::Status s = WriteNewToken(path); !s.ok()) return s;
    if (stat(path.c_str(), &st) != 0) return absl::InternalError(absl::StrCat("token file '", path, "' vanished"));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("token file '", path,
                                                      "' is readable by others; chmod 600 it"));
  }
  absl::StatusOr<std::string> text = ReadFile(path, "token file");
  if (!text.ok()) return text.status();
  std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("token file '", path, "' is empty"));
  return token;
}

bool TokenAuth::Matches(std::string_view header) const {
  const std::string expected = "Bearer " + token_;
  // Constant time in the content: every byte of the expected value is compared.
  unsigned char diff = header.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char h = i < header.size() ? static_cast<unsigned char>(header[i]) : 0;
    diff |= static_cast<unsigned char>(h ^ static_cast<unsigned char>(expected[i]));
  }
  return diff == 0;
}

grpc::Status TokenAuth::Check(const grpc::ServerContext& context) const {
  const auto& md = context.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing the cluster token: send metadata 'authorization: Bearer <token>' "
                        "(the token is in the coordinator's state folder, file 'token')");
  }
  if (!Matches(std::string_view(it->second.data(), it->second.size()))) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "wrong cluster token");
  }
  return grpc::Status::OK;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const std::string& tls_cert, const std::string& tls_key, const std::string& tls_client_ca) {
  if (tls_cert.empty() && tls_key.empty()) {
    if (!tls_client_ca.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca: needs --tls-cert and --tls-key");
    }
    return grpc::InsecureServerCredentials();
  }
  if (tls_cert.empty() || tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key: give both or neither");
  }
  absl::StatusOr<std::string> cert = ReadFile(tls_cert, "--tls-cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadFile(tls_key, "--tls-key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions opts;
  opts.pem_key_cert_pairs.push_back({*key, *cert});
  if (!tls_client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadFile(tls_client_ca, "--tls-client-ca");
    if (!ca.ok()) return ca.status();
    opts.pem_root_certs = *ca;
    opts.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(opts);
}

}  // namespace rackrun::coordinator
