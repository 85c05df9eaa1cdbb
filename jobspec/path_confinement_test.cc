#include "jobspec/path_confinement.h"

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::jobspec {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// A scratch tree:
//   allowed/            the root
//   allowed/sub/f       a file inside
//   allowed/out   ->    ../outside          (a symlink that escapes)
//   allowed/deep  ->    ../outside/a/b      (escapes, two levels down)
//   allowed/in    ->    sub                 (a symlink that stays inside)
//   allowed/secret ->   ../outside/secret   (a file symlink that escapes)
//   allowed2            a sibling whose name starts with the root's
//   outside/secret, outside/a/b/
//   root-link   ->      allowed             (the root named through a symlink)
class PathConfinementTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        fs::path(::testing::TempDir()) /
        ("confine_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "allowed" / "sub");
    fs::create_directories(dir_ / "allowed2");
    fs::create_directories(dir_ / "outside" / "a" / "b");
    std::ofstream(dir_ / "allowed" / "sub" / "f") << "x";
    std::ofstream(dir_ / "outside" / "secret") << "x";
    fs::create_directory_symlink("../outside", dir_ / "allowed" / "out");
    fs::create_directory_symlink("../outside/a/b", dir_ / "allowed" / "deep");
    fs::create_directory_symlink("sub", dir_ / "allowed" / "in");
    fs::create_symlink("../outside/secret", dir_ / "allowed" / "secret");
    fs::create_directory_symlink("allowed", dir_ / "root-link");
    dir_ = fs::canonical(dir_);  // TempDir may itself lead through a symlink
    absl::StatusOr<std::vector<std::string>> roots = ParseAllowedRoots((dir_ / "allowed").string());
    ASSERT_TRUE(roots.ok()) << roots.status();
    roots_ = *roots;
  }
  void TearDown() override { fs::remove_all(dir_); }

  absl::Status Check(const std::string& relative) const {
    return CheckPathConfined("checkpoint.dir", (dir_ / relative).string(), roots_, "node7");
  }

  fs::path dir_;
  std::vector<std::string> roots_;
};

TEST_F(PathConfinementTest, PathsInsideTheRootAreAllowedWhetherTheyExistOrNot) {
  EXPECT_TRUE(Check("allowed").ok());
  EXPECT_TRUE(Check("allowed/sub/f").ok());
  EXPECT_TRUE(Check("allowed/new/deeper/ckpt").ok());  // nothing of it exists yet
  EXPECT_TRUE(Check("allowed/sub/../sub/f").ok());
  EXPECT_TRUE(Check("allowed/in/f").ok());  // a symlink that stays inside
  EXPECT_TRUE(Check("allowed/in/new/file").ok());
}

TEST_F(PathConfinementTest, DotDotEscapesAreRefused) {
  EXPECT_EQ(Check("allowed/../outside/secret").code(), absl::StatusCode::kPermissionDenied);
  // `..` in the part that does not exist yet.
  EXPECT_EQ(Check("allowed/new/../../outside/x").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Check("allowed/..").code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(PathConfinementTest, SymlinkEscapesAreRefused) {
  EXPECT_EQ(Check("allowed/out").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Check("allowed/out/secret").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Check("allowed/out/not-yet/ckpt").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Check("allowed/secret").code(), absl::StatusCode::kPermissionDenied);  // a file link
  // The kernel follows the link before `..`: deep/.. is outside/a, not allowed/.
  EXPECT_EQ(Check("allowed/deep/../x").code(), absl::StatusCode::kPermissionDenied);
  absl::StatusOr<std::string> resolved = ResolvePathNow((dir_ / "allowed/deep/../x").string());
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(*resolved, (dir_ / "outside" / "a" / "x").string());
}

TEST_F(PathConfinementTest, ASiblingWithTheRootsNameAsPrefixIsOutside) {
  EXPECT_EQ(Check("allowed2/f").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Check("allowed2").code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(PathConfinementTest, TheErrorNamesFieldPathWhereItLeadsHostAndRoots) {
  const std::string path = (dir_ / "allowed" / "out" / "ckpt").string();
  const absl::Status s = CheckPathConfined("checkpoint.dir", path, roots_, "node7");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("checkpoint.dir: '" + path + "'"));
  EXPECT_THAT(s.message(), HasSubstr("leads to '" + (dir_ / "outside" / "ckpt").string() + "'"));
  EXPECT_THAT(s.message(), HasSubstr("on host node7"));
  EXPECT_THAT(s.message(), HasSubstr("allowed roots: " + (dir_ / "allowed").string()));
  EXPECT_THAT(s.message(), HasSubstr("--allowed-roots"));
}

TEST_F(PathConfinementTest, RelativePathsAreTakenFromTheWorkingDirectory) {
  absl::StatusOr<std::string> resolved = ResolvePathNow("no-such-folder/x");
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(*resolved, (fs::canonical(fs::current_path()) / "no-such-folder" / "x").string());
}

TEST_F(PathConfinementTest, RootsAreResolvedCheckedAndDeduplicated) {
  absl::StatusOr<std::vector<std::string>> roots =
      ParseAllowedRoots((dir_ / "root-link").string() + "," + (dir_ / "allowed").string() + "," +
                        (dir_ / "outside").string());
  ASSERT_TRUE(roots.ok()) << roots.status();
  EXPECT_EQ(*roots,
            (std::vector<std::string>{(dir_ / "allowed").string(), (dir_ / "outside").string()}));
  // A spec path through the root's symlink or through its real name: both inside.
  EXPECT_TRUE(
      CheckPathConfined("data.train", (dir_ / "root-link/sub/f").string(), *roots, "h").ok());
  EXPECT_TRUE(
      CheckPathConfined("data.train", (dir_ / "outside/secret").string(), *roots, "h").ok());

  for (const auto& [value, text] : std::vector<std::pair<std::string, std::string>>{
           {"", "empty"},
           {(dir_ / "allowed").string() + ",,/tmp", "empty entry"},
           {"data", "not an absolute path"},
           {(dir_ / "missing").string(), "create the folder"},
           {(dir_ / "allowed/sub/f").string(), "is not a folder"}}) {
    absl::StatusOr<std::vector<std::string>> bad = ParseAllowedRoots(value);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << value;
    EXPECT_THAT(bad.status().message(), HasSubstr(text)) << value;
  }
}

TEST_F(PathConfinementTest, EverySpecPathIsCheckedAndTheFirstOutsideNamed) {
  rackrun::v1::JobSpec spec;
  spec.mutable_data()->set_train((dir_ / "allowed/sub/f").string());
  spec.mutable_data()->set_validation((dir_ / "allowed/sub/f").string());
  spec.mutable_checkpoint()->set_dir((dir_ / "allowed/ckpt").string());
  spec.mutable_logging()->set_json((dir_ / "allowed/log.jsonl").string());
  spec.mutable_logging()->set_load_trace((dir_ / "allowed/trace").string());
  EXPECT_TRUE(CheckSpecPathsConfined(spec, roots_, "h").ok());

  const std::string outside = (dir_ / "outside/x").string();
  using v1::JobSpec;
  const std::vector<std::pair<const char*, std::function<void(JobSpec&)>>> moves = {
      {"data.train", [&](JobSpec& s) { s.mutable_data()->set_train(outside); }},
      {"data.validation", [&](JobSpec& s) { s.mutable_data()->set_validation(outside); }},
      {"checkpoint.dir", [&](JobSpec& s) { s.mutable_checkpoint()->set_dir(outside); }},
      {"logging.json", [&](JobSpec& s) { s.mutable_logging()->set_json(outside); }},
      {"logging.load_trace", [&](JobSpec& s) { s.mutable_logging()->set_load_trace(outside); }},
  };
  for (const auto& [field, move] : moves) {
    JobSpec s = spec;
    move(s);
    const absl::Status status = CheckSpecPathsConfined(s, roots_, "h");
    EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << field;
    EXPECT_THAT(status.message(), HasSubstr(std::string(field) + ": '" + outside + "'"));
    // Unconfined: the same spec passes.
    EXPECT_TRUE(CheckSpecPathsConfined(s, {}, "h").ok());
  }
}

}  // namespace
}  // namespace rackrun::jobspec
