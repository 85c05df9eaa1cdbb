#include "coordinator/auth.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>

#include "coordinator/test_util.h"

namespace rackrun::coordinator {
namespace {

TEST(AuthTest, TokenFileIsCreatedOnceWithMode0600) {
  testing::ScratchDir dir;
  const std::string path = dir.path() + "/token";
  auto t1 = LoadOrCreateToken(path, true);
  ASSERT_TRUE(t1.ok()) << t1.status();
  EXPECT_EQ(t1->size(), 64u);
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto t2 = LoadOrCreateToken(path, true);
  ASSERT_TRUE(t2.ok());
  EXPECT_EQ(*t1, *t2);
  EXPECT_FALSE(LoadOrCreateToken(dir.path() + "/missing", false).ok());
  chmod(path.c_str(), 0644);
  EXPECT_EQ(LoadOrCreateToken(path, true).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(AuthTest, BearerMatchesOnlyTheExactToken) {
  TokenAuth auth("abc123");
  EXPECT_TRUE(auth.Matches("Bearer abc123"));
  EXPECT_FALSE(auth.Matches("Bearer abc124"));
  EXPECT_FALSE(auth.Matches("Bearer abc1234"));
  EXPECT_FALSE(auth.Matches("Bearer abc12"));
  EXPECT_FALSE(auth.Matches("abc123"));
  EXPECT_FALSE(auth.Matches(""));
}

TEST(AuthTest, CredentialsFlags) {
  EXPECT_TRUE(MakeServerCredentials("", "", "").ok());
  EXPECT_EQ(MakeServerCredentials("cert.pem", "", "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeServerCredentials("", "", "ca.pem").status().code(), absl::StatusCode::kInvalidArgument);
  auto missing = MakeServerCredentials("/nonexistent/cert.pem", "/nonexistent/key.pem", "");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("--tls-cert"), std::string::npos);
}

}  // namespace
}  // namespace rackrun::coordinator
