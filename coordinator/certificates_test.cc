#include "coordinator/certificates.h"

#include <gtest/gtest.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>

#include <memory>
#include <set>

#include "base/file.h"
#include "coordinator/test_util.h"
#include "rpc/join_token.h"

namespace rackrun::coordinator {
namespace {

const absl::Time kNow = absl::FromUnixSeconds(1'800'000'000);

CertificateOptions Options(std::vector<std::string> sans, absl::Time now = kNow) {
  CertificateOptions o;
  o.sans = std::move(sans);
  o.now = now;
  return o;
}

std::string Read(const std::string& path) {
  absl::StatusOr<std::string> s = base::ReadWholeFile(path);
  return s.ok() ? *s : "";
}

// The certificate's DNS and IP names, as OpenSSL reads them back.
std::set<std::string> Names(const std::string& pem) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), BIO_free);
  std::unique_ptr<X509, decltype(&X509_free)> cert(
      PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr), X509_free);
  std::set<std::string> out;
  if (cert == nullptr) return out;
  for (const char* host :
       {"127.0.0.1", "10.1.2.3", "::1", "coordinator.example", "other.example"}) {
    const bool ip = std::string(host).find_first_not_of("0123456789.:") == std::string::npos;
    if (ip ? X509_check_ip_asc(cert.get(), host, 0) == 1
           : X509_check_host(cert.get(), host, 0, 0, nullptr) == 1) {
      out.insert(host);
    }
  }
  return out;
}

// The server certificate verifies against the CA (and only against it).
bool SignedBy(const std::string& leaf_pem, const std::string& ca_pem, absl::Time at = kNow) {
  std::unique_ptr<BIO, decltype(&BIO_free)> lb(
      BIO_new_mem_buf(leaf_pem.data(), static_cast<int>(leaf_pem.size())), BIO_free);
  std::unique_ptr<BIO, decltype(&BIO_free)> cb(
      BIO_new_mem_buf(ca_pem.data(), static_cast<int>(ca_pem.size())), BIO_free);
  std::unique_ptr<X509, decltype(&X509_free)> leaf(
      PEM_read_bio_X509(lb.get(), nullptr, nullptr, nullptr), X509_free);
  std::unique_ptr<X509, decltype(&X509_free)> ca(
      PEM_read_bio_X509(cb.get(), nullptr, nullptr, nullptr), X509_free);
  std::unique_ptr<X509_STORE, decltype(&X509_STORE_free)> store(X509_STORE_new(), X509_STORE_free);
  X509_STORE_add_cert(store.get(), ca.get());
  std::unique_ptr<X509_STORE_CTX, decltype(&X509_STORE_CTX_free)> ctx(X509_STORE_CTX_new(),
                                                                      X509_STORE_CTX_free);
  X509_STORE_CTX_init(ctx.get(), store.get(), leaf.get(), nullptr);
  X509_VERIFY_PARAM_set_time(X509_STORE_CTX_get0_param(ctx.get()), absl::ToTimeT(at));
  return X509_verify_cert(ctx.get()) == 1;
}

TEST(CertificatesTest, FirstStartMakesACaAndAServerCertificateMode0600) {
  testing::ScratchDir dir;
  auto c = EnsureCertificates(dir.path(), Options({"127.0.0.1", "coordinator.example"}));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->ca_created);
  EXPECT_EQ(c->issued_because, "first start");
  for (const char* f : {"ca.crt", "ca.key", "server.crt", "server.key"}) {
    struct stat st;
    ASSERT_EQ(stat((dir.path() + "/" + f).c_str(), &st), 0) << f;
    EXPECT_EQ(st.st_mode & 0777, 0600u) << f;
  }
  EXPECT_EQ(Names(Read(dir.path() + "/server.crt")),
            (std::set<std::string>{"127.0.0.1", "coordinator.example"}));
  EXPECT_TRUE(SignedBy(Read(dir.path() + "/server.crt"), c->ca_pem));
  // The CA itself names no host; the chain served is the server certificate, then the CA.
  EXPECT_TRUE(Names(c->ca_pem).empty());
  EXPECT_EQ(c->chain_pem, Read(dir.path() + "/server.crt") + c->ca_pem);
  EXPECT_EQ(*rpc::CertificateSha256(Read(dir.path() + "/ca.crt")), c->ca_sha256);
  EXPECT_EQ(c->server_expires, kNow + absl::Hours(24 * 365));
  EXPECT_EQ(c->ca_expires, kNow + absl::Hours(24 * 3650));
}

TEST(CertificatesTest, SecondStartReusesBoth) {
  testing::ScratchDir dir;
  auto first = EnsureCertificates(dir.path(), Options({"127.0.0.1", "coordinator.example"}));
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string server = Read(dir.path() + "/server.crt");
  // The same names in another order and spelling are the same names.
  auto again = EnsureCertificates(
      dir.path(), Options({"Coordinator.Example", "127.0.0.1"}, kNow + absl::Hours(24)));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->ca_created);
  EXPECT_EQ(again->issued_because, "");
  EXPECT_EQ(again->ca_sha256, first->ca_sha256);
  EXPECT_EQ(Read(dir.path() + "/server.crt"), server);
  EXPECT_EQ(again->key_pem, first->key_pem);
}

TEST(CertificatesTest, ChangedNamesReissueTheServerCertificateUnderTheSameCa) {
  testing::ScratchDir dir;
  auto first = EnsureCertificates(dir.path(), Options({"127.0.0.1", "coordinator.example"}));
  ASSERT_TRUE(first.ok()) << first.status();
  auto moved = EnsureCertificates(dir.path(), Options({"10.1.2.3", "coordinator.example", "::1"}));
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_FALSE(moved->ca_created);
  EXPECT_EQ(moved->ca_sha256, first->ca_sha256);  // join tokens stay valid
  EXPECT_NE(moved->issued_because.find("names changed"), std::string::npos)
      << moved->issued_because;
  EXPECT_EQ(Names(Read(dir.path() + "/server.crt")),
            (std::set<std::string>{"10.1.2.3", "::1", "coordinator.example"}));
  EXPECT_TRUE(SignedBy(Read(dir.path() + "/server.crt"), first->ca_pem));
}

TEST(CertificatesTest, ServerCertificateNearExpiryIsReissuedAndTheCaWarned) {
  testing::ScratchDir dir;
  auto first = EnsureCertificates(dir.path(), Options({"127.0.0.1"}));
  ASSERT_TRUE(first.ok()) << first.status();
  // 340 days later the server certificate has 25 days left: re-issued at start.
  const absl::Time later = kNow + absl::Hours(24 * 340);
  auto renewed = EnsureCertificates(dir.path(), Options({"127.0.0.1"}, later));
  ASSERT_TRUE(renewed.ok()) << renewed.status();
  EXPECT_EQ(renewed->issued_because, "expires soon");
  EXPECT_EQ(renewed->server_expires, later + absl::Hours(24 * 365));

  // The CA is never replaced silently: 3640 days in, it is warned about ...
  const absl::Time near_ca_end = kNow + absl::Hours(24 * 3640);
  auto old_ca = EnsureCertificates(dir.path(), Options({"127.0.0.1"}, near_ca_end));
  ASSERT_TRUE(old_ca.ok()) << old_ca.status();
  EXPECT_EQ(old_ca->ca_sha256, first->ca_sha256);
  const std::string w =
      ExpiryWarning("the CA", old_ca->ca_expires, near_ca_end, absl::Hours(24 * 30), "renew it");
  EXPECT_NE(w.find("the CA expires on"), std::string::npos) << w;
  EXPECT_NE(w.find("(in 10 days)"), std::string::npos) << w;
  EXPECT_NE(w.find("renew it"), std::string::npos) << w;
  EXPECT_EQ(ExpiryWarning("the CA", old_ca->ca_expires, kNow, absl::Hours(24 * 30), "x"), "");
  EXPECT_NE(ExpiryWarning("the CA", old_ca->ca_expires, kNow + absl::Hours(24 * 4000),
                          absl::Hours(1), "x")
                .find("expired on"),
            std::string::npos);
  // ... and replaced by the renewal command (renew_server), which then issues under it.
  CertificateOptions renew = Options({"127.0.0.1"}, near_ca_end);
  renew.renew_server = true;
  auto new_ca = EnsureCertificates(dir.path(), renew);
  ASSERT_TRUE(new_ca.ok()) << new_ca.status();
  EXPECT_TRUE(new_ca->ca_created);
  EXPECT_NE(new_ca->ca_sha256, first->ca_sha256);
  EXPECT_TRUE(SignedBy(Read(dir.path() + "/server.crt"), new_ca->ca_pem, near_ca_end));
  EXPECT_FALSE(SignedBy(Read(dir.path() + "/server.crt"), first->ca_pem, near_ca_end));
}

TEST(CertificatesTest, DamagedOrExposedFilesAreRefusedNamingTheFix) {
  testing::ScratchDir dir;
  ASSERT_TRUE(EnsureCertificates(dir.path(), Options({"127.0.0.1"})).ok());
  chmod((dir.path() + "/server.key").c_str(), 0644);
  auto exposed = EnsureCertificates(dir.path(), Options({"127.0.0.1"}));
  ASSERT_FALSE(exposed.ok());
  EXPECT_NE(exposed.status().message().find("server.key"), std::string::npos) << exposed.status();
  EXPECT_NE(exposed.status().message().find("chmod 600"), std::string::npos) << exposed.status();
  chmod((dir.path() + "/server.key").c_str(), 0600);

  ASSERT_TRUE(WritePrivateFile(dir.path() + "/ca.key", "not a key\n").ok());
  auto damaged = EnsureCertificates(dir.path(), Options({"127.0.0.1"}));
  ASSERT_FALSE(damaged.ok());
  EXPECT_NE(damaged.status().message().find("remove both"), std::string::npos) << damaged.status();

  // A server key that does not belong to its certificate: re-issued, not served.
  testing::ScratchDir other;
  ASSERT_TRUE(EnsureCertificates(other.path(), Options({"127.0.0.1"})).ok());
  testing::ScratchDir third;
  ASSERT_TRUE(EnsureCertificates(third.path(), Options({"127.0.0.1"})).ok());
  ASSERT_TRUE(
      WritePrivateFile(third.path() + "/server.key", Read(other.path() + "/server.key")).ok());
  auto mismatched = EnsureCertificates(third.path(), Options({"127.0.0.1"}));
  ASSERT_TRUE(mismatched.ok()) << mismatched.status();
  EXPECT_EQ(mismatched->issued_because, "server.crt does not match server.key");
}

TEST(CertificatesTest, ServerSansNameTheListenHostTheHostNameAndExtras) {
  EXPECT_EQ(ServerSans("127.0.0.1", "node7", {"rack.example", "node7", "10.0.0.1"}),
            (std::vector<std::string>{"127.0.0.1", "node7", "rack.example", "10.0.0.1"}));
  EXPECT_EQ(ServerSans("[::1]", "node7", {}), (std::vector<std::string>{"::1", "node7"}));
  // A wildcard listen names the interfaces' addresses (loopback among them).
  std::vector<std::string> any = ServerSans("0.0.0.0", "node7", {});
  EXPECT_NE(std::find(any.begin(), any.end(), "127.0.0.1"), any.end());
  EXPECT_EQ(std::find(any.begin(), any.end(), "0.0.0.0"), any.end());
}

}  // namespace
}  // namespace rackrun::coordinator
