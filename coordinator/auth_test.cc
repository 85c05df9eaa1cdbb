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
  EXPECT_TRUE(TokenAuth::Matches("Bearer abc123", "abc123"));
  EXPECT_FALSE(TokenAuth::Matches("Bearer abc124", "abc123"));
  EXPECT_FALSE(TokenAuth::Matches("Bearer abc1234", "abc123"));
  EXPECT_FALSE(TokenAuth::Matches("Bearer abc12", "abc123"));
  EXPECT_FALSE(TokenAuth::Matches("abc123", "abc123"));
  EXPECT_FALSE(TokenAuth::Matches("", "abc123"));
  EXPECT_FALSE(TokenAuth::Matches("Bearer ", ""));  // an empty token grants nothing
}

TEST(AuthTest, EachRoleHasItsTokenAndItsRights) {
  TokenAuth auth(RoleTokens{"a", "u", "w", "r"});
  EXPECT_EQ(auth.RoleOf("Bearer a"), Role::kAdmin);
  EXPECT_EQ(auth.RoleOf("Bearer u"), Role::kUser);
  EXPECT_EQ(auth.RoleOf("Bearer w"), Role::kWorker);
  EXPECT_EQ(auth.RoleOf("Bearer r"), Role::kReadOnly);
  EXPECT_EQ(auth.RoleOf("Bearer x"), std::nullopt);
  // The old single token (TokenAuth(token)) is the admin token.
  EXPECT_EQ(TokenAuth(std::string("t")).RoleOf("Bearer t"), Role::kAdmin);
  for (Role r : {Role::kReadOnly, Role::kUser, Role::kWorker, Role::kAdmin}) {
    EXPECT_TRUE(RoleMay(r, Access::kRead)) << RoleName(r);
  }
  EXPECT_TRUE(RoleMay(Role::kUser, Access::kJobs));
  EXPECT_TRUE(RoleMay(Role::kAdmin, Access::kJobs));
  EXPECT_FALSE(RoleMay(Role::kWorker, Access::kJobs));
  EXPECT_FALSE(RoleMay(Role::kReadOnly, Access::kJobs));
  EXPECT_TRUE(RoleMay(Role::kWorker, Access::kRack));
  EXPECT_TRUE(RoleMay(Role::kAdmin, Access::kRack));
  EXPECT_FALSE(RoleMay(Role::kUser, Access::kRack));
  EXPECT_FALSE(RoleMay(Role::kReadOnly, Access::kRack));
}

TEST(AuthTest, RoleTokenFilesAreMadeOnceEachPrivateAndDistinct) {
  testing::ScratchDir dir;
  auto t = LoadOrCreateRoleTokens(dir.path(), dir.path() + "/token", true);
  ASSERT_TRUE(t.ok()) << t.status();
  for (const char* f : {"token", "token-user", "token-worker", "token-readonly"}) {
    struct stat st;
    ASSERT_EQ(stat((dir.path() + "/" + f).c_str(), &st), 0) << f;
    EXPECT_EQ(st.st_mode & 0777, 0600u) << f;
  }
  EXPECT_NE(t->user, t->worker);
  auto again = LoadOrCreateRoleTokens(dir.path(), dir.path() + "/token", true);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->worker, t->worker);
  // A role file holding another role's token is refused, naming the fix.
  { std::ofstream(dir.path() + "/token-readonly") << t->user << "\n"; }
  auto same = LoadOrCreateRoleTokens(dir.path(), dir.path() + "/token", true);
  ASSERT_FALSE(same.ok());
  EXPECT_NE(same.status().message().find("same token"), std::string::npos) << same.status();
}

TEST(AuthTest, CredentialsFlags) {
  EXPECT_TRUE(MakeServerCredentials("", "", "").ok());
  EXPECT_EQ(MakeServerCredentials("cert.pem", "", "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeServerCredentials("", "", "ca.pem").status().code(),
            absl::StatusCode::kInvalidArgument);
  auto missing = MakeServerCredentials("/nonexistent/cert.pem", "/nonexistent/key.pem", "");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("--tls-cert"), std::string::npos);
}

}  // namespace
}  // namespace rackrun::coordinator
