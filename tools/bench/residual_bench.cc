// residual_bench: per-sublayer time of every residual mode (the stream operations outside
// the body F), side by side with vanilla and with this machine's memory bandwidth measured
// in the same run by a STREAM-like copy and triad.
//
//   bench_residual_bench [--tokens 4096] [--widths 128,512,1024] [--reps 5] [--modes all]
//                        [--no-backward] [--json] [--cpu-time]
//
// Per mode and width it prints the counted traffic per token per sublayer in units of C
// (the paper's row-by-row accounting and what our fused kernels touch), the median seconds
// per sublayer (forward without saving for backward; forward with saving; backward), the
// achieved bytes/s of the fused forward (fused bytes / time) and its fraction of the
// measured bandwidth. The body F is not run (its output is the body input), so only the
// residual component is timed.
//
// Roofline per operation (ReadInput, WriteOutput, WriteOutputBackward, ReadInputBackward):
// the bench also measures, in the same run, the copy bandwidth (STREAM copy, bytes read +
// written) and the GEMM rate (cpu::Gemm, the training step's sgemm, on a 1024^3 product
// on all threads), and counts per operation the bytes it must move and the FLOPs it does
// (OpCost below: the formulas follow the xhc.cc algorithm step by step). roofline =
// max(bytes / copy bandwidth, FLOPs / GEMM rate); achieved = roofline / measured time.
// Both machine figures are taken before and after the modes and the larger is used (the
// shorter, stricter roofline). Bytes are compulsory traffic: every input the operation
// needs read once, every output written once (re-reads by our kernels are not counted,
// they are what the achieved fraction exposes); FLOPs count every multiply and add of the
// algorithm, all priced at the GEMM rate (so vector passes are under-priced: again a
// stricter bound). Only vanilla and the xhc family have a cost model; hc and mhc print
// no roofline.
#include <omp.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/clock.h"
#include "base/statistics.h"
#include "runtime/cpu/gemm.h"
#include "runtime/residual/residual_streams.h"
#include "tools/bench/startup.h"

namespace {

using rackrun::base::Median;

using rackrun::runtime::ResidualConfig;
using rackrun::runtime::ResidualMode;
using rackrun::runtime::ResidualModeName;
using rackrun::runtime::ResidualStreams;
using rackrun::runtime::SublayerKind;

// The clock of every measurement: wall time, or with --cpu-time the process's CPU time
// (CLOCK_PROCESS_CPUTIME_ID). On a shared, oversubscribed machine wall time counts the
// slices other processes run in; with one thread (OMP_NUM_THREADS=1) CPU time does not,
// and since the bandwidth and the GEMM rate are measured with the same clock, the
// roofline fractions stay comparable. With more threads CPU time sums the threads, so
// --cpu-time requires one thread.
bool g_cpu_time = false;
double Now() {
  if (!g_cpu_time) return rackrun::base::NowSeconds();
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Bandwidth {
  double copy = 0;   // bytes/s, counting read + write
  double triad = 0;  // bytes/s, counting 2 reads + 1 write
};

// STREAM-like kernels over arrays far larger than the caches, all threads, static schedule.
Bandwidth MeasureBandwidth(int reps) {
  const int64_t n = int64_t{1} << 25;  // 32 Mi floats = 128 MiB per array
  std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n)),
      c(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    a[static_cast<size_t>(i)] = 1.0f;
    b[static_cast<size_t>(i)] = 2.0f;
    c[static_cast<size_t>(i)] = 0.0f;
  }
  std::vector<double> tc, tt;
  float* pa = a.data();
  float* pb = b.data();
  float* pc = c.data();
  for (int r = 0; r < reps; ++r) {
    double t0 = Now();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) pc[i] = pa[i];
    tc.push_back(Now() - t0);
    t0 = Now();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) pa[i] = pb[i] + 3.0f * pc[i];
    tt.push_back(Now() - t0);
  }
  const double bytes = static_cast<double>(n) * sizeof(float);
  return Bandwidth{2 * bytes / Median(tc), 3 * bytes / Median(tt)};
}

// GFLOP/s of cpu::Gemm (OpenBLAS sgemm split over the OpenMP threads: the rate the
// training step's GEMMs get) on a 1024 x 1024 x 1024 product, median of `reps`.
double MeasureGemmRate(int reps) {
  const int n = 1024;
  std::vector<float> a(static_cast<size_t>(n) * n), b(a.size()), c(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<float>(i % 7) * 0.1f;
    b[i] = static_cast<float>(i % 5) * 0.1f;
  }
  std::vector<double> t;
  for (int r = 0; r <= reps; ++r) {
    const double t0 = Now();
    rackrun::runtime::cpu::Gemm<float>(false, true, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f,
                                       c.data(), n);
    if (r > 0) t.push_back(Now() - t0);  // r = 0 warms up
  }
  return 2.0 * n * n * n / Median(t);
}

// Operations timed and modelled, in call order of a training step.
enum Op { kRead, kWrite, kWriteBwd, kReadBwd, kOps };
const char* const kOpNames[kOps] = {"read", "write", "write_bwd", "read_bwd"};

struct OpCost {
  double bytes = 0;  // compulsory bytes per sublayer (all tokens), averaged over sublayers
  double flops = 0;  // FLOPs per sublayer (all tokens), averaged over sublayers
};

// Bytes and FLOPs per operation, averaged over the config's sublayers, for `tokens` tokens
// in fp32, following the algorithm of the mode (residual_streams.cc for vanilla, xhc.cc for
// the xhc family). Forward counts are for the forward without saving (the one timed for
// read/write). Returns false for modes without a model (hc, mhc).
bool OpCosts(const ResidualConfig& cfg, int tokens, OpCost out[kOps]) {
  const double E = sizeof(float), C = cfg.width, T = tokens;
  const int L = static_cast<int>(cfg.sublayers.size());
  for (int o = 0; o < kOps; ++o) out[o] = OpCost{};
  if (cfg.mode == ResidualMode::kVanilla) {
    // read: u = x; write: x += out; write_bwd: d_out = dx; read_bwd: dx += d_u.
    out[kRead] = {E * 2 * C * T, 0};
    out[kWrite] = {E * 3 * C * T, C * T};
    out[kWriteBwd] = {E * 2 * C * T, 0};
    out[kReadBwd] = {E * 3 * C * T, C * T};
    return true;
  }
  if (cfg.mode != ResidualMode::kXhc && cfg.mode != ResidualMode::kXhcFlash &&
      cfg.mode != ResidualMode::kXhcFlash4)
    return false;
  const double N = cfg.streams, k = cfg.active, NC = N * C, kC = k * C;
  const int g = cfg.group_size();
  const int J = static_cast<int>(cfg.conv_widths.size());
  const double P1 = N + g * N;  // router + g pre-mappings, one projection of the full state
  const double it = cfg.sinkhorn_iters;
  for (int l = 0; l < L; ++l) {
    const bool mlp = cfg.sublayers[static_cast<size_t>(l)] == SublayerKind::kMlp;
    const int s = l % g;
    const bool last = s == g - 1;
    const double Kr = mlp ? 1 + J : 1;
    const double P2 = (last ? k * k : 0) + k * Kr;  // H_res (if mixing) + H_post logits
    double rb = 0, rf = 0, wb = 0, wf = 0, wbb = 0, wbf = 0, rbb = 0, rbf = 0;
    // ---- read (ReadInput) ----
    // Active mappings (every sublayer): RMS of the k active rows (3 flops/element), the
    // projection to P2 logits (2 P2 kC), Sinkhorn on k x k (~4 k^2 per iteration) and the
    // sigmoids; weights P2 x kC read once per batch.
    rf += 3 * kC + 2 * P2 * kC + (last ? 4 * k * k * it : 0) + 4 * k * Kr;
    rb += E * P2 * kC / T;
    if (s == 0) {
      // Group entry: read the state once (NC), write u and the g-1 bases (g C); the router
      // + pre-mapping projection (2 P1 NC), moments of the state (3 NC), the g dense
      // combinations over N rows (2 g NC); weights P1 x NC read once per batch.
      rb += E * (NC + g * C) + E * P1 * NC / T;
      rf += 2 * P1 * NC + 3 * NC + 2 * g * NC;
    } else {
      // Flash sublayer s > 0: read the base (C) and the k active rows (kC), write u (C).
      rb += E * (2 * C + kC);
      rf += 2 * kC;
    }
    // ---- write (WriteOutput) ----
    // Read out (C) and the k active rows, write the k rows back (2 kC); write-back
    // 2 k Kr C; mixing (last) 2 k^2 C; MLP basis: convolutions 2 w_j C, modified
    // Gram-Schmidt (j+1) dots and axpys (4 C each) and a norm (2 C) per level.
    wb += E * (C + 2 * kC);
    wf += 2 * k * Kr * C + (last ? 2 * k * k * C : 0);
    if (mlp) {
      wf += 2 * C;
      for (int j = 0; j < J; ++j)
        wf += 2 * cfg.conv_widths[static_cast<size_t>(j)] * C + 4 * (j + 1) * C + 2 * C;
    }
    // ---- write_bwd (WriteOutputBackward) ----
    // Read dX's k active rows and the saved A, O ((k + Kr) C); write dX's k rows, the
    // walked-back X rows (2 kC) and d_out (C). FLOPs: dA through H_res and its gradient
    // (4 k^2 C, last), the write-back (4 k Kr C), the RMS term (2 kC), the transpose
    // projection and the weight gradient (4 P2 kC), Gram-Schmidt backward (recompute
    // levels, undo each step: ~(2 w_j + 12 (j+1) + 2) C per level) and the convolutions'
    // input and weight gradients (4 w_j C); weights and their gradients P2 x kC.
    wbb += E * ((4 * k + Kr + 1) * C) + E * 3 * P2 * kC / T;
    wbf += (last ? 4 * k * k * C : 0) + 4 * k * Kr * C + 2 * kC + 4 * P2 * kC;
    if (mlp)
      for (int j = 0; j < J; ++j) {
        const double w = cfg.conv_widths[static_cast<size_t>(j)];
        wbf += (2 * w + 12 * (j + 1) + 2) * C + 4 * w * C;
      }
    // ---- read_bwd (ReadInputBackward) ----
    // Dense read backward over all N rows: read X and dX, write dX (3 NC), read d_u (C);
    // a dot and an axpy per row (4 NC). Group entry adds the norm terms (3 NC), the
    // transpose projection and the weight gradient of the P1 x NC weights (4 P1 NC; the
    // weights and their gradient: 3 P1 NC bytes per batch).
    rbb += E * (3 * NC + C);
    rbf += 4 * NC;
    if (s == 0) {
      rbb += E * 3 * P1 * NC / T;
      rbf += 3 * NC + 4 * P1 * NC;
    }
    out[kRead].bytes += rb * T / L;
    out[kRead].flops += rf * T / L;
    out[kWrite].bytes += wb * T / L;
    out[kWrite].flops += wf * T / L;
    out[kWriteBwd].bytes += wbb * T / L;
    out[kWriteBwd].flops += wbf * T / L;
    out[kReadBwd].bytes += rbb * T / L;
    out[kReadBwd].flops += rbf * T / L;
  }
  return true;
}

struct Result {
  std::string mode;
  int width = 0;
  double paper_c = 0;       // paper accounting, units of C per token per sublayer
  double fused_c = 0;       // our fused forward without saving
  double fused_save_c = 0;  // our fused forward with saving for the backward
  double fwd_s = 0;         // seconds per sublayer, forward (no save)
  double fwd_save_s = 0;    // seconds per sublayer, forward with save
  double bwd_s = 0;         // seconds per sublayer, backward
  double achieved = 0;      // fused bytes / fwd_s
  double fraction = 0;      // achieved / measured bandwidth
  double paper_rate = 0;    // paper bytes / fwd_s (the paper's traffic at our speed)
  // The forward split into its two calls: ReadInput (mapping generation + dense read) and
  // WriteOutput (write-back, mixing, merge): the latter has no projections, pure streaming.
  double read_s = 0, write_s = 0;
  double write_c = 0;         // fused traffic of WriteOutput, units of C
  double write_fraction = 0;  // its achieved bytes/s over the measured bandwidth
  // Per operation: median seconds per sublayer and the cost model (OpCosts).
  double op_s[kOps] = {};
  bool has_model = false;
  OpCost cost[kOps];
};

// Steps counted by WriteOutput (the rest are ReadInput's).
bool IsWriteStep(const std::string& name) {
  for (const char* w : {"mix", "post write-back", "merge + scatter", "convolutions", "merge",
                        "apply post", "apply res"})
    if (name == w) return true;
  return false;
}

Result RunMode(ResidualMode mode, int width, int tokens, int reps, bool backward,
               double bandwidth) {
  const std::vector<SublayerKind> sub = ResidualConfig::Transformer(2);
  const ResidualConfig config = ResidualConfig::ForMode(mode, width, sub);
  auto made = ResidualStreams<float>::Create(config, 1);
  if (!made.ok()) {
    std::fprintf(stderr, "%s\n", std::string(made.status().message()).c_str());
    std::exit(1);
  }
  ResidualStreams<float>& rs = *made;
  // Give the mapping weights realistic non-zero values (init has most at 0).
  uint32_t state = 12345;
  for (auto& p : rs.Parameters())
    for (int64_t i = 0; i < p.size; ++i) {
      state = state * 1664525u + 1013904223u;
      p.value[i] = (static_cast<float>(state >> 8) / 16777216.0f - 0.5f) * 0.04f;
    }
  const int L = static_cast<int>(sub.size());
  const size_t tc = static_cast<size_t>(tokens) * static_cast<size_t>(width);
  std::vector<float> emb(tc), u(tc), y(tc), d(tc), du(tc), dout(tc);
  for (size_t i = 0; i < tc; ++i) {
    emb[i] = static_cast<float>((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    d[i] = static_cast<float>((i * 40503u) % 1000) / 1000.0f - 0.5f;
  }
  const std::vector<int32_t> starts = {0, tokens / 2};
  Result r;
  r.mode = std::string(ResidualModeName(mode));
  r.width = width;
  double read_total = 0, write_total = 0;
  auto forward = [&](bool save, double* seconds) {
    if (!rs.BeginBatch(tokens, starts, save).ok() || !rs.Expand(emb).ok()) std::exit(1);
    read_total = write_total = 0;
    for (int l = 0; l < L; ++l) {
      const double t0 = Now();
      if (!rs.ReadInput(l, u).ok()) std::exit(1);
      const double t1 = Now();
      // The body F is not part of the measurement: its output is its input.
      if (!rs.WriteOutput(l, u).ok()) std::exit(1);
      read_total += t1 - t0;
      write_total += Now() - t1;
    }
    if (!rs.Collapse(y).ok()) std::exit(1);
    *seconds = (read_total + write_total) / L;
  };
  std::vector<double> tf, tfs, tb, tr, tw, twb, trb;
  // Each measurement repeats the pass `inner` times (>= ~0.2 s in all): on a loaded machine
  // a parallel region waits for descheduled threads, which quantises short timings.
  int inner = 1;
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up (allocations, page faults)
    double s = 0, fsum = 0, rsum = 0, wsum = 0;
    for (int i = 0; i < inner; ++i) {
      rs.ResetTraffic();
      forward(false, &s);
      fsum += s;
      rsum += read_total / L;
      wsum += write_total / L;
    }
    if (rep == 0) inner = std::clamp(static_cast<int>(0.2 / std::max(1e-6, s * L)) + 1, 1, 50);
    if (rep > 0) {
      tf.push_back(fsum / inner);
      tr.push_back(rsum / inner);
      tw.push_back(wsum / inner);
    }
    if (rep == reps) {
      r.paper_c = rs.traffic().PaperPerSublayer(width);
      r.fused_c = rs.traffic().FusedPerSublayer(width);
      double w = 0;
      for (const auto& step : rs.traffic().steps)
        if (IsWriteStep(step.name)) w += static_cast<double>(step.fused_read + step.fused_written);
      r.write_c = w / static_cast<double>(rs.traffic().sublayer_tokens) / width;
    }
    if (!backward) continue;
    double fs_sum = 0, b_sum = 0, wb_sum = 0, rb_sum = 0;
    const int binner = rep == 0 ? 1 : std::max(1, inner / 3);
    for (int i = 0; i < binner; ++i) {
      rs.ResetTraffic();
      forward(true, &s);
      fs_sum += s;
      if (rep == reps) r.fused_save_c = rs.traffic().FusedPerSublayer(width);
      if (!rs.CollapseBackward(d).ok()) std::exit(1);
      double total = 0;
      for (int l = L - 1; l >= 0; --l) {
        const double t0 = Now();
        if (!rs.WriteOutputBackward(l, dout).ok()) std::exit(1);
        const double t1 = Now();
        if (!rs.ReadInputBackward(l, dout).ok()) std::exit(1);
        const double t2 = Now();
        total += t2 - t0;
        wb_sum += (t1 - t0) / L;
        rb_sum += (t2 - t1) / L;
      }
      if (!rs.ExpandBackward(du).ok()) std::exit(1);
      b_sum += total / L;
    }
    if (rep > 0) {
      tfs.push_back(fs_sum / binner);
      tb.push_back(b_sum / binner);
      twb.push_back(wb_sum / binner);
      trb.push_back(rb_sum / binner);
    }
  }
  r.fwd_s = Median(tf);
  r.fwd_save_s = Median(tfs);
  r.bwd_s = Median(tb);
  const double unit = static_cast<double>(tokens) * width * sizeof(float);
  r.achieved = r.fused_c * unit / r.fwd_s;
  r.fraction = r.achieved / bandwidth;
  r.paper_rate = r.paper_c * unit / r.fwd_s;
  r.read_s = Median(tr);
  r.write_s = Median(tw);
  r.write_fraction = r.write_c * unit / r.write_s / bandwidth;
  r.op_s[kRead] = r.read_s;
  r.op_s[kWrite] = r.write_s;
  if (backward) {
    r.op_s[kWriteBwd] = Median(twb);
    r.op_s[kReadBwd] = Median(trb);
  }
  r.has_model = OpCosts(config, tokens, r.cost);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int tokens = 4096;
  int reps = 5;
  bool backward = true;
  std::vector<int> widths = {128, 512, 1024};
  std::vector<ResidualMode> modes = {ResidualMode::kVanilla,  ResidualMode::kHc,
                                     ResidualMode::kMhc,      ResidualMode::kXhc,
                                     ResidualMode::kXhcFlash, ResidualMode::kXhcFlash4};
  rackrun::bench::BenchStartup bench(
      argc, argv,
      "Per-sublayer time of every residual mode (the stream operations outside the body F)\n"
      "next to a roofline from this machine's copy bandwidth and GEMM rate, measured in the\n"
      "same run (this file's header says how).\n");
  rackrun::flags::FlagSet& flags = bench.flags();
  flags.Int("--tokens", &tokens, "T", "tokens per sublayer").Range(1);
  flags.List("--widths", &widths, "LIST", "widths C").Range(1);
  flags.Int("--reps", &reps, "R", "repetitions (medians)").Range(1);
  flags
      .Custom("--modes", "all|LIST", "residual modes",
              [&modes](std::string_view value) {
                if (value == "all") return absl::OkStatus();
                std::vector<ResidualMode> chosen;
                for (size_t p = 0; p < value.size();) {
                  const size_t q = std::min(value.find(',', p), value.size());
                  auto m = rackrun::runtime::ParseResidualMode(std::string(value.substr(p, q - p)));
                  if (!m.ok()) return m.status();
                  chosen.push_back(*m);
                  p = q + 1;
                }
                if (chosen.empty()) return absl::InvalidArgumentError("give all or a list");
                modes = std::move(chosen);
                return absl::OkStatus();
              })
      .Default("all");
  flags.Switch("--no-backward", "time the forward only", [&backward] { backward = false; });
  flags.Switch("--cpu-time", &g_cpu_time,
               "time with the process's CPU time instead of wall time (needs OMP_NUM_THREADS=1)");
  if (std::optional<int> exit = bench.Start()) return *exit;
  const bool json = bench.json();
  if (g_cpu_time && omp_get_max_threads() != 1) {
    return flags.Fail("--cpu-time", "measures one thread: run with OMP_NUM_THREADS=1");
  }
  const Bandwidth bw = MeasureBandwidth(reps);
  const double gemm_rate = MeasureGemmRate(reps);
  const double bandwidth = std::max(bw.copy, bw.triad);
  std::vector<Result> results;
  for (int width : widths)
    for (ResidualMode mode : modes)
      results.push_back(RunMode(mode, width, tokens, reps, backward, bandwidth));
  // Bandwidth and GEMM rate again after the runs: the machine is shared, so report both;
  // the roofline uses the larger of each.
  const Bandwidth bw_after = MeasureBandwidth(reps);
  const double gemm_rate_after = MeasureGemmRate(reps);
  const double roof_bw = std::max(bw.copy, bw_after.copy);
  const double roof_gemm = std::max(gemm_rate, gemm_rate_after);
  auto roofline = [&](const OpCost& c) { return std::max(c.bytes / roof_bw, c.flops / roof_gemm); };
  if (json) {
    nlohmann::json j;
    j["tokens"] = tokens;
    j["threads"] = omp_get_max_threads();
    j["clock"] = g_cpu_time ? "process_cpu_time" : "wall";
    j["bandwidth_bytes_per_s"] = {{"copy", bw.copy},
                                  {"triad", bw.triad},
                                  {"copy_after", bw_after.copy},
                                  {"triad_after", bw_after.triad},
                                  {"reference", bandwidth},
                                  {"roofline_copy", roof_bw}};
    j["gemm_flops_per_s"] = {
        {"before", gemm_rate}, {"after", gemm_rate_after}, {"roofline", roof_gemm}};
    for (const Result& r : results) {
      nlohmann::json ops = nlohmann::json::array();
      for (int o = 0; o < kOps && r.has_model; ++o) {
        if (r.op_s[o] <= 0) continue;
        const double roof = roofline(r.cost[o]);
        ops.push_back(
            {{"op", kOpNames[o]},
             {"bytes", r.cost[o].bytes},
             {"flops", r.cost[o].flops},
             {"seconds", r.op_s[o]},
             {"roofline_s", roof},
             {"bound",
              r.cost[o].bytes / roof_bw >= r.cost[o].flops / roof_gemm ? "memory" : "compute"},
             {"fraction_of_roofline", roof / r.op_s[o]}});
      }
      j["results"].push_back({{"mode", r.mode},
                              {"width", r.width},
                              {"traffic_paper_C", r.paper_c},
                              {"traffic_fused_C", r.fused_c},
                              {"traffic_fused_with_save_C", r.fused_save_c},
                              {"forward_s_per_sublayer", r.fwd_s},
                              {"forward_with_save_s_per_sublayer", r.fwd_save_s},
                              {"backward_s_per_sublayer", r.bwd_s},
                              {"achieved_bytes_per_s", r.achieved},
                              {"fraction_of_bandwidth", r.fraction},
                              {"paper_traffic_bytes_per_s", r.paper_rate},
                              {"read_input_s_per_sublayer", r.read_s},
                              {"write_output_s_per_sublayer", r.write_s},
                              {"write_output_traffic_fused_C", r.write_c},
                              {"write_output_fraction_of_bandwidth", r.write_fraction},
                              {"ops", ops}});
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("tokens %d, threads %d, reps %d (medians), clock: %s\n", tokens,
              omp_get_max_threads(), reps, g_cpu_time ? "process CPU time" : "wall");
  std::printf("bandwidth before: copy %.2f GB/s, triad %.2f GB/s; after: copy %.2f, triad %.2f\n",
              bw.copy / 1e9, bw.triad / 1e9, bw_after.copy / 1e9, bw_after.triad / 1e9);
  std::printf("\n%-11s %5s | %7s %7s %7s | %8s %8s %8s | %6s %5s %7s | %7s %7s %5s %5s\n", "mode",
              "C", "paper C", "fused C", "+save C", "fwd ms", "fwd+sv", "bwd ms", "GB/s", "of BW",
              "paperGB", "read ms", "writ ms", "wr C", "wr BW");
  for (const Result& r : results)
    std::printf(
        "%-11s %5d | %7.2f %7.2f %7.2f | %8.2f %8.2f %8.2f | %6.2f %4.0f%% %7.2f | %7.2f %7.2f "
        "%5.1f %4.0f%%\n",
        r.mode.c_str(), r.width, r.paper_c, r.fused_c, r.fused_save_c, r.fwd_s * 1e3,
        r.fwd_save_s * 1e3, r.bwd_s * 1e3, r.achieved / 1e9, 100 * r.fraction, r.paper_rate / 1e9,
        r.read_s * 1e3, r.write_s * 1e3, r.write_c, 100 * r.write_fraction);
  std::printf(
      "\npaper C: the xHC paper's row-by-row accounting (vanilla 3, mhc 34, xhc 73.5; for the\n"
      "flash modes the same rows applied to our schedule, paper quotes 51 and 40). fused C:\n"
      "what our kernels move to/from memory in a forward without saving; +save C adds the rows\n"
      "saved for the backward. GB/s = fused bytes / forward time; 'of BW' compares it with\n"
      "the measured bandwidth (target >= 70%%); paperGB = the paper's traffic at our speed.\n"
      "read/writ ms: the forward's ReadInput (projections: compute-bound) and WriteOutput\n"
      "(write-back, mixing, merge: pure streaming); wr C / wr BW: WriteOutput's fused traffic\n"
      "and its fraction of the measured bandwidth.\n");
  std::printf(
      "\nroofline per operation: copy %.2f GB/s, GEMM %.1f GFLOP/s (before %.1f, after %.1f;"
      " the larger of\nbefore/after is used). roofline = max(MB / copy, GFLOP / GEMM rate),"
      " ach = roofline / time.\n",
      roof_bw / 1e9, roof_gemm / 1e9, gemm_rate / 1e9, gemm_rate_after / 1e9);
  std::printf("%-11s %5s %-9s | %8s %8s | %8s %8s %4s %6s\n", "mode", "C", "op", "MB", "GFLOP",
              "ms", "roof ms", "bnd", "ach");
  for (const Result& r : results) {
    if (!r.has_model) continue;
    for (int o = 0; o < kOps; ++o) {
      if (r.op_s[o] <= 0) continue;
      const OpCost& c = r.cost[o];
      const double roof = roofline(c);
      std::printf("%-11s %5d %-9s | %8.1f %8.3f | %8.2f %8.2f %4s %5.0f%%\n", r.mode.c_str(),
                  r.width, kOpNames[o], c.bytes / 1e6, c.flops / 1e9, r.op_s[o] * 1e3, roof * 1e3,
                  c.bytes / roof_bw >= c.flops / roof_gemm ? "mem" : "gemm",
                  100 * roof / r.op_s[o]);
    }
  }
  return 0;
}
