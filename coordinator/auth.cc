#include "coordinator/auth.h"

#include <fcntl.h>
#include <grpcpp/security/server_credentials.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "rpc/tls_material.h"

namespace rackrun::coordinator {
namespace {

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
  const std::string token = absl::BytesToHexString(absl::string_view(
                                reinterpret_cast<const char*>(bytes), sizeof(bytes))) +
                            "\n";
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    return absl::InternalError(absl::StrCat("cannot create '", tmp, "': ", std::strerror(errno)));
  fchmod(fd, 0600);  // whatever the umask
  bool ok =
      write(fd, token.data(), token.size()) == static_cast<ssize_t>(token.size()) && fsync(fd) == 0;
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
      return absl::InvalidArgumentError(
          absl::StrCat("token file '", path, "': ", std::strerror(errno)));
    }
    if (absl::Status s = WriteNewToken(path); !s.ok()) return s;
    if (stat(path.c_str(), &st) != 0)
      return absl::InternalError(absl::StrCat("token file '", path, "' vanished"));
  }
  // The one rule for token files (rpc/tls_material.h), the worker's and the CLI's too.
  absl::StatusOr<std::string> token = rpc::ReadTokenFile(path);
  if (!token.ok() && token.status().code() == absl::StatusCode::kNotFound) {
    return absl::InvalidArgumentError(token.status().message());
  }
  return token;
}

const char* RoleName(Role role) {
  switch (role) {
    case Role::kReadOnly:
      return "read-only";
    case Role::kUser:
      return "user";
    case Role::kWorker:
      return "worker";
    case Role::kAdmin:
      return "admin";
  }
  return "unknown";
}

bool RoleMay(Role role, Access access) {
  switch (access) {
    case Access::kRead:
      return true;
    case Access::kJobs:
      return role == Role::kUser || role == Role::kAdmin;
    case Access::kRack:
      return role == Role::kWorker || role == Role::kAdmin;
  }
  return false;
}

absl::StatusOr<RoleTokens> LoadOrCreateRoleTokens(const std::string& state_dir,
                                                  const std::string& admin_file,
                                                  bool create_admin) {
  RoleTokens t;
  for (const auto& [path, into, create] :
       {std::tuple<std::string, std::string*, bool>{admin_file, &t.admin, create_admin},
        {state_dir + "/token-user", &t.user, true},
        {state_dir + "/token-worker", &t.worker, true},
        {state_dir + "/token-readonly", &t.readonly, true}}) {
    absl::StatusOr<std::string> token = LoadOrCreateToken(path, create);
    if (!token.ok()) return token.status();
    *into = *std::move(token);
  }
  // One token in two roles would make the narrower role meaningless.
  const std::string* all[] = {&t.admin, &t.user, &t.worker, &t.readonly};
  for (int i = 0; i < 4; ++i) {
    for (int j = i + 1; j < 4; ++j) {
      if (*all[i] == *all[j]) {
        return absl::FailedPreconditionError(absl::StrCat(
            "two token files of '", state_dir,
            "' (or --token-file) hold the same token; every "
            "role needs its own: delete the copies in token-user, token-worker, token-readonly "
            "and restart (new ones are made)"));
      }
    }
  }
  return t;
}

bool TokenAuth::Matches(std::string_view header, const std::string& token) {
  if (token.empty()) return false;
  const std::string expected = "Bearer " + token;
  // Constant time in the content: every byte of the expected value is compared.
  unsigned char diff = header.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char h = i < header.size() ? static_cast<unsigned char>(header[i]) : 0;
    diff |= static_cast<unsigned char>(h ^ static_cast<unsigned char>(expected[i]));
  }
  return diff == 0;
}

std::optional<Role> TokenAuth::RoleOf(std::string_view header) const {
  std::optional<Role> found;
  for (const auto& [role, token] :
       {std::pair<Role, const std::string*>{Role::kAdmin, &tokens_.admin},
        {Role::kUser, &tokens_.user},
        {Role::kWorker, &tokens_.worker},
        {Role::kReadOnly, &tokens_.readonly}}) {
    if (Matches(header, *token) && !found) found = role;
  }
  return found;
}

namespace {

grpc::Status MissingToken() {
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "missing the cluster token: send metadata 'authorization: Bearer <token>' "
                      "(the tokens are in the coordinator's state folder: token-user, "
                      "token-worker, token-readonly, or the admin token 'token')");
}

grpc::Status WrongToken() {
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "wrong cluster token");
}

}  // namespace

grpc::Status TokenAuth::Check(const grpc::ServerContext& context, Access access,
                              std::string_view method) const {
  const auto& md = context.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return MissingToken();
  const std::optional<Role> role = RoleOf(std::string_view(it->second.data(), it->second.size()));
  if (!role) return WrongToken();
  if (RoleMay(*role, access)) return grpc::Status::OK;
  const char* needed = access == Access::kJobs ? "user" : "worker";
  return grpc::Status(
      grpc::StatusCode::PERMISSION_DENIED,
      absl::StrCat(absl::string_view(method.data(), method.size()), " needs the ", needed,
                   " role (the coordinator's token-", needed,
                   " or its admin token); this token has the ", RoleName(*role), " role"));
}

bool TokenGate::Open(std::string_view path) {
  return path.starts_with("/grpc.health.v1.Health/") ||
         path.starts_with("/grpc.reflection.v1alpha.ServerReflection/") ||
         path.starts_with("/grpc.reflection.v1.ServerReflection/");
}

grpc::Status TokenGate::Process(const InputMetadata& metadata, grpc::AuthContext* /*context*/,
                                OutputMetadata* /*consumed*/, OutputMetadata* /*response*/) {
  const auto path = metadata.find(":path");
  if (path != metadata.end() && Open(std::string_view(path->second.data(), path->second.size()))) {
    return grpc::Status::OK;
  }
  // The first `authorization` value decides, as in the handler's check (TokenAuth::Check).
  const auto [first, last] = metadata.equal_range("authorization");
  if (first == last) return MissingToken();
  const std::string_view header(first->second.data(), first->second.size());
  return auth_.RoleOf(header).has_value() ? grpc::Status::OK : WrongToken();
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
  absl::StatusOr<std::string> cert = rpc::ReadCertificateFile("--tls-cert", tls_cert);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key =
      rpc::ReadKeyFileFor("--tls-key", tls_key, "--tls-cert", tls_cert, *cert);
  if (!key.ok()) return key.status();
  return MakeServerCredentialsFromPem(*cert, *key, tls_client_ca);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentialsFromPem(
    const std::string& chain_pem, const std::string& key_pem, const std::string& tls_client_ca) {
  grpc::SslServerCredentialsOptions opts;
  opts.pem_key_cert_pairs.push_back({key_pem, chain_pem});
  if (!tls_client_ca.empty()) {
    absl::StatusOr<std::string> ca = rpc::ReadCertificateFile("--tls-client-ca", tls_client_ca);
    if (!ca.ok()) return ca.status();
    opts.pem_root_certs = *ca;
    opts.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(opts);
}

}  // namespace rackrun::coordinator
