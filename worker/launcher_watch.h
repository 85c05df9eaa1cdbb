// Orphans: a worker started by a launcher (mpirun through its local daemon, srun through
// slurmstepd) belongs to that launch and ends with it; one started by systemd or by hand
// outlives whatever started it and keeps waiting for its coordinator.
//
// LauncherVariable() says which it is: the name of the first launcher variable set
// (OMPI_COMM_WORLD_RANK for Open MPI's mpirun, SLURM_PROCID for srun), or null. RANK and
// PMIX_RANK are not launcher evidence here: torchrun-style RANK is how workers are numbered by
// hand, and PMIX_RANK alone is not set by the two launchers without their own variable.
//
// LauncherWatch notices the launcher's death as a change of getppid(): the launcher is the
// worker's parent process, and when it dies the kernel re-parents the worker (to init or a
// subreaper). It polls instead of using prctl(PR_SET_PDEATHSIG), which fires when the
// parent *thread* that forked the worker ends (the launchers are multi-threaded) and has to
// be armed before a race with the parent's death. Polling costs one system call per period.
//
// On the death: `on_death` runs once on the watch thread (the worker's drain: the running
// job stops at a step boundary, its result is reported, the worker deregisters); if the
// process has not ended `grace` later (a coordinator that cannot be reached, peers that
// hang), the watch prints why and ends the process with exit status 3.
//
// Thread-safety: construct and destroy on one thread; destroying the watch stops it (also
// during the grace, so a worker whose drain finished in time exits normally).
#ifndef RACKRUN_WORKER_LAUNCHER_WATCH_H_
#define RACKRUN_WORKER_LAUNCHER_WATCH_H_

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace rackrun::worker {

// The launcher variable in this process's environment, or nullptr (see above).
const char* LauncherVariable();

class LauncherWatch {
 public:
  // Watches `launcher` (the getppid() read first thing in main, before a launcher's death
  // could re-parent the process) from now on. A launcher already gone when the watch
  // starts (getppid() differs, or the launcher given is 1) counts as a death at once.
  LauncherWatch(pid_t launcher, std::function<void(pid_t launcher)> on_death,
                std::chrono::milliseconds grace,
                std::chrono::milliseconds period = std::chrono::milliseconds(200));
  ~LauncherWatch();
  LauncherWatch(const LauncherWatch&) = delete;
  LauncherWatch& operator=(const LauncherWatch&) = delete;

  pid_t launcher() const { return launcher_; }

 private:
  void Loop();

  const pid_t launcher_;
  const std::function<void(pid_t)> on_death_;
  const std::chrono::milliseconds grace_;
  const std::chrono::milliseconds period_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopped_ = false;  // guarded by mu_
  std::thread thread_;
};

}  // namespace rackrun::worker

#endif  // RACKRUN_WORKER_LAUNCHER_WATCH_H_
