#include "runtime/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::runtime {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string FreshDir(const std::string& name) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / "ckpt_test" / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

Checkpoint Sample(int64_t step) {
  std::vector<float> w = {1.5f, -2.0f, static_cast<float>(step)};
  return Checkpoint{.step = step,
                    .sections = {{"meta", R"({"step": )" + std::to_string(step) + "}"},
                                 {"param/w", PackFloats(w)}}};
}

void FlipByte(const std::string& path, std::streamoff offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x40);
  f.seekp(offset);
  f.write(&c, 1);
}

TEST(Crc32cTest, KnownVectors) {
  // RFC 3720 appendix B.4 check value of "123456789".
  EXPECT_EQ(Crc32c("123456789"), 0xe3069283u);
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8a9136aau);
  EXPECT_EQ(Crc32c("6789", Crc32c("12345")), Crc32c("123456789"));
}

TEST(CheckpointTest, RoundTripsSections) {
  const std::string dir = FreshDir("round_trip");
  absl::StatusOr<std::string> path = SaveCheckpoint(dir, Sample(7), 2);
  ASSERT_TRUE(path.ok()) << path.status();
  EXPECT_EQ(*path, CheckpointPath(dir, 7));
  absl::StatusOr<Checkpoint> c = LoadCheckpoint(*path);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->step, 7);
  ASSERT_NE(c->Find("param/w"), nullptr);
  std::vector<float> w(3);
  ASSERT_TRUE(UnpackFloats(*c->Find("param/w"), w).ok());
  EXPECT_THAT(w, ElementsAre(1.5f, -2.0f, 7.0f));
  std::vector<float> wrong(4);
  EXPECT_THAT(UnpackFloats(*c->Find("param/w"), wrong).message(), HasSubstr("different model"));
  // No temp file is left behind.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), {}), 1);
}

TEST(CheckpointTest, KeepsTheNewestAndNeverFewerThanTwo) {
  const std::string dir = FreshDir("keep");
  for (int64_t step = 10; step <= 50; step += 10)
    ASSERT_TRUE(SaveCheckpoint(dir, Sample(step), 1).ok());
  EXPECT_THAT(ListCheckpoints(dir), ElementsAre(CheckpointPath(dir, 40), CheckpointPath(dir, 50)));
  ASSERT_TRUE(SaveCheckpoint(dir, Sample(60), 3).ok());
  EXPECT_EQ(ListCheckpoints(dir).size(), 3u);
}

TEST(CheckpointTest, RefusesATruncatedFileNamingIt) {
  const std::string dir = FreshDir("truncated");
  const std::string path = *SaveCheckpoint(dir, Sample(3), 2);
  const auto size = std::filesystem::file_size(path);
  for (const auto cut : {size - 1, size - 20, size / 2, uintmax_t{5}}) {
    std::filesystem::copy_file(path, path + ".full",
                               std::filesystem::copy_options::overwrite_existing);
    std::filesystem::resize_file(path, cut);
    absl::StatusOr<Checkpoint> c = LoadCheckpoint(path);
    ASSERT_FALSE(c.ok()) << "cut at " << cut;
    EXPECT_THAT(c.status().message(), HasSubstr(path));
    EXPECT_THAT(c.status().message(), HasSubstr("truncated"));
    std::filesystem::rename(path + ".full", path);
  }
}

TEST(CheckpointTest, RefusesACorruptedByteAnywhere) {
  const std::string dir = FreshDir("corrupt");
  const std::string path = *SaveCheckpoint(dir, Sample(3), 2);
  const auto size = static_cast<std::streamoff>(std::filesystem::file_size(path));
  for (std::streamoff offset = 0; offset < size; ++offset) {
    FlipByte(path, offset);
    EXPECT_FALSE(LoadCheckpoint(path).ok()) << "flipped byte " << offset;
    FlipByte(path, offset);
  }
  EXPECT_TRUE(LoadCheckpoint(path).ok());
}

TEST(CheckpointTest, ResumeRefusesADamagedNewestAndNamesThePreviousGoodOne) {
  const std::string dir = FreshDir("resume");
  ASSERT_TRUE(SaveCheckpoint(dir, Sample(10), 2).ok());
  const std::string newest = *SaveCheckpoint(dir, Sample(20), 2);
  std::string loaded;
  absl::StatusOr<Checkpoint> c = LoadCheckpointForResume(dir, &loaded);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->step, 20);
  EXPECT_EQ(loaded, newest);

  FlipByte(newest, 40);
  c = LoadCheckpointForResume(dir);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(newest));
  EXPECT_THAT(c.status().message(), HasSubstr(CheckpointPath(dir, 10)));
  // The previous good checkpoint is still there and loads.
  c = LoadCheckpointForResume(CheckpointPath(dir, 10));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->step, 10);
}

TEST(CheckpointTest, EmptyOrMissingFolderIsAClearError) {
  const std::string dir = FreshDir("empty");
  absl::StatusOr<Checkpoint> c = LoadCheckpointForResume(dir);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("no checkpoint"));
  EXPECT_FALSE(LoadCheckpointForResume(dir + "/nope.ckpt").ok());
}

TEST(WriteFileAtomicallyTest, ReplacesContentAndLeavesNoTemporaries) {
  const std::string dir = FreshDir("atomic");
  const std::string path = dir + "/f";
  ASSERT_TRUE(WriteFileAtomically(path, "first").ok());
  ASSERT_TRUE(WriteFileAtomically(path, "second").ok());
  EXPECT_EQ(*ReadWholeFile(path), "second");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), {}), 1);
  EXPECT_FALSE(WriteFileAtomically(dir + "/missing-folder/f", "x").ok());
}

}  // namespace
}  // namespace rackrun::runtime
