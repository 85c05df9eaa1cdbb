// The coordinator's automatic TLS: a private CA and a server certificate it issues itself,
// kept in its state folder, so that TLS needs no set-up (as k3s does). OpenSSL's libcrypto,
// EC P-256 keys, SHA-256 signatures; never the openssl program.
//
// Files in `dir` (every one mode 0600, written atomically):
//   ca.crt, ca.key          the CA; made once, kept (join tokens pin its hash)
//   server.crt, server.key  the server certificate, signed by the CA, with the wanted SANs
// EnsureCertificates keeps the CA and (re-)issues the server certificate when it is
// missing, does not match its key or the CA, names other SANs than wanted, expires within
// `renew_before`, or when asked (`renew_server`). The CA is replaced only when asked
// (`renew_ca`) or when it expires within `renew_before` and the server certificate is
// being renewed by request (the renewal command, rackrun-coordinator --renew-certs):
// a new CA changes every join token.
//
// Thread-compatible; one coordinator per state folder (the job store's lock).
#ifndef RACKRUN_COORDINATOR_CERTIFICATES_H_
#define RACKRUN_COORDINATOR_CERTIFICATES_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace rackrun::coordinator {

struct CertificateOptions {
  // DNS names and IP addresses (IPv4 or IPv6 literals) the server certificate names.
  std::vector<std::string> sans;
  absl::Time now = absl::Now();
  absl::Duration ca_validity = absl::Hours(24 * 3650);
  absl::Duration server_validity = absl::Hours(24 * 365);
  // A server certificate expiring sooner is re-issued at start; a CA expiring sooner is
  // warned about (ExpiryWarning).
  absl::Duration renew_before = absl::Hours(24 * 30);
  bool renew_server = false;  // re-issue the server certificate now
  bool renew_ca = false;      // a new CA (and so a new server certificate) now
};

struct ServerCertificates {
  std::string ca_pem;
  std::string chain_pem;  // the server certificate, then the CA: what the server presents
  std::string key_pem;
  std::string ca_sha256;  // rpc::CertificateSha256(ca_pem)
  absl::Time ca_expires, server_expires;
  bool ca_created = false;
  // Why the server certificate was (re-)issued this time; empty when it was reused.
  std::string issued_because;
};

absl::StatusOr<ServerCertificates> EnsureCertificates(const std::string& dir,
                                                      const CertificateOptions& options);

// The SANs for a coordinator listening on `listen_host`: that host (every address of
// this machine's interfaces when it is a wildcard: empty, 0.0.0.0, ::), this machine's
// host name, then `extra`; without duplicates, in that order.
std::vector<std::string> ServerSans(const std::string& listen_host, const std::string& hostname,
                                    const std::vector<std::string>& extra);

// Writes `bytes` to `path` with mode 0600 from the start (whatever the umask), atomically.
absl::Status WritePrivateFile(const std::string& path, const std::string& bytes);

// When the first certificate of `pem` expires.
absl::StatusOr<absl::Time> CertificateExpiry(const std::string& pem);

// "<what> expires on <date> (in N days); <fix>" when `expires` is within `ahead` of `now`,
// "<what> expired on <date>; <fix>" when past; empty otherwise.
std::string ExpiryWarning(const std::string& what, absl::Time expires, absl::Time now,
                          absl::Duration ahead, const std::string& fix);

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_CERTIFICATES_H_
