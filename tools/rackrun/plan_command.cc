// rackrun plan: replays a load trace (or generated loads) through balancing policies and
// prints, per policy, imbalance, replicas, fan-out, simulated layer time and solve time.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/file.h"
#include "base/signals.h"
#include "base/statistics.h"
#include "base/string_view.h"
#include "flags/flags.h"
#include "nlohmann/json.hpp"
#include "planner/cluster.h"
#include "planner/cluster_replay.h"
#include "planner/generate.h"
#include "planner/plan.h"
#include "planner/planner.h"
#include "planner/replay.h"
#include "planner/simulator.h"
#include "planner/trace.h"
#include "tools/rackrun/command.h"

namespace rackrun::cli {
namespace {

using base::Mean;

namespace pl = ::rackrun::planner;
using nlohmann::json;

constexpr const char* kSynopsis =
    R"((--trace FILE | --generate [generator options]) [options]
       rackrun plan --generate [generator options] --out FILE)";

constexpr const char* kDescription =
    R"(Replays exact per-(microbatch, layer) expert loads through balancing policies and prints,
per policy: rank imbalance (max/mean) before and after balancing (p50/p99/max over the
trace's entries), replicas, replica fan-out bytes and time (direct vs relay), EPLB
re-placement bytes, simulated MoE layer time as % of the force-balanced ideal, and plan
solve time (p50/p99, microseconds on this CPU). Every plan is checked with the invariant
checker; a violation fails the run.
)";

constexpr const char* kEpilogue =
    R"(greedy: the plain greedy baseline (move the heaviest rank's largest instance into a free
slot of the rank with most room, filling it to the mean).

Weight movement counted per policy: ultraep, greedy and ideal fan out every replica's weights
every (microbatch, layer) (slots are shared across layers); the simulated time includes
the part of the relay fan-out not hidden behind dispatch. eplb keeps replicas resident
and moves weights only when it replans: those bytes (re-placed instances, masters
included) are its re-placement, counted as exposed time in that microbatch. ideal is the
bound (no fan-out cost in its simulated time). 'fan-out ms' is the cost model's
completion time of the schedule (direct / relay).

limits: at most 1000000 entries (microbatches x layers) per run, since per-entry
statistics are kept for the percentiles; at most 16777216 loads per entry (ranks x
experts); trace lines at most 16 MiB. A run longer than 2 s reports progress on stderr.
--out writes FILE.tmp-PID and renames it onto FILE when complete: FILE is whole or absent
(an error, SIGINT or SIGTERM removes the temporary file).

exit status: 0 ok, 1 failure (bad trace, invariant violation), 2 usage error.
)";

// Bounds of one run (stated in kEpilogue).
constexpr int64_t kMaxEntries = 1000000;
constexpr int64_t kMaxLoadsPerEntry = int64_t{1} << 24;

using base::AsAbsl;

// printf into a std::string (the CLI links Abseil's strings, not str_format).
__attribute__((format(printf, 1, 2))) std::string Format(const char* format, ...) {
  char buffer[256];
  va_list args;
  va_start(args, format);
  const int n = std::vsnprintf(buffer, sizeof(buffer), format, args);
  va_end(args);
  return std::string(buffer, static_cast<size_t>(std::clamp(n, 0, 255)));
}

struct PlanFlags {
  std::optional<std::string> trace;
  bool generate = false;
  std::optional<std::string> out;
  pl::GeneratorOptions gen;
  std::optional<int> masters_per_rank;
  std::vector<std::string> policies;
  int slots = 2;
  pl::PlannerOptions planner;
  std::string preset = "h200-nvl72";
  std::optional<int64_t> expert_bytes;
  bool json = false;
  bool eplb_replacement_exposed = true;
  int64_t warmup = 0;
  // The cluster (with --domains): model.domains is set only then.
  std::optional<int> domains;
  pl::ClusterModel cluster;
  double expert_params = 0;  // when --expert-params is given
  double gpu_tflops = 0;     // when --gpu-tflops is given
};

// A usage error after parsing: "FLAG: WHAT" (the caller prints it in the flags library's
// format, exit 2).
absl::Status Usage(std::string_view flag, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(AsAbsl(flag), ": ", AsAbsl(what)));
}

// A value's problem, for a Custom flag (the flag set names the flag).
absl::Status Problem(std::string_view value, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("'", AsAbsl(value), "' ", AsAbsl(what)));
}

// Bounds of the flags' ranges.
constexpr double kIntMax = 1 << 30;
constexpr double kTwoTo40 = static_cast<double>(int64_t{1} << 40);

// The generator's options; returns their section (rejected with --trace: a trace fixes the
// domain and loads).
int DeclareGeneratorFlags(flags::FlagSet& flag_set, PlanFlags& f) {
  const int generator = flag_set.Section("generator options (only with --generate)");
  flag_set.Int("--ranks", &f.gen.ranks, "N", "source/expert ranks G").Range(1, 65536);
  flag_set.Int("--experts", &f.gen.experts, "N", "logical experts, a multiple of --ranks")
      .Range(1, 1 << 20);
  flag_set
      .Int("--masters-per-rank", &f.masters_per_rank, "N",
           "alternative to --experts: experts = ranks * N")
      .Range(1, 1 << 20);
  flag_set.Int("--topk", &f.gen.topk, "K", "distinct experts per token").Range(1, 1 << 20);
  flag_set
      .Int("--tokens-per-rank", &f.gen.tokens_per_rank, "N",
           "mean tokens per source rank per microbatch")
      .Range(0, kTwoTo40);
  flag_set
      .Double("--token-jitter", &f.gen.token_jitter, "F",
              "per-rank token counts vary uniformly by +-F")
      .Range(0, 0.999);
  flag_set.Double("--imbalance", &f.gen.imbalance, "X", "target initial max/mean rank load, >= 1")
      .Range(1, 1e6);
  flag_set.Int("--microbatches", &f.gen.microbatches, "N", "microbatches")
      .Range(1, static_cast<double>(kMaxEntries));
  flag_set.Int("--layers", &f.gen.layers, "N", "MoE layers per microbatch").Range(1, 4096);
  flag_set
      .Custom("--nonstationary", "MODE",
              "none | drift | jump: hot experts change gradually or at once every --shift-every "
              "microbatches",
              [&f](std::string_view value) {
                absl::StatusOr<pl::LoadShift> shift = pl::ParseLoadShift(value);
                if (!shift.ok()) return Problem(value, "is not a mode; use none, drift or jump");
                f.gen.shift = *shift;
                return absl::OkStatus();
              })
      .Default("none");
  flag_set.Int("--shift-every", &f.gen.shift_every, "J", "the period of --nonstationary")
      .Range(1, kIntMax);
  flag_set.Int("--seed", &f.gen.seed, "S", "the generator's seed");
  flag_set
      .Custom("--popularity", "MODEL",
              "zipf (calibrated to --imbalance) | lognormal: expert weights exp(sigma * N(0,1)), "
              "heavy-tailed, not calibrated",
              [&f](std::string_view value) {
                absl::StatusOr<pl::PopularityModel> model = pl::ParsePopularityModel(value);
                if (!model.ok()) return Problem(value, "is not a model; use zipf or lognormal");
                f.gen.popularity = *model;
                return absl::OkStatus();
              })
      .Default("zipf");
  flag_set
      .Double("--sigma", &f.gen.lognormal_sigma, "X", "lognormal sigma, (0, 8]; 1 to 2 are typical")
      .Range(1e-3, 8);
  flag_set
      .Int("--spikes", &f.gen.spike_experts, "N",
           "in a fraction --spike-rate of the (microbatch, layer) entries, 1..N random "
           "experts spike to --spike-min..--spike-max times their weight for that entry "
           "only (0: no spikes)")
      .Range(0, 1 << 20);
  flag_set.Double("--spike-min", &f.gen.spike_min, "X", "spike factor range, low end")
      .Range(1, 1e6);
  flag_set.Double("--spike-max", &f.gen.spike_max, "X", "spike factor range, high end")
      .Range(1, 1e6);
  flag_set.Double("--spike-rate", &f.gen.spike_rate, "F", "probability that an entry spikes")
      .Range(0, 1);
  flag_set.String("--out", &f.out, "FILE", "write the generated trace to FILE instead of planning");

  return generator;
}

void DeclarePolicyFlags(flags::FlagSet& flag_set, PlanFlags& f) {
  flag_set.Section("policies and domain");
  flag_set
      .Custom("--policy", "LIST", "comma-separated from ultraep,greedy,eplb,none,ideal",
              [&f](std::string_view value) {
                // Distinct names from pl::Policies(); replaces any earlier list.
                f.policies.clear();
                for (absl::string_view p : absl::StrSplit(AsAbsl(value), ',')) {
                  const std::string name(p);
                  if (pl::FindPolicy(name) == nullptr) {
                    return absl::InvalidArgumentError(
                        absl::StrCat("unknown policy '", name, "'; use a comma-separated list of ",
                                     pl::PolicyNames()));
                  }
                  if (std::find(f.policies.begin(), f.policies.end(), name) != f.policies.end()) {
                    return absl::InvalidArgumentError(
                        absl::StrCat("policy '", name, "' is listed twice"));
                  }
                  f.policies.push_back(name);
                }
                return absl::OkStatus();
              })
      .Default("all");
  flag_set
      .Int("--slots", &f.slots, "N",
           "redundant slots per rank; masters per rank come from the trace (experts / ranks)")
      .Range(0, 4096);
  flag_set.Double("--eps", &f.planner.eps, "X", "ultraep threshold precision").Range(1e-9, 1);
  flag_set
      .Int("--min-replica-tokens", &f.planner.min_replica_tokens, "N",
           "ultraep minimum tokens per replica")
      .Range(1, kTwoTo40);
  flag_set
      .Int("--eplb-window", &f.planner.eplb_window, "W",
           "eplb moving-average window in microbatches")
      .Range(1, 1 << 20);
  flag_set
      .Int("--eplb-interval", &f.planner.eplb_interval, "K", "eplb replans every K microbatches")
      .Range(1, 1 << 20);
  flag_set
      .Custom("--eplb-replacement", "MODE",
              "exposed | hidden: whether eplb's re-placement transfers add to the simulated "
              "layer time",
              [&f](std::string_view value) {
                if (value != "exposed" && value != "hidden") {
                  return Problem(value, "is not a mode; use exposed or hidden");
                }
                f.eplb_replacement_exposed = value == "exposed";
                return absl::OkStatus();
              })
      .Default("exposed");
  flag_set
      .Int("--warmup", &f.warmup, "N",
           "plan the first N microbatches (eplb builds its history) but leave them out of "
           "every statistic")
      .Range(0, kTwoTo40);
}

void DeclareClusterFlags(flags::FlagSet& flag_set, PlanFlags& f) {
  flag_set.Section(
      "cluster: D racks of EP G, data parallel across racks (with --domains; defaults: a "
      "DeepSeek-V3-like model, sources in planner/cluster.cc)",
      "Each domain plans from its own generated loads (domain 0 with --seed, the others with\n"
      "seeds mixed from it); the step adds MoE backward, the dense layers and the gradient\n"
      "all-reduce (expert gradients over the D ranks holding a shard, dense gradients over\n"
      "all ranks), overlapped with the last microbatch's backward (docs/design.md 3.11).\n");
  flag_set
      .Int("--domains", &f.domains, "D",
           "racks, each one EP domain of --ranks GPUs; prints the step table too")
      .Range(1, 65536);
  flag_set
      .Double("--scaleout-gbps", &f.cluster.scaleout_gbps, "X",
              "scale-out line rate per GPU, Gb/s per direction")
      .Range(1e-3, 1e6);
  flag_set
      .Double("--scaleout-efficiency", &f.cluster.scaleout_efficiency, "F",
              "achieved fraction of --scaleout-gbps")
      .Range(1e-3, 1);
  flag_set
      .Custom("--scaleout-latency-us", "X", "scale-out latency per message (all-reduce step)",
              [&f](std::string_view value) {
                absl::StatusOr<double> us = flags::ParseDouble(value, 0, 1e6);
                if (!us.ok()) return us.status();
                f.cluster.scaleout_latency_s = *us * 1e-6;
                return absl::OkStatus();
              })
      .Default("5");
  flag_set
      .Custom("--allreduce", "ALGO", "ring | tree: the scale-out all-reduce's cost model",
              [&f](std::string_view value) {
                absl::StatusOr<pl::AllReduceAlgorithm> a = pl::ParseAllReduceAlgorithm(value);
                if (!a.ok()) return Problem(value, "is not an algorithm; use ring or tree");
                f.cluster.allreduce = *a;
                return absl::OkStatus();
              })
      .Default("ring");
  flag_set
      .Double("--dense-params", &f.cluster.dense_params, "N",
              "dense parameters (attention, dense FFNs, shared experts, embeddings)")
      .Range(0, 1e15)
      .Default("17.1e9");
  flag_set
      .Double("--expert-params", &f.expert_params, "N",
              "routed expert parameters over all MoE layers")
      .Range(1, 1e15)
      .Default("--moe-layers x --experts x the preset's expert, 653.9e9");
  flag_set
      .Int("--moe-layers", &f.cluster.moe_layers, "L",
           "MoE layers of the model; each generated layer stands for L / --layers of them")
      .Range(1, 4096);
  flag_set
      .Int("--microbatches-per-step", &f.cluster.microbatches_per_step, "M",
           "microbatches per step (gradients are reduced once per step)")
      .Range(1, 1 << 20);
  flag_set
      .Double("--gpu-tflops", &f.gpu_tflops, "X", "achieved expert and dense GEMM TFLOP/s per GPU")
      .Range(1e-3, 1e6)
      .Default("the preset's, 593.4");
}

// Declares every option on `flag_set`, bound to `f` (its values are the defaults shown);
// returns the generator options' section (rejected with --trace: a trace fixes the domain
// and loads).
int DeclareFlags(flags::FlagSet& flag_set, PlanFlags& f) {
  f.gen.microbatches = 20;
  flag_set.Describe(kDescription);
  flag_set.Epilogue(kEpilogue);

  flag_set.Section("input (one of)");
  flag_set.String("--trace", &f.trace, "FILE",
                  "JSON Lines trace (docs/design.md section 8.3), replayed in file order");
  flag_set.Switch("--generate", &f.generate, "generate loads in memory (options below)");

  const int generator = DeclareGeneratorFlags(flag_set, f);
  DeclarePolicyFlags(flag_set, f);
  DeclareClusterFlags(flag_set, f);
  flag_set.Section("hardware model and output");
  flag_set.String("--preset", &f.preset, "NAME",
                  "hardware preset for the simulator and fan-out cost model (h200-nvl72: "
                  "H200-class GPUs on an NVL72-like NVLink 5 domain, DeepSeek-V3 experts; sources "
                  "in planner/simulator.cc)");
  flag_set.Int("--expert-bytes", &f.expert_bytes, "N", "bytes of one expert's weights")
      .Range(1, kTwoTo40)
      .Default("the preset's, 88080384");
  flag_set.Switch("--json", &f.json, "print one JSON document instead of the table");
  return generator;
}

// The cluster options: only with --domains, which needs --generate and whole steps.
absl::Status CheckClusterFlags(const flags::FlagSet& flag_set, const PlanFlags& f) {
  static constexpr const char* kClusterFlags[] = {
      "--allreduce",           "--dense-params",  "--expert-params",
      "--gpu-tflops",          "--moe-layers",    "--microbatches-per-step",
      "--scaleout-efficiency", "--scaleout-gbps", "--scaleout-latency-us"};
  if (!f.domains) {
    for (const char* flag : kClusterFlags) {
      if (flag_set.Given(flag)) return Usage(flag, "applies only with --domains");
    }
    return absl::OkStatus();
  }
  if (!f.generate) {
    return Usage("--domains",
                 "needs --generate: every domain plans from its own generated load stream, and a "
                 "trace holds one domain's loads");
  }
  if (f.out) return Usage("--out", "writes one domain's trace; drop --domains");
  const int64_t measured = f.gen.microbatches - f.warmup;
  if (measured > 0 && measured % f.cluster.microbatches_per_step != 0) {
    return Usage("--microbatches-per-step",
                 absl::StrCat(f.cluster.microbatches_per_step, " does not divide the ", measured,
                              " measured microbatches (--microbatches ", f.gen.microbatches,
                              " - --warmup ", f.warmup, "); make it whole steps"));
  }
  const int64_t entries = int64_t{*f.domains} * f.gen.microbatches * f.gen.layers;
  if (entries > kMaxEntries) {
    return Usage("--domains",
                 absl::StrCat(*f.domains, " x --microbatches ", f.gen.microbatches, " x --layers ",
                              f.gen.layers, " = ", entries, " entries, over the limit of ",
                              kMaxEntries, " per run; plan fewer microbatches or layers"));
  }
  return absl::OkStatus();
}

// The checks across options, after parsing; completes `f` (experts from
// --masters-per-rank, every policy when none was named).
absl::Status CheckFlags(const flags::FlagSet& flag_set, int generator, PlanFlags& f) {
  // Alphabetical: with --trace, the error names the first generator option given.
  const std::vector<std::string> generator_flags_seen = flag_set.GivenIn(generator);
  if (f.trace && f.generate) return Usage("--trace", "use either --trace or --generate, not both");
  if (!f.trace && !f.generate) {
    return Usage("--trace", "give a trace with --trace FILE, or --generate to generate one");
  }
  if (f.trace && !generator_flags_seen.empty()) {
    return Usage(generator_flags_seen.front(),
                 "applies only with --generate (a trace fixes the domain and loads)");
  }
  if (f.masters_per_rank) {
    if (flag_set.Given("--experts") && f.gen.experts != f.gen.ranks * *f.masters_per_rank) {
      return Usage("--masters-per-rank", "contradicts --experts; give only one of them");
    }
    f.gen.experts = f.gen.ranks * *f.masters_per_rank;
  }
  if (f.generate) {
    if (f.gen.experts % f.gen.ranks != 0) {
      return Usage("--experts",
                   absl::StrCat(f.gen.experts, " is not a multiple of --ranks (", f.gen.ranks,
                                "); give --experts or --masters-per-rank"));
    }
    if (f.gen.popularity == pl::PopularityModel::kLognormal && flag_set.Given("--imbalance")) {
      return Usage("--imbalance",
                   "applies only to --popularity zipf (lognormal is set by --sigma)");
    }
    if (f.gen.popularity != pl::PopularityModel::kLognormal && flag_set.Given("--sigma")) {
      return Usage("--sigma", "applies only with --popularity lognormal");
    }
    if (f.gen.spike_min > f.gen.spike_max) {
      return Usage("--spike-min",
                   absl::StrCat(f.gen.spike_min, " is above --spike-max (", f.gen.spike_max, ")"));
    }
    if (f.gen.spike_experts > f.gen.experts) {
      return Usage("--spikes", absl::StrCat(f.gen.spike_experts, " is more than --experts (",
                                            f.gen.experts, ")"));
    }
    if (f.gen.topk > f.gen.experts) {
      return Usage("--topk",
                   absl::StrCat(f.gen.topk, " is more than --experts (", f.gen.experts, ")"));
    }
    if (f.gen.microbatches * f.gen.layers > kMaxEntries) {
      return Usage(
          "--microbatches",
          absl::StrCat(f.gen.microbatches, " x --layers ", f.gen.layers, " = ",
                       f.gen.microbatches * f.gen.layers, " entries, over the limit of ",
                       kMaxEntries, " per run; plan fewer, or several runs with different --seed"));
    }
    if (int64_t{f.gen.ranks} * f.gen.experts > kMaxLoadsPerEntry) {
      return Usage(
          "--experts",
          absl::StrCat("--ranks ", f.gen.ranks, " x --experts ", f.gen.experts, " = ",
                       int64_t{f.gen.ranks} * f.gen.experts, " loads per entry, over the limit of ",
                       kMaxLoadsPerEntry, "; use fewer ranks or experts"));
    }
  }
  if (absl::Status s = CheckClusterFlags(flag_set, f); !s.ok()) return s;
  if (f.out && (f.json || !f.policies.empty())) {
    return Usage("--out", "writes a trace and plans nothing; drop --json and --policy");
  }
  if (f.policies.empty()) {
    for (const pl::PolicyTraits& p : pl::Policies()) f.policies.emplace_back(p.name);
  }
  return absl::OkStatus();
}

// Where the loads come from: a trace file, streamed, or the generator.
class LoadSource {
 public:
  virtual ~LoadSource() = default;
  virtual absl::StatusOr<std::optional<pl::TraceEntry>> Next() = 0;
};

class TraceSource final : public LoadSource {
 public:
  explicit TraceSource(pl::TraceReader reader) : reader_(std::move(reader)) {}
  absl::StatusOr<std::optional<pl::TraceEntry>> Next() override { return reader_.Next(); }
  int64_t line_number() const { return reader_.line_number(); }

 private:
  pl::TraceReader reader_;
};

// Microbatch-major, layer-minor, as a training step produces them.
class GeneratedSource final : public LoadSource {
 public:
  explicit GeneratedSource(pl::LoadGenerator generator) : generator_(std::move(generator)) {}
  absl::StatusOr<std::optional<pl::TraceEntry>> Next() override {
    const pl::GeneratorOptions& o = generator_.options();
    if (microbatch_ >= o.microbatches) return std::optional<pl::TraceEntry>();
    absl::StatusOr<pl::TraceEntry> entry = generator_.Generate(microbatch_, layer_);
    if (++layer_ == o.layers) {
      layer_ = 0;
      ++microbatch_;
    }
    if (!entry.ok()) return entry.status();
    return std::optional<pl::TraceEntry>(*std::move(entry));
  }

 private:
  pl::LoadGenerator generator_;
  int64_t microbatch_ = 0;
  int layer_ = 0;
};

// A policy's chained plan fingerprint: equal hashes mean bit-identical plans in the same
// order (used to check determinism across processes).
std::string HashHex(uint64_t hash) {
  return Format("%016llx", static_cast<unsigned long long>(hash));
}

struct Triple {
  double p50, p99, max;
};
Triple Summary(std::vector<double> v) {
  return {base::Percentile(v, 0.50), base::Percentile(v, 0.99),
          v.empty() ? 0 : *std::max_element(v.begin(), v.end())};
}

json TripleJson(const Triple& t) { return json{{"p50", t.p50}, {"p99", t.p99}, {"max", t.max}}; }

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "rackrun plan: %s\n", std::string(status.message()).c_str());
  return 1;
}

// Progress on stderr for long runs: nothing for the first 2 s, then a line every 5 s
// (rewritten in place on a terminal). `total` is 0 when unknown (a trace).
class Progress {
 public:
  Progress(std::string_view verb, int64_t total)
      : verb_(verb), total_(total), tty_(::isatty(STDERR_FILENO) == 1) {}
  ~Progress() {
    if (shown_ && tty_) std::fputc('\n', stderr);
  }
  void Update(int64_t done) {
    const auto now = std::chrono::steady_clock::now();
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    if (elapsed < next_report_s_) return;
    next_report_s_ = elapsed + 5;
    std::string line = absl::StrCat("rackrun plan: ", verb_, " ", done);
    if (total_ > 0) {
      const double left = elapsed * static_cast<double>(total_ - done) / static_cast<double>(done);
      absl::StrAppend(
          &line, " / ", total_, " entries (",
          Format("%.1f", 100.0 * static_cast<double>(done) / static_cast<double>(total_)), "%), ",
          Format("%.0f", elapsed), " s elapsed, about ",
          left < 3600 ? Format("%.0f s", left) : Format("%.1f h", left / 3600), " left");
    } else {
      absl::StrAppend(&line, " entries, ", Format("%.0f", elapsed), " s elapsed");
    }
    std::fprintf(stderr, tty_ ? "\r%s\x1b[K" : "%s\n", line.c_str());
    std::fflush(stderr);
    shown_ = true;
  }

 private:
  std::string verb_;
  int64_t total_;
  bool tty_;
  bool shown_ = false;
  double next_report_s_ = 2;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// Writes the generated trace to --out through a temporary file renamed when complete, so
// an error (disk full, a bad entry) leaves no partial FILE.
int WriteTrace(const PlanFlags& f, LoadSource& source) {
  absl::StatusOr<base::AtomicFileWriter> writer = base::AtomicFileWriter::Open(*f.out);
  if (!writer.ok()) return Fail(writer.status());
  // SIGINT/SIGTERM stop the run between entries; the temporary file is removed.
  static std::atomic<int> stop_signal{0};
  if (absl::Status s = base::WatchStopSignals([](int signal) { stop_signal = signal; }); !s.ok()) {
    return Fail(s);
  }
  Progress progress("wrote", f.gen.microbatches * f.gen.layers);
  int64_t entries = 0;
  std::string pending;
  constexpr size_t kFlushBytes = size_t{1} << 20;
  while (true) {
    absl::StatusOr<std::optional<pl::TraceEntry>> next = source.Next();
    if (!next.ok()) return Fail(next.status());
    if (!next->has_value()) break;
    pending += pl::FormatTraceLine(**next);
    pending += '\n';
    if (pending.size() >= kFlushBytes) {
      if (absl::Status s = writer->Append(pending); !s.ok()) return Fail(s);
      pending.clear();
    }
    progress.Update(++entries);
    if (const int signal = stop_signal.load(); signal != 0) {
      Fail(absl::CancelledError(absl::StrCat("stopped by signal ", signal, " after ", entries,
                                             " entries; ", *f.out, " was not written")));
      return 128 + signal;
    }
  }
  if (absl::Status s = writer->Append(pending); !s.ok()) return Fail(s);
  if (absl::Status s = writer->Commit(); !s.ok()) return Fail(s);
  std::fprintf(stderr, "rackrun plan: wrote %lld entries (%lld microbatches x %d layers) to %s\n",
               static_cast<long long>(entries), static_cast<long long>(f.gen.microbatches),
               f.gen.layers, f.out->c_str());
  return 0;
}

std::string SourceText(const PlanFlags& f) {
  if (f.trace) return absl::StrCat("trace ", *f.trace);
  const pl::GeneratorOptions& g = f.gen;
  return absl::StrCat(
      "generated: EP", g.ranks, ", ", g.experts, " experts, top-", g.topk, ", ", g.tokens_per_rank,
      " tokens/rank", g.token_jitter > 0 ? absl::StrCat(" +-", g.token_jitter * 100, "%") : "",
      g.popularity == pl::PopularityModel::kLognormal
          ? absl::StrCat(", lognormal sigma ", g.lognormal_sigma)
          : absl::StrCat(", imbalance ", g.imbalance),
      g.spike_experts > 0
          ? absl::StrCat(", spikes of 1-", g.spike_experts, " experts x", g.spike_min, "-",
                         g.spike_max, " in ", g.spike_rate * 100, "% of entries")
          : "",
      ", ",
      pl::LoadShiftName(g.shift) == "none"
          ? std::string("stationary")
          : absl::StrCat(AsAbsl(pl::LoadShiftName(g.shift)), " every ", g.shift_every),
      ", seed ", g.seed);
}

// What a replay (one domain, or every domain's merged) reports.
struct ReplayView {
  std::vector<pl::PolicyReplay> results;
  pl::Domain domain;
  int64_t entries = 0;
  size_t microbatches = 0;  // distinct, warm-up included (per domain)
  size_t measured_microbatches = 0;
  size_t layers = 0;
};

int NoEntries(const PlanFlags& f, const ReplayView& v) {
  return Fail(absl::InvalidArgumentError(absl::StrCat(f.trace ? *f.trace : std::string("generator"),
                                                      ": no entries to measure (", v.microbatches,
                                                      " microbatches, --warmup ", f.warmup, ")")));
}

constexpr double kMiB = 1024.0 * 1024.0;

json ReplayJson(const PlanFlags& f, const pl::HardwareModel& hw, int64_t expert_bytes,
                const ReplayView& v) {
  const int64_t entries = v.entries;
  const pl::Domain& domain = v.domain;
  json doc;
  doc["source"] = SourceText(f);
  if (f.trace) {
    doc["trace"] = *f.trace;
  } else {
    const pl::GeneratorOptions& g = f.gen;
    doc["generator"] = {{"ranks", g.ranks},
                        {"experts", g.experts},
                        {"topk", g.topk},
                        {"tokens_per_rank", g.tokens_per_rank},
                        {"token_jitter", g.token_jitter},
                        {"imbalance", g.imbalance},
                        {"microbatches", g.microbatches},
                        {"layers", g.layers},
                        {"nonstationary", std::string(pl::LoadShiftName(g.shift))},
                        {"shift_every", g.shift_every},
                        {"popularity", std::string(pl::PopularityModelName(g.popularity))},
                        {"lognormal_sigma", g.lognormal_sigma},
                        {"spike_experts", g.spike_experts},
                        {"spike_min", g.spike_min},
                        {"spike_max", g.spike_max},
                        {"spike_rate", g.spike_rate},
                        {"seed", g.seed}};
  }
  doc["entries"] = entries;
  doc["microbatches"] = v.measured_microbatches;
  doc["warmup_microbatches"] = v.microbatches - v.measured_microbatches;
  doc["layers"] = v.layers;
  doc["domain"] = {{"ranks", domain.ranks},
                   {"masters_per_rank", domain.masters_per_rank},
                   {"slots_per_rank", domain.slots_per_rank},
                   {"experts", domain.experts()}};
  doc["options"] = {{"eps", f.planner.eps},
                    {"min_replica_tokens", f.planner.min_replica_tokens},
                    {"eplb_window", f.planner.eplb_window},
                    {"eplb_interval", f.planner.eplb_interval},
                    {"eplb_replacement", f.eplb_replacement_exposed ? "exposed" : "hidden"}};
  doc["hardware"] = {{"preset", hw.name},
                     {"expert_bytes", expert_bytes},
                     {"token_bytes", hw.token_bytes()},
                     {"gemm_flops_per_s", hw.gemm_flops_per_s},
                     {"a2a_bytes_per_s", hw.a2a_bytes_per_s},
                     {"fanout_egress_bytes_per_s", hw.fanout.egress_bytes_per_s}};
  json policies = json::array();
  const double per_entry_us = 1e6 / static_cast<double>(entries);
  for (const pl::PolicyReplay& run : v.results) {
    policies.push_back(
        {{"policy", run.policy},
         {"imbalance_before", TripleJson(Summary(run.before))},
         {"imbalance_after", TripleJson(Summary(run.after))},
         {"replicas_mean", Mean(run.replicas)},
         {"replicas_max", Summary(run.replicas).max},
         {"fanout_bytes_mean", Mean(run.fanout_bytes)},
         {"fanout_direct_ms_mean", Mean(run.direct_ms)},
         {"fanout_relay_ms_mean", Mean(run.relay_ms)},
         {"replacement_bytes_total", run.replacement_bytes},
         {"simulated_percent_of_ideal", 100.0 * run.ideal_s / run.layer_s},
         {"simulated_percent_of_ideal_min",
          *std::min_element(run.percent.begin(), run.percent.end())},
         {"layer_time_us_mean", run.layer_s / static_cast<double>(entries) * 1e6},
         {"ideal_layer_time_us_mean", run.ideal_s / static_cast<double>(entries) * 1e6},
         {"layer_time_breakdown_us_mean",
          {{"dispatch", run.parts.dispatch_s * per_entry_us},
           {"exposed_fanout", run.parts.exposed_fanout_s * per_entry_us},
           {"compute", run.parts.compute_s * per_entry_us},
           {"combine", run.parts.combine_s * per_entry_us},
           {"replacement", run.parts.replacement_s * per_entry_us}}},
         {"solve_us", TripleJson(Summary(run.solve_us))},
         {"plan_hash", HashHex(run.plan_hash)}});
  }
  doc["policies"] = std::move(policies);
  return doc;
}

// The per-(microbatch, layer) table. `domains_text` follows the entry count (empty
// without --domains, so that output stays as it was).
void PrintReplay(const PlanFlags& f, const pl::HardwareModel& hw, int64_t expert_bytes,
                 const ReplayView& v, const std::string& domains_text) {
  const pl::Domain& domain = v.domain;
  std::printf("rackrun plan: %s\n", SourceText(f).c_str());
  std::printf(
      "%lld entries (%zu microbatches x %zu layers%s); domain %d ranks x (%d masters + %d "
      "slots); hardware %s, expert %.1f MiB\n",
      static_cast<long long>(v.entries), v.measured_microbatches, v.layers, domains_text.c_str(),
      domain.ranks, domain.masters_per_rank, domain.slots_per_rank, hw.name.c_str(),
      static_cast<double>(expert_bytes) / kMiB);
  std::printf(
      "ultraep eps %g; eplb W=%d K=%d, re-placement %s; %lld warm-up microbatches not "
      "measured\n\n",
      f.planner.eps, f.planner.eplb_window, f.planner.eplb_interval,
      f.eplb_replacement_exposed ? "exposed" : "hidden",
      static_cast<long long>(v.microbatches - v.measured_microbatches));
  std::printf(
      "| policy  | imbalance before p50/p99/max | after p50/p99/max     | replicas | fan-out MiB | "
      "fan-out ms direct/relay | re-placed MiB | sim %% of ideal | solve us p50/p99    |\n");
  std::printf(
      "|---------|------------------------------|-----------------------|----------|-------------|"
      "-------------------------|---------------|----------------|---------------------|\n");
  for (const pl::PolicyReplay& run : v.results) {
    const Triple before = Summary(run.before);
    const Triple after = Summary(run.after);
    const std::string before_text =
        Format("%.3f / %.3f / %.3f", before.p50, before.p99, before.max);
    const std::string after_text = Format("%.3f / %.3f / %.3f", after.p50, after.p99, after.max);
    const std::string fanout_ms = Format("%.3f / %.3f", Mean(run.direct_ms), Mean(run.relay_ms));
    const std::string solve_text = Format("%.1f / %.1f", base::Percentile(run.solve_us, 0.50),
                                          base::Percentile(run.solve_us, 0.99));
    std::printf("| %-7s | %-28s | %-21s | %8.1f | %11.1f | %-23s | %13.1f | %14.1f | %-19s |\n",
                run.policy.c_str(), before_text.c_str(), after_text.c_str(), Mean(run.replicas),
                Mean(run.fanout_bytes) / kMiB, fanout_ms.c_str(),
                static_cast<double>(run.replacement_bytes) / kMiB,
                100.0 * run.ideal_s / run.layer_s, solve_text.c_str());
  }
  std::printf(
      "\nreplicas, fan-out MiB and ms: mean per (microbatch, layer); re-placed MiB: total over "
      "the trace; sim %% of ideal: summed force-balanced ideal time / summed simulated layer "
      "time.\n");
}

// A policy's solve times per domain: the median of the domains' p50s and their largest.
struct DomainSolves {
  double p50_median = 0, p50_max = 0;
};
DomainSolves SolvesByDomain(const pl::ClusterReplay& cluster, size_t policy) {
  std::vector<double> p50s;
  for (int d = 0; d < cluster.domains(); ++d) {
    p50s.push_back(base::Percentile(cluster.domain(d).results()[policy].solve_us, 0.50));
  }
  return {base::Median(p50s), *std::max_element(p50s.begin(), p50s.end())};
}

json StepJson(const pl::StepTime& s) {
  return json{{"step_ms", s.total_s * 1e3},
              {"moe_forward_ms", s.moe_forward_s * 1e3},
              {"moe_backward_ms", s.moe_backward_s * 1e3},
              {"moe_compute_ms", s.moe_compute_s * 1e3},
              {"moe_a2a_ms", s.moe_a2a_s * 1e3},
              {"balancing_ms", s.balancing_s * 1e3},
              {"dense_ms", s.dense_s * 1e3},
              {"compute_ms", s.compute_s * 1e3},
              {"last_backward_ms", s.last_backward_s * 1e3},
              {"allreduce_ms", s.allreduce_s * 1e3},
              {"exposed_allreduce_ms", s.exposed_allreduce_s * 1e3}};
}

// --domains: every domain's own stream through its own planners, then the step table.
// The cluster of --domains with the flags' model: the routed expert parameters from the
// preset's expert unless --expert-params; --gpu-tflops into `hw`.
absl::StatusOr<pl::ClusterModel> ClusterModelOf(const PlanFlags& f, pl::HardwareModel& hw) {
  pl::ClusterModel model = f.cluster;
  model.domains = *f.domains;
  if (f.expert_params <= 0) {
    model.expert_params = static_cast<double>(model.moe_layers) * f.gen.experts *
                          static_cast<double>(hw.expert_bytes()) /
                          static_cast<double>(hw.bytes_per_element);
  } else {
    model.expert_params = f.expert_params;
  }
  if (f.gpu_tflops > 0) hw.gemm_flops_per_s = f.gpu_tflops * 1e12;
  if (absl::Status s = model.Validate(); !s.ok()) return s;
  return model;
}

// Generates every domain's loads (domain d with its own seed) and replays them, microbatch
// by microbatch and layer by layer, through the policies.
absl::Status ReplayDomains(const PlanFlags& f, int domains, pl::ClusterReplay& cluster) {
  const auto in_domain = [](int d, const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("domain ", d, ": ", s.message()));
  };
  std::vector<pl::LoadGenerator> generators;
  for (int d = 0; d < domains; ++d) {
    pl::GeneratorOptions g = f.gen;
    g.seed = pl::DomainSeed(f.gen.seed, d);
    absl::StatusOr<pl::LoadGenerator> generator = pl::LoadGenerator::Create(g);
    if (!generator.ok()) return in_domain(d, generator.status());
    generators.push_back(*std::move(generator));
  }
  Progress progress("planned", int64_t{domains} * f.gen.microbatches * f.gen.layers);
  int64_t done = 0;
  for (int64_t mb = 0; mb < f.gen.microbatches; ++mb) {
    for (int layer = 0; layer < f.gen.layers; ++layer) {
      for (int d = 0; d < domains; ++d) {
        absl::StatusOr<pl::TraceEntry> entry =
            generators[static_cast<size_t>(d)].Generate(mb, layer);
        if (!entry.ok()) return in_domain(d, entry.status());
        if (absl::Status s = cluster.Add(d, *entry); !s.ok()) return s;
        progress.Update(++done);
      }
    }
  }
  return absl::OkStatus();
}

// The mean step of the policy that does not balance (its tokens stay with the masters),
// the baseline of "vs none"; null when it was not replayed.
const pl::StepTime* UnbalancedStep(const std::vector<pl::PolicySteps>& steps) {
  for (size_t p = 0; p + 1 < steps.size(); ++p) {
    const pl::PolicyTraits* traits = pl::FindPolicy(steps[p].policy);
    if (traits != nullptr && traits->split == pl::TokenSplit::kMastersOnly) return &steps[p].mean;
  }
  return nullptr;
}

// What the cluster's outputs print from: the replay and its mean steps per policy (the
// ideal bound last), the baseline policy's, the gradient all-reduce, the ranks per domain.
struct ClusterView {
  const PlanFlags& f;
  const pl::ClusterReplay& cluster;
  const pl::ClusterModel& model;
  const pl::HardwareModel& hw;
  int64_t expert_bytes;
  const ReplayView& view;
  const std::vector<pl::PolicySteps>& steps;
  const pl::StepTime& ideal;
  const pl::StepTime* none;
  const pl::GradientReduce& reduce;
  int ep;
};

void PrintClusterJson(const ClusterView& c) {
  const auto& [f, cluster, model, hw, expert_bytes, view, steps, ideal, none, reduce, ep] = c;
  const double solves_per_step =
      static_cast<double>(model.moe_layers) * model.microbatches_per_step;
  json doc = ReplayJson(f, hw, expert_bytes, view);
  json policies = json::array();
  for (size_t p = 0; p < steps.size(); ++p) {
    const pl::StepTime& s = steps[p].mean;
    json j = StepJson(s);
    j["policy"] = steps[p].policy;
    j["percent_of_ideal"] = 100.0 * ideal.total_s / s.total_s;
    if (none != nullptr) j["speedup_over_none"] = none->total_s / s.total_s;
    j["balancing_percent_of_step"] = 100.0 * s.balancing_s / s.total_s;
    if (p + 1 < steps.size()) {
      const DomainSolves solves = SolvesByDomain(cluster, p);
      j["solve_us_p50_domain_median"] = solves.p50_median;
      j["solve_us_p50_domain_max"] = solves.p50_max;
      j["solve_percent_of_step_if_exposed"] =
          100.0 * solves.p50_median * 1e-6 * solves_per_step / s.total_s;
    }
    policies.push_back(std::move(j));
  }
  doc["cluster"] = {{"domains", model.domains},
                    {"ep", ep},
                    {"gpus", int64_t{model.domains} * ep},
                    {"allreduce", std::string(pl::AllReduceAlgorithmName(model.allreduce))},
                    {"scaleout_gbps", model.scaleout_gbps},
                    {"scaleout_efficiency", model.scaleout_efficiency},
                    {"scaleout_latency_us", model.scaleout_latency_s * 1e6},
                    {"dense_params", model.dense_params},
                    {"expert_params", model.expert_params},
                    {"moe_layers", model.moe_layers},
                    {"microbatches_per_step", model.microbatches_per_step},
                    {"gemm_flops_per_s", hw.gemm_flops_per_s},
                    {"steps", steps.front().steps.size()},
                    {"gradient_reduce_ms",
                     {{"dense_scaleup", reduce.dense_scaleup_s * 1e3},
                      {"dense_scaleout", reduce.dense_scaleout_s * 1e3},
                      {"expert_scaleout", reduce.expert_scaleout_s * 1e3},
                      {"total", reduce.total_s * 1e3}}},
                    {"policies", std::move(policies)}};
  std::printf("%s\n", doc.dump(2).c_str());
}

void PrintClusterTable(const ClusterView& c) {
  const auto& [f, cluster, model, hw, expert_bytes, view, steps, ideal, none, reduce, ep] = c;
  PrintReplay(f, hw, expert_bytes, view, absl::StrCat(" x ", model.domains, " domains"));
  std::printf(
      "\ncluster: %d domains x EP%d = %lld GPUs; %zu steps of %d microbatches x %d MoE layers; "
      "dense %.4g + expert %.4g parameters; GEMM %.1f TFLOP/s per GPU; scale-out %g Gb/s x %g "
      "per GPU, %g us, %s all-reduce\n",
      model.domains, ep, static_cast<long long>(int64_t{model.domains} * ep),
      steps.front().steps.size(), model.microbatches_per_step, model.moe_layers, model.dense_params,
      model.expert_params, hw.gemm_flops_per_s / 1e12, model.scaleout_gbps,
      model.scaleout_efficiency, model.scaleout_latency_s * 1e6,
      std::string(pl::AllReduceAlgorithmName(model.allreduce)).c_str());
  std::printf(
      "gradient all-reduce per step: dense in-rack %.1f ms + dense scale-out %.1f ms + expert "
      "scale-out %.1f ms = %.1f ms\n\n",
      reduce.dense_scaleup_s * 1e3, reduce.dense_scaleout_s * 1e3, reduce.expert_scaleout_s * 1e3,
      reduce.total_s * 1e3);
  std::printf(
      "| policy     | step ms  | %% of ideal | vs none | MoE compute ms | MoE a2a ms | balancing "
      "ms (%% step) | dense ms | all-reduce ms total / exposed | solve us p50 median / max of "
      "domains |\n");
  std::printf(
      "|------------|----------|------------|---------|----------------|------------|-----------"
      "-----------|----------|-------------------------------|----------------------------------"
      "---|\n");
  for (size_t p = 0; p < steps.size(); ++p) {
    const pl::StepTime& s = steps[p].mean;
    const std::string balancing =
        Format("%.1f (%.2f%%)", s.balancing_s * 1e3, 100.0 * s.balancing_s / s.total_s);
    const std::string reduce_text =
        Format("%.1f / %.1f", s.allreduce_s * 1e3, s.exposed_allreduce_s * 1e3);
    std::string solve_text = "-";
    if (p + 1 < steps.size()) {
      const DomainSolves solves = SolvesByDomain(cluster, p);
      solve_text = Format("%.1f / %.1f", solves.p50_median, solves.p50_max);
    }
    std::printf(
        "| %-10s | %8.1f | %10.1f | %7s | %14.1f | %10.1f | %-20s | %8.1f | %-29s | %-35s |\n",
        steps[p].policy.c_str(), s.total_s * 1e3, 100.0 * ideal.total_s / s.total_s,
        none != nullptr ? Format("%.3f", none->total_s / s.total_s).c_str() : "-",
        s.moe_compute_s * 1e3, s.moe_a2a_s * 1e3, balancing.c_str(), s.dense_s * 1e3,
        reduce_text.c_str(), solve_text.c_str());
  }
  std::printf(
      "\nstep: mean over steps of the slowest domain's microbatches plus the exposed all-reduce; "
      "%% of ideal: the force-balanced ideal step / the step; vs none: none's step / the step; "
      "balancing: exposed fan-out, replica-gradient reduction and re-placement; solve: this "
      "CPU's planner time, one domain per solve, not in the step.\n");
}

int PlanCluster(const PlanFlags& f, pl::ReplayOptions options, int64_t expert_bytes) {
  absl::StatusOr<pl::ClusterModel> model = ClusterModelOf(f, options.hardware);
  if (!model.ok()) return Fail(model.status());
  const pl::HardwareModel hw = options.hardware;
  pl::ClusterReplay cluster(std::move(options), *model, f.gen.topk);
  if (absl::Status s = ReplayDomains(f, model->domains, cluster); !s.ok()) return Fail(s);
  const pl::Replay& first = cluster.domain(0);
  ReplayView view{
      cluster.Merged(), first.domain(), 0, first.microbatches(), first.measured_microbatches(),
      first.layers()};
  for (int d = 0; d < cluster.domains(); ++d) view.entries += cluster.domain(d).entries();
  if (view.entries == 0) return NoEntries(f, view);
  if (absl::Status s = cluster.Finish(); !s.ok()) return Fail(s);
  const std::vector<pl::PolicySteps>& steps = cluster.steps();
  const ClusterView printed{f,
                            cluster,
                            *model,
                            hw,
                            expert_bytes,
                            view,
                            steps,
                            steps.back().mean,
                            UnbalancedStep(steps),
                            cluster.reduce(),
                            view.domain.ranks};
  if (f.json) {
    PrintClusterJson(printed);
  } else {
    PrintClusterTable(printed);
  }
  return 0;
}

}  // namespace

int PlanCommand(const Args& args) {
  PlanFlags f;
  flags::FlagSet flag_set("rackrun plan", kSynopsis);
  const int generator_section = DeclareFlags(flag_set, f);
  if (std::optional<int> exit = flag_set.ParseCommandLine(args)) return *exit;
  if (absl::Status s = CheckFlags(flag_set, generator_section, f); !s.ok()) {
    return flag_set.Fail(s);
  }
  absl::StatusOr<pl::HardwareModel> hw = pl::HardwarePreset(f.preset);
  if (!hw.ok()) {
    std::fprintf(stderr, "rackrun plan: --preset: %s\nrun 'rackrun plan --help' for usage\n",
                 std::string(hw.status().message()).c_str());
    return 2;
  }
  const int64_t expert_bytes = f.expert_bytes.value_or(hw->expert_bytes());

  std::unique_ptr<LoadSource> source;
  if (f.trace) {
    absl::StatusOr<pl::TraceReader> reader = pl::TraceReader::Open(*f.trace);
    if (!reader.ok()) return Fail(reader.status());
    source = std::make_unique<TraceSource>(*std::move(reader));
  } else {
    absl::StatusOr<pl::LoadGenerator> generator = pl::LoadGenerator::Create(f.gen);
    if (!generator.ok()) return Fail(generator.status());
    source = std::make_unique<GeneratedSource>(*std::move(generator));
  }
  if (f.out) return WriteTrace(f, *source);

  pl::ReplayOptions options;
  options.policies = f.policies;
  options.slots = f.slots;
  options.planner = f.planner;
  options.planner.expert_bytes = expert_bytes;
  options.hardware = *hw;
  options.replacement_exposed = f.eplb_replacement_exposed;
  options.warmup = f.warmup;
  if (f.domains) return PlanCluster(f, std::move(options), expert_bytes);

  pl::Replay replay(std::move(options));
  Progress progress("planned", f.trace ? 0 : f.gen.microbatches * f.gen.layers);
  int64_t read = 0;
  while (true) {
    absl::StatusOr<std::optional<pl::TraceEntry>> next = source->Next();
    if (!next.ok()) return Fail(next.status());
    if (!next->has_value()) break;
    ++read;
    if (f.trace && read > kMaxEntries) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          *f.trace, ":", static_cast<const TraceSource&>(*source).line_number(),
          ": the trace has more than ", kMaxEntries,
          " entries, the limit of one run (per-entry statistics are kept in memory); split it")));
    }
    progress.Update(read);
    if (absl::Status s = replay.Add(**next); !s.ok()) return Fail(s);
  }
  ReplayView view{replay.results(),
                  replay.domain(),
                  replay.entries(),
                  replay.microbatches(),
                  replay.measured_microbatches(),
                  replay.layers()};
  if (view.entries == 0) return NoEntries(f, view);
  if (f.json) {
    std::printf("%s\n", ReplayJson(f, *hw, expert_bytes, view).dump(2).c_str());
    return 0;
  }
  PrintReplay(f, *hw, expert_bytes, view, "");
  return 0;
}

}  // namespace rackrun::cli
