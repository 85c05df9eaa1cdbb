// Planner benchmark: initial and final imbalance, replicas and solve time of every policy
// on calibrated Zipf loads (planner/generate.h), side by side.
//
//   bench_planner_bench [--json] [--solves N] [--microbatches M] [--ep 8,16,...]
//                       [--policy ultraep,eplb,none,ideal]
//                       [--split largest_remainder|cumulative]
//
// For each EP size G: 256 experts when 256 is a multiple of G (EP8..EP64, EP256), else 4
// masters per rank (EP72: 288 experts); 2 redundant slots per rank, top-8, 8192 tokens per
// source rank, initial (home-placement) imbalance 1.5 / 2 / 3. Each policy solves N times,
// cycling through M generated microbatches of one layer (eplb sees them in order, so its
// history is real); solve time is SolveInto into a reused Plan on one pinned thread, p50 and
// p99 over the N solves. Imbalance figures are means over the solves.
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/statistics.h"
#include "nlohmann/json.hpp"
#include "planner/generate.h"
#include "planner/plan.h"
#include "planner/planner.h"

namespace {

using rackrun::base::Percentile;

using rackrun::planner::Domain;
using rackrun::planner::LoadMatrix;
using rackrun::planner::Plan;

struct Row {
  int ranks = 0;
  int experts = 0;
  double target = 0;
  std::string policy;
  double initial = 0;
  double final_mean = 0;
  double final_max = 0;
  double replicas = 0;
  double p50_us = 0;
  double p99_us = 0;
  std::string error;
};

std::vector<int> ParseList(const char* text) {
  std::vector<int> out;
  std::string s(text);
  size_t at = 0;
  while (at <= s.size()) {
    const size_t comma = s.find(',', at);
    out.push_back(std::atoi(s.substr(at, comma - at).c_str()));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  int solves = 200;
  int microbatches = 20;
  std::vector<int> eps = {8, 16, 32, 64, 72, 256};
  std::vector<std::string> policies = {"ultraep", "eplb", "none", "ideal"};
  rackrun::planner::SplitRounding split = rackrun::planner::SplitRounding::kLargestRemainder;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--json") {
      json = true;
    } else if (arg == "--solves" && i + 1 < argc) {
      solves = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--microbatches" && i + 1 < argc) {
      microbatches = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--ep" && i + 1 < argc) {
      eps = ParseList(argv[++i]);
    } else if (arg == "--split" && i + 1 < argc) {
      const std::string_view rounding = argv[++i];
      if (rounding != "largest_remainder" && rounding != "cumulative") {
        std::fprintf(stderr, "--split must be largest_remainder or cumulative\n");
        return 2;
      }
      split = rounding == "cumulative" ? rackrun::planner::SplitRounding::kCumulative
                                       : rackrun::planner::SplitRounding::kLargestRemainder;
    } else if (arg == "--policy" && i + 1 < argc) {
      policies.clear();
      std::string list = argv[++i];
      for (size_t at = 0; at <= list.size();) {
        const size_t comma = std::min(list.find(',', at), list.size());
        policies.push_back(list.substr(at, comma - at));
        at = comma + 1;
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--json] [--solves N] [--microbatches M] [--ep 8,16,32,64,72,256] "
                   "[--policy ultraep,eplb,none,ideal] [--split largest_remainder|cumulative]\n",
                   argv[0]);
      return 2;
    }
  }
  // One thread, pinned to the CPU it starts on.
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(sched_getcpu(), &set);
  sched_setaffinity(0, sizeof(set), &set);

  // Machine calibration: the median time to sum 16384 int64 counts (one EP64 load matrix)
  // on this thread. On a shared or throttled machine every figure below scales with it.
  double reference_us = 0;
  {
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
      us.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
    }
    reference_us = Percentile(us, 0.5);
  }

  const std::vector<double> targets = {1.5, 2.0, 3.0};
  std::vector<Row> rows;
  for (const int ranks : eps) {
    const int experts = (256 % ranks == 0) ? 256 : ranks * 4;
    const Domain domain{ranks, experts / ranks, 2};
    for (const double target : targets) {
      rackrun::planner::GeneratorOptions gen;
      gen.ranks = ranks;
      gen.experts = experts;
      gen.topk = 8;
      gen.tokens_per_rank = 8192;
      gen.imbalance = target;
      gen.microbatches = microbatches;
      gen.seed = 7;
      auto generator = rackrun::planner::LoadGenerator::Create(gen);
      std::vector<LoadMatrix> loads;
      std::string error;
      if (!generator.ok()) {
        error = std::string(generator.status().message());
      } else {
        for (int t = 0; t < microbatches && error.empty(); ++t) {
          auto entry = generator->Generate(t, 0);
          if (!entry.ok()) {
            error = std::string(entry.status().message());
          } else {
            loads.push_back(std::move(entry->loads));
          }
        }
      }
      for (const std::string& policy : policies) {
        Row row;
        row.ranks = ranks;
        row.experts = experts;
        row.target = target;
        row.policy = policy;
        if (!error.empty()) {
          row.error = error;
          rows.push_back(row);
          continue;
        }
        rackrun::planner::PlannerOptions options;
        options.eplb_window = 100;
        options.eplb_interval = 10;
        options.split_rounding = split;
        auto planner = rackrun::planner::MakePlanner(policy, domain, options);
        if (!planner.ok()) {
          row.error = std::string(planner.status().message());
          rows.push_back(row);
          continue;
        }
        Plan plan;
        std::vector<double> us;
        us.reserve(static_cast<size_t>(solves));
        double initial = 0;
        double final_sum = 0;
        double final_max = 0;
        double replicas = 0;
        for (int s = 0; s < solves; ++s) {
          const LoadMatrix& l = loads[static_cast<size_t>(s % microbatches)];
          const auto start = std::chrono::steady_clock::now();
          const absl::Status status = (*planner)->SolveInto(l, 0, &plan);
          const auto stop = std::chrono::steady_clock::now();
          if (!status.ok()) {
            row.error = std::string(status.message());
            break;
          }
          us.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
          initial += rackrun::planner::Imbalance(rackrun::planner::HomeRankLoads(domain, l));
          const double after = rackrun::planner::Imbalance(plan.RankLoads());
          final_sum += after;
          final_max = std::max(final_max, after);
          replicas += plan.num_replicas();
        }
        const double n = static_cast<double>(std::max<size_t>(us.size(), 1));
        row.initial = initial / n;
        row.final_mean = final_sum / n;
        row.final_max = final_max;
        row.replicas = replicas / n;
        row.p50_us = Percentile(us, 0.50);
        row.p99_us = Percentile(us, 0.99);
        rows.push_back(row);
      }
    }
  }

  if (json) {
    nlohmann::json out = nlohmann::json::array();
    for (const Row& r : rows) {
      nlohmann::json j = {{"ep", r.ranks},           {"experts", r.experts},
                          {"slots_per_rank", 2},     {"topk", 8},
                          {"tokens_per_rank", 8192}, {"target_imbalance", r.target},
                          {"policy", r.policy}};
      if (!r.error.empty()) {
        j["error"] = r.error;
      } else {
        j["initial_max_over_mean"] = r.initial;
        j["final_max_over_mean"] = r.final_mean;
        j["final_max_over_mean_worst"] = r.final_max;
        j["replicas"] = r.replicas;
        j["solve_p50_us"] = r.p50_us;
        j["solve_p99_us"] = r.p99_us;
      }
      out.push_back(j);
    }
    std::printf("%s\n",
                nlohmann::json{{"solves", solves},
                               {"microbatches", microbatches},
                               {"reference_sum16k_us", reference_us},
                               {"split", split == rackrun::planner::SplitRounding::kCumulative
                                             ? "cumulative"
                                             : "largest_remainder"},
                               {"rows", out}}
                    .dump(2)
                    .c_str());
    return 0;
  }
  std::printf(
      "planner_bench: %d solves per cell over %d microbatches, 2 slots/rank, top-8, "
      "8192 tokens/rank, one pinned thread\n",
      solves, microbatches);
  std::printf(
      "calibration: summing 16384 int64 takes %.2f us (median) on this thread; split "
      "rounding: %s\n",
      reference_us,
      split == rackrun::planner::SplitRounding::kCumulative ? "cumulative" : "largest_remainder");
  std::printf("%-5s %-7s %-6s %-8s %8s %8s %8s %8s %9s %9s\n", "EP", "experts", "target", "policy",
              "initial", "final", "worst", "replicas", "p50(us)", "p99(us)");
  for (const Row& r : rows) {
    if (!r.error.empty()) {
      std::printf("%-5d %-7d %-6.1f %-8s  skipped: %s\n", r.ranks, r.experts, r.target,
                  r.policy.c_str(), r.error.c_str());
      continue;
    }
    std::printf("%-5d %-7d %-6.1f %-8s %8.3f %8.4f %8.4f %8.1f %9.1f %9.1f\n", r.ranks, r.experts,
                r.target, r.policy.c_str(), r.initial, r.final_mean, r.final_max, r.replicas,
                r.p50_us, r.p99_us);
  }
  return 0;
}
