// End-to-end tests of issue #12's input bounds in the CLI: `rackrun plan` refuses an
// oversized trace line with FILE:LINE, names a directory given as --trace, refuses runs
// over its stated limits, and leaves no partial --out; `rackrun data` refuses
// --val-fraction 0 with what to do instead.

#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/shell.h"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using Result = ::rackrun::testing::ShellResult;

// Per-test folder: CTest runs the tests of this file in parallel processes.
std::filesystem::path Dir() {
  const std::filesystem::path dir = ::rackrun::testing::ScratchDir("cli_limits_");
  std::filesystem::create_directories(dir);
  return dir;
}

Result RunCli(const std::string& args) {
  return ::rackrun::testing::Shell(std::string(RACKRUN_BINARY) + " " + args, Dir() / "stdout.txt",
                                   Dir() / "stderr.txt");
}

TEST(InputLimitsTest, PlanRefusesALineOverTheLimitWithFileAndLine) {
  const std::string trace = (Dir() / "long.jsonl").string();
  {
    // 17 MiB of spaces before a JSON object: over the 16 MiB limit.
    std::ofstream out(trace);
    out << std::string((size_t{17} << 20), ' ') << "{}\n";
  }
  Result r = RunCli("plan --trace " + trace);
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr(trace + ":1: line is longer than 16777216 bytes"));
}

TEST(InputLimitsTest, PlanSaysATraceDirectoryIsADirectory) {
  Result r = RunCli("plan --trace " + Dir().string());
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("is a directory"));
  EXPECT_THAT(r.err, Not(HasSubstr("read error")));
}

TEST(InputLimitsTest, PlanRefusesRunsOverItsLimits) {
  Result r = RunCli("plan --generate --microbatches 1000000000");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("--microbatches: 1000000000 is out of range; use 1..1000000"));
  r = RunCli("plan --generate --microbatches 1000 --layers 1001");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err,
              HasSubstr("1000 x --layers 1001 = 1001000 entries, over the limit of 1000000"));
  r = RunCli("plan --generate --ranks 8192 --experts 8192");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("67108864 loads per entry, over the limit of 16777216"));
}

TEST(InputLimitsTest, PlanOutIsCompleteOrAbsentAndErrorsNameFileAndErrno) {
  const std::string missing = (Dir() / "no-such-dir" / "t.jsonl").string();
  Result r = RunCli("plan --generate --ranks 8 --masters-per-rank 2 --topk 2 --out " + missing);
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr(missing));
  EXPECT_THAT(r.err, HasSubstr("No such file or directory"));

  const std::string out = (Dir() / "t.jsonl").string();
  r = RunCli("plan --generate --ranks 8 --masters-per-rank 2 --topk 2 --microbatches 3 --out " +
             out);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(::rackrun::testing::Lines(out).size(), 3u);
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(Dir())) {
    files += e.path().filename().string().find(".tmp-") != std::string::npos;
  }
  EXPECT_EQ(files, 0) << "a temporary file was left behind";
}

TEST(InputLimitsTest, DataRefusesAValidationFractionAboveOneHalf) {
  const std::string text = (Dir() / "text.txt").string();
  { std::ofstream(text) << "one document\n\f\nanother document\n"; }
  const std::string out = (Dir() / "data").string();
  Result r = RunCli("data --input " + text + " --output " + out + " --val-fraction 0.7");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("--val-fraction: 0.7 is out of range"));
  EXPECT_FALSE(std::filesystem::exists(out));
  // 0 writes the training dataset alone.
  r = RunCli("data --input " + text + " --output " + out + " --val-fraction 0");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(out + "/text.idx"));
  EXPECT_FALSE(std::filesystem::exists(out + "/text-val.idx"));
}

}  // namespace
