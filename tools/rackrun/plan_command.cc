// rackrun plan: replays a load trace (or generated loads) through balancing policies and
// prints, per policy, imbalance, replicas, fan-out, simulated layer time and solve time.
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

#include <unistd.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/file.h"
#include "base/signals.h"
#include "base/statistics.h"
#include "nlohmann/json.hpp"
#include "planner/fanout.h"
#include "planner/generate.h"
#include "planner/invariants.h"
#include "planner/plan.h"
#include "planner/planner.h"
#include "planner/simulator.h"
#include "planner/trace.h"
#include "tools/rackrun/command.h"

namespace rackrun::cli {
namespace {

using base::Mean;

namespace pl = ::rackrun::planner;
using nlohmann::json;

constexpr std::string_view kUsage =
    R"(usage: rackrun plan (--trace FILE | --generate [generator options]) [options]
       rackrun plan --generate [generator options] --out FILE

Replays exact per-(microbatch, layer) expert loads through balancing policies and prints,
per policy: rank imbalance (max/mean) before and after balancing (p50/p99/max over the
trace's entries), replicas, replica fan-out bytes and time (direct vs relay), EPLB
re-placement bytes, simulated MoE layer time as % of the force-balanced ideal, and plan
solve time (p50/p99, microseconds on this CPU). Every plan is checked with the invariant
checker; a violation fails the run.

input (one of):
  --trace FILE            JSON Lines trace (docs/design.md section 8.3), replayed in file order
  --generate              generate loads in memory (options below)

generator options (only with --generate):
  --ranks N               source/expert ranks G (default 64)
  --experts N             logical experts, a multiple of --ranks (default 256)
  --masters-per-rank N    alternative to --experts: experts = ranks * N
  --topk K                distinct experts per token (default 8)
  --tokens-per-rank N     mean tokens per source rank per microbatch (default 8192)
  --token-jitter F        per-rank token counts vary uniformly by +-F (default 0)
  --imbalance X           target initial max/mean rank load, >= 1 (default 2)
  --microbatches N        (default 20)
  --layers N              MoE layers per microbatch (default 1)
  --nonstationary MODE    none | drift | jump: hot experts change gradually or at once
                          every --shift-every microbatches (default none)
  --shift-every J         (default 10)
  --seed S                (default 1)
  --popularity MODEL      zipf (calibrated to --imbalance) | lognormal: expert weights
                          exp(sigma * N(0,1)), heavy-tailed, not calibrated (default zipf)
  --sigma X               lognormal sigma, (0, 8] (default 1.5; 1 to 2 are typical)
  --spikes N              in a fraction --spike-rate of the (microbatch, layer) entries,
                          1..N random experts spike to --spike-min..--spike-max times their
                          weight for that entry only (default 0: no spikes)
  --spike-min X, --spike-max X   spike factor range (default 5 and 20)
  --spike-rate F          probability that an entry spikes (default 0.25)
  --out FILE              write the generated trace to FILE instead of planning

policies and domain:
  --policy LIST           comma-separated from ultraep,greedy,eplb,none,ideal (default all)
  --slots N               redundant slots per rank (default 2); masters per rank come from
                          the trace (experts / ranks)
  --eps X                 ultraep threshold precision (default 0.01)
  --min-replica-tokens N  ultraep minimum tokens per replica (default 1)
  --eplb-window W         eplb moving-average window in microbatches (default 100)
  --eplb-interval K       eplb replans every K microbatches (default 10)
  --eplb-replacement M    exposed | hidden: whether eplb's re-placement transfers add to
                          the simulated layer time (default exposed)
  --warmup N              plan the first N microbatches (eplb builds its history) but leave
                          them out of every statistic (default 0)

hardware model and output:
  --preset NAME           hardware preset for the simulator and fan-out cost model
                          (default h200-nvl72: H200-class GPUs on an NVL72-like NVLink 5
                          domain, DeepSeek-V3 experts; sources in planner/simulator.cc)
  --expert-bytes N        bytes of one expert's weights (default: the preset's, 88080384)
  --json                  print one JSON document instead of the table
  --help                  this text

greedy: the plain greedy baseline (move the heaviest rank's largest instance into a free
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

// Bounds of one run (stated in kUsage).
constexpr int64_t kMaxEntries = 1000000;
constexpr int64_t kMaxLoadsPerEntry = int64_t{1} << 24;

constexpr std::string_view kAllPolicies[] = {"ultraep", "greedy", "eplb", "none", "ideal"};

absl::string_view AsAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

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
  bool help = false;
  bool eplb_replacement_exposed = true;
  int64_t warmup = 0;
};

// A usage error names the flag; the caller prints it with a pointer to --help, exit 2.
absl::Status Usage(std::string_view flag, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(AsAbsl(flag), ": ", AsAbsl(what)));
}

absl::Status ParseInt(std::string_view flag, const std::string& value, int64_t lo, int64_t hi,
                      int64_t* out) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(value, &v)) {
    return Usage(flag, absl::StrCat("'", value, "' is not an integer"));
  }
  if (v < lo || v > hi) {
    return Usage(flag, absl::StrCat(v, " is out of range; use ", lo, "..", hi));
  }
  *out = v;
  return absl::OkStatus();
}

template <typename T>
absl::Status ParseIntTo(std::string_view flag, const std::string& value, int64_t lo, int64_t hi,
                        T* out) {
  int64_t v = 0;
  if (absl::Status s = ParseInt(flag, value, lo, hi, &v); !s.ok()) return s;
  *out = static_cast<T>(v);
  return absl::OkStatus();
}

absl::Status ParseDouble(std::string_view flag, const std::string& value, double lo, double hi,
                         double* out) {
  double v = 0;
  if (!absl::SimpleAtod(value, &v) || !std::isfinite(v)) {
    return Usage(flag, absl::StrCat("'", value, "' is not a number"));
  }
  if (v < lo || v > hi) {
    return Usage(flag, absl::StrCat(value, " is out of range; use ", lo, "..", hi));
  }
  *out = v;
  return absl::OkStatus();
}

// Parses an option's value into PlanFlags, or says what is wrong with it; `flag` names the
// option in the message. A switch takes no value: its parser gets an empty one.
using ParseValue = std::function<absl::Status(std::string_view flag, const std::string& value)>;

// An integer in lo..hi; T may be a std::optional.
template <typename T>
ParseValue IntValue(T* out, int64_t lo, int64_t hi) {
  return [=](std::string_view flag, const std::string& value) {
    return ParseIntTo(flag, value, lo, hi, out);
  };
}

ParseValue NumberValue(double* out, double lo, double hi) {
  return [=](std::string_view flag, const std::string& value) {
    return ParseDouble(flag, value, lo, hi, out);
  };
}

template <typename T>
ParseValue TextValue(T* out) {
  return [=](std::string_view, const std::string& value) {
    *out = value;
    return absl::OkStatus();
  };
}

ParseValue SwitchOn(bool* out) {
  return [=](std::string_view, const std::string&) {
    *out = true;
    return absl::OkStatus();
  };
}

ParseValue SeedValue(uint64_t* out) {
  return [=](std::string_view flag, const std::string& value) {
    if (!absl::SimpleAtoi(value, out)) {
      return Usage(flag, absl::StrCat("'", value, "' is not a non-negative integer"));
    }
    return absl::OkStatus();
  };
}

ParseValue LoadShiftValue(pl::LoadShift* out) {
  return [=](std::string_view flag, const std::string& value) {
    absl::StatusOr<pl::LoadShift> shift = pl::ParseLoadShift(value);
    if (!shift.ok()) {
      return Usage(flag, absl::StrCat("'", value, "' is not a mode; use none, drift or jump"));
    }
    *out = *shift;
    return absl::OkStatus();
  };
}

ParseValue PopularityValue(pl::PopularityModel* out) {
  return [=](std::string_view flag, const std::string& value) {
    absl::StatusOr<pl::PopularityModel> model = pl::ParsePopularityModel(value);
    if (!model.ok()) {
      return Usage(flag, absl::StrCat("'", value, "' is not a model; use zipf or lognormal"));
    }
    *out = *model;
    return absl::OkStatus();
  };
}

ParseValue ReplacementValue(bool* exposed) {
  return [=](std::string_view flag, const std::string& value) {
    if (value != "exposed" && value != "hidden") {
      return Usage(flag, absl::StrCat("'", value, "' is not a mode; use exposed or hidden"));
    }
    *exposed = value == "exposed";
    return absl::OkStatus();
  };
}

// A comma-separated list of distinct names from kAllPolicies; replaces any earlier list.
ParseValue PolicyListValue(std::vector<std::string>* out) {
  return [=](std::string_view flag, const std::string& value) {
    out->clear();
    for (absl::string_view p : absl::StrSplit(value, ',')) {
      const std::string name(p);
      if (std::find(std::begin(kAllPolicies), std::end(kAllPolicies), name) ==
          std::end(kAllPolicies)) {
        return Usage(flag, absl::StrCat("unknown policy '", name,
                                        "'; use a comma-separated list of ultraep, greedy, "
                                        "eplb, none, ideal"));
      }
      if (std::find(out->begin(), out->end(), name) != out->end()) {
        return Usage(flag, absl::StrCat("policy '", name, "' is listed twice"));
      }
      out->push_back(name);
    }
    return absl::OkStatus();
  };
}

// A generator option is rejected with --trace (a trace fixes the domain and loads).
enum class OptionKind { kSwitch, kValue, kGeneratorValue };

struct Option {
  std::string_view name;
  OptionKind kind;
  ParseValue parse;
};

absl::StatusOr<PlanFlags> ParseFlags(const Args& args) {
  PlanFlags f;
  f.gen.microbatches = 20;
  constexpr int64_t kIntMax = 1 << 30;
  constexpr int64_t kTwoTo40 = int64_t{1} << 40;
  using enum OptionKind;
  // Every option, once (and in kUsage): name, kind, where and how its value goes.
  const Option options[] = {
      {"--help", kSwitch, SwitchOn(&f.help)},
      {"--generate", kSwitch, SwitchOn(&f.generate)},
      {"--json", kSwitch, SwitchOn(&f.json)},
      {"--trace", kValue, TextValue(&f.trace)},
      {"--out", kGeneratorValue, TextValue(&f.out)},
      {"--ranks", kGeneratorValue, IntValue(&f.gen.ranks, 1, 65536)},
      {"--experts", kGeneratorValue, IntValue(&f.gen.experts, 1, 1 << 20)},
      {"--masters-per-rank", kGeneratorValue, IntValue(&f.masters_per_rank, 1, 1 << 20)},
      {"--topk", kGeneratorValue, IntValue(&f.gen.topk, 1, 1 << 20)},
      {"--tokens-per-rank", kGeneratorValue, IntValue(&f.gen.tokens_per_rank, 0, kTwoTo40)},
      {"--token-jitter", kGeneratorValue, NumberValue(&f.gen.token_jitter, 0, 0.999)},
      {"--imbalance", kGeneratorValue, NumberValue(&f.gen.imbalance, 1, 1e6)},
      {"--microbatches", kGeneratorValue, IntValue(&f.gen.microbatches, 1, kMaxEntries)},
      {"--layers", kGeneratorValue, IntValue(&f.gen.layers, 1, 4096)},
      {"--nonstationary", kGeneratorValue, LoadShiftValue(&f.gen.shift)},
      {"--shift-every", kGeneratorValue, IntValue(&f.gen.shift_every, 1, kIntMax)},
      {"--seed", kGeneratorValue, SeedValue(&f.gen.seed)},
      {"--popularity", kGeneratorValue, PopularityValue(&f.gen.popularity)},
      {"--sigma", kGeneratorValue, NumberValue(&f.gen.lognormal_sigma, 1e-3, 8)},
      {"--spikes", kGeneratorValue, IntValue(&f.gen.spike_experts, 0, 1 << 20)},
      {"--spike-min", kGeneratorValue, NumberValue(&f.gen.spike_min, 1, 1e6)},
      {"--spike-max", kGeneratorValue, NumberValue(&f.gen.spike_max, 1, 1e6)},
      {"--spike-rate", kGeneratorValue, NumberValue(&f.gen.spike_rate, 0, 1)},
      {"--policy", kValue, PolicyListValue(&f.policies)},
      {"--slots", kValue, IntValue(&f.slots, 0, 4096)},
      {"--eps", kValue, NumberValue(&f.planner.eps, 1e-9, 1)},
      {"--min-replica-tokens", kValue, IntValue(&f.planner.min_replica_tokens, 1, kTwoTo40)},
      {"--eplb-window", kValue, IntValue(&f.planner.eplb_window, 1, 1 << 20)},
      {"--eplb-interval", kValue, IntValue(&f.planner.eplb_interval, 1, 1 << 20)},
      {"--eplb-replacement", kValue, ReplacementValue(&f.eplb_replacement_exposed)},
      {"--warmup", kValue, IntValue(&f.warmup, 0, kTwoTo40)},
      {"--preset", kValue, TextValue(&f.preset)},
      {"--expert-bytes", kValue, IntValue(&f.expert_bytes, 1, kTwoTo40)},
  };
  // Ordered: with --trace, the error names the alphabetically first generator option given.
  std::set<std::string> generator_flags_seen;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i];
    std::optional<std::string> inline_value;
    if (flag.rfind("--", 0) != 0) {
      return Usage(flag, "unexpected argument; options start with --");
    }
    if (const size_t eq = flag.find('='); eq != std::string::npos) {
      inline_value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    }
    const Option* option = std::find_if(std::begin(options), std::end(options),
                                        [&](const Option& o) { return o.name == flag; });
    if (option == std::end(options)) return Usage(flag, "unknown option");
    std::string value;
    if (option->kind == kSwitch) {
      if (inline_value) return Usage(flag, "takes no value");
    } else if (inline_value) {
      value = *inline_value;
    } else {
      if (i + 1 >= args.size()) return Usage(flag, "needs a value");
      value = args[++i];
    }
    if (absl::Status s = option->parse(flag, value); !s.ok()) return s;
    if (option->kind == kGeneratorValue) generator_flags_seen.insert(flag);
  }
  if (f.help) return f;
  if (f.trace && f.generate) return Usage("--trace", "use either --trace or --generate, not both");
  if (!f.trace && !f.generate) {
    return Usage("--trace", "give a trace with --trace FILE, or --generate to generate one");
  }
  if (f.trace && !generator_flags_seen.empty()) {
    return Usage(*generator_flags_seen.begin(),
                 "applies only with --generate (a trace fixes the domain and loads)");
  }
  if (f.masters_per_rank) {
    if (generator_flags_seen.count("--experts") > 0 &&
        f.gen.experts != f.gen.ranks * *f.masters_per_rank) {
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
    if (f.gen.popularity == pl::PopularityModel::kLognormal &&
        generator_flags_seen.count("--imbalance") > 0) {
      return Usage("--imbalance", "applies only to --popularity zipf (lognormal is set by --sigma)");
    }
    if (f.gen.popularity != pl::PopularityModel::kLognormal &&
        generator_flags_seen.count("--sigma") > 0) {
      return Usage("--sigma", "applies only with --popularity lognormal");
    }
    if (f.gen.spike_min > f.gen.spike_max) {
      return Usage("--spike-min", absl::StrCat(f.gen.spike_min, " is above --spike-max (",
                                               f.gen.spike_max, ")"));
    }
    if (f.gen.spike_experts > f.gen.experts) {
      return Usage("--spikes",
                   absl::StrCat(f.gen.spike_experts, " is more than --experts (", f.gen.experts, ")"));
    }
    if (f.gen.topk > f.gen.experts) {
      return Usage("--topk",
                   absl::StrCat(f.gen.topk, " is more than --experts (", f.gen.experts, ")"));
    }
    if (f.gen.microbatches * f.gen.layers > kMaxEntries) {
      return Usage("--microbatches",
                   absl::StrCat(f.gen.microbatches, " x --layers ", f.gen.layers, " = ",
                                f.gen.microbatches * f.gen.layers,
                                " entries, over the limit of ", kMaxEntries,
                                " per run; plan fewer, or several runs with different --seed"));
    }
    if (int64_t{f.gen.ranks} * f.gen.experts > kMaxLoadsPerEntry) {
      return Usage("--experts", absl::StrCat("--ranks ", f.gen.ranks, " x --experts ",
                                             f.gen.experts, " = ",
                                             int64_t{f.gen.ranks} * f.gen.experts,
                                             " loads per entry, over the limit of ",
                                             kMaxLoadsPerEntry, "; use fewer ranks or experts"));
    }
  }
  if (f.out && (f.json || !f.policies.empty())) {
    return Usage("--out", "writes a trace and plans nothing; drop --json and --policy");
  }
  if (f.policies.empty()) f.policies.assign(std::begin(kAllPolicies), std::end(kAllPolicies));
  return f;
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

// Plan fingerprints chained over the trace: equal hashes mean bit-identical plans in the
// same order (used to check determinism across processes).
class PlanHash {
 public:
  void Add(const pl::Plan& plan) { h_ = pl::PlanFingerprint(plan, h_); }
  std::string Hex() const { return Format("%016llx", static_cast<unsigned long long>(h_)); }

 private:
  uint64_t h_ = pl::kFingerprintSeed;
};

// Nearest-rank percentile of `v` (sorted in place).
struct PolicyRun {
  std::string name;
  std::unique_ptr<pl::Planner> planner;
  pl::InvariantOptions invariants;
  std::map<int, pl::Plan> plans;  // one reusable Plan per layer
  std::vector<double> before, after, replicas, fanout_bytes, direct_ms, relay_ms, solve_us, percent;
  int64_t replacement_bytes = 0;
  double layer_s = 0;
  double ideal_s = 0;
  pl::LayerTime parts;  // sums over measured entries, for the breakdown
  PlanHash hash;
};

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
      absl::StrAppend(&line, " / ", total_, " entries (",
                      Format("%.1f", 100.0 * static_cast<double>(done) / static_cast<double>(total_)),
                      "%), ", Format("%.0f", elapsed), " s elapsed, about ",
                      left < 3600 ? Format("%.0f s", left) : Format("%.1f h", left / 3600),
                      " left");
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

}  // namespace

int PlanCommand(const Args& args) {
  absl::StatusOr<PlanFlags> parsed = ParseFlags(args);
  if (!parsed.ok()) {
    std::fprintf(stderr, "rackrun plan: %s\nrun 'rackrun plan --help' for usage\n",
                 std::string(parsed.status().message()).c_str());
    return 2;
  }
  const PlanFlags& f = *parsed;
  if (f.help) {
    std::fwrite(kUsage.data(), 1, kUsage.size(), stdout);
    return 0;
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

  pl::PlannerOptions planner_options = f.planner;
  planner_options.expert_bytes = expert_bytes;
  pl::Domain domain;
  std::vector<PolicyRun> runs;
  int64_t entries = 0;
  std::set<int64_t> microbatches;
  std::set<int> layers;
  std::set<int64_t> measured_microbatches;
  pl::FanoutOptions direct_options;
  direct_options.mode = pl::FanoutMode::kDirect;
  pl::FanoutOptions relay_options;
  relay_options.mode = pl::FanoutMode::kRelay;

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
    const pl::TraceEntry& entry = **next;
    const pl::LoadMatrix& loads = entry.loads;
    if (runs.empty()) {
      domain.ranks = loads.ranks;
      domain.masters_per_rank = loads.experts / loads.ranks;
      domain.slots_per_rank = f.slots;
      if (absl::Status s = domain.Validate(); !s.ok()) return Fail(s);
      for (const std::string& name : f.policies) {
        absl::StatusOr<std::unique_ptr<pl::Planner>> planner =
            pl::MakePlanner(name, domain, planner_options);
        if (!planner.ok()) return Fail(planner.status());
        PolicyRun run;
        run.name = name;
        run.planner = *std::move(planner);
        run.invariants.masters_at_home = name != "eplb";
        run.invariants.enforce_slot_budget = name != "ideal";
        runs.push_back(std::move(run));
      }
    }
    microbatches.insert(entry.microbatch);
    // Warm-up entries are planned (policies with history need them) but not measured.
    const bool measured = static_cast<int64_t>(microbatches.size()) > f.warmup;
    if (measured) {
      ++entries;
      measured_microbatches.insert(entry.microbatch);
      layers.insert(entry.layer);
    }
    const double before = pl::Imbalance(pl::HomeRankLoads(domain, loads));
    const pl::LayerTime ideal = pl::SimulateForceBalanced(loads, *hw);

    for (PolicyRun& run : runs) {
      pl::Plan& plan = run.plans[entry.layer];
      const auto start = std::chrono::steady_clock::now();
      absl::Status solved = run.planner->SolveInto(loads, entry.layer, &plan);
      const auto stop = std::chrono::steady_clock::now();
      const std::string where = absl::StrCat("policy ", run.name, ", microbatch ", entry.microbatch,
                                             ", layer ", entry.layer);
      if (!solved.ok()) {
        return Fail(absl::Status(solved.code(), absl::StrCat(where, ": ", solved.message())));
      }
      if (absl::Status ok = pl::CheckPlanInvariants(domain, loads, plan, run.invariants);
          !ok.ok()) {
        return Fail(absl::Status(
            ok.code(), absl::StrCat(where, ": plan violates an invariant: ", ok.message())));
      }
      run.solve_us.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
      run.hash.Add(plan);
      if (!measured) continue;
      run.before.push_back(before);
      run.after.push_back(pl::Imbalance(plan.RankLoads()));
      run.replicas.push_back(plan.num_replicas());

      // Weights moved now: ultraep, greedy and ideal fan out every replica; eplb only
      // re-places.
      const bool fans_out = run.name == "ultraep" || run.name == "greedy" || run.name == "ideal";
      pl::FanoutCost relay;
      if (fans_out && plan.num_replicas() > 0) {
        const pl::FanoutCost direct = pl::EstimateFanout(pl::PlanFanout(plan, direct_options),
                                                         domain.ranks, expert_bytes, hw->fanout);
        relay = pl::EstimateFanout(pl::PlanFanout(plan, relay_options), domain.ranks, expert_bytes,
                                   hw->fanout);
        run.fanout_bytes.push_back(static_cast<double>(direct.bytes));
        run.direct_ms.push_back(direct.seconds * 1e3);
        run.relay_ms.push_back(relay.seconds * 1e3);
      } else {
        run.fanout_bytes.push_back(0);
        run.direct_ms.push_back(0);
        run.relay_ms.push_back(0);
      }
      const int64_t replaced = run.planner->last_replacement_bytes();
      run.replacement_bytes += replaced;
      const pl::LayerTime t = pl::SimulateLayer(
          plan, loads, *hw, run.name == "ideal" || !fans_out ? pl::FanoutCost{} : relay,
          f.eplb_replacement_exposed ? replaced : 0);
      run.layer_s += t.total_s;
      run.parts.dispatch_s += t.dispatch_s;
      run.parts.exposed_fanout_s += t.exposed_fanout_s;
      run.parts.compute_s += t.compute_s;
      run.parts.combine_s += t.combine_s;
      run.parts.replacement_s += t.replacement_s;
      run.ideal_s += ideal.total_s;
      run.percent.push_back(pl::PercentOfIdeal(ideal, t));
    }
  }
  if (entries == 0) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat(f.trace ? *f.trace : std::string("generator"), ": no entries to measure (",
                     microbatches.size(), " microbatches, --warmup ", f.warmup, ")")));
  }

  constexpr double kMiB = 1024.0 * 1024.0;
  if (f.json) {
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
    doc["microbatches"] = measured_microbatches.size();
    doc["warmup_microbatches"] = microbatches.size() - measured_microbatches.size();
    doc["layers"] = layers.size();
    doc["domain"] = {{"ranks", domain.ranks},
                     {"masters_per_rank", domain.masters_per_rank},
                     {"slots_per_rank", domain.slots_per_rank},
                     {"experts", domain.experts()}};
    doc["options"] = {{"eps", f.planner.eps},
                      {"min_replica_tokens", f.planner.min_replica_tokens},
                      {"eplb_window", f.planner.eplb_window},
                      {"eplb_interval", f.planner.eplb_interval},
                      {"eplb_replacement", f.eplb_replacement_exposed ? "exposed" : "hidden"}};
    doc["hardware"] = {{"preset", hw->name},
                       {"expert_bytes", expert_bytes},
                       {"token_bytes", hw->token_bytes()},
                       {"gemm_flops_per_s", hw->gemm_flops_per_s},
                       {"a2a_bytes_per_s", hw->a2a_bytes_per_s},
                       {"fanout_egress_bytes_per_s", hw->fanout.egress_bytes_per_s}};
    json policies = json::array();
    const double per_entry_us = 1e6 / static_cast<double>(entries);
    for (PolicyRun& run : runs) {
      std::vector<double> solve = run.solve_us;
      policies.push_back(
          {{"policy", run.name},
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
           {"solve_us",
            {{"p50", base::Percentile(solve, 0.50)},
             {"p99", base::Percentile(solve, 0.99)},
             {"max", solve.back()}}},
           {"plan_hash", run.hash.Hex()}});
    }
    doc["policies"] = std::move(policies);
    std::printf("%s\n", doc.dump(2).c_str());
    return 0;
  }

  std::printf("rackrun plan: %s\n", SourceText(f).c_str());
  std::printf(
      "%lld entries (%zu microbatches x %zu layers); domain %d ranks x (%d masters + %d slots); "
      "hardware %s, expert %.1f MiB\n",
      static_cast<long long>(entries), measured_microbatches.size(), layers.size(), domain.ranks,
      domain.masters_per_rank, domain.slots_per_rank, hw->name.c_str(),
      static_cast<double>(expert_bytes) / kMiB);
  std::printf(
      "ultraep eps %g; eplb W=%d K=%d, re-placement %s; %lld warm-up microbatches not "
      "measured\n\n",
      f.planner.eps, f.planner.eplb_window, f.planner.eplb_interval,
      f.eplb_replacement_exposed ? "exposed" : "hidden",
      static_cast<long long>(microbatches.size() - measured_microbatches.size()));
  std::printf(
      "| policy  | imbalance before p50/p99/max | after p50/p99/max     | replicas | fan-out MiB | "
      "fan-out ms direct/relay | re-placed MiB | sim %% of ideal | solve us p50/p99    |\n");
  std::printf(
      "|---------|------------------------------|-----------------------|----------|-------------|"
      "-------------------------|---------------|----------------|---------------------|\n");
  for (PolicyRun& run : runs) {
    const Triple before = Summary(run.before);
    const Triple after = Summary(run.after);
    std::vector<double> solve = run.solve_us;
    const std::string before_text =
        Format("%.3f / %.3f / %.3f", before.p50, before.p99, before.max);
    const std::string after_text = Format("%.3f / %.3f / %.3f", after.p50, after.p99, after.max);
    const std::string fanout_ms = Format("%.3f / %.3f", Mean(run.direct_ms), Mean(run.relay_ms));
    const std::string solve_text =
        Format("%.1f / %.1f", base::Percentile(solve, 0.50), base::Percentile(solve, 0.99));
    std::printf("| %-7s | %-28s | %-21s | %8.1f | %11.1f | %-23s | %13.1f | %14.1f | %-19s |\n",
                run.name.c_str(), before_text.c_str(), after_text.c_str(), Mean(run.replicas),
                Mean(run.fanout_bytes) / kMiB, fanout_ms.c_str(),
                static_cast<double>(run.replacement_bytes) / kMiB,
                100.0 * run.ideal_s / run.layer_s, solve_text.c_str());
  }
  std::printf(
      "\nreplicas, fan-out MiB and ms: mean per (microbatch, layer); re-placed MiB: total over "
      "the trace; sim %% of ideal: summed force-balanced ideal time / summed simulated layer "
      "time.\n");
  return 0;
}

}  // namespace rackrun::cli
