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
#include <string>
#include <thread>

namespace rackrun::worker {

// The launcher variable in this process's environment, or nullptr (see above).
const char* LauncherVariable();

// Where the launcher put this worker: rank, size and local rank, each pair read from one
// launcher's variables (the first whose rank variable is set, in this order): Open MPI
// (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK), Slurm (SLURM_PROCID, SLURM_NTASKS or
// SLURM_STEP_NUM_TASKS, SLURM_LOCALID), PMIx (PMIX_RANK; PMIx puts no size in the
// environment), torchrun-style (RANK, WORLD_SIZE, LOCAL_RANK). A rank never comes with
// another launcher's size. Rank -1 when none is set; size 0 when the launcher's size
// variable is missing or not a number.
struct LauncherPlace {
  int rank = -1;
  int size = 0;
  int local_rank = 0;
  const char* rank_variable = nullptr;  // where the rank came from; null: none
  const char* size_variable = nullptr;  // the size variable read (or expected)
};
// `getenv` reads one variable (null when unset); the process's environment by default.
LauncherPlace LauncherPlaceOf(const std::function<const char*(const char*)>& getenv = nullptr);
// For the worker's start-up line: "launcher rank 1 of 4 (OMPI_COMM_WORLD_RANK)",
// "launcher rank 0 (RANK; WORLD_SIZE not set)", "no launcher rank (started by hand)".
std::string DescribeLauncherPlace(const LauncherPlace& place);

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
