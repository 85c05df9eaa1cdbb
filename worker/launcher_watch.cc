#include "worker/launcher_watch.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace rackrun::worker {

const char* LauncherVariable() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "SLURM_PROCID"}) {
    if (std::getenv(name) != nullptr) return name;
  }
  return nullptr;
}

namespace {

bool ReadInt(const char* text, int* out) { return text != nullptr && absl::SimpleAtoi(text, out); }

}  // namespace

LauncherPlace LauncherPlaceOf(const std::function<const char*(const char*)>& getenv) {
  const auto get = [&](const char* name) -> const char* {
    return getenv ? getenv(name) : std::getenv(name);
  };
  struct Launcher {
    const char* rank;
    std::vector<const char*> sizes;  // the first set is read
    const char* local_rank;
  };
  static const Launcher kLaunchers[] = {
      {"OMPI_COMM_WORLD_RANK", {"OMPI_COMM_WORLD_SIZE"}, "OMPI_COMM_WORLD_LOCAL_RANK"},
      {"SLURM_PROCID", {"SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"}, "SLURM_LOCALID"},
      {"PMIX_RANK", {}, nullptr},
      {"RANK", {"WORLD_SIZE"}, "LOCAL_RANK"},
  };
  LauncherPlace place;
  for (const Launcher& l : kLaunchers) {
    if (!ReadInt(get(l.rank), &place.rank)) continue;
    place.rank_variable = l.rank;
    for (const char* size : l.sizes) {
      if (place.size_variable == nullptr) place.size_variable = size;
      if (ReadInt(get(size), &place.size)) {
        place.size_variable = size;
        break;
      }
    }
    if (place.size < 0) place.size = 0;
    if (l.local_rank != nullptr && !ReadInt(get(l.local_rank), &place.local_rank))
      place.local_rank = 0;
    return place;
  }
  place.rank = -1;
  return place;
}

std::string DescribeLauncherPlace(const LauncherPlace& place) {
  if (place.rank_variable == nullptr) return "no launcher rank (started by hand)";
  if (place.size > 0) {
    return absl::StrCat("launcher rank ", place.rank, " of ", place.size, " (", place.rank_variable,
                        ")");
  }
  return absl::StrCat("launcher rank ", place.rank, " (", place.rank_variable, "; ",
                      place.size_variable != nullptr ? absl::StrCat(place.size_variable, " not set")
                                                     : std::string("no size in the environment"),
                      ")");
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
  std::fprintf(
      stderr, "rackrun-worker: still running %lld s after the launcher (pid %d) died; exiting\n",
      static_cast<long long>(std::chrono::duration_cast<std::chrono::seconds>(grace_).count()),
      static_cast<int>(launcher_));
  std::fflush(stderr);
  std::_Exit(3);
}

}  // namespace rackrun::worker
