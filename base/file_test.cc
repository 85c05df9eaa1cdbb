#include "base/file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include "gtest/gtest.h"
#include "tests/support/shell.h"

namespace rackrun::base {
namespace {

// The test's own folder, removed when it passes.
std::string ScratchDir() {
  const std::filesystem::path dir = ::rackrun::testing::ScratchDir("base_file_test_");
  std::filesystem::create_directories(dir);
  return dir.string();
}

TEST(FileTest, WritesAtomicallyAndReadsBack) {
  const std::string path = ScratchDir() + "/a.txt";
  ASSERT_TRUE(WriteFileAtomically(path, "first").ok());
  ASSERT_TRUE(WriteFileAtomically(path, "second").ok());
  absl::StatusOr<std::string> read = ReadWholeFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "second");
  // No temporary file is left behind.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(ScratchDir())) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);
}

TEST(FileTest, ErrorsNameTheFile) {
  absl::StatusOr<std::string> read = ReadWholeFile("/nonexistent/x");
  ASSERT_EQ(read.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(read.status().message().find("/nonexistent/x"), std::string::npos);
  const absl::Status write = WriteFileAtomically("/nonexistent/dir/y", "z");
  ASSERT_FALSE(write.ok());
  EXPECT_NE(write.message().find("/nonexistent/dir/y"), std::string::npos);
}

TEST(FileTest, StreamedWriteIsCompleteOrAbsent) {
  const std::string dir = ScratchDir() + "/streamed";
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/out.txt";
  ASSERT_TRUE(WriteFileAtomically(path, "old").ok());
  {
    absl::StatusOr<AtomicFileWriter> w = AtomicFileWriter::Open(path);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE(w->Append("new ").ok());
    ASSERT_TRUE(w->Append("text").ok());
    EXPECT_EQ(*ReadWholeFile(path), "old");  // untouched until Commit
    ASSERT_TRUE(w->Commit().ok());
  }
  EXPECT_EQ(*ReadWholeFile(path), "new text");
  {
    // Abandoned (an error path returns early): the old file stays, no temporary is left.
    absl::StatusOr<AtomicFileWriter> w = AtomicFileWriter::Open(path);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->Append("partial").ok());
  }
  EXPECT_EQ(*ReadWholeFile(path), "new text");
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);
  absl::StatusOr<AtomicFileWriter> missing = AtomicFileWriter::Open("/nonexistent/dir/z");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/dir/z"), std::string::npos);
  EXPECT_NE(missing.status().message().find("No such file"), std::string::npos);
}

}  // namespace
}  // namespace rackrun::base
