// The data channels side by side: the same point-to-point and collective patterns on the
// MPI channel, the Gloo channel (TCP on 127.0.0.1) and the UCX channel (UCP tag API; UCX
// picks shared memory between ranks of one host), the latter two being the worker
// daemons' per-job channels, in one run of the same processes, alternating backends
// round by round.
//
//   mpirun --allow-run-as-root --oversubscribe -np R bench_channel_bench
//          [--json] [--rounds N] [--scale X] [--a2a-kib K]
//
// Patterns (the sizes of the demo model's step, examples/tiny-moe.yaml on 2 ranks):
//   pingpong-8B     rank 0 <-> rank 1, Isend/Irecv of 8 bytes; the figure is a round trip
//   pingpong-64K    the same with 64 KiB (above the Gloo channel's inline size, UCX's
//                   rendezvous protocol)
//   allgather-512B  64 int64 per rank (the in-band planner's load rows)
//   alltoallv-512K  512 KiB to every other rank (a token dispatch of 1024 tokens, C=128;
//                   --a2a-kib picks another size)
//   allreduce-1M    256 Ki float32 (the dense gradients' order of magnitude)
// Per pattern and backend: wall time per operation (median and p90 over every sample of
// every round; each sample is one operation on rank 0, operations back to back as in a
// step, a barrier only between rounds), and the CPU time per operation
// of all ranks together (getrusage of every process, all its threads: the caller's wait
// loop and any helper thread of the backend), with the context switches per operation.
// The rendezvous for Gloo and UCX goes through files in a folder rank 0 creates (removed
// at exit).
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/statistics.h"
#include "comm/data_channel.h"
#include "comm/gloo_channel.h"
#include "comm/mpi_channel.h"
#include "comm/ucx_channel.h"
#include "nlohmann/json.hpp"
#include "tools/bench/startup.h"

namespace {

using rackrun::comm::DataChannel;
using rackrun::comm::DataType;
using rackrun::comm::DirectoryRendezvousStore;

void Check(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "bench_channel_bench: %s: %s\n", what, std::string(s.message()).c_str());
  rackrun::comm::AbortJob(1);
}

struct Usage {
  double cpu_s = 0;
  double switches = 0;
};
Usage Now() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  Usage out;
  out.cpu_s = static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
              1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
  out.switches = static_cast<double>(u.ru_nvcsw + u.ru_nivcsw);
  return out;
}

// Rank 0 sends `bytes` to rank 1, which sends them back; other ranks idle.
absl::Status PingPong(DataChannel& ch, void* out, void* in, int64_t bytes) {
  const int rank = ch.rank();
  if (rank > 1) return absl::OkStatus();
  const int peer = 1 - rank;
  const absl::Duration t = absl::Seconds(30);
  if (rank == 0) {
    auto s = ch.Isend(out, bytes, DataType::kByte, peer, 7);
    if (!s.ok()) return s.status();
    auto r = ch.Irecv(in, bytes, DataType::kByte, peer, 7);
    if (!r.ok()) return r.status();
    if (absl::Status w = (*s)->Wait(t); !w.ok()) return w;
    return (*r)->Wait(t);
  }
  auto r = ch.Irecv(in, bytes, DataType::kByte, peer, 7);
  if (!r.ok()) return r.status();
  if (absl::Status w = (*r)->Wait(t); !w.ok()) return w;
  auto s = ch.Isend(out, bytes, DataType::kByte, peer, 7);
  if (!s.ok()) return s.status();
  return (*s)->Wait(t);
}

struct Pattern {
  std::string name;
  int iterations;
  std::function<absl::Status(DataChannel&)> op;
};

struct Result {
  std::vector<double> wall_us;  // rank 0's samples
  double cpu_us = 0;            // all ranks, summed over the rounds
  double switches = 0;
  int64_t ops = 0;
};

}  // namespace

int main(int argc, char** argv) {
  int rounds = 3;
  double scale = 1.0;
  int a2a_kib = 512;
  rackrun::bench::BenchStartup bench(
      argc, argv,
      "The MPI, Gloo and UCX data channels side by side on the same patterns, alternating\n"
      "round by round. Run it under mpirun -np R (R >= 2).\n");
  rackrun::flags::FlagSet& flags = bench.flags();
  flags.Int("--rounds", &rounds, "N", "rounds, each backend once per round").Range(1);
  flags.Double("--scale", &scale, "X", "multiplies every pattern's iteration count").Range(0.01);
  flags.Int("--a2a-kib", &a2a_kib, "K", "alltoallv size per peer in KiB").Range(1);
  if (std::optional<int> exit = bench.Start()) return *exit;
  const bool json = bench.json();
  absl::StatusOr<std::unique_ptr<DataChannel>> mpi = rackrun::comm::CreateMpiChannel();
  Check(mpi.status(), "MPI channel");
  DataChannel& m = **mpi;
  const int rank = m.rank();
  const int ranks = m.size();
  if (ranks < 2) {
    std::fprintf(stderr, "bench_channel_bench: run it under mpirun -np 2 (or more)\n");
    return 2;
  }
  // Rank 0's scratch folder for the Gloo and UCX rendezvous, announced over MPI.
  char dir[256] = {};
  if (rank == 0) {
    std::string t =
        (std::filesystem::temp_directory_path() / "rackrun-channel-bench.XXXXXX").string();
    if (mkdtemp(t.data()) == nullptr) {
      std::fprintf(stderr, "bench_channel_bench: mkdtemp %s failed\n", t.c_str());
      rackrun::comm::AbortJob(1);
    }
    std::snprintf(dir, sizeof(dir), "%s", t.c_str());
  }
  Check(m.Broadcast(dir, sizeof(dir), DataType::kByte, 0), "broadcast of the scratch folder");
  DirectoryRendezvousStore store(dir);
  rackrun::comm::GlooChannelOptions go;
  go.channel.timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<DataChannel>> gloo =
      rackrun::comm::CreateGlooChannel(store, "bench", rank, ranks, go);
  Check(gloo.status(), "Gloo channel");
  rackrun::comm::UcxChannelOptions uo;
  uo.channel.timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<DataChannel>> ucx =
      rackrun::comm::CreateUcxChannel(store, "bench", rank, ranks, uo);
  Check(ucx.status(), "UCX channel");
  Check(m.Barrier(), "barrier");
  if (rank == 0) std::filesystem::remove_all(dir);

  // Buffers shared by both backends.
  std::vector<std::byte> ping(8, std::byte{2}), pong(8);
  std::vector<int64_t> rows(64, rank), gathered(64 * static_cast<size_t>(ranks));
  const int64_t a2a_floats = int64_t{a2a_kib} * 1024 / 4;
  std::vector<float> a2a_send(a2a_floats * static_cast<size_t>(ranks), 1.0F + rank);
  std::vector<float> a2a_recv(a2a_send.size());
  std::vector<int64_t> a2a_counts(ranks, a2a_floats), a2a_displs(ranks);
  for (int r = 0; r < ranks; ++r) a2a_displs[r] = r * a2a_floats;
  std::vector<float> grads(256 * 1024, 0.5F + rank), summed(grads.size());
  const auto iters = [&](int n) { return std::max(1, static_cast<int>(n * scale)); };
  std::vector<std::byte> big_ping(64 * 1024, std::byte{1}), big_pong(big_ping.size());

  std::vector<Pattern> patterns = {
      {"pingpong-8B", iters(2000),
       [&](DataChannel& ch) { return PingPong(ch, ping.data(), pong.data(), 8); }},
      {"pingpong-64K", iters(500),
       [&](DataChannel& ch) { return PingPong(ch, big_ping.data(), big_pong.data(), 64 * 1024); }},
      {"allgather-512B", iters(1000),
       [&](DataChannel& ch) {
         return ch.Allgather(rows.data(), gathered.data(), 64, DataType::kInt64);
       }},
      {absl::StrCat("alltoallv-", a2a_kib, "K"), iters(200),
       [&](DataChannel& ch) {
         return ch.AllToAllV(a2a_send.data(), a2a_counts, a2a_displs, a2a_recv.data(), a2a_counts,
                             a2a_displs, DataType::kFloat32);
       }},
      {"allreduce-1M", iters(100),
       [&](DataChannel& ch) {
         return ch.AllReduce(grads.data(), summed.data(), static_cast<int64_t>(grads.size()),
                             DataType::kFloat32, rackrun::comm::ReduceOp::kSum);
       }},
  };
  constexpr int kBackends = 3;
  DataChannel* backends[kBackends] = {&m, gloo->get(), ucx->get()};
  const char* names[kBackends] = {"mpi", "gloo", "ucx"};
  std::vector<std::vector<Result>> results(patterns.size(), std::vector<Result>(kBackends));
  for (size_t p = 0; p < patterns.size(); ++p) {
    for (int b = 0; b < kBackends; ++b) {  // warm-up
      for (int i = 0; i < std::min(20, patterns[p].iterations); ++i) {
        Check(patterns[p].op(*backends[b]), patterns[p].name.c_str());
      }
    }
    for (int round = 0; round < rounds; ++round) {
      for (int b = 0; b < kBackends; ++b) {
        Check(m.Barrier(), "barrier");
        Result& r = results[p][b];
        const Usage before = Now();
        for (int i = 0; i < patterns[p].iterations; ++i) {
          const absl::Time t0 = absl::Now();
          Check(patterns[p].op(*backends[b]), patterns[p].name.c_str());
          r.wall_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
        }
        const Usage after = Now();
        double mine[2] = {after.cpu_s - before.cpu_s, after.switches - before.switches};
        std::vector<double> all(2 * static_cast<size_t>(ranks));
        Check(m.Allgather(mine, all.data(), 2, DataType::kFloat64), "usage allgather");
        for (int q = 0; q < ranks; ++q) {
          r.cpu_us += 1e6 * all[2 * q];
          r.switches += all[2 * q + 1];
        }
        r.ops += patterns[p].iterations;
      }
    }
  }
  gloo->reset();
  ucx->reset();
  if (rank != 0) return 0;

  nlohmann::json out = nlohmann::json::array();
  if (!json) {
    std::printf(
        "%d ranks, %d rounds alternating mpi/gloo/ucx; wall = rank 0 per operation, CPU and "
        "switches = all ranks per operation\n\n",
        ranks, rounds);
    std::printf(
        "| pattern | backend | ops | wall p50 us | wall p90 us | CPU us/op "
        "| ctx switches/op | /mpi wall p50 |\n|---|---|---|---|---|---|---|---|\n");
  }
  for (size_t p = 0; p < patterns.size(); ++p) {
    const double mpi_p50 = rackrun::base::Median(results[p][0].wall_us);
    for (int b = 0; b < kBackends; ++b) {
      const Result& r = results[p][b];
      const double p50 = rackrun::base::Median(r.wall_us);
      const double p90 = rackrun::base::Percentile(r.wall_us, 0.9);
      const double cpu = r.cpu_us / static_cast<double>(r.ops);
      const double sw = r.switches / static_cast<double>(r.ops);
      out.push_back({{"pattern", patterns[p].name},
                     {"backend", names[b]},
                     {"ranks", ranks},
                     {"ops", r.ops},
                     {"wall_p50_us", p50},
                     {"wall_p90_us", p90},
                     {"cpu_us_per_op", cpu},
                     {"switches_per_op", sw}});
      if (!json) {
        char ratio[32] = "";
        if (b > 0 && mpi_p50 > 0) std::snprintf(ratio, sizeof(ratio), "%.1f", p50 / mpi_p50);
        std::printf("| %s | %s | %lld | %.1f | %.1f | %.1f | %.2f | %s |\n",
                    patterns[p].name.c_str(), names[b], static_cast<long long>(r.ops), p50, p90,
                    cpu, sw, ratio);
      }
    }
  }
  if (json) std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
