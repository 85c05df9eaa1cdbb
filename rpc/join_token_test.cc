#include "rpc/join_token.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>

#include "rpc/credentials.h"

namespace rackrun::rpc {
namespace {

using ::testing::HasSubstr;

const std::string kHash(64, 'a');

TEST(JoinTokenTest, RoundTripsAndBareTokensPass) {
  const std::string text = FormatJoinToken(kHash, "s3cret");
  EXPECT_EQ(text, "rr1-" + kHash + "::s3cret");
  auto parsed = ParseJoinToken(text, "RACKRUN_TOKEN");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_TRUE(parsed->has_value());
  EXPECT_EQ((*parsed)->ca_sha256, kHash);
  EXPECT_EQ((*parsed)->secret, "s3cret");
  // Upper-case hex is the same pin.
  auto upper = ParseJoinToken("rr1-" + std::string(64, 'A') + "::x", "f");
  ASSERT_TRUE(upper.ok());
  EXPECT_EQ((**upper).ca_sha256, kHash);
  // A bare token (64 hex digits, as the coordinator writes) is not a join token.
  auto bare = ParseJoinToken(std::string(64, '7'), "f");
  ASSERT_TRUE(bare.ok());
  EXPECT_FALSE(bare->has_value());
}

TEST(JoinTokenTest, MalformedTokensNameTheSourceAndTheFixNeverTheSecret) {
  struct Case {
    std::string text, says;
  };
  const Case cases[] = {
      {"rr1-" + kHash + "s3cret", "no '::'"},
      {"rr1-" + kHash.substr(0, 40) + "::s3cret", "64 hex digits"},
      {"rr1-" + std::string(63, 'a') + "g::s3cret", "not all hex digits"},
      {"rr1-" + kHash + "::", "no secret"},
      {"rr1-" + kHash + "::s3cret rr1-x", "whitespace"},
      {"K10" + kHash + "::server:s3cret", "does not start with 'rr1-'"},
  };
  for (const Case& c : cases) {
    auto parsed = ParseJoinToken(c.text, "/etc/rackrun/join-token");
    ASSERT_FALSE(parsed.ok()) << c.text;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string m(parsed.status().message());
    EXPECT_THAT(m, HasSubstr("/etc/rackrun/join-token")) << c.text;
    EXPECT_THAT(m, HasSubstr(c.says)) << c.text;
    EXPECT_THAT(m, HasSubstr("join-token-ROLE again")) << c.text;
    EXPECT_THAT(m, ::testing::Not(HasSubstr("s3cret"))) << c.text;
  }
}

TEST(JoinTokenTest, LoadClusterTokenSplitsAJoinTokenAndRefusesABadOne) {
  setenv("RACKRUN_TOKEN", ("rr1-" + kHash + "::abc").c_str(), 1);
  auto t = LoadClusterToken();
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->token, "abc");
  EXPECT_EQ(t->ca_sha256, kHash);
  setenv("RACKRUN_TOKEN", "rr1-abc::def", 1);
  auto bad = LoadClusterToken();
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("RACKRUN_TOKEN"));
  setenv("RACKRUN_TOKEN", "plain", 1);
  auto plain = LoadClusterToken();
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->token, "plain");
  EXPECT_EQ(plain->ca_sha256, "");
  unsetenv("RACKRUN_TOKEN");
}

TEST(JoinTokenTest, FingerprintNeedsACertificate) {
  EXPECT_EQ(CertificateSha256("hello").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(JoinTokenTest, FetchFromAPlaintextOrAbsentServerSaysWhy) {
  EXPECT_EQ(FetchPinnedCa("no-port", kHash, std::chrono::milliseconds(500)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A listener that answers a TLS hello with plaintext and closes (as an HTTP/2 server
  // without TLS does): Unavailable, saying that a join token needs TLS.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ASSERT_EQ(listen(fd, 1), 0);
  std::thread server([fd] {
    const int c = accept(fd, nullptr, nullptr);
    char buf[512];
    (void)!read(c, buf, sizeof(buf));
    const char reply[] = "\x00\x00\x12\x04\x00\x00\x00\x00\x00garbage-not-tls";
    (void)!write(c, reply, sizeof(reply));
    close(c);
  });
  const std::string address = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  auto plain = FetchPinnedCa(address, kHash, std::chrono::milliseconds(5000));
  server.join();
  close(fd);
  ASSERT_FALSE(plain.ok());
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(plain.status().message()), HasSubstr("needs a coordinator serving TLS"));
  // Nobody listening: Unavailable naming the address.
  auto gone = FetchPinnedCa(address, kHash, std::chrono::milliseconds(500));
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(gone.status().message()), HasSubstr(address));
}

}  // namespace
}  // namespace rackrun::rpc
