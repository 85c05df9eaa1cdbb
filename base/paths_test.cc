#include "base/paths.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/shell.h"

namespace rackrun::base {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// A scratch tree:
//   root/             the allowed root
//   root/sub/         a folder inside
//   root/dangling ->  ../outside/x.json   (a link whose target does not exist)
//   root/loop     ->  loop
//   outside/
class PathsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::rackrun::testing::ScratchDir("base_paths_test_");
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "root" / "sub");
    fs::create_directories(dir_ / "outside");
    dir_ = fs::canonical(dir_);
    fs::create_symlink("../outside/x.json", dir_ / "root" / "dangling");
    fs::create_symlink("loop", dir_ / "root" / "loop");
  }
  void TearDown() override { SetJobFileRoots({}); }

  std::string At(const std::string& relative) const { return (dir_ / relative).string(); }

  fs::path dir_;
};

TEST_F(PathsTest, ADanglingSymlinkLeadsToItsTarget) {
  absl::StatusOr<std::string> resolved = ResolvePath(At("root/dangling"));
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(*resolved, At("outside/x.json"));
  // std::filesystem::weakly_canonical stops at the dangling link: the hole this closes.
  EXPECT_EQ(fs::weakly_canonical(At("root/dangling")).string(), At("root/dangling"));
  // Below a missing component the rest is lexical; `..` after a link is the target's.
  EXPECT_EQ(*ResolvePath(At("root/new/../sub/./f")), At("root/sub/f"));
  EXPECT_EQ(*ResolvePath(At("root/dangling/../y")), At("outside/y"));
  EXPECT_THAT(std::string(ResolvePath(At("root/loop")).status().message()),
              HasSubstr("symbolic links (a loop?)"));
  EXPECT_TRUE(PathIsWithin(At("root/sub/f"), At("root")));
  EXPECT_TRUE(PathIsWithin(At("root"), At("root")));
  EXPECT_FALSE(PathIsWithin(At("root2/f"), At("root")));
}

TEST_F(PathsTest, ConfinedJobFilesNeverLeaveTheRootsAndOwnFilesAreNotConfined) {
  SetJobFileRoots({At("root")});
  // A dangling link as an output: refused, and nothing is created outside.
  absl::StatusOr<int> fd =
      OpenRegularFile(At("root/dangling"), O_WRONLY | O_CREAT | O_TRUNC, FileUse::kJob);
  ASSERT_EQ(fd.status().code(), absl::StatusCode::kPermissionDenied) << fd.status();
  EXPECT_THAT(std::string(fd.status().message()),
              HasSubstr(absl::StrCat("leads to '", At("outside/x.json"))));
  EXPECT_FALSE(fs::exists(At("outside/x.json")));
  EXPECT_EQ(WriteFileAtomically(At("root/dangling"), "x", FileUse::kJob).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_FALSE(fs::exists(At("outside/x.json")));
  // Inside: created, written atomically, read back.
  ASSERT_TRUE(WriteFileAtomically(At("root/sub/ok"), "fine", FileUse::kJob).ok());
  EXPECT_EQ(*ReadWholeFile(At("root/sub/ok"), FileUse::kJob), "fine");
  // The process's own files are not job files.
  std::ofstream(At("outside/own")) << "own";
  EXPECT_EQ(*ReadWholeFile(At("outside/own")), "own");
  EXPECT_EQ(ReadWholeFile(At("outside/own"), FileUse::kJob).status().code(),
            absl::StatusCode::kPermissionDenied);
}

// A folder swapped for a symlink after the attempt's start check (here: after an atomic
// writer opened its folder) cannot redirect the file: the rename happens in the folder
// that was opened, never through the link.
TEST_F(PathsTest, AFolderSwappedForASymlinkAfterTheCheckIsNotFollowed) {
  SetJobFileRoots({At("root")});
  absl::StatusOr<AtomicFileWriter> writer =
      AtomicFileWriter::Open(At("root/sub/ckpt"), FileUse::kJob);
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_TRUE(writer->Append("checkpoint").ok());
  fs::rename(At("root/sub"), At("root/real"));
  fs::create_directory_symlink(At("outside"), At("root/sub"));
  ASSERT_TRUE(writer->Commit().ok());
  EXPECT_TRUE(fs::is_empty(At("outside")));
  EXPECT_EQ(*ReadWholeFile(At("root/real/ckpt")), "checkpoint");
  // A later open through the swapped folder is refused by name.
  absl::StatusOr<int> fd = OpenRegularFile(At("root/sub/log"), O_WRONLY | O_CREAT, FileUse::kJob);
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kPermissionDenied) << fd.status();
  EXPECT_TRUE(fs::is_empty(At("outside")));
}

TEST_F(PathsTest, SpecialFilesAreRefusedWithoutBlocking) {
  ASSERT_EQ(::mkfifo(At("root/fifo").c_str(), 0600), 0);
  for (const int flags : {O_RDONLY, O_WRONLY | O_CREAT | O_TRUNC, O_RDWR}) {
    absl::StatusOr<int> fd = OpenRegularFile(At("root/fifo"), flags, FileUse::kJob);
    EXPECT_EQ(fd.status().code(), absl::StatusCode::kInvalidArgument) << flags;
    EXPECT_THAT(std::string(fd.status().message()),
                HasSubstr(absl::StrCat("'", At("root/fifo"), "' is a FIFO, not a regular file")));
  }
  EXPECT_THAT(std::string(ReadWholeFile("/dev/zero").status().message()),
              HasSubstr("is a character device"));
  EXPECT_THAT(std::string(ReadSmallFile(At("root"), 10).status().message()),
              HasSubstr("is a directory"));
  std::ofstream(At("root/big")) << std::string(11, 'x');
  EXPECT_THAT(std::string(ReadSmallFile(At("root/big"), 10).status().message()),
              HasSubstr("larger than 10 bytes"));
  EXPECT_EQ(*ReadSmallFile(At("root/big"), 11), std::string(11, 'x'));
}

}  // namespace
}  // namespace rackrun::base
