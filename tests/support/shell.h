// Running a program the way a user does, for the end-to-end tests: a shell command with
// stdout and stderr captured in files, and the small file readers those tests need.
// Header-only; tests include it as "tests/support/shell.h".
#ifndef RACKRUN_TESTS_SUPPORT_SHELL_H_
#define RACKRUN_TESTS_SUPPORT_SHELL_H_

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace rackrun::testing {

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
