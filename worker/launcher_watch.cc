#include "worker/launcher_watch.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <utility>

namespace rackrun::worker {

const char* LauncherVariable() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "SLURM_PROCID"}) {
    if (std::getenv(name) != nullptr) return name;
  }
  return nullptr;
}

LauncherWatch::LauncherWatch(pid_t launcher, std::function<void(pid_t)> on_death,
                             std::chrono::milliseconds grace, std::chrono::milliseconds period)
    : launcher_(launcher), on_death_(std::move(on_death)), grace_(grace), period_(period) {
  thread_ = std::thread([this] { Loop(); });
}

LauncherWatch::~LauncherWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void LauncherWatch::Loop() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    while (::getppid() == launcher_ && launcher_ != 1) {
      if (cv_.wait_for(lock, period_, [&] { return stopped_; })) return;
    }
  }
  on_death_(launcher_);
  std::unique_lock<std::mutex> lock(mu_);
  if (cv_.wait_for(lock, grace_, [&] { return stopped_; })) return;
  std::fprintf(stderr,
               "rackrun-worker: still running %lld s after the launcher (pid %d) died; exiting\n",
               static_cast<long long>(std::chrono::duration_cast<std::chrono::seconds>(grace_).count()),
               static_cast<int>(launcher_));
  std::fflush(stderr);
  std::_Exit(3);
}

}  // namespace rackrun::worker
