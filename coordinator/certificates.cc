#include "coordinator/certificates.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/file.h"
#include "rpc/join_token.h"

namespace rackrun::coordinator {
namespace {

using X509Ptr = std::unique_ptr<X509, decltype(&X509_free)>;
using KeyPtr = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;
using BioPtr = std::unique_ptr<BIO, decltype(&BIO_free)>;

std::string OpenSslError(const std::string& what) {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return what;
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  return absl::StrCat(what, ": ", buf);
}

// The file's text, "" when it does not exist; FailedPrecondition when others may read it.
absl::StatusOr<std::string> ReadPrivateFile(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return std::string();
    return absl::FailedPreconditionError(absl::StrCat("'", path, "': ", std::strerror(errno)));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("'", path, "' is readable by group or others; chmod 600 it"));
  }
  return base::ReadWholeFile(path);
}

X509Ptr ParseCert(const std::string& pem) {
  BioPtr bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), BIO_free);
  X509Ptr cert(bio != nullptr ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr,
               X509_free);
  ERR_clear_error();
  return cert;
}

KeyPtr ParseKey(const std::string& pem) {
  BioPtr bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), BIO_free);
  KeyPtr key(
      bio != nullptr ? PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr) : nullptr,
      EVP_PKEY_free);
  ERR_clear_error();
  return key;
}

std::string BioText(BIO* bio) {
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  return std::string(data, static_cast<size_t>(n));
}

std::string CertPem(X509* cert) {
  BioPtr bio(BIO_new(BIO_s_mem()), BIO_free);
  PEM_write_bio_X509(bio.get(), cert);
  return BioText(bio.get());
}

std::string KeyPem(EVP_PKEY* key) {
  BioPtr bio(BIO_new(BIO_s_mem()), BIO_free);
  PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr);
  return BioText(bio.get());
}

absl::Time AsnTime(const ASN1_TIME* t) {
  struct tm tm {};
  if (ASN1_TIME_to_tm(t, &tm) != 1) return absl::InfinitePast();
  return absl::FromUnixSeconds(timegm(&tm));
}

bool IsIp(const std::string& s) {
  in6_addr a;
  return inet_pton(AF_INET, s.c_str(), &a) == 1 || inet_pton(AF_INET6, s.c_str(), &a) == 1;
}

// One spelling per name: IP literals as inet_ntop writes them, DNS names in lower case.
std::string CanonicalSan(std::string s) {
  if (s.size() >= 2 && s.front() == '[' && s.back() == ']') s = s.substr(1, s.size() - 2);
  char buf[INET6_ADDRSTRLEN];
  in_addr v4;
  in6_addr v6;
  if (inet_pton(AF_INET, s.c_str(), &v4) == 1) return inet_ntop(AF_INET, &v4, buf, sizeof(buf));
  if (inet_pton(AF_INET6, s.c_str(), &v6) == 1) return inet_ntop(AF_INET6, &v6, buf, sizeof(buf));
  return absl::AsciiStrToLower(s);
}

std::set<std::string> SansOf(X509* cert) {
  std::set<std::string> out;
  auto* names =
      static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr));
  if (names == nullptr) return out;
  for (int i = 0; i < sk_GENERAL_NAME_num(names); ++i) {
    const GENERAL_NAME* n = sk_GENERAL_NAME_value(names, i);
    if (n->type == GEN_DNS) {
      const ASN1_STRING* s = n->d.dNSName;
      out.insert(
          absl::AsciiStrToLower(std::string(reinterpret_cast<const char*>(ASN1_STRING_get0_data(s)),
                                            static_cast<size_t>(ASN1_STRING_length(s)))));
    } else if (n->type == GEN_IPADD) {
      const ASN1_OCTET_STRING* s = n->d.iPAddress;
      char buf[INET6_ADDRSTRLEN];
      const int len = ASN1_STRING_length(s);
      if (len == 4 || len == 16) {
        out.insert(
            inet_ntop(len == 4 ? AF_INET : AF_INET6, ASN1_STRING_get0_data(s), buf, sizeof(buf)));
      }
    }
  }
  GENERAL_NAMES_free(names);
  return out;
}

absl::Status AddExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  if (ext == nullptr)
    return absl::InternalError(OpenSslError(absl::StrCat("certificate extension '", value, "'")));
  const int ok = X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
  if (ok != 1) return absl::InternalError(OpenSslError("X509_add_ext"));
  return absl::OkStatus();
}

struct Issued {
  X509Ptr cert{nullptr, X509_free};
  KeyPtr key{nullptr, EVP_PKEY_free};
};

// A fresh P-256 key and a certificate for it, signed by (issuer, issuer_key), or
// self-signed when issuer is null (the CA).
absl::StatusOr<Issued> Issue(const std::string& common_name, X509* issuer, EVP_PKEY* issuer_key,
                             const std::vector<std::string>& sans, absl::Time now,
                             absl::Duration validity) {
  Issued out;
  out.key.reset(EVP_PKEY_Q_keygen(nullptr, nullptr, "EC", "P-256"));
  if (out.key == nullptr) return absl::InternalError(OpenSslError("EC P-256 key generation"));
  out.cert.reset(X509_new());
  X509* cert = out.cert.get();
  X509_set_version(cert, 2);  // v3
  unsigned char serial[16];
  if (RAND_bytes(serial, sizeof(serial)) != 1)
    return absl::InternalError(OpenSslError("RAND_bytes"));
  serial[0] &= 0x7f;  // positive
  std::unique_ptr<BIGNUM, decltype(&BN_free)> bn(BN_bin2bn(serial, sizeof(serial), nullptr),
                                                 BN_free);
  BN_to_ASN1_INTEGER(bn.get(), X509_get_serialNumber(cert));
  // Valid from an hour ago: clocks of workers and coordinator differ a little.
  time_t start = absl::ToTimeT(now);
  const int64_t seconds = absl::ToInt64Seconds(validity);
  X509_time_adj_ex(X509_getm_notBefore(cert), 0, -3600, &start);
  X509_time_adj_ex(X509_getm_notAfter(cert), static_cast<int>(seconds / 86400),
                   static_cast<long>(seconds % 86400), &start);
  X509_NAME* name = X509_get_subject_name(cert);
  X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("rackrun"), -1, -1, 0);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(common_name.c_str()), -1, -1,
                             0);
  X509_set_issuer_name(cert, issuer != nullptr ? X509_get_subject_name(issuer) : name);
  X509_set_pubkey(cert, out.key.get());
  X509* signer = issuer != nullptr ? issuer : cert;
  if (issuer == nullptr) {
    for (const auto& [nid, value] :
         {std::pair<int, std::string>{NID_basic_constraints, "critical,CA:TRUE,pathlen:0"},
          {NID_key_usage, "critical,keyCertSign,cRLSign"},
          {NID_subject_key_identifier, "hash"}}) {
      if (absl::Status s = AddExtension(cert, signer, nid, value); !s.ok()) return s;
    }
  } else {
    std::vector<std::string> alt;
    for (const std::string& s : sans) alt.push_back(absl::StrCat(IsIp(s) ? "IP:" : "DNS:", s));
    for (const auto& [nid, value] :
         {std::pair<int, std::string>{NID_basic_constraints, "critical,CA:FALSE"},
          {NID_key_usage, "critical,digitalSignature"},
          {NID_ext_key_usage, "serverAuth"},
          {NID_subject_key_identifier, "hash"},
          {NID_authority_key_identifier, "keyid"},
          {NID_subject_alt_name, absl::StrJoin(alt, ",")}}) {
      if (absl::Status s = AddExtension(cert, signer, nid, value); !s.ok()) return s;
    }
  }
  if (X509_sign(cert, issuer_key != nullptr ? issuer_key : out.key.get(), EVP_sha256()) == 0) {
    return absl::InternalError(OpenSslError("signing the certificate"));
  }
  return out;
}

// A certificate and its key as stored: either may be missing (null) or unreadable.
struct StoredPair {
  X509Ptr cert{nullptr, X509_free};
  KeyPtr key{nullptr, EVP_PKEY_free};
  bool missing = false;  // neither file exists
};

absl::StatusOr<StoredPair> ReadPair(const std::string& crt_path, const std::string& key_path) {
  absl::StatusOr<std::string> crt = ReadPrivateFile(crt_path);
  if (!crt.ok()) return crt.status();
  absl::StatusOr<std::string> key = ReadPrivateFile(key_path);
  if (!key.ok()) return key.status();
  StoredPair out;
  out.cert = ParseCert(*crt);
  out.key = ParseKey(*key);
  out.missing = crt->empty() && key->empty();
  return out;
}

// The key first: a certificate is never on disk without its key.
absl::Status WritePair(const std::string& crt_path, const std::string& key_path,
                       const Issued& issued) {
  if (absl::Status s = WritePrivateFile(key_path, KeyPem(issued.key.get())); !s.ok()) return s;
  return WritePrivateFile(crt_path, CertPem(issued.cert.get()));
}

}  // namespace

absl::Status WritePrivateFile(const std::string& path, const std::string& bytes) {
  const std::string tmp = base::TemporaryPath(path);
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0)
    return absl::InternalError(absl::StrCat("cannot create '", tmp, "': ", std::strerror(errno)));
  fchmod(fd, 0600);
  const bool ok =
      write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()) && fsync(fd) == 0;
  close(fd);
  if (!ok || rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = std::strerror(errno);
    unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat("cannot write '", path, "': ", err));
  }
  return absl::OkStatus();
}

std::vector<std::string> ServerSans(const std::string& listen_host, const std::string& hostname,
                                    const std::vector<std::string>& extra) {
  std::vector<std::string> out;
  const auto add = [&out](const std::string& s) {
    if (s.empty()) return;
    const std::string c = CanonicalSan(s);
    if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  };
  const std::string host = CanonicalSan(listen_host);
  if (host.empty() || host == "0.0.0.0" || host == "::") {
    ifaddrs* list = nullptr;
    if (getifaddrs(&list) == 0) {
      for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
        if (a->ifa_addr == nullptr) continue;
        char buf[INET6_ADDRSTRLEN];
        if (a->ifa_addr->sa_family == AF_INET) {
          add(inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, buf,
                        sizeof(buf)));
        } else if (a->ifa_addr->sa_family == AF_INET6 && host == "::") {
          const in6_addr* v6 = &reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr;
          if (!IN6_IS_ADDR_LINKLOCAL(v6)) add(inet_ntop(AF_INET6, v6, buf, sizeof(buf)));
        }
      }
      freeifaddrs(list);
    }
  } else {
    add(host);
  }
  add(hostname);
  for (const std::string& e : extra) add(e);
  return out;
}

absl::StatusOr<absl::Time> CertificateExpiry(const std::string& pem) {
  X509Ptr cert = ParseCert(pem);
  if (cert == nullptr)
    return absl::InvalidArgumentError("no PEM certificate (-----BEGIN CERTIFICATE-----)");
  return AsnTime(X509_get0_notAfter(cert.get()));
}

std::string ExpiryWarning(const std::string& what, absl::Time expires, absl::Time now,
                          absl::Duration ahead, const std::string& fix) {
  const std::string date = absl::FormatTime("%Y-%m-%d %H:%M UTC", expires, absl::UTCTimeZone());
  if (expires <= now) return absl::StrCat(what, " expired on ", date, "; ", fix);
  if (expires - now > ahead) return "";
  return absl::StrCat(what, " expires on ", date, " (in ", absl::ToInt64Hours(expires - now) / 24,
                      " days); ", fix);
}

absl::StatusOr<ServerCertificates> EnsureCertificates(const std::string& dir,
                                                      const CertificateOptions& options) {
  if (options.sans.empty())
    return absl::InvalidArgumentError("--tls-san: the server certificate needs a name");
  const std::string ca_crt = dir + "/ca.crt", ca_key = dir + "/ca.key";
  const std::string srv_crt = dir + "/server.crt", srv_key = dir + "/server.key";
  ServerCertificates out;

  // The CA: both files or neither.
  absl::StatusOr<StoredPair> stored_ca = ReadPair(ca_crt, ca_key);
  if (!stored_ca.ok()) return stored_ca.status();
  X509Ptr ca = std::move(stored_ca->cert);
  KeyPtr ca_private = std::move(stored_ca->key);
  const bool ca_missing = stored_ca->missing;
  if (!ca_missing && !options.renew_ca) {
    if (ca == nullptr || ca_private == nullptr ||
        X509_check_private_key(ca.get(), ca_private.get()) != 1) {
      ERR_clear_error();
      return absl::FailedPreconditionError(absl::StrCat(
          "the automatic CA in '", dir,
          "' is damaged (ca.crt and ca.key missing, unreadable or "
          "not a pair); remove both to make a new CA (every join token changes), or run with "
          "--tls-cert/--tls-key"));
    }
  }
  bool renew_ca = options.renew_ca;
  if (!ca_missing && !renew_ca && options.renew_server &&
      AsnTime(X509_get0_notAfter(ca.get())) - options.now < options.renew_before) {
    renew_ca = true;  // the renewal command also replaces a CA that is about to expire
  }
  if (ca_missing || renew_ca) {
    absl::StatusOr<Issued> made =
        Issue("rackrun coordinator CA", nullptr, nullptr, {}, options.now, options.ca_validity);
    if (!made.ok()) return made.status();
    if (absl::Status s = WritePair(ca_crt, ca_key, *made); !s.ok()) return s;
    ca = std::move(made->cert);
    ca_private = std::move(made->key);
    out.ca_created = true;
  }
  out.ca_pem = CertPem(ca.get());
  out.ca_expires = AsnTime(X509_get0_notAfter(ca.get()));

  // The server certificate: reused when it still fits.
  std::set<std::string> wanted;
  for (const std::string& s : options.sans) wanted.insert(CanonicalSan(s));
  absl::StatusOr<StoredPair> stored_srv = ReadPair(srv_crt, srv_key);
  if (!stored_srv.ok()) return stored_srv.status();
  X509Ptr srv = std::move(stored_srv->cert);
  KeyPtr srv_private = std::move(stored_srv->key);
  std::string why;
  if (srv == nullptr || srv_private == nullptr) {
    why = stored_srv->missing ? "first start" : "server.crt or server.key unreadable";
  } else if (X509_check_private_key(srv.get(), srv_private.get()) != 1) {
    why = "server.crt does not match server.key";
  } else if (out.ca_created || X509_verify(srv.get(), X509_get0_pubkey(ca.get())) != 1) {
    why = "new CA";
  } else if (std::set<std::string> have = SansOf(srv.get()); have != wanted) {
    why = absl::StrCat("names changed from ", absl::StrJoin(have, ","), " to ",
                       absl::StrJoin(wanted, ","));
  } else if (AsnTime(X509_get0_notAfter(srv.get())) - options.now < options.renew_before) {
    why = "expires soon";
  } else if (options.renew_server) {
    why = "renewal asked";
  }
  ERR_clear_error();
  if (!why.empty()) {
    absl::StatusOr<Issued> made = Issue("rackrun coordinator", ca.get(), ca_private.get(),
                                        options.sans, options.now, options.server_validity);
    if (!made.ok()) return made.status();
    if (absl::Status s = WritePair(srv_crt, srv_key, *made); !s.ok()) return s;
    srv = std::move(made->cert);
    srv_private = std::move(made->key);
    out.issued_because = why;
  }
  out.chain_pem = CertPem(srv.get()) + out.ca_pem;
  out.key_pem = KeyPem(srv_private.get());
  out.server_expires = AsnTime(X509_get0_notAfter(srv.get()));
  absl::StatusOr<std::string> sha = rpc::CertificateSha256(out.ca_pem);
  if (!sha.ok()) return sha.status();
  out.ca_sha256 = *sha;
  return out;
}

}  // namespace rackrun::coordinator
