// Relay vs direct fan-out of expert weights over real MPI transfers, next to what the
// planner's cost model (EstimateFanout) predicts for the same schedule.
//
//   mpirun --allow-run-as-root --oversubscribe -np R bench_fanout_bench
//          [--json] [--expert-mib M] [--chunk-kib K] [--reps N]
//
// Scenarios, on R ranks (R >= 2):
//   one-hot:  expert 0 (master rank 0) replicated on every other rank (n = R-1 replicas);
//   two-hot:  experts 0 and 1 (masters ranks 0 and 1) each replicated on every other rank.
// Modes, all schedules from planner::PlanFanout on the same plan:
//   direct        every master sends each replica itself;
//   relay         the planner's relay rule (relays only if n >= 4 and gain >= 2);
//   relay-forced  the same rule with the thresholds off (n >= 2, gain >= 0), so relays are
//                 measured where the rule would decline them (e.g. R = 4).
// --egress-mbps X emulates a per-rank egress link of X MB/s (the regime relays are for: a
// NIC or NVLink port per rank), because on one shared-memory host the ranks' copies share
// the CPUs and no rank has an egress link of its own: each rank's sends are serialized on
// its emulated link and a message is handed to MPI when its last byte would have left.
// Each run is timed from a barrier to the last rank's completion (max over ranks), N reps,
// median and min reported. The cost model is calibrated in the same run from a measured
// point-to-point transfer (rank 0 -> 1, same chunking): latency = time of a 1-chunk 4 KiB
// transfer, egress bandwidth = bytes / (time of one expert - latency).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "base/statistics.h"
#include "comm/data_channel.h"
#include "comm/fanout_executor.h"
#include "comm/forwarding_channel.h"
#include "comm/mpi_channel.h"
#include "nlohmann/json.hpp"
#include "planner/fanout.h"
#include "planner/plan.h"
#include "tools/bench/startup.h"

namespace {

using rackrun::base::Median;

using rackrun::comm::DataChannel;
using rackrun::comm::DataType;
using rackrun::planner::FanoutSchedule;

// The DataChannel decorator behind --egress-mbps: point-to-point sends of this rank share
// one emulated link of `bytes_per_s`; everything else goes straight to `inner`.
class EgressLimitedChannel final : public rackrun::comm::ForwardingChannel {
 public:
  EgressLimitedChannel(DataChannel& inner, double bytes_per_s)
      : ForwardingChannel(inner), bytes_per_s_(bytes_per_s) {}

  absl::StatusOr<std::unique_ptr<rackrun::comm::Request>> Isend(const void* buf, int64_t count,
                                                                DataType type, int peer,
                                                                int tag) override {
    const double bytes = static_cast<double>(count) * rackrun::comm::DataTypeSize(type);
    const absl::Time now = absl::Now();
    link_free_ = std::max(link_free_, now) + absl::Seconds(bytes / bytes_per_s_);
    return std::make_unique<DeferredSend>(
        rackrun::comm::RequestInfo{true, rank(), size(), peer, tag, static_cast<int64_t>(bytes)},
        inner(), buf, count, type, link_free_);
  }

 private:
  class DeferredSend final : public rackrun::comm::Request {
   public:
    DeferredSend(const rackrun::comm::RequestInfo& info, DataChannel& inner, const void* buf,
                 int64_t count, DataType type, absl::Time post_at)
        : Request(info), inner_(inner), buf_(buf), count_(count), type_(type), post_at_(post_at) {}
    absl::StatusOr<bool> Test() override {
      if (posted_ == nullptr) {
        if (absl::Now() < post_at_) return false;
        auto r = inner_.Isend(buf_, count_, type_, info().peer, info().tag);
        if (!r.ok()) return r.status();
        posted_ = *std::move(r);
      }
      return posted_->Test();
    }

   private:
    DataChannel& inner_;
    const void* buf_;
    int64_t count_;
    DataType type_;
    absl::Time post_at_;
    std::unique_ptr<rackrun::comm::Request> posted_;
  };

  double bytes_per_s_;
  absl::Time link_free_ = absl::InfinitePast();
};

struct Row {
  std::string scenario;
  std::string mode;
  int replicas = 0;
  int relays = 0;
  int transfers = 0;
  double median_s = 0;
  double min_s = 0;
  double predicted_s = 0;
  int64_t max_rank_bytes = 0;
};

// A plan whose experts [0, hot) have masters on ranks [0, hot) and replicas everywhere else.
rackrun::planner::Plan HotPlan(int ranks, int hot) {
  rackrun::planner::Plan plan;
  plan.ranks = ranks;
  plan.experts = ranks;
  for (int e = 0; e < ranks; ++e) {
    plan.first.push_back(static_cast<int32_t>(plan.instances.size()));
    plan.instances.push_back({e, e, true});
    if (e < hot) {
      for (int r = 0; r < ranks; ++r) {
        if (r != e) plan.instances.push_back({e, r, false});
      }
    }
  }
  plan.first.push_back(static_cast<int32_t>(plan.instances.size()));
  plan.quota.assign(plan.instances.size(), 0);
  rackrun::planner::IndexSplitColumns(&plan);
  return plan;
}

int CountRelays(const FanoutSchedule& s) {
  std::map<std::pair<int, int>, bool> relays;
  for (const auto& t : s.transfers) {
    if (t.stage == 1) relays[{t.expert, t.src_rank}] = true;
  }
  return static_cast<int>(relays.size());
}

// Runs `schedule` `reps` times; returns every rep's completion time (max over ranks).
std::vector<double> Measure(DataChannel& channel, const FanoutSchedule& schedule,
                            int64_t expert_bytes, int64_t chunk_bytes, int reps) {
  std::map<int, std::vector<std::byte>> storage;
  std::map<int, std::span<std::byte>> buffers;
  for (const auto& t : schedule.transfers) {
    if (t.src_rank != channel.rank() && t.dst_rank != channel.rank()) continue;
    auto& bytes = storage[t.expert];
    if (bytes.empty()) {
      bytes.resize(static_cast<size_t>(expert_bytes));
      for (size_t i = 0; i < bytes.size(); ++i) {
        bytes[i] = static_cast<std::byte>((i * 31 + static_cast<size_t>(t.expert)) & 0xFF);
      }
    }
    buffers[t.expert] = bytes;
  }
  rackrun::comm::FanoutExecutorOptions options;
  options.chunk_bytes = chunk_bytes;
  std::vector<double> samples;
  for (int rep = 0; rep < reps + 1; ++rep) {  // rep 0 warms up connections and pages
    if (absl::Status s = channel.Barrier(); !s.ok()) {
      std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
      std::exit(1);
    }
    const absl::Time start = absl::Now();
    auto stats = rackrun::comm::ExecuteFanout(channel, schedule, expert_bytes, buffers, options);
    if (!stats.ok()) {
      std::fprintf(stderr, "%s\n", std::string(stats.status().message()).c_str());
      std::exit(1);
    }
    double mine = absl::ToDoubleSeconds(absl::Now() - start);
    std::vector<double> all(static_cast<size_t>(channel.size()));
    if (!channel.Allgather(&mine, all.data(), 1, DataType::kFloat64).ok()) std::exit(1);
    if (rep > 0) samples.push_back(*std::max_element(all.begin(), all.end()));
  }
  return samples;
}

}  // namespace

int main(int argc, char** argv) {
  double expert_mib = 8;
  int64_t chunk_kib = 256;
  int reps = 7;
  double egress_mbps = 0;
  rackrun::bench::BenchStartup bench(
      argc, argv,
      "Relay vs direct fan-out of expert weights over real MPI transfers, next to the\n"
      "planner's cost model for the same schedule. Run it under mpirun -np R (R >= 2).\n");
  rackrun::flags::FlagSet& flags = bench.flags();
  flags.Double("--expert-mib", &expert_mib, "M", "one expert's weights in MiB").Range(1e-3);
  flags.Int("--chunk-kib", &chunk_kib, "K", "transfer chunk in KiB").Range(1);
  flags.Int("--reps", &reps, "N", "timed repetitions per mode, after one warm-up").Range(1);
  flags
      .Double("--egress-mbps", &egress_mbps, "X",
              "emulate a per-rank egress link of X MB/s (0: off)")
      .Range(0);
  if (std::optional<int> exit = bench.Start()) return *exit;
  const bool json = bench.json();
  auto channel_or = rackrun::comm::CreateMpiChannel();
  if (!channel_or.ok()) {
    std::fprintf(stderr, "%s\n", std::string(channel_or.status().message()).c_str());
    return 1;
  }
  std::unique_ptr<DataChannel> limited;
  if (egress_mbps > 0) {
    limited = std::make_unique<EgressLimitedChannel>(**channel_or, egress_mbps * 1e6);
  }
  DataChannel& channel = limited != nullptr ? *limited : **channel_or;
  const int ranks = channel.size();
  if (ranks < 2) {
    std::fprintf(stderr, "fanout_bench needs at least 2 ranks (mpirun -np R, R >= 2)\n");
    return 2;
  }
  const auto expert_bytes = static_cast<int64_t>(expert_mib * (1 << 20));
  const int64_t chunk_bytes = chunk_kib << 10;

  // Calibration: one point-to-point transfer, rank 0 -> 1, same executor and chunking.
  const FanoutSchedule p2p{{{0, 0, 1, 0}}};
  const double latency = Median(Measure(channel, p2p, 4096, chunk_bytes, reps));
  const double one = Median(Measure(channel, p2p, expert_bytes, chunk_bytes, reps));
  const double bandwidth = static_cast<double>(expert_bytes) / std::max(one - latency, 1e-9);
  rackrun::planner::FanoutCostModel model{bandwidth, latency, chunk_bytes};

  std::vector<Row> rows;
  for (int hot : {1, 2}) {
    if (hot >= ranks) continue;
    const auto plan = HotPlan(ranks, hot);
    const std::string scenario = hot == 1 ? "one-hot" : "two-hot";
    struct Mode {
      const char* name;
      rackrun::planner::FanoutOptions options;
    };
    const Mode modes[] = {
        {"direct", {rackrun::planner::FanoutMode::kDirect}},
        {"relay", {rackrun::planner::FanoutMode::kRelay}},
        {"relay-forced", {rackrun::planner::FanoutMode::kRelay, 2, 8, 0}},
    };
    for (const Mode& mode : modes) {
      const FanoutSchedule schedule = rackrun::planner::PlanFanout(plan, mode.options);
      const std::vector<double> samples =
          Measure(channel, schedule, expert_bytes, chunk_bytes, reps);
      const auto cost = rackrun::planner::EstimateFanout(schedule, ranks, expert_bytes, model);
      Row row;
      row.scenario = scenario;
      row.mode = mode.name;
      row.replicas = ranks - 1;
      row.relays = CountRelays(schedule);
      row.transfers = static_cast<int>(schedule.transfers.size());
      row.median_s = Median(samples);
      row.min_s = *std::min_element(samples.begin(), samples.end());
      row.predicted_s = cost.seconds;
      row.max_rank_bytes = cost.max_rank_bytes;
      rows.push_back(row);
    }
  }

  if (channel.rank() == 0) {
    if (json) {
      nlohmann::json out;
      out["ranks"] = ranks;
      out["expert_bytes"] = expert_bytes;
      out["chunk_bytes"] = chunk_bytes;
      out["reps"] = reps;
      out["emulated_egress_bytes_per_s"] = egress_mbps * 1e6;
      out["calibration"] = {
          {"latency_s", latency}, {"egress_bytes_per_s", bandwidth}, {"p2p_expert_s", one}};
      for (const Row& r : rows) {
        out["rows"].push_back({{"scenario", r.scenario},
                               {"mode", r.mode},
                               {"replicas_per_expert", r.replicas},
                               {"relays", r.relays},
                               {"transfers", r.transfers},
                               {"measured_median_s", r.median_s},
                               {"measured_min_s", r.min_s},
                               {"predicted_s", r.predicted_s},
                               {"max_rank_bytes", r.max_rank_bytes}});
      }
      std::printf("%s\n", out.dump(2).c_str());
    } else {
      char link[96] = "shared-memory transport, no egress emulation";
      if (egress_mbps > 0) {
        std::snprintf(link, sizeof(link), "emulated egress %.0f MB/s per rank", egress_mbps);
      }
      std::printf("fan-out over MPI: %d ranks, expert %.1f MiB, chunk %lld KiB, %d reps, %s\n",
                  ranks, expert_mib, static_cast<long long>(chunk_kib), reps, link);
      std::printf(
          "calibration (rank 0 -> 1): latency %.1f us, egress %.2f GB/s, one expert %.2f ms\n",
          latency * 1e6, bandwidth / 1e9, one * 1e3);
      std::printf("%-8s %-13s %8s %6s %9s %12s %10s %13s %9s\n", "scenario", "mode", "replicas",
                  "relays", "transfers", "median(ms)", "min(ms)", "predicted(ms)", "meas/pred");
      for (const Row& r : rows) {
        std::printf("%-8s %-13s %8d %6d %9d %12.2f %10.2f %13.2f %9.2f\n", r.scenario.c_str(),
                    r.mode.c_str(), r.replicas, r.relays, r.transfers, r.median_s * 1e3,
                    r.min_s * 1e3, r.predicted_s * 1e3, r.median_s / r.predicted_s);
      }
    }
  }
  limited.reset();
  channel_or->reset();
  return 0;
}
