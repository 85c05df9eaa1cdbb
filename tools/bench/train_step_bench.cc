// Training-step throughput of the demo model (4 blocks, C=128, 16 experts top-2, byte
// vocabulary, seq 256) in rackrun and in the PyTorch reference (tools/bench/
// torch_reference.py, same model, same thread count), side by side; plus the GEMM backend
// and its measured GFLOP/s on the step's shapes.
//
//   bench_train_step_bench [--json] [--residual vanilla,xhc] [--batch 8] [--seq 256]
//                          [--steps 6] [--warmup 2] [--threads T] [--expert-hidden 256]
//                          [--no-torch] [--python /usr/bin/python3]
//
// One step = ZeroGrad + ForwardBackward + AdamW update (runtime/optimizer.h, the trainer's
// optimizer). Figures are medians over --steps timed steps after --warmup; the time split
// comes from Model::timing() (gemm, attention core, residual streams, MoE routing, other)
// plus the optimizer.
//
// OpenMP wait policy: libgomp reads OMP_WAIT_POLICY only when it loads, so when the
// variable is unset the bench re-executes itself with OMP_WAIT_POLICY=passive (the child
// PyTorch process inherits it). On a shared, oversubscribed machine the default policy
// (spin ~300k iterations at every barrier) lets a preempted partner thread stall each
// parallel region for a time slice: 2-thread steps measured 4-5x slower than passive
// under a load of ~5 on 2 cores. Set OMP_WAIT_POLICY yourself to measure another policy. The
// PyTorch script runs as a child process with the same shape and thread count when the interpreter
// has torch (Debian's python3-torch: tools/setup --torch).
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "base/clock.h"
#include "base/statistics.h"
#include "nlohmann/json.hpp"
#include "runtime/cpu/blas.h"
#include "runtime/cpu/gemm.h"
#include "runtime/model.h"
#include "runtime/optimizer.h"
#include "tools/bench/startup.h"
#include "tools/bench/train_step.h"

namespace {

using rackrun::base::Median;

using rackrun::runtime::AdamW;
using rackrun::runtime::AdamWConfig;
using rackrun::runtime::Model;
using rackrun::runtime::ModelConfig;
using rackrun::runtime::OptimizedTensor;

struct Options {
  std::vector<std::string> residual = {"vanilla", "xhc"};
  int batch = 8;
  int seq = 256;
  int steps = 6;
  int warmup = 2;
  int threads = 0;
  int expert_hidden = 256;
  bool torch = true;
  std::string python = "/usr/bin/python3";
};

struct Row {
  std::string impl, residual;
  double tokens_per_s = 0, step_s = 0;
  double gemm = 0, attention = 0, residual_s = 0, routing = 0, optimizer = 0, other = 0;
  double first_loss = 0;
  int64_t parameters = 0;
  std::string note;
};

rackrun::bench::TrainStepShape Shape(const Options& o) {
  rackrun::bench::TrainStepShape s = rackrun::bench::DemoShape();
  s.batch = o.batch;
  s.seq = o.seq;
  s.expert_hidden = o.expert_hidden;
  return s;
}

Row RunOurs(const Options& o, const std::string& residual) {
  Row row;
  row.impl = "rackrun";
  row.residual = residual;
  auto model_or = Model<float>::Create(rackrun::bench::ModelConfigOf(Shape(o), residual), 1);
  if (!model_or.ok()) {
    row.note = std::string(model_or.status().message());
    return row;
  }
  Model<float>& model = **model_or;
  std::vector<OptimizedTensor> tensors;
  for (const auto& p : model.Parameters()) {
    tensors.push_back(
        OptimizedTensor{p.name, p.value, p.grad, p.size, rackrun::runtime::DecaysWeight(p.name)});
    row.parameters += p.size;
  }
  AdamW adamw(AdamWConfig{}, tensors);
  std::mt19937 rng(1);
  const int tokens = o.batch * o.seq;
  std::vector<int32_t> data(static_cast<size_t>(tokens) + 1);
  for (auto& t : data) t = static_cast<int32_t>(rng() % 256);
  std::vector<int32_t> inputs(data.begin(), data.end() - 1), targets(data.begin() + 1, data.end());
  std::vector<double> step, gemm, attention, res, routing, opt, other;
  for (int i = 0; i < o.warmup + o.steps; ++i) {
    const double t0 = rackrun::base::NowSeconds();
    model.ZeroGrad();
    auto loss = model.ForwardBackward(inputs, targets, o.batch, {}, 1.0f);
    if (!loss.ok()) {
      row.note = std::string(loss.status().message());
      return row;
    }
    const double t1 = rackrun::base::NowSeconds();
    adamw.Step(1e-3);
    const double t2 = rackrun::base::NowSeconds();
    if (i == 0) row.first_loss = *loss;
    if (i < o.warmup) continue;
    const auto& tm = model.timing();
    step.push_back(t2 - t0);
    gemm.push_back(tm.gemm);
    attention.push_back(tm.attention);
    res.push_back(tm.residual);
    routing.push_back(tm.routing);
    opt.push_back(t2 - t1);
    // ZeroGrad is part of the step's "other".
    other.push_back(tm.other + (t1 - t0 - tm.total));
  }
  row.step_s = Median(step);
  row.tokens_per_s = tokens / row.step_s;
  row.gemm = Median(gemm);
  row.attention = Median(attention);
  row.residual_s = Median(res);
  row.routing = Median(routing);
  row.optimizer = Median(opt);
  row.other = Median(other);
  return row;
}

Row RunTorch(const Options& o, const std::string& residual, int threads) {
  Row row;
  row.impl = "pytorch";
  row.residual = residual;
  rackrun::bench::TorchOptions torch;
  torch.python = o.python;
  torch.threads = threads;
  torch.steps = o.steps;
  torch.warmup = o.warmup;
  absl::StatusOr<rackrun::bench::TorchResult> r =
      rackrun::bench::RunTorchReference(torch, Shape(o), residual);
  if (!r.ok()) {
    row.note = std::string(r.status().message());
    return row;
  }
  row.tokens_per_s = r->tokens_per_s;
  row.step_s = r->step_s;
  row.optimizer = r->optimizer_s;
  row.first_loss = r->first_loss;
  row.parameters = r->parameters;
  row.note = "torch " + r->torch_version;
  return row;
}

struct GemmRow {
  int m, n, k;
  double runtime_gflops, split_gflops, library_gflops;  // library: 0 without the OpenMP build
};

// The step's main GEMM shapes: QKV projection, expert up-projection (one expert's share
// of the tokens), its weight gradient, LM head; each as the runtime runs it and both ways of
// threading it (runtime/cpu/gemm.h).
std::vector<GemmRow> MeasureGemm(int tokens, int threads) {
  using rackrun::runtime::cpu::GemmThreading;
  const std::array<std::array<int, 3>, 4> shapes = {{{tokens, 384, 128},
                                                     {tokens * 2 / 16, 512, 128},
                                                     {128, 512, tokens * 2 / 16},
                                                     {tokens, 256, 128}}};
  std::vector<GemmRow> rows;
  std::mt19937 rng(3);
  for (const auto& s : shapes) {
    const int m = s[0], n = s[1], k = s[2];
    std::vector<float> a(static_cast<size_t>(m) * k), b(static_cast<size_t>(k) * n),
        c(static_cast<size_t>(m) * n);
    for (auto& x : a) x = static_cast<float>(rng() % 100) / 100.0f;
    for (auto& x : b) x = static_cast<float>(rng() % 100) / 100.0f;
    auto best = [&](auto&& call) {
      double t = 1e30;
      for (int r = 0; r < 20; ++r) {
        const double t0 = rackrun::base::NowSeconds();
        call();
        t = std::min(t, rackrun::base::NowSeconds() - t0);
      }
      return 2.0 * m * n * k / t / 1e9;
    };
    const auto with = [&](GemmThreading how) {
      return best([&] {
        rackrun::runtime::cpu::GemmWith<float>(how, threads, false, false, m, n, k, 1.0f, a.data(),
                                               k, b.data(), n, 0.0f, c.data(), n);
      });
    };
    GemmRow row{m, n, k, 0, 0, 0};
    row.runtime_gflops = best([&] {
      rackrun::runtime::cpu::Gemm<float>(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n,
                                         0.0f, c.data(), n);
    });
    row.split_gflops = with(GemmThreading::kSplit);
    if (rackrun::runtime::cpu::Blas().openmp) row.library_gflops = with(GemmThreading::kLibrary);
    rows.push_back(row);
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  rackrun::bench::BenchStartup bench(
      argc, argv,
      "Training-step throughput of the demo model in rackrun and in the PyTorch reference\n"
      "(tools/bench/torch_reference.py, when the interpreter has torch), side by side, plus the\n"
      "GEMM backend's GFLOP/s on the step's shapes.\n",
      {.passive_openmp_wait = true});
  rackrun::flags::FlagSet& flags = bench.flags();
  flags.List("--residual", &o.residual, "LIST", "residual modes");
  flags.Int("--batch", &o.batch, "B", "sequences per step").Range(1);
  flags.Int("--seq", &o.seq, "S", "sequence length").Range(1);
  flags.Int("--steps", &o.steps, "N", "timed steps (medians)").Range(1);
  flags.Int("--warmup", &o.warmup, "W", "untimed steps first").Range(0);
  flags.Int("--threads", &o.threads, "T", "OpenMP threads")
      .Range(0)
      .Default("OpenMP's default (OMP_NUM_THREADS)");
  flags.Int("--expert-hidden", &o.expert_hidden, "F", "expert hidden width").Range(1);
  flags.Switch("--no-torch", "skip the PyTorch reference", [&o] { o.torch = false; });
  flags.String("--python", &o.python, "PATH", "the interpreter for the PyTorch reference");
  if (std::optional<int> exit = bench.Start()) return *exit;
  if (o.threads > 0) omp_set_num_threads(o.threads);
  const int threads = omp_get_max_threads();
  const bool torch = o.torch && rackrun::bench::CheckTorch(o.python, "cpu").ok();

  const std::vector<GemmRow> gemm = MeasureGemm(o.batch * o.seq, threads);
  std::vector<Row> rows;
  for (const auto& mode : o.residual) {
    rows.push_back(RunOurs(o, mode));
    if (torch) {
      if (rackrun::bench::TorchHasMode(mode)) {
        rows.push_back(RunTorch(o, mode, threads));
      } else {
        Row r;
        r.impl = "pytorch";
        r.residual = mode;
        r.note = "no PyTorch reference for this mode";
        rows.push_back(r);
      }
    }
  }

  if (bench.json()) {
    nlohmann::json j;
    j["threads"] = threads;
    j["batch"] = o.batch;
    j["seq"] = o.seq;
    j["tokens_per_step"] = o.batch * o.seq;
    j["gemm_backend"] = rackrun::runtime::cpu::GemmBackendName();
    j["gemm"] = nlohmann::json::array();
    j["kernels"] = rackrun::runtime::cpu::GemmDescription(threads);
    j["omp_wait_policy"] = std::getenv("OMP_WAIT_POLICY") ? std::getenv("OMP_WAIT_POLICY") : "";
    for (const auto& g : gemm) {
      j["gemm"].push_back({{"m", g.m},
                           {"n", g.n},
                           {"k", g.k},
                           {"runtime_gflops", g.runtime_gflops},
                           {"split_gflops", g.split_gflops},
                           {"library_gflops", g.library_gflops}});
    }
    for (const auto& r : rows) {
      j["runs"].push_back({{"impl", r.impl},
                           {"residual", r.residual},
                           {"tokens_per_s", r.tokens_per_s},
                           {"step_s", r.step_s},
                           {"gemm_s", r.gemm},
                           {"attention_s", r.attention},
                           {"residual_s", r.residual_s},
                           {"routing_s", r.routing},
                           {"optimizer_s", r.optimizer},
                           {"other_s", r.other},
                           {"first_loss", r.first_loss},
                           {"parameters", r.parameters},
                           {"residual_share", r.step_s > 0 ? r.residual_s / r.step_s : 0.0},
                           {"note", r.note}});
    }
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  std::printf("Kernels: %s\nOMP_WAIT_POLICY=%s\n",
              rackrun::runtime::cpu::GemmDescription(threads).c_str(),
              policy != nullptr ? policy : "(unset)");
  std::printf("%6s %6s %6s %14s %10s %12s\n", "m", "n", "k", "runtime GF/s", "split", "library");
  for (const auto& g : gemm) {
    std::printf("%6d %6d %6d %14.1f %10.1f %12s\n", g.m, g.n, g.k, g.runtime_gflops, g.split_gflops,
                g.library_gflops > 0 ? absl::StrFormat("%.1f", g.library_gflops).c_str() : "-");
  }
  std::printf(
      "\nTraining step, demo model (4 blocks, C=128, 16 experts top-2, F=%d, vocab 256), "
      "batch %d x seq %d = %d tokens, %d threads, median of %d steps\n",
      o.expert_hidden, o.batch, o.seq, o.batch * o.seq, threads, o.steps);
  using rackrun::bench::Fixed;
  rackrun::bench::Table table({{"impl", 8, true},
                               {"residual", 9, true},
                               {"tokens/s", 10},
                               {"step ms", 9},
                               {"gemm", 8},
                               {"attn", 8},
                               {"resid", 8},
                               {"routing", 8},
                               {"optim", 8},
                               {"other", 8},
                               {"params", 9},
                               {"note", 0, true, 2}});
  for (const auto& r : rows) {
    const bool ours = r.impl != "pytorch";  // PyTorch reports no split but the optimizer's
    const auto split = [&](double s) { return ours ? Fixed(1e3 * s, 1) : "-"; };
    table.AddRow({r.impl, r.residual, Fixed(r.tokens_per_s, 0), Fixed(1e3 * r.step_s, 1),
                  split(r.gemm), split(r.attention), split(r.residual_s), split(r.routing),
                  Fixed(1e3 * r.optimizer, 1), split(r.other), std::to_string(r.parameters),
                  r.note});
  }
  std::printf("%s", table.ToString().c_str());
  std::printf("(split columns in ms; the machine is shared, so compare rows of one run)\n");
  // The residual modes against vanilla in this run: step-time ratio and residual share.
  const Row* vanilla = nullptr;
  for (const auto& r : rows)
    if (r.impl == "rackrun" && r.residual == "vanilla") vanilla = &r;
  for (const auto& r : rows) {
    if (r.impl != "rackrun" || r.residual == "vanilla" || r.step_s <= 0) continue;
    std::printf("%s: residual streams %.1f ms = %.0f%% of the step", r.residual.c_str(),
                1e3 * r.residual_s, 100 * r.residual_s / r.step_s);
    if (vanilla != nullptr && vanilla->step_s > 0)
      std::printf("; step %.2fx vanilla's (+%.1f ms)", r.step_s / vanilla->step_s,
                  1e3 * (r.step_s - vanilla->step_s));
    std::printf("\n");
  }
  return 0;
}
