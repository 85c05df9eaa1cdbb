// Planner benchmark, two parts, every policy in the same run:
//
//  1. Tail quality per load family: each family's microbatches (generated, planner/
//     generate.h) go through every policy in order (eplb sees them in order, so its history
//     is real), at 2 and at 4 redundant slots per rank. Printed per (family, slots, policy):
//     the home-placement max/mean rank load and the final one, p50 / p99 / max over the
//     microbatches, mean replicas, the solve time p50, and a digest of the plans
//     (PlanFingerprint chained over the microbatches: equal digests, identical plans).
//  2. Solve time against EP: the zipf-2 family (256 experts, top-8, 2 slots per rank) at
//     EP 8, 16, 32, 64, 128, 256; each policy solves N times, cycling through M microbatches,
//     SolveInto into a reused Plan on one pinned thread; p50 / p99 of the N solves, and
//     p50 per rank so linear growth shows as a flat column, and a digest of the plans of the
//     first M solves (one per microbatch).
// `ultraep-search` is ultraep with PlannerOptions::refine off: the docs/design.md 3.2 search
// alone, as ultraep was before its refinement pass.
//
//   bench_planner_bench [--json] [--solves N] [--microbatches M] [--tail-microbatches T]
//                       [--ep 8,16,...] [--policy ultraep,ultraep-search,greedy,eplb,none,ideal]
//                       [--family NAME,...] [--split largest_remainder|cumulative]
//                       [--skip-tail] [--skip-timing]
//
// Families (8192 tokens per source rank; top-8 and 256 experts unless named):
//   zipf-1.5, zipf-2, zipf-3   EP64, Zipf popularity calibrated to that initial imbalance
//   lognormal-1, -1.5, -2      EP64, popularity exp(sigma * N(0,1)), sigma 1 / 1.5 / 2
//   spikes                     EP64, zipf-1.5 plus, in half the microbatches, 1-3 experts
//                              spiking to 5-20x their weight
//   jump                       EP64, zipf-2 whose hot experts change at once every 5
//   drift-lognormal            EP64, lognormal-1.5 drifting to a new profile every 10
//   ep16-top4                  EP16, 64 experts, top-4, zipf-2
//   ep72                       EP72, 288 experts, zipf-2
//   ep32-jitter                EP32, zipf-2, source token counts +-30%
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "base/statistics.h"
#include "nlohmann/json.hpp"
#include "planner/generate.h"
#include "planner/plan.h"
#include "planner/planner.h"
#include "tools/bench/startup.h"

namespace {

using rackrun::base::Percentile;

using rackrun::planner::Domain;
using rackrun::planner::GeneratorOptions;
using rackrun::planner::LoadMatrix;
using rackrun::planner::Plan;

struct Family {
  std::string name;
  GeneratorOptions gen;
};

GeneratorOptions Base(int ranks, int experts, int topk, double imbalance) {
  GeneratorOptions g;
  g.ranks = ranks;
  g.experts = experts;
  g.topk = topk;
  g.tokens_per_rank = 8192;
  g.imbalance = imbalance;
  g.seed = 7;
  return g;
}

std::vector<Family> AllFamilies() {
  using rackrun::planner::LoadShift;
  using rackrun::planner::PopularityModel;
  std::vector<Family> out;
  for (const double x : {1.5, 2.0, 3.0}) {
    out.push_back({x == 2.0 ? "zipf-2" : (x == 1.5 ? "zipf-1.5" : "zipf-3"), Base(64, 256, 8, x)});
  }
  for (const double sigma : {1.0, 1.5, 2.0}) {
    Family f{sigma == 1.0 ? "lognormal-1" : (sigma == 1.5 ? "lognormal-1.5" : "lognormal-2"),
             Base(64, 256, 8, 1)};
    f.gen.popularity = PopularityModel::kLognormal;
    f.gen.lognormal_sigma = sigma;
    out.push_back(f);
  }
  Family spikes{"spikes", Base(64, 256, 8, 1.5)};
  spikes.gen.spike_experts = 3;
  spikes.gen.spike_min = 5;
  spikes.gen.spike_max = 20;
  spikes.gen.spike_rate = 0.5;
  out.push_back(spikes);
  Family jump{"jump", Base(64, 256, 8, 2)};
  jump.gen.shift = LoadShift::kJump;
  jump.gen.shift_every = 5;
  out.push_back(jump);
  Family drift{"drift-lognormal", Base(64, 256, 8, 1)};
  drift.gen.popularity = PopularityModel::kLognormal;
  drift.gen.lognormal_sigma = 1.5;
  drift.gen.shift = LoadShift::kDrift;
  drift.gen.shift_every = 10;
  out.push_back(drift);
  out.push_back({"ep16-top4", Base(16, 64, 4, 2)});
  out.push_back({"ep72", Base(72, 288, 8, 2)});
  Family jitter{"ep32-jitter", Base(32, 256, 8, 2)};
  jitter.gen.token_jitter = 0.3;
  out.push_back(jitter);
  return out;
}

struct TailRow {
  std::string family;
  int ranks = 0;
  int experts = 0;
  int topk = 0;
  int slots = 0;
  std::string policy;
  double initial[3] = {0, 0, 0};  // p50, p99, max
  double final_[3] = {0, 0, 0};
  double replicas = 0;
  double p50_us = 0;
  uint64_t digest = 0;  // PlanFingerprint chained over the microbatches' plans
  std::string error;
};

struct TimeRow {
  int ranks = 0;
  int experts = 0;
  std::string policy;
  double p50_us = 0;
  double p99_us = 0;
  uint64_t digest = 0;  // PlanFingerprint chained over the first M solves (one per microbatch)
  std::string error;
};

void Triple(std::vector<double> v, double* out) {
  out[0] = Percentile(v, 0.50);
  out[1] = Percentile(v, 0.99);
  out[2] = v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

// The microbatches of layer 0, or an error message.
std::string Generate(const GeneratorOptions& gen, int count, std::vector<LoadMatrix>* loads) {
  GeneratorOptions g = gen;
  g.microbatches = count;
  auto generator = rackrun::planner::LoadGenerator::Create(g);
  if (!generator.ok()) return std::string(generator.status().message());
  for (int t = 0; t < count; ++t) {
    auto entry = generator->Generate(t, 0);
    if (!entry.ok()) return std::string(entry.status().message());
    loads->push_back(std::move(entry->loads));
  }
  return "";
}

// "ultraep-search" is ultraep without its refinement pass (docs/design.md 3.2's search alone), the
// algorithm before the refinement, kept for the comparison.
absl::StatusOr<std::unique_ptr<rackrun::planner::Planner>> Make(
    const std::string& policy, const Domain& domain, rackrun::planner::PlannerOptions options) {
  if (policy == "ultraep-search") {
    options.refine = false;
    return rackrun::planner::MakePlanner("ultraep", domain, options);
  }

  return rackrun::planner::MakePlanner(policy, domain, options);
}

rackrun::planner::PlannerOptions Options(rackrun::planner::SplitRounding split) {
  rackrun::planner::PlannerOptions options;
  options.eplb_window = 100;
  options.eplb_interval = 10;
  options.split_rounding = split;
  return options;
}

double Micros(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// The planner of `policy`, or null with `*error` set (an error already set, from making
// the loads, is kept and no planner is made).
std::unique_ptr<rackrun::planner::Planner> MakeOrError(const std::string& policy,
                                                       const Domain& domain,
                                                       rackrun::planner::SplitRounding split,
                                                       std::string* error) {
  if (!error->empty()) return nullptr;
  auto planner = Make(policy, domain, Options(split));
  if (!planner.ok()) {
    *error = std::string(planner.status().message());
    return nullptr;
  }
  return *std::move(planner);
}

// One timed SolveInto: its wall time in microseconds appended to `us`.
absl::Status TimedSolve(rackrun::planner::Planner& planner, const LoadMatrix& loads, Plan* plan,
                        std::vector<double>* us) {
  const auto start = std::chrono::steady_clock::now();
  const absl::Status status = planner.SolveInto(loads, 0, plan);
  const auto stop = std::chrono::steady_clock::now();
  if (status.ok()) us->push_back(Micros(start, stop));
  return status;
}

// Machine calibration: the median time to sum 16384 int64 counts (one EP64 load matrix)
// on this thread. On a shared or throttled machine every figure scales with it.
double CalibrationUs() {
  std::vector<int64_t> data(16384);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<int64_t>(i * 7 % 1000);
  std::vector<double> us;
  volatile int64_t sink = 0;
  for (int rep = 0; rep < 200; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    int64_t sum = 0;
    for (const int64_t v : data) sum += v ^ rep;
    sink = sink + sum;
    const auto stop = std::chrono::steady_clock::now();
    us.push_back(Micros(start, stop));
  }
  return Percentile(us, 0.5);
}

// 1. Tail quality: every family's microbatches through every policy, at 2 and 4 slots.
std::vector<TailRow> TailQuality(const std::vector<Family>& families,
                                 const std::vector<std::string>& policies, int tail_microbatches,
                                 rackrun::planner::SplitRounding split) {
  std::vector<TailRow> tail_rows;
  for (const Family& family : families) {
    std::vector<LoadMatrix> loads;
    const std::string error = Generate(family.gen, tail_microbatches, &loads);
    for (const int slots : {2, 4}) {
      const Domain domain{family.gen.ranks, family.gen.experts / family.gen.ranks, slots};
      for (const std::string& policy : policies) {
        TailRow row;
        row.family = family.name;
        row.ranks = family.gen.ranks;
        row.experts = family.gen.experts;
        row.topk = family.gen.topk;
        row.slots = slots;
        row.policy = policy;
        row.error = error;
        const std::unique_ptr<rackrun::planner::Planner> planner =
            MakeOrError(policy, domain, split, &row.error);
        if (planner == nullptr) {
          tail_rows.push_back(row);
          continue;
        }
        Plan plan;
        std::vector<double> initial, final_, us;
        double replicas = 0;
        row.digest = rackrun::planner::kFingerprintSeed;
        for (const LoadMatrix& l : loads) {
          if (absl::Status status = TimedSolve(*planner, l, &plan, &us); !status.ok()) {
            row.error = std::string(status.message());
            break;
          }
          initial.push_back(
              rackrun::planner::Imbalance(rackrun::planner::HomeRankLoads(domain, l)));
          final_.push_back(rackrun::planner::Imbalance(plan.RankLoads()));
          replicas += plan.num_replicas();
          row.digest = rackrun::planner::PlanFingerprint(plan, row.digest);
        }
        Triple(initial, row.initial);
        Triple(final_, row.final_);
        row.replicas = replicas / static_cast<double>(std::max<size_t>(us.size(), 1));
        row.p50_us = Percentile(us, 0.5);
        tail_rows.push_back(row);
      }
    }
  }
  return tail_rows;
}

// 2. Solve time against EP: each policy's SolveInto on zipf-2 at every EP size.
std::vector<TimeRow> SolveTimes(const std::vector<int>& eps,
                                const std::vector<std::string>& policies, int solves,
                                int microbatches, rackrun::planner::SplitRounding split) {
  std::vector<TimeRow> time_rows;
  for (const int ranks : eps) {
    const int experts = (ranks > 0 && 256 % ranks == 0) ? 256 : std::max(ranks, 1) * 4;
    const Domain domain{ranks, ranks > 0 ? experts / ranks : 0, 2};
    std::vector<LoadMatrix> loads;
    const std::string error = Generate(Base(ranks, experts, 8, 2), microbatches, &loads);
    for (const std::string& policy : policies) {
      TimeRow row;
      row.ranks = ranks;
      row.experts = experts;
      row.policy = policy;
      row.error = error;
      const std::unique_ptr<rackrun::planner::Planner> planner =
          MakeOrError(policy, domain, split, &row.error);
      if (planner == nullptr) {
        time_rows.push_back(row);
        continue;
      }
      Plan plan;
      std::vector<double> us;
      row.digest = rackrun::planner::kFingerprintSeed;
      for (int s = 0; s < solves; ++s) {
        const LoadMatrix& l = loads[static_cast<size_t>(s % microbatches)];
        if (absl::Status status = TimedSolve(*planner, l, &plan, &us); !status.ok()) {
          row.error = std::string(status.message());
          break;
        }
        if (s < microbatches) row.digest = rackrun::planner::PlanFingerprint(plan, row.digest);
      }
      row.p50_us = Percentile(us, 0.50);
      row.p99_us = Percentile(us, 0.99);
      time_rows.push_back(row);
    }
  }
  return time_rows;
}

// What main passes to the output.
struct Run {
  int solves;
  int microbatches;
  int tail_microbatches;
  double reference_us;
  const char* split_name;
};

// A plan digest as the tables print it: 16 hex digits.
std::string DigestHex(uint64_t digest) {
  char hex[24];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(digest));
  return hex;
}

// 3. The output as one JSON document.
void PrintJson(const Run& run, const std::vector<TailRow>& tail_rows,
               const std::vector<TimeRow>& time_rows) {
  nlohmann::json quality = nlohmann::json::array();
  for (const TailRow& r : tail_rows) {
    nlohmann::json j = {{"family", r.family},        {"ep", r.ranks},
                        {"experts", r.experts},      {"topk", r.topk},
                        {"slots_per_rank", r.slots}, {"policy", r.policy}};
    if (!r.error.empty()) {
      j["error"] = r.error;
    } else {
      j["initial_max_over_mean"] = {
          {"p50", r.initial[0]}, {"p99", r.initial[1]}, {"max", r.initial[2]}};
      j["final_max_over_mean"] = {{"p50", r.final_[0]}, {"p99", r.final_[1]}, {"max", r.final_[2]}};
      j["replicas"] = r.replicas;
      j["solve_p50_us"] = r.p50_us;
      j["plan_digest"] = DigestHex(r.digest);
    }
    quality.push_back(j);
  }
  nlohmann::json times = nlohmann::json::array();
  for (const TimeRow& r : time_rows) {
    nlohmann::json j = {{"ep", r.ranks},     {"experts", r.experts},    {"slots_per_rank", 2},
                        {"topk", 8},         {"tokens_per_rank", 8192}, {"family", "zipf-2"},
                        {"policy", r.policy}};
    if (!r.error.empty()) {
      j["error"] = r.error;
    } else {
      j["solve_p50_us"] = r.p50_us;
      j["solve_p99_us"] = r.p99_us;
      j["plan_digest"] = DigestHex(r.digest);
    }
    times.push_back(j);
  }
  std::printf("%s\n", nlohmann::json{{"solves", run.solves},
                                     {"microbatches", run.microbatches},
                                     {"tail_microbatches", run.tail_microbatches},
                                     {"reference_sum16k_us", run.reference_us},
                                     {"split", run.split_name},
                                     {"tail_quality", quality},
                                     {"solve_time", times}}
                          .dump(2)
                          .c_str());
}

// 3. The output as the two tables.
void PrintTables(const Run& run, const std::vector<TailRow>& tail_rows,
                 const std::vector<TimeRow>& time_rows) {
  std::printf("planner_bench: 8192 tokens/rank, one pinned thread, split rounding %s\n",
              run.split_name);
  std::printf("calibration: summing 16384 int64 takes %.2f us (median) on this thread\n",
              run.reference_us);
  if (!tail_rows.empty()) {
    std::printf(
        "\n1. tail quality: max/mean rank load over %d microbatches per family (p50 / p99 / "
        "max), replicas mean, solve p50 (us)\n",
        run.tail_microbatches);
    std::printf("%-16s %-13s %-5s %-14s %-23s %-23s %8s %8s  %s\n", "family", "domain", "slots",
                "policy", "initial p50/p99/max", "final p50/p99/max", "replicas", "p50(us)",
                "plan digest");
    for (const TailRow& r : tail_rows) {
      char domain[32];
      std::snprintf(domain, sizeof(domain), "EP%d/%d/top%d", r.ranks, r.experts, r.topk);
      if (!r.error.empty()) {
        std::printf("%-16s %-13s %-5d %-14s skipped: %s\n", r.family.c_str(), domain, r.slots,
                    r.policy.c_str(), r.error.c_str());
        continue;
      }
      std::printf(
          "%-16s %-13s %-5d %-14s %6.3f/%6.3f/%6.3f    %6.4f/%6.4f/%6.4f %8.1f %8.1f  %016llx\n",
          r.family.c_str(), domain, r.slots, r.policy.c_str(), r.initial[0], r.initial[1],
          r.initial[2], r.final_[0], r.final_[1], r.final_[2], r.replicas, r.p50_us,
          static_cast<unsigned long long>(r.digest));
    }
  }
  if (!time_rows.empty()) {
    std::printf(
        "\n2. solve time against EP: zipf-2, top-8, 2 slots/rank, %d solves over %d "
        "microbatches\n",
        run.solves, run.microbatches);
    std::printf("%-5s %-7s %-14s %9s %9s %12s  %s\n", "EP", "experts", "policy", "p50(us)",
                "p99(us)", "p50/EP(us)", "plan digest");
    for (const TimeRow& r : time_rows) {
      if (!r.error.empty()) {
        std::printf("%-5d %-7d %-14s skipped: %s\n", r.ranks, r.experts, r.policy.c_str(),
                    r.error.c_str());
        continue;
      }
      std::printf("%-5d %-7d %-14s %9.1f %9.1f %12.3f  %016llx\n", r.ranks, r.experts,
                  r.policy.c_str(), r.p50_us, r.p99_us, r.p50_us / std::max(r.ranks, 1),
                  static_cast<unsigned long long>(r.digest));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int solves = 200;
  int microbatches = 20;
  int tail_microbatches = 100;
  bool tail = true;
  bool timing = true;
  std::vector<int> eps = {8, 16, 32, 64, 128, 256};
  std::vector<std::string> policies = {"ultraep", "ultraep-search", "greedy",
                                       "eplb",    "none",           "ideal"};
  std::vector<std::string> family_names;
  rackrun::planner::SplitRounding split = rackrun::planner::SplitRounding::kLargestRemainder;
  // One thread, pinned to the CPU it starts on.
  rackrun::bench::BenchStartup bench(
      argc, argv,
      "Planner benchmark: 1. tail quality per load family, 2. solve time against EP, every\n"
      "policy in the same run, on one pinned thread (this file's header says what is printed).\n",
      {.pin_to_one_cpu = true});
  rackrun::flags::FlagSet& flags = bench.flags();
  flags.List("--policy", &policies, "LIST", "policies");
  flags.List("--family", &family_names, "LIST", "load families of part 1").Default("all");
  flags.Int("--tail-microbatches", &tail_microbatches, "T", "microbatches per family (part 1)")
      .Range(1);
  flags.List("--ep", &eps, "LIST", "EP sizes of part 2").Range(1);
  flags.Int("--solves", &solves, "N", "solves per policy and EP (part 2)").Range(1);
  flags.Int("--microbatches", &microbatches, "M", "microbatches the solves cycle through (part 2)")
      .Range(1);
  flags
      .Custom("--split", "MODE", "largest_remainder | cumulative: how quotas round",
              [&split](std::string_view value) {
                if (value != "largest_remainder" && value != "cumulative") {
                  return absl::InvalidArgumentError("must be largest_remainder or cumulative");
                }
                split = value == "cumulative" ? rackrun::planner::SplitRounding::kCumulative
                                              : rackrun::planner::SplitRounding::kLargestRemainder;
                return absl::OkStatus();
              })
      .Default("largest_remainder");
  flags.Switch("--skip-tail", "skip part 1", [&tail] { tail = false; });
  flags.Switch("--skip-timing", "skip part 2", [&timing] { timing = false; });
  if (std::optional<int> exit = bench.Start()) return *exit;
  const bool json = bench.json();
  std::vector<Family> families;
  for (const Family& f : AllFamilies()) {
    if (family_names.empty() ||
        std::find(family_names.begin(), family_names.end(), f.name) != family_names.end()) {
      families.push_back(f);
    }
  }
  if (families.size() < (family_names.empty() ? 1 : family_names.size())) {
    std::string known;
    for (const Family& f : AllFamilies()) known += " " + f.name;
    return flags.Fail("--family", "unknown family; known:" + known);
  }

  const double reference_us = CalibrationUs();
  const std::vector<TailRow> tail_rows =
      TailQuality(tail ? families : std::vector<Family>{}, policies, tail_microbatches, split);
  const std::vector<TimeRow> time_rows =
      SolveTimes(timing ? eps : std::vector<int>{}, policies, solves, microbatches, split);
  const char* split_name =
      split == rackrun::planner::SplitRounding::kCumulative ? "cumulative" : "largest_remainder";
  // 3. The output: one JSON document, or the two tables.
  const Run run{solves, microbatches, tail_microbatches, reference_us, split_name};
  if (json) {
    PrintJson(run, tail_rows, time_rows);
  } else {
    PrintTables(run, tail_rows, time_rows);
  }
  return 0;
}
