// Long-running processes for the daemon tests (coordinator, workers, mpirun of workers):
// a child with its output in a file, killed if still running at the end; waiting for a
// line in a file; a free loopback port. Header-only.
#ifndef RACKRUN_TESTS_SUPPORT_PROCESS_H_
#define RACKRUN_TESTS_SUPPORT_PROCESS_H_

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/shell.h"

namespace rackrun::testing {

// A child process with stdout and stderr into one file; killed (SIGKILL) if still running
// when destroyed, or when the test process dies. argv[0] is a path (execv); `env` entries
// "NAME=VALUE" are added to the inherited environment.
class Child {
 public:
  Child(const std::vector<std::string>& argv, const std::filesystem::path& output,
        const std::vector<std::string>& env = {}) {
    const pid_t parent = getpid();
    pid_ = fork();
    if (pid_ == 0) {
      // Killed with the test process too (a sanitizer that halts the test, a crash): a
      // daemon left running would keep CTest's output pipe open and CTest would wait.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      const int fd = open(output.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      for (const std::string& e : env) putenv(const_cast<char*>(e.c_str()));
      std::vector<char*> args;
      for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
  }
  ~Child() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  void Signal(int sig) const { kill(pid_, sig); }

  // The exit code, -1 after a signal, -2 when it has not exited within `timeout`.
  int Wait(std::chrono::milliseconds timeout) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -2;
  }

 private:
  pid_t pid_ = -1;
  bool exited_ = false;
};

// Polls `path` until its text matches `pattern` (the first match, with its groups), for
// at most `timeout`; an empty match when it never does. `text` receives the last read.
inline std::smatch WaitForText(const std::filesystem::path& path, const std::regex& pattern,
                               std::string* text,
                               std::chrono::milliseconds timeout = std::chrono::seconds(15)) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  std::smatch m;
  while (std::chrono::steady_clock::now() < end) {
    *text = Slurp(path);
    if (std::regex_search(*text, m, pattern)) return m;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return m;
}

// A loopback port nobody listens on (bound, then closed again).
inline int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace rackrun::testing

#endif  // RACKRUN_TESTS_SUPPORT_PROCESS_H_
