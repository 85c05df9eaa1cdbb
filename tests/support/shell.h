// Running a program the way a user does, for the end-to-end tests: a shell command with
// stdout and stderr captured in files, and the small file readers those tests need.
// Header-only; tests include it as "tests/support/shell.h".
#ifndef RACKRUN_TESTS_SUPPORT_SHELL_H_
#define RACKRUN_TESTS_SUPPORT_SHELL_H_

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace rackrun::testing {

// Removes the scratch folders a test was handed (ScratchDir) when it ends without a
// failure; a failed test's folder stays for inspection. Registered with Google Test on the
// first ScratchDir call, which owns it from then on.
class ScratchFolders : public ::testing::EmptyTestEventListener {
 public:
  static ScratchFolders& Get() {
    static ScratchFolders* const folders = [] {
      auto* f = new ScratchFolders;
      ::testing::UnitTest::GetInstance()->listeners().Append(f);
      return f;
    }();
    return *folders;
  }
  void Track(const std::filesystem::path& dir) {
    if (std::find(dirs_.begin(), dirs_.end(), dir) == dirs_.end()) dirs_.push_back(dir);
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!info.result()->Failed()) {
      for (const std::filesystem::path& dir : dirs_) {
        std::error_code ec;
        std::filesystem::remove_all(dir, ec);
      }
    }
    dirs_.clear();
  }

 private:
  ScratchFolders() = default;
  std::vector<std::filesystem::path> dirs_;
};

// The running test's scratch folder: TempDir()/<prefix><test name>-<pid>. The pid keeps runs
// of one test side by side (two checkouts, a loop of it beside the suite) out of each
// other's folders. Not created; callers remove and create it. Removed when the test ends
// without a failure (ScratchFolders). Call it from the test's own thread.
inline std::filesystem::path ScratchDir(const std::string& prefix) {
  std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) /
      (prefix + ::testing::UnitTest::GetInstance()->current_test_info()->name() + "-" +
       std::to_string(::getpid()));
  ScratchFolders::Get().Track(dir);
  return dir;
}

struct ShellResult {
  int code = -1;  // exit status; -1 when the command did not exit normally
  std::string out;
  std::string err;
};

// The whole file, or "" when it cannot be read.
inline std::string Slurp(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline std::vector<std::string> Lines(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Prints the last `lines` lines of every *.log file directly in `dir` (name order) to
// stdout: a failed end-to-end test shows its daemons' side in the CTest output and the CI
// log, not only in a folder that the next run of the same test wipes.
inline void PrintLogTails(const std::filesystem::path& dir, size_t lines = 40) {
  std::vector<std::filesystem::path> logs;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.is_regular_file() && entry.path().extension() == ".log") logs.push_back(entry.path());
  }
  std::sort(logs.begin(), logs.end());
  for (const std::filesystem::path& log : logs) {
    const std::vector<std::string> all = Lines(log);
    const size_t from = all.size() > lines ? all.size() - lines : 0;
    std::printf("---- %s (last %zu of %zu lines)\n", log.string().c_str(), all.size() - from,
                all.size());
    for (size_t i = from; i < all.size(); ++i) std::printf("%s\n", all[i].c_str());
  }
  std::fflush(stdout);
}

// Runs `command` with /bin/sh, stdout into `out` and stderr into `err` (then read back).
inline ShellResult Shell(const std::string& command, const std::filesystem::path& out,
                         const std::filesystem::path& err) {
  const std::string full = command + " >" + out.string() + " 2>" + err.string();
  const int status = std::system(full.c_str());
  ShellResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = Slurp(out);
  r.err = Slurp(err);
  return r;
}

}  // namespace rackrun::testing

#endif  // RACKRUN_TESTS_SUPPORT_SHELL_H_
