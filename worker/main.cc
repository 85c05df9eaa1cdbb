// rackrun-worker: the per-device worker daemon (worker.h). Started by mpirun, srun
// --mpi=pmix, torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK), systemd or by hand.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "base/signals.h"
#include "worker/worker.h"

namespace {

constexpr char kUsage[] =
    R"(usage: rackrun-worker [--coordinator HOST:PORT] [options]

Registers with the rack coordinator and runs the jobs it assigns, one at a time, until
SIGTERM or SIGINT (then the running job finishes its step, checkpoints and stops on every
rank; the worker deregisters and exits 0; a second signal exits at once).

options:
  --coordinator HOST:PORT  the rack coordinator (default $RACKRUN_COORDINATOR, else 127.0.0.1:7070)
  --token-file FILE        the cluster token (default $RACKRUN_TOKEN, else the file
                           $RACKRUN_TOKEN_FILE, else ~/.rackrun/token)
  --tls-ca FILE            TLS: trust server certificates signed by FILE
  --tls-cert FILE --tls-key FILE   TLS client certificate
  --host NAME              the name this worker reports (default: the hostname)
  --data-address ADDR      address peers reach this worker's data channel on (default: host)
  --device DEV             cpu (default) or cuda:N (offers the NCCL channel)
  --threads N              compute threads per job (default: the job spec's resources.threads)
  --patience-s S           how long to wait for an unreachable coordinator (default 120)
  --metrics-listen H:P     serve Prometheus metrics on http://H:P/metrics (default: none)
  --peak-flops F           one device's peak FLOP/s, for the MFU series (default: no MFU)
The launcher rank (for deterministic rank assignment) is read from OMPI_COMM_WORLD_RANK,
SLURM_PROCID / PMIX_RANK or RANK, and the size from the matching variables.
)";

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  int out = 0;
  if (v == nullptr || !absl::SimpleAtoi(v, &out)) return fallback;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  rackrun::worker::WorkerOptions o;
  const char* env_coordinator = std::getenv("RACKRUN_COORDINATOR");
  o.connection.coordinator = env_coordinator != nullptr ? env_coordinator : "127.0.0.1:7070";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "rackrun-worker: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    const auto number = [&]() {
      const std::string v = value();
      int n = 0;
      if (!absl::SimpleAtoi(v, &n)) {
        std::fprintf(stderr, "rackrun-worker: %s: '%s' is not a number\n", a.c_str(), v.c_str());
        std::exit(2);
      }
      return n;
    };
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (a == "--coordinator") {
      o.connection.coordinator = value();
    } else if (a == "--token-file") {
      o.connection.token_file = value();
    } else if (a == "--tls-ca") {
      o.connection.tls_ca = value();
    } else if (a == "--tls-cert") {
      o.connection.tls_cert = value();
    } else if (a == "--tls-key") {
      o.connection.tls_key = value();
    } else if (a == "--host") {
      o.host = value();
    } else if (a == "--data-address") {
      o.data_address = value();
    } else if (a == "--device") {
      o.device = value();
    } else if (a == "--threads") {
      o.threads = number();
    } else if (a == "--metrics-listen") {
      o.metrics_listen = value();
    } else if (a == "--peak-flops") {
      const std::string v = value();
      if (!absl::SimpleAtod(v, &o.peak_flops) || o.peak_flops < 0) {
        std::fprintf(stderr, "rackrun-worker: --peak-flops: '%s' is not a FLOP/s figure\n", v.c_str());
        return 2;
      }
    } else if (a == "--patience-s") {
      o.patience = std::chrono::seconds(number());
    } else {
      std::fprintf(stderr, "rackrun-worker: unknown option '%s'\n\n%s", a.c_str(), kUsage);
      return 2;
    }
  }
  // The launcher's rank and size: Open MPI, then Slurm/PMIx, then torchrun-style.
  o.launcher_rank = EnvInt("OMPI_COMM_WORLD_RANK",
                           EnvInt("SLURM_PROCID", EnvInt("PMIX_RANK", EnvInt("RANK", -1))));
  o.launcher_size =
      EnvInt("OMPI_COMM_WORLD_SIZE", EnvInt("SLURM_NTASKS", EnvInt("WORLD_SIZE", 0)));
  o.local_rank = EnvInt("OMPI_COMM_WORLD_LOCAL_RANK",
                        EnvInt("SLURM_LOCALID", EnvInt("LOCAL_RANK", 0)));
  if (const char* fault = std::getenv("RACKRUN_FAULT"); fault != nullptr) o.fault = fault;
  // Milliseconds from the environment; a value that is not one is refused by name.
  for (const auto& [name, into] :
       {std::pair<const char*, std::chrono::milliseconds*>{"RACKRUN_VICTIM_GRACE_MS", &o.victim_grace},
        {"RACKRUN_WORKER_START_DELAY_MS", &o.start_delay}}) {
    const char* v = std::getenv(name);
    if (v == nullptr) continue;
    int ms = 0;
    if (!absl::SimpleAtoi(v, &ms) || ms < 0) {
      std::fprintf(stderr, "rackrun-worker: %s='%s' is not a number of milliseconds (>= 0)\n",
                   name, v);
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
  std::printf("rackrun-worker: pid %d, coordinator %s, launcher rank %d of %d, device %s\n",
              static_cast<int>(::getpid()), o.connection.coordinator.c_str(), o.launcher_rank,
              o.launcher_size, o.device.c_str());
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
  const absl::Status s = w->Serve();
  if (!s.ok()) {
    std::fprintf(stderr, "rackrun-worker: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
