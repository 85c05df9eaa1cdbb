#include "runtime/checkpoint.h"

#include <sys/wait.h>
#include <unistd.h>

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
using ::testing::Not;
namespace fs = std::filesystem;

CheckpointFolderRun From(const std::string& checkpoint, int64_t step) {
  CheckpointFolderRun run;
  run.resumed_from = checkpoint;
  run.resumed_step = step;
  return run;
}

CheckpointFolderRun StartOver() {
  CheckpointFolderRun run;
  run.start_over = true;
  run.owner = "job 7";
  return run;
}

// The folders `<dir>/<prefix>-*` (moved-aside checkpoints).
std::vector<fs::path> Aside(const std::string& dir, const std::string& prefix) {
  std::vector<fs::path> found;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    if (e.is_directory() && e.path().filename().string().rfind(prefix + "-", 0) == 0) {
      found.push_back(e.path());
    }
  }
  return found;
}

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

TEST(CheckpointTest, TheChecksumIdentifiesTheContent) {
  const std::string dir = FreshDir("checksum");
  Checkpoint a = Sample(5), b = Sample(5);
  b.sections[1].payload[0] ^= 1;
  const absl::StatusOr<Checkpoint> la = LoadCheckpoint(*SaveCheckpoint(dir + "/a", a, 2));
  const absl::StatusOr<Checkpoint> lb = LoadCheckpoint(*SaveCheckpoint(dir + "/b", b, 2));
  const absl::StatusOr<Checkpoint> la2 = LoadCheckpoint(CheckpointPath(dir + "/a", 5));
  ASSERT_TRUE(la.ok() && lb.ok() && la2.ok());
  EXPECT_NE(la->checksum, lb->checksum);  // same layout, one bit of one payload differs
  EXPECT_EQ(la->checksum, la2->checksum);
}

TEST(CheckpointTest, ASpecOrOtherFileIsNamedAsNotACheckpoint) {
  const std::string dir = FreshDir("not_a_checkpoint");
  const std::string spec = dir + "/job.yaml";
  std::ofstream(spec) << "model: {width: 16}\ntraining: {steps: 6}\n";
  absl::StatusOr<Checkpoint> c = LoadCheckpointForResume(spec);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("'" + spec + "' is not a rackrun checkpoint"));
  EXPECT_THAT(c.status().message(), HasSubstr("perhaps a job spec"));
  EXPECT_THAT(c.status().message(), HasSubstr("step-<8 digits>.ckpt"));
  EXPECT_THAT(c.status().message(), Not(HasSubstr("magic")));
}

TEST(CheckpointFolderTest, ASecondWriterIsRefusedNamingTheHoldersPidAndHost) {
  const std::string dir = FreshDir("lock");
  absl::StatusOr<CheckpointFolderClaim> first = ClaimCheckpointFolder(dir, {});
  ASSERT_TRUE(first.ok()) << first.status();
  // The run that starts a folder is recorded as its owner.
  EXPECT_EQ(*CheckpointFolderOwner(dir),
            "pid " + std::to_string(getpid()) + " on host " + base::HostName());
  absl::StatusOr<CheckpointFolderClaim> second = ClaimCheckpointFolder(dir, {});
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(), HasSubstr("is in use by pid " + std::to_string(getpid()) +
                                                   " on host " + base::HostName()));
  // A writer in another process is refused too (the lock is not per process).
  const pid_t child = fork();
  if (child == 0) _exit(ClaimCheckpointFolder(dir, {}).ok() ? 1 : 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child took the lock";
  // Released with the claim.
  first = absl::UnknownError("released");
  EXPECT_TRUE(ClaimCheckpointFolder(dir, {}).ok());
}

TEST(CheckpointFolderTest, AFreshRunIntoAnotherRunsFolderIsRefusedOrStartsOver) {
  const std::string dir = FreshDir("fresh_into_used");
  ASSERT_TRUE(SaveCheckpoint(dir, Sample(2), 2).ok());
  ASSERT_TRUE(SaveCheckpoint(dir, Sample(4), 2).ok());
  const std::string before = *ReadWholeFile(CheckpointPath(dir, 4));
  absl::StatusOr<CheckpointFolderClaim> c = ClaimCheckpointFolder(dir, {});
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("already holds checkpoints of another run"));
  EXPECT_THAT(c.status().message(), HasSubstr("step-00000004.ckpt"));
  EXPECT_THAT(c.status().message(), HasSubstr("--resume " + dir));
  EXPECT_THAT(c.status().message(), HasSubstr("--start-over"));
  EXPECT_EQ(*ReadWholeFile(CheckpointPath(dir, 4)), before);
  // Resuming a checkpoint of another folder into this one is a fresh run here as well.
  const std::string other = FreshDir("fresh_into_used_other");
  const std::string elsewhere = *SaveCheckpoint(other, Sample(9), 2);
  c = ClaimCheckpointFolder(dir, From(elsewhere, 9));
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("another run"));

  EXPECT_FALSE(CheckpointFolderOwner(dir).ok());  // refused runs record nothing
  c = ClaimCheckpointFolder(dir, StartOver());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*CheckpointFolderOwner(dir), "job 7");
  EXPECT_TRUE(ListCheckpoints(dir).empty());
  const std::vector<fs::path> previous = Aside(dir, "previous");
  ASSERT_EQ(previous.size(), 1u);
  EXPECT_EQ(ListCheckpoints(previous[0].string()).size(), 2u);
  EXPECT_EQ(*ReadWholeFile((previous[0] / "step-00000004.ckpt").string()), before);
  ASSERT_EQ(c->notes.size(), 1u);
  EXPECT_THAT(c->notes[0], HasSubstr(previous[0].string()));
}

TEST(CheckpointFolderTest, ResumingAnOlderCheckpointMovesTheNewerOnesAside) {
  const std::string dir = FreshDir("resume_older");
  for (int64_t step : {2, 4, 6}) ASSERT_TRUE(SaveCheckpoint(dir, Sample(step), 3).ok());
  // Continuing from the newest changes nothing.
  absl::StatusOr<CheckpointFolderClaim> c =
      ClaimCheckpointFolder(dir, From(CheckpointPath(dir, 6), 6));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->notes.empty());
  c = absl::UnknownError("released");
  c = ClaimCheckpointFolder(dir, From(CheckpointPath(dir, 4), 4));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(CheckpointFolderOwner(dir).ok()) << "continuing a folder does not claim it anew";
  EXPECT_THAT(ListCheckpoints(dir), ElementsAre(CheckpointPath(dir, 2), CheckpointPath(dir, 4)));
  const std::vector<fs::path> superseded = Aside(dir, "superseded");
  ASSERT_EQ(superseded.size(), 1u);
  EXPECT_TRUE(fs::exists(superseded[0] / "step-00000006.ckpt"));
  ASSERT_EQ(c->notes.size(), 1u);
  EXPECT_THAT(c->notes[0], HasSubstr("step-00000006.ckpt"));
}

TEST(CheckpointFolderTest, APathThatIsAFileOrCannotBeCreatedIsRefusedWithTheReason) {
  const std::string dir = FreshDir("not_a_folder");
  const std::string file = dir + "/ckpt";
  std::ofstream(file) << "x";
  absl::StatusOr<CheckpointFolderClaim> c = ClaimCheckpointFolder(file, {});
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(),
              HasSubstr("checkpoint.dir: '" + file + "' exists and is not a folder"));
  c = ClaimCheckpointFolder(file + "/sub", {});
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("checkpoint.dir: cannot create '" + file + "/sub'"));
  EXPECT_THAT(c.status().message(), HasSubstr("Not a directory"));
}

TEST(CheckpointFolderTest, TemporariesOfDeadWritersAreRemovedAndLiveOnesKept) {
  const std::string dir = FreshDir("stale");
  // A pid that is certainly gone: a child that has exited and been reaped.
  const pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  const std::string dead = CheckpointPath(dir, 8) + ".tmp-" + std::to_string(child);
  const std::string live = CheckpointPath(dir, 8) + ".tmp-" + std::to_string(getppid());
  const std::string unrelated = dir + "/notes.txt.tmp-" + std::to_string(child);
  for (const std::string& f : {dead, live, unrelated}) std::ofstream(f) << "partial";
  absl::StatusOr<CheckpointFolderClaim> c = ClaimCheckpointFolder(dir, {});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(unrelated));
  ASSERT_EQ(c->notes.size(), 1u);
  EXPECT_THAT(c->notes[0], HasSubstr(fs::path(dead).filename().string()));
}

}  // namespace
}  // namespace rackrun::runtime
