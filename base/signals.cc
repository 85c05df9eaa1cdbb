#include "base/signals.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

namespace rackrun::base {
namespace {

int g_pipe[2] = {-1, -1};

void OnSignal(int sig) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  (void)!::write(g_pipe[1], &byte, 1);
  errno = saved;
}

int ReadSignal() {
  unsigned char sig = 0;
  while (::read(g_pipe[0], &sig, 1) != 1) {
  }
  return sig;
}

}  // namespace

absl::Status WatchStopSignals(std::function<void(int signal)> on_first) {
  if (g_pipe[0] >= 0) return absl::FailedPreconditionError("stop signals are already watched");
  if (::pipe(g_pipe) != 0) {
    return absl::InternalError(absl::StrCat("pipe for signals: ", std::strerror(errno)));
  }
  struct sigaction action {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  if (sigaction(SIGTERM, &action, nullptr) != 0 || sigaction(SIGINT, &action, nullptr) != 0) {
    return absl::InternalError(absl::StrCat("sigaction: ", std::strerror(errno)));
  }
  std::thread([on_first = std::move(on_first)] {
    on_first(ReadSignal());
    const int second = ReadSignal();
    std::_Exit(128 + second);
  }).detach();
  return absl::OkStatus();
}

void IgnoreSigpipe() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      std::signal(SIGPIPE, SIG_IGN);
    }
  });
}

}  // namespace rackrun::base
