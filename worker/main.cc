// rackrun-worker: the per-device worker daemon (worker.h). Started by mpirun, srun
// --mpi=pmix, torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK), systemd or by hand.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "base/paths.h"
#include "base/process_limits.h"
#include "base/signals.h"
#include "flags/flags.h"
#include "jobspec/path_confinement.h"
#include "rpc/rack_label.h"
#include "runtime/fault_injection.h"
#include "worker/launcher_watch.h"
#include "worker/worker.h"

namespace {

// The flags, bound to `o` (whose values are the defaults the help shows).
void DeclareFlags(rackrun::flags::FlagSet& flags, rackrun::worker::WorkerOptions& o) {
  flags.Describe(
      "Registers with the rack coordinator and runs the jobs it assigns, one at a time, until\n"
      "SIGTERM or SIGINT (then the running job finishes its step, checkpoints and stops on every\n"
      "rank; the worker deregisters and exits 0; a second signal exits at once).\n");
  flags.Epilogue(
      "The launcher rank (for deterministic rank assignment) is read from OMPI_COMM_WORLD_RANK,\n"
      "SLURM_PROCID, PMIX_RANK or RANK, and the size from the same launcher's variable\n"
      "(OMPI_COMM_WORLD_SIZE, SLURM_NTASKS, WORLD_SIZE).\n");
  o.connection.coordinator = "127.0.0.1:7070";
  flags.String("--coordinator", &o.connection.coordinator, "HOST:PORT", "the rack coordinator")
      .Env("RACKRUN_COORDINATOR");
  flags
      .String("--token-file", &o.connection.token_file, "FILE",
              "the worker token: STATE_DIR/token-worker, or join-token-worker (brings TLS)")
      .Default("$RACKRUN_TOKEN, else the file $RACKRUN_TOKEN_FILE, else ~/.rackrun/token");
  flags.String("--tls-ca", &o.connection.tls_ca, "FILE",
               "TLS: trust server certificates signed by FILE");
  flags.String("--tls-cert", &o.connection.tls_cert, "FILE", "TLS client certificate");
  flags.String("--tls-key", &o.connection.tls_key, "FILE", "its private key");
  flags.String("--host", &o.host, "NAME", "the name this worker reports").Default("the hostname");
  flags
      .String("--data-address", &o.data_address, "ADDR",
              "address peers reach this worker's data channel on")
      .Default("--host");
  flags
      .Custom("--rack", "NAME",
              "this worker's rack (host group) label: the coordinator packs the ranks of one "
              "expert-parallel domain onto workers with one label",
              [&o](std::string_view value) {
                o.rack = std::string(value);
                return rackrun::rpc::CheckRackLabel(o.rack);  // the flags name --rack
              })
      .Env("RACKRUN_RACK")
      .Default("none");
  flags.String("--device", &o.device, "DEV",
               "cpu, cuda (the launcher's local rank's GPU) or cuda:N: where jobs with "
               "resources.device: cuda run; a GPU is checked at start (refused when unusable), "
               "registered with the coordinator and offers the NCCL channel");
  flags.Int("--threads", &o.threads, "N", "compute threads per job")
      .Default("the job spec's resources.threads");
  flags
      .Custom("--patience-s", "S", "how long to wait for an unreachable coordinator",
              [&o](std::string_view value) {
                absl::StatusOr<int64_t> s = rackrun::flags::ParseInt(value, 0, INT32_MAX);
                if (!s.ok()) return s.status();
                o.patience = std::chrono::seconds(*s);
                return absl::OkStatus();
              })
      .Default(
          std::to_string(std::chrono::duration_cast<std::chrono::seconds>(o.patience).count()));
  flags
      .String("--metrics-listen", &o.metrics_listen, "H:P",
              "serve Prometheus metrics on http://H:P/metrics")
      .Default("none");
  flags.Double("--peak-flops", &o.peak_flops, "F", "one device's peak FLOP/s, for the MFU series")
      .Range(0)
      .Default("no MFU");
  flags
      .Custom("--allowed-roots", "DIR[,DIR...]",
              "folders a job's data, checkpoint and log paths must lead into (after symlinks)",
              [&o](std::string_view value) {
                absl::StatusOr<std::vector<std::string>> roots =
                    rackrun::jobspec::ParseAllowedRoots(value);
                if (!roots.ok()) return roots.status();
                o.allowed_roots = *std::move(roots);
                return absl::OkStatus();
              })
      .Default("unconfined");
}

}  // namespace

int main(int argc, char** argv) {
  const pid_t parent = ::getppid();  // the launcher, if one started us (launcher_watch.h)
  // A write to a closed connection or pipe fails instead of killing the worker (a peer
  // that closes while the worker fetches its CA; a launcher gone with the output pipe).
  rackrun::base::IgnoreSigpipe();
  // A job's data channel holds a connection per peer (Gloo, UCX), the metrics endpoint its
  // clients' (base/process_limits.h). Failing to raise it is not fatal: the limit stays.
  (void)rackrun::base::RaiseOpenFileLimit();
  rackrun::worker::WorkerOptions o;
  rackrun::flags::FlagSet flags("rackrun-worker", "[--coordinator HOST:PORT] [options]");
  DeclareFlags(flags, o);
  if (std::optional<int> exit = flags.ParseCommandLine(argc, argv)) return *exit;
  // Every open of a job's file is confined to the roots, not only the check at attempt
  // start (base/file.h, jobspec/path_confinement.h).
  rackrun::base::SetJobFileRoots(o.allowed_roots);
  o.connection.ca_fetch_patience = o.patience;
  // The launcher's rank, size and local rank, all from one launcher (launcher_watch.h).
  const rackrun::worker::LauncherPlace place = rackrun::worker::LauncherPlaceOf();
  o.launcher_rank = place.rank;
  o.launcher_size = place.size;
  o.local_rank = place.local_rank;
  // Fault injection for the end-to-end tests, the process's (runtime/fault_injection.h): a
  // malformed value is refused here, before the worker contacts anything.
  if (absl::Status s = rackrun::runtime::InstallFaultInjectionFromEnvironment(); !s.ok()) {
    std::fprintf(stderr, "rackrun-worker: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  // Milliseconds from the environment; a value that is not one is refused by name.
  for (const auto& [name, into] : {std::pair<const char*, std::chrono::milliseconds*>{
                                       "RACKRUN_VICTIM_GRACE_MS", &o.victim_grace},
                                   {"RACKRUN_WORKER_START_DELAY_MS", &o.start_delay}}) {
    const char* v = std::getenv(name);
    if (v == nullptr) continue;
    int ms = 0;
    if (!absl::SimpleAtoi(v, &ms) || ms < 0) {
      std::fprintf(stderr, "rackrun-worker: %s='%s' is not a number of milliseconds (>= 0)\n", name,
                   v);
      return 2;
    }
    *into = std::chrono::milliseconds(ms);
  }

  absl::StatusOr<std::unique_ptr<rackrun::worker::Worker>> worker =
      rackrun::worker::Worker::Create(o);
  if (!worker.ok()) {
    std::fprintf(stderr, "rackrun-worker: %s\n", std::string(worker.status().message()).c_str());
    return 1;
  }
  std::printf("rackrun-worker: pid %d, coordinator %s, %s, device %s\n",
              static_cast<int>(::getpid()), o.connection.coordinator.c_str(),
              rackrun::worker::DescribeLauncherPlace(place).c_str(), o.device.c_str());
  std::fflush(stdout);
  rackrun::worker::Worker* w = worker->get();
  // SIGTERM/SIGINT: drain (finish the step, checkpoint, report, deregister, exit 0); a
  // second signal exits at once.
  if (absl::Status s = rackrun::base::WatchStopSignals([w](int sig) {
        std::fprintf(stderr, "rackrun-worker: %s: finishing the current step, then exiting\n",
                     strsignal(sig));
        w->Shutdown();
      });
      !s.ok()) {
    std::fprintf(stderr, "rackrun-worker: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  // Started by mpirun or srun: the worker ends with its launcher (launcher_watch.h).
  std::unique_ptr<rackrun::worker::LauncherWatch> launcher_watch;
  if (const char* variable = rackrun::worker::LauncherVariable(); variable != nullptr) {
    std::printf(
        "rackrun-worker: started by a launcher (%s is set): exits when its process %d "
        "ends\n",
        variable, static_cast<int>(parent));
    std::fflush(stdout);
    launcher_watch = std::make_unique<rackrun::worker::LauncherWatch>(
        parent,
        [w](pid_t launcher) {
          std::fprintf(stderr,
                       "rackrun-worker: the launcher (pid %d) ended: finishing the "
                       "current step, then exiting\n",
                       static_cast<int>(launcher));
          w->Shutdown();
        },
        std::chrono::seconds(30));
  }
  const absl::Status s = w->Serve();
  if (!s.ok()) {
    std::fprintf(stderr, "rackrun-worker: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
