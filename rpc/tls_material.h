// TLS material and tokens named by flags, checked when a process starts: the coordinator's
// --tls-cert, --tls-key and --tls-client-ca, the clients' --tls-ca, --tls-cert and
// --tls-key (worker and CLI), and every token file. Handing gRPC a garbage, empty or
// mismatched file made the coordinator say "cannot listen on ... (address in use)" and the
// clients "cannot reach the coordinator (empty address list)"; an empty or directory
// --tls-client-ca was accepted and then refused every client. Here each file is read as a
// small regular file (base::ReadSmallFile: never a blocking open, bounded), parsed with
// OpenSSL, and a key is checked against its certificate; every error names the flag, the
// file and what is wrong with it.
#ifndef RACKRUN_RPC_TLS_MATERIAL_H_
#define RACKRUN_RPC_TLS_MATERIAL_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace rackrun::rpc {

// The most a certificate, key or CA file may hold: a chain or a CA bundle (Debian's
// ca-certificates.crt is about 200 KiB).
inline constexpr size_t kMaxPemFileBytes = size_t{1} << 20;
// The most a token file may hold: a join token is 134 characters.
inline constexpr size_t kMaxTokenFileBytes = 4096;

// The PEM text of `path`, given as `flag`, when it holds one or more certificates that
// OpenSSL parses and nothing else it cannot; InvalidArgument "FLAG: 'PATH' ..." saying
// what is wrong (missing, a directory or other non-regular file, larger than 1 MiB, empty,
// no certificate, a certificate that does not parse).
absl::StatusOr<std::string> ReadCertificateFile(const std::string& flag, const std::string& path);

// The PEM text of the private key `key_path` (`key_flag`) when OpenSSL parses it and it is
// the key of the first certificate of `cert_pem` (read from `cert_path`, given as
// `cert_flag`); InvalidArgument naming the flags and files otherwise.
absl::StatusOr<std::string> ReadKeyFileFor(const std::string& key_flag, const std::string& key_path,
                                           const std::string& cert_flag,
                                           const std::string& cert_path,
                                           const std::string& cert_pem);

// The token in the file `path`, surrounding whitespace dropped: the one rule of the
// coordinator (its role token files), the worker and the CLI. A regular file of at most
// kMaxTokenFileBytes, readable and writable by its owner only: a file that group or others
// may read is FailedPrecondition naming its mode and the command that fixes it
// (`chmod 600 PATH`); NotFound when it does not exist; InvalidArgument for anything else
// (a directory is "a directory", a FIFO "a FIFO", an empty file "empty").
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

}  // namespace rackrun::rpc

#endif  // RACKRUN_RPC_TLS_MATERIAL_H_
