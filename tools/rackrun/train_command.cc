// rackrun train: runs one training job (a JobSpec file), in this process or, when a
// launcher (mpirun, srun) started several, expert-parallel over all of them.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "absl/strings/str_format.h"
#include "base/resource_failure.h"
#include "base/signals.h"
#include "base/status.h"
#include "comm/data_channel.h"
#include "comm/mpi_channel.h"
#ifdef RACKRUN_HAVE_NCCL
#include "comm/nccl_channel.h"
#endif
#include "flags/flags.h"
#include "jobspec/device.h"
#include "jobspec/job_memory.h"
#include "jobspec/spec.h"
#include "runtime/cpu/gemm.h"
#include "runtime/cuda/device_probe.h"
#include "runtime/cuda/engine.h"
#include "runtime/fault_injection.h"
#include "runtime/job_config.h"
#include "runtime/step_log.h"
#include "runtime/trainer.h"
#include "runtime/training_session.h"
#include "tools/rackrun/command.h"

namespace rackrun::cli {
namespace {

namespace rt = ::rackrun::runtime;

constexpr const char* kSynopsis =
    R"(SPEC [--set FIELD=VALUE]... [--log-json FILE] [--load-trace FILE]
                     [--resume PATH] [--start-over]
       mpirun -np R rackrun train SPEC ...      (or srun --mpi=pmix -n R rackrun train ...))";

constexpr const char* kDescription =
    R"(Trains the model described by SPEC (a YAML or JSON JobSpec, proto/rackrun/v1/job_spec.proto).
Prints one line per logging.interval steps (step, loss, validation loss when evaluated,
tokens/s, learning rate, grad norm, per-layer expert load max/mean, elapsed) and a final
summary that compares the loss with the unigram entropy of the training data.

Started by a launcher with R > 1 ranks, the job is expert-parallel: the ranks form
D = R / G domains of G = parallelism.expert_parallel consecutive ranks (0 = all ranks, one
domain); each rank holds experts/G experts of every MoE layer (the same shards in every
domain), the global microbatch (data.batch_size) is split over all R ranks, and every
microbatch and MoE layer is rebalanced inside each domain by balancer.policy (none,
ultraep, eplb); dense gradients are all-reduced over the R ranks, expert gradients over
the D domains. Rank 0 prints; its log lines add per-layer rank load max/mean before>after
balancing and the milliseconds spent planning, fanning out weights, in token all-to-alls
and reducing replica gradients.
)";

constexpr const char* kEpilogue =
    R"(outputs: a checkpoint folder belongs to one run. Before the first step rank 0 checks every
output (checkpoint.dir, --log-json, --load-trace) and takes DIR/LOCK for the whole run: a
second run on the same folder is refused, naming the holder's pid and host; a run without
--resume into a folder with checkpoints is refused unless --start-over; temporary files of
a writer killed mid-checkpoint are removed; DIR/OWNER names the run that started the folder
(a restarted daemon job continues only its own). Every rank must start from the same state (the
same --resume, or none): a disagreement names the ranks. A write error (disk full) stops
the run with the file and the system's reason; logs keep only whole records, checkpoints
are written to a temporary file and renamed.

example:
  tools/fetch-corpus && rackrun data --input out/corpus/brown/brown.txt --output out/corpus/brown
  rackrun train examples/tiny-moe.yaml --set training.steps=50
)";

// What the command line asked for.
struct TrainArgs {
  std::string spec_path;
  std::vector<std::string> overrides;
  std::string resume;
  bool print_spec = false;
};

// The flags, into `a`; the overrides in command-line order (--log-json is --set
// logging.json=...).
void DeclareFlags(flags::FlagSet& flag_set, TrainArgs& a) {
  std::vector<std::string>* overrides = &a.overrides;
  flag_set.Describe(kDescription);
  flag_set.Epilogue(kEpilogue);
  flag_set.Positional("SPEC", &a.spec_path, "the job spec file (YAML or JSON)");
  flag_set.Strings("--set", overrides, "FIELD=VALUE",
                   "override a spec field, e.g. --set training.steps=50 (repeatable)");
  const auto override_of = [overrides](std::string field) {
    return [overrides, field](std::string_view value) {
      overrides->push_back(field + "=" + std::string(value));
      return absl::OkStatus();
    };
  };
  flag_set.Custom("--log-json", "FILE", "also write every logged step as JSON Lines (logging.json)",
                  override_of("logging.json"));
  flag_set.Custom("--load-trace", "FILE",
                  "record every training microbatch's expert loads (logging.load_trace), "
                  "replayable with `rackrun plan --trace FILE`",
                  override_of("logging.load_trace"));
  flag_set.String("--resume", &a.resume, "PATH",
                  "continue from a checkpoint file (DIR/step-NNNNNNNN.ckpt), or the newest one in "
                  "a checkpoint folder; checkpoints keep going to checkpoint.dir (default: that "
                  "folder). Resuming from an older checkpoint of the folder moves its newer ones "
                  "into DIR/superseded-<time>/. --log-json and --load-trace are cut back to the "
                  "resumed step and extended.");
  flag_set.Switch("--start-over",
                  "checkpoint.dir holds another run's checkpoints: move them into "
                  "DIR/previous-<time>/ and train from step 0, or from --resume of a checkpoint "
                  "elsewhere (checkpoint.start_over; nothing is deleted; no effect when --resume "
                  "continues checkpoint.dir's own checkpoints)",
                  [overrides] { overrides->push_back("checkpoint.start_over=true"); });
  flag_set.Switch("--print-spec", &a.print_spec,
                  "print the effective spec (defaults filled in) as JSON and exit");
}

// Ranks the launcher started on this machine (Open MPI, MPICH/Hydra, Slurm); 1 if unknown.
int LocalRanks() {
  for (const char* name :
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}) {
    if (const char* v = std::getenv(name); v != nullptr && std::atoi(v) > 0) return std::atoi(v);
  }
  return 1;
}

// The spec with its overrides; --resume of a checkpoint file or folder with no
// checkpoint.dir keeps writing checkpoints beside it.
absl::StatusOr<rackrun::v1::JobSpec> LoadSpec(const TrainArgs& a) {
  absl::StatusOr<rackrun::v1::JobSpec> spec = jobspec::LoadJobSpec(a.spec_path, a.overrides);
  if (!spec.ok()) return spec.status();
  if (!a.resume.empty() && spec->checkpoint().dir().empty()) {
    std::error_code ec;
    const std::filesystem::path p(a.resume);
    spec->mutable_checkpoint()->set_dir(
        std::filesystem::is_directory(p, ec) ? p.string() : p.parent_path().string());
  }
  return spec;
}

// Several ranks: one MPI data channel over all of them (null for one rank). A fatal error
// on any rank then ends the whole job (AbortJob) instead of leaving peers waiting in a
// collective.
absl::StatusOr<std::unique_ptr<comm::DataChannel>> OpenLauncherChannel(int launched) {
  if (launched <= 1) return nullptr;
  absl::StatusOr<comm::ChannelOptions> options = comm::ChannelOptions::FromEnv();
  if (!options.ok()) return options.status();
  absl::StatusOr<std::unique_ptr<comm::DataChannel>> channel = comm::CreateMpiChannel(*options);
  if (!channel.ok()) return channel.status();
  if ((*channel)->size() != launched) {
    std::fprintf(stderr,
                 "rackrun train: the launcher started %d ranks but MPI sees %d; this MPI "
                 "library does not match the launcher (under Slurm use srun --mpi=pmix)\n",
                 launched, (*channel)->size());
    comm::AbortJob(1);
  }
  return channel;
}

// resources.channel: nccl under a launcher: the ranks' NCCL communicator, bootstrapped over the
// launcher's MPI channel, on this rank's GPU, in host-buffer mode (the trainer's own buffers
// are host memory; expert parallelism's device rows, weights and gradients go as they are,
// comm/nccl_channel.h). Null for any other channel: a launch connects its ranks by MPI (the
// other names choose the daemons' channels). InvalidArgument naming resources.channel for a
// cpu job; resources.device's errors where the GPU is not usable; NCCL's otherwise.
absl::StatusOr<std::unique_ptr<comm::DataChannel>> OpenNcclChannel(const rackrun::v1::JobSpec& spec,
                                                                   comm::DataChannel* launcher) {
  if (launcher == nullptr || spec.resources().channel() != "nccl") return nullptr;
  absl::StatusOr<jobspec::DeviceSpec> device = jobspec::ParseDevice(spec.resources().device());
  if (!device.ok()) return device.status();
  if (!device->is_cuda()) {
    return absl::InvalidArgumentError(
        "resources.channel: nccl connects the ranks' GPUs and this job computes on the CPU; set "
        "resources.device: cuda, or leave resources.channel unset to train over MPI");
  }
  const int local = comm::LauncherLocalRank();
  if (absl::StatusOr<rt::cuda::GpuInfo> gpu = rt::cuda::CheckDevice(*device, local, LocalRanks());
      !gpu.ok()) {
    return gpu.status();
  }
#ifdef RACKRUN_HAVE_NCCL
  absl::StatusOr<comm::ChannelOptions> options = comm::ChannelOptions::FromEnv();
  if (!options.ok()) return options.status();
  comm::NcclChannelOptions nccl;
  nccl.channel = *options;
  nccl.device = device->GpuFor(local);
  nccl.host_buffers = true;
  return comm::CreateNcclChannel(*launcher, nccl);
#else
  return absl::FailedPreconditionError(
      "resources.channel: nccl: this program was built without NCCL (not found at build "
      "time); rebuild with NCCL, or leave resources.channel unset to train over MPI");
#endif
}

// How a rank reports a failure once its channel exists: "rackrun train: rank R: WHAT..." on
// stderr; under a launcher the whole job ends (AbortJob).
class Failure {
 public:
  explicit Failure(const comm::DataChannel* channel) : channel_(channel) {}
  int operator()(const std::string& what, const absl::Status& s) const {
    std::fprintf(
        stderr, "rackrun train: %s%s%s\n",
        channel_ != nullptr ? ("rank " + std::to_string(channel_->rank()) + ": ").c_str() : "",
        what.c_str(), std::string(s.message()).c_str());
    if (channel_ != nullptr) comm::AbortJob(1);
    return 1;
  }

 private:
  const comm::DataChannel* channel_;
};

// The trainer, resumed from --resume, every output checked and claimed before the first
// step (the ranks' resume states too); a failure says which of the three went wrong.
absl::StatusOr<std::unique_ptr<rt::TrainingSession>> StartSession(const rackrun::v1::JobSpec& spec,
                                                                  const TrainArgs& a,
                                                                  comm::DataChannel* channel) {
  rt::SessionOptions session_options;
  session_options.resume_from = a.resume;
  session_options.trainer.device_engine = rt::cuda::GpuEngineFactory();  // resources.device: cuda
  rt::SessionStage stage = rt::SessionStage::kCreate;
  absl::StatusOr<std::unique_ptr<rt::TrainingSession>> session =
      rt::TrainingSession::Start(spec, channel, session_options, &stage);
  if (session.ok()) return session;
  switch (stage) {
    case rt::SessionStage::kCreate:
      return base::Annotate(session.status(), a.spec_path);
    case rt::SessionStage::kResume:
      return base::Annotate(session.status(), "--resume");
    case rt::SessionStage::kPrepare:
      break;
  }
  return session.status();
}

// Rank 0's lines before the first step: the resume, notes, the layout, the model, the data,
// memory and kernels.
void PrintJob(const rt::TrainingSession& session, const TrainArgs& a,
              const comm::DataChannel* channel, const jobspec::JobMemoryEstimate& memory) {
  const rt::Trainer& t = session.trainer();
  if (!session.resumed_from().empty()) {
    std::printf("resumed at step %lld from %s\n", static_cast<long long>(t.step()),
                a.resume.c_str());
    if (!t.resume_note().empty()) std::printf("note: %s\n", t.resume_note().c_str());
  }
  for (const std::string& note : t.notes()) std::printf("note: %s\n", note.c_str());
  const rackrun::v1::ModelSpec& m = t.spec().model();
  const rt::TrainConfig& c = t.config();
  if (t.ranks() > 1) {
    const rackrun::v1::BalancerSpec& b = t.spec().balancer();
    std::printf(
        "expert parallel: %d ranks (%s) = %d domain%s (data_parallel) x %d ranks "
        "(expert_parallel), %d experts per rank + %d replica slots, balancer %s\n",
        t.ranks(), std::string(channel->backend()).c_str(), t.data_parallel_degree(),
        t.data_parallel_degree() > 1 ? "s" : "", t.expert_parallel_degree(),
        m.moe().experts() / t.expert_parallel_degree(), b.slots(), b.policy().c_str());
  }
  std::printf(
      "job %s: %s N=%d%s, %d blocks, C=%d, %d heads, %d experts top-%d, vocab %d, %lld "
      "parameters\n",
      t.spec().name().c_str(), m.residual().c_str(), m.streams(),
      m.active() > 0 ? (" k=" + std::to_string(m.active())).c_str() : "", m.blocks(), m.width(),
      m.heads(), m.moe().experts(), m.moe().top_k(), m.vocab(),
      static_cast<long long>(t.parameter_count()));
  std::printf(
      "data: %s, %lld train tokens (unigram entropy %s), %lld validation tokens; tokenizer "
      "%s; %d x %d tokens x %d microbatch(es) per step; %d threads\n",
      t.train_data().Describe().c_str(), static_cast<long long>(t.train_tokens()),
      t.train_unigram_entropy() >= 0
          ? absl::StrFormat("%.4f nats/token", t.train_unigram_entropy()).c_str()
          : "unknown",
      static_cast<long long>(t.validation_tokens()), t.train_data().tokenizer().Describe().c_str(),
      c.batch_size, c.seq_len, c.microbatches, omp_get_max_threads());
  std::printf("memory: estimated %s; this machine: %s\n", memory.Describe().c_str(),
              jobspec::ReadMachineMemory().Describe().c_str());
  std::printf("kernels: %s\n", rt::cpu::GemmDescription(omp_get_max_threads()).c_str());
  if (t.device_engine() != nullptr) {
    // What the GPU holds from the start (jobspec::CheckDeviceMemory's bound); a step's
    // activations come on top (the log's device memory figures after each step).
    std::printf("device: %s; parameters, gradients and AdamW moments %s\n",
                t.device_engine()->Describe().c_str(),
                jobspec::FormatBytes(jobspec::DeviceStateBytes(memory)).c_str());
  }
}

// SIGTERM/SIGINT (what Slurm and mpirun send first): every rank finishes its step, the
// job checkpoints (checkpoint.dir) and exits 0; a second signal exits at once. While it
// lives, a signal stops `trainer`.
class StopOnSignals {
 public:
  explicit StopOnSignals(rt::Trainer& trainer) {
    std::lock_guard<std::mutex> lock(mu_);
    trainer_ = &trainer;
  }
  ~StopOnSignals() {
    std::lock_guard<std::mutex> lock(mu_);
    trainer_ = nullptr;
  }
  StopOnSignals(const StopOnSignals&) = delete;
  StopOnSignals& operator=(const StopOnSignals&) = delete;

  static absl::Status Watch() {
    return rackrun::base::WatchStopSignals([](int sig) {
      std::fprintf(stderr, "rackrun train: %s: finishing the current step, then stopping\n",
                   strsignal(sig));
      std::lock_guard<std::mutex> lock(mu_);
      if (trainer_ != nullptr) trainer_->RequestStop(rt::StopReason::kDrain);
    });
  }

 private:
  static inline std::mutex mu_;
  static inline rt::Trainer* trainer_ = nullptr;  // guarded by mu_; null once Run ended
};

// Rank 0's summary of the run.
void PrintSummary(const rt::TrainSummary& s, int64_t total_steps) {
  if (s.stopped == rt::StopReason::kDrain) {
    std::printf("stopped by a signal at step %lld of %lld%s\n", static_cast<long long>(s.steps),
                static_cast<long long>(total_steps),
                s.last_checkpoint.empty() ? " (no checkpoint.dir: nothing saved)"
                                          : (", checkpoint " + s.last_checkpoint).c_str());
    return;
  }
  if (s.losses.empty()) {
    std::printf("nothing to train: already at step %lld of %lld\n", static_cast<long long>(s.steps),
                static_cast<long long>(total_steps));
    return;
  }
  std::printf("summary: %lld steps (%lld this run) in %.1f s, %.0f tokens/s\n",
              static_cast<long long>(s.steps), static_cast<long long>(s.steps - s.first_step),
              s.elapsed_s, s.tokens_per_s);
  std::printf("  final train loss %.4f (mean of last %zu steps %.4f)", s.final_loss,
              std::min<size_t>(10, s.losses.size()), s.tail_loss);
  if (s.final_val_loss) std::printf(", validation loss %.4f", *s.final_val_loss);
  std::printf("\n");
  if (s.train_unigram_entropy >= 0) {  // unknown for data without a record
    std::printf("  unigram entropy of the training data %.4f nats/token: ",
                s.train_unigram_entropy);
    const double best = s.final_val_loss ? *s.final_val_loss : s.tail_loss;
    std::printf("%s loss is %.4f nats/token %s it\n", s.final_val_loss ? "validation" : "train",
                std::abs(s.train_unigram_entropy - best),
                best < s.train_unigram_entropy ? "below" : "ABOVE");
  }
  if (!s.last_checkpoint.empty()) std::printf("  checkpoint %s\n", s.last_checkpoint.c_str());
}

// Trains to the end (or a signal) with rank 0 printing the log line of every logged step.
absl::StatusOr<rt::TrainSummary> Train(rt::Trainer& t, bool lead) {
  const StopOnSignals stop(t);
  if (absl::Status s = StopOnSignals::Watch(); !s.ok()) return s;
  std::vector<rt::TrainObserver*> observers;
  std::unique_ptr<rt::StepLog> log;
  if (lead) {
    const rt::TrainConfig& c = t.config();
    absl::StatusOr<std::unique_ptr<rt::StepLog>> made = rt::StepLog::Create(
        c.log_interval, c.steps, /*json_path=*/"", /*append=*/false, [&](const rt::StepRecord& r) {
          std::printf("%s\n", r.ToLogLine(c.steps).c_str());
          std::fflush(stdout);
        });
    if (!made.ok()) return made.status();
    log = *std::move(made);
    observers.push_back(log.get());
  }
  return t.Run(observers);
}

int RunTrain(const Args& args) {
  TrainArgs a;
  flags::FlagSet flag_set("rackrun train", kSynopsis);
  DeclareFlags(flag_set, a);
  if (std::optional<int> exit = flag_set.ParseCommandLine(args)) return *exit;
  absl::StatusOr<rackrun::v1::JobSpec> spec = LoadSpec(a);
  if (!spec.ok()) {
    std::fprintf(stderr, "rackrun train: %s\n", std::string(spec.status().message()).c_str());
    return 1;
  }
  if (a.print_spec) {
    std::printf("%s\n", jobspec::JobSpecToJson(*spec).c_str());
    return 0;
  }
  const int launched = comm::LauncherWorldSize();
  absl::StatusOr<std::unique_ptr<comm::DataChannel>> channel = OpenLauncherChannel(launched);
  if (!channel.ok()) {
    std::fprintf(stderr, "rackrun train: %s\n", std::string(channel.status().message()).c_str());
    return 1;
  }
  const Failure fail(channel->get());
  const bool lead = *channel == nullptr || (*channel)->rank() == 0;
  // Fault injection for the end-to-end tests, the process's (runtime/fault_injection.h).
  if (absl::Status s = rt::InstallFaultInjectionFromEnvironment(); !s.ok()) return fail("", s);
  // The expert-parallel layout on the launched ranks, and what this machine cannot hold or
  // run, refused before anything is allocated.
  absl::StatusOr<jobspec::ExpertParallelLayout> layout =
      jobspec::ExpertParallelLayoutOf(*spec, launched > 1 ? launched : 1);
  if (!layout.ok()) return fail(a.spec_path + ": ", layout.status());
  absl::StatusOr<jobspec::JobMemoryEstimate> memory = rt::CheckJobFitsThisMachine(
      *spec, launched > 1 ? launched : 1, LocalRanks(), spec->resources().threads());
  if (!memory.ok()) return fail(a.spec_path + ": ", memory.status());
  absl::StatusOr<std::unique_ptr<comm::DataChannel>> nccl = OpenNcclChannel(*spec, channel->get());
  if (!nccl.ok()) return fail(a.spec_path + ": ", nccl.status());
  comm::DataChannel* data = *nccl != nullptr ? nccl->get() : channel->get();
  absl::StatusOr<std::unique_ptr<rt::TrainingSession>> session = StartSession(*spec, a, data);
  if (!session.ok()) return fail("", session.status());
  if (lead) PrintJob(**session, a, data, *memory);
  std::fflush(stdout);
  absl::StatusOr<rt::TrainSummary> summary = Train((*session)->trainer(), lead);
  if (!summary.ok()) return fail("", summary.status());
  if (lead) PrintSummary(*summary, (*session)->trainer().config().steps);
  return 0;
}

}  // namespace

// An allocation that fails despite the estimate (other processes took the memory, a
// ulimit, an estimate that is short) or a thread that cannot start ends the job with a
// message, not an abort; under a launcher the other ranks are ended too instead of waiting
// in a collective.
int TrainCommand(const Args& args) {
  absl::StatusOr<int> exit = base::CatchResourceFailures([&] { return RunTrain(args); });
  if (exit.ok()) return *exit;
  std::fprintf(stderr, "rackrun train: %s\n", std::string(exit.status().message()).c_str());
  if (comm::LauncherWorldSize() > 1) comm::AbortJob(1);
  return 1;
}

}  // namespace rackrun::cli
