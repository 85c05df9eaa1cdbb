#include "rpc/tls_material.h"

#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>

#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/file.h"

namespace rackrun::rpc {
namespace {

using Bio = std::unique_ptr<BIO, decltype(&BIO_free)>;
using Cert = std::unique_ptr<X509, decltype(&X509_free)>;
using Key = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;

// OpenSSL's reason for the last failure, and its queue emptied.
std::string OpenSslReason() {
  const unsigned long e = ERR_peek_last_error();
  const char* reason = e != 0 ? ERR_reason_error_string(e) : nullptr;
  ERR_clear_error();
  return reason != nullptr ? reason : "unknown reason";
}

Bio MemoryBio(const std::string& pem) {
  return Bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), BIO_free);
}

// The file at `path` as `flag` names it, as a small regular file; errors name both.
absl::StatusOr<std::string> ReadFlagFile(const std::string& flag, const std::string& path,
                                         const char* holds) {
  absl::StatusOr<std::string> text = base::ReadSmallFile(path, kMaxPemFileBytes);
  if (!text.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", text.status().message()));
  }
  if (absl::StripAsciiWhitespace(*text).empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", path, "' is empty; it must hold ", holds, " (PEM)"));
  }
  return text;
}

// No passphrase prompt on the terminal: an encrypted key fails to parse.
int NoPassphrase(char* /*buffer*/, int /*size*/, int /*rwflag*/, void* /*user*/) { return 0; }

}  // namespace

absl::StatusOr<std::string> ReadCertificateFile(const std::string& flag, const std::string& path) {
  absl::StatusOr<std::string> pem = ReadFlagFile(flag, path, "one or more certificates");
  if (!pem.ok()) return pem.status();
  Bio bio = MemoryBio(*pem);
  int certificates = 0;
  ERR_clear_error();
  while (bio != nullptr) {
    Cert cert(PEM_read_bio_X509(bio.get(), nullptr, NoPassphrase, nullptr), X509_free);
    if (cert == nullptr) break;
    ++certificates;
  }
  // The loop ends at the end of the text (no further BEGIN line) or at a block that does
  // not parse.
  const unsigned long e = ERR_peek_last_error();
  const bool at_end =
      e == 0 || (ERR_GET_LIB(e) == ERR_LIB_PEM && ERR_GET_REASON(e) == PEM_R_NO_START_LINE);
  if (certificates > 0 && at_end) {
    ERR_clear_error();
    return pem;
  }
  if (certificates == 0 && at_end) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": '", path,
        "' holds no PEM certificate (-----BEGIN CERTIFICATE-----); give the certificate file, "
        "not its key or a DER file"));
  }
  return absl::InvalidArgumentError(absl::StrCat(flag, ": certificate ", certificates + 1, " of '",
                                                 path, "' does not parse (", OpenSslReason(),
                                                 "); the file is damaged or not PEM"));
}

absl::StatusOr<std::string> ReadKeyFileFor(const std::string& key_flag, const std::string& key_path,
                                           const std::string& cert_flag,
                                           const std::string& cert_path,
                                           const std::string& cert_pem) {
  absl::StatusOr<std::string> pem = ReadFlagFile(key_flag, key_path, "a private key");
  if (!pem.ok()) return pem.status();
  ERR_clear_error();
  Bio key_bio = MemoryBio(*pem);
  Key key(key_bio != nullptr
              ? PEM_read_bio_PrivateKey(key_bio.get(), nullptr, NoPassphrase, nullptr)
              : nullptr,
          EVP_PKEY_free);
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        key_flag, ": '", key_path, "' holds no private key OpenSSL can read (", OpenSslReason(),
        "); give the unencrypted PEM key (-----BEGIN PRIVATE KEY-----) of ", cert_flag, " '",
        cert_path, "'"));
  }
  Bio cert_bio = MemoryBio(cert_pem);
  Cert cert(cert_bio != nullptr ? PEM_read_bio_X509(cert_bio.get(), nullptr, NoPassphrase, nullptr)
                                : nullptr,
            X509_free);
  if (cert == nullptr || X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(
        key_flag, ": '", key_path, "' is not the private key of ", cert_flag, " '", cert_path,
        "' (the certificate's public key does not match it); give the key the certificate was "
        "issued for"));
  }
  return pem;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  absl::StatusOr<std::string> text = base::ReadSmallFile(path, kMaxTokenFileBytes);
  if (!text.ok()) {
    if (text.status().code() == absl::StatusCode::kNotFound) return text.status();
    return absl::InvalidArgumentError(absl::StrCat("token file ", text.status().message()));
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && (st.st_mode & 077) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "token file '%s' is open to group or others (mode %04o); run 'chmod 600 %s'", path,
        st.st_mode & 07777, path));
  }
  std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("token file '", path, "' is empty"));
  }
  return token;
}

}  // namespace rackrun::rpc
