// gpu_residual_bench: the xhc stream operations on a GPU (runtime/cuda/xhc.h) against a copy
// kernel timed in the same run, forward and backward, fp32 and bf16 states.
//
//   bench_gpu_residual_bench [--tokens 8192] [--widths 1024,4096] [--streams 16] [--active 4]
//                            [--reps 5] [--dtypes fp32,bf16] [--modes xhc,xhc_flash]
//                            [--json]
//
// Per mode, state type and width it runs one attention and one MLP sublayer of xhc, mhc or hc
// (the last two at 4 streams: every sublayer reads, mixes and writes the full state) or one
// xhc_flash group (attention, then MLP: the MLP reads from the group's bases, only it mixes) (N
// streams, k active, convolutions 4, 8, 12), random parameters, and times each operation with CUDA
// events: read (ReadInput: the mapping GEMM, the fused dense read + gather, the active GEMM, the
// maps), write (WriteOutput: convolutions, Gram-Schmidt, mixing, write-back and scatter), write_bwd
// and read_bwd (their backward, GEMMs included). Bytes are what the kernels count moving to or from
// device memory (XhcStreams::traffic); achieved = bytes / median time, against the copy kernel's
// rate (bytes read + written) over a buffer of the state's size, measured before the operations.
// The forward's bytes per token are also set against docs/design.md's accounting for xhc (paper: 53
// C read + 17 C written for an attention sublayer, 57 + 20 for an MLP one) and xhc_flash (52.5 C
// per sublayer in the paper's style applied to our schedule; the paper states 51 C) and mhc (34 C
// at N = 4).
//
// JSON: with --json on stdout, and always to $OUT/bench_gpu_residual.json when OUT is set
// (the device check collects it). Without a usable GPU it prints the cause and exits 1.
// Not run on a GPU yet.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/statistics.h"
#include "runtime/cuda/device.h"
#include "runtime/cuda/kernels.h"
#include "runtime/cuda/xhc.h"
#include "tools/bench/startup.h"

namespace {

namespace cu = rackrun::runtime::cuda;
using rackrun::base::Median;
using rackrun::runtime::ParamRef;
using rackrun::runtime::ResidualConfig;
using rackrun::runtime::ResidualMode;

constexpr const char* kOps[] = {"read", "write", "write_bwd", "read_bwd"};

struct OpResult {
  std::string sublayer;  // attention | mlp
  std::string op;
  double seconds = 0;  // median
  int64_t bytes = 0;
  std::vector<cu::KernelTraffic> kernels;  // what each kernel of the operation moved
};

struct Run {
  std::string mode;  // xhc | xhc_flash
  std::string dtype;
  int width = 0;
  double copy_bytes_per_s = 0;
  std::vector<OpResult> ops;
};

// Fast, reproducible values in [-1, 1): the state of a benchmark needs no normal law.
void FillUniform(std::vector<float>& v, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& f : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    f = static_cast<float>(static_cast<int64_t>(x >> 40) - (int64_t{1} << 23)) / (1 << 23);
  }
}

absl::StatusOr<double> CopyRate(cu::Device* dev, int64_t bytes, int reps) {
  cu::DeviceTensor<float> a(dev, "copy source"), b(dev, "copy destination");
  const int64_t n = (bytes + 15) / 16 * 4;
  if (absl::Status s = a.Resize({n}); !s.ok()) return s;
  if (absl::Status s = b.Resize({n}); !s.ok()) return s;
  if (absl::Status s = a.Zero(); !s.ok()) return s;
  absl::StatusOr<cu::Event> e0 = cu::Event::Create(true), e1 = cu::Event::Create(true);
  if (!e0.ok()) return e0.status();
  if (!e1.ok()) return e1.status();
  std::vector<double> times;
  for (int r = 0; r < reps + 1; ++r) {
    (void)e0->Record(dev->stream());
    if (absl::Status s = cu::CudaCheck(
            cu::kernels::CopyBytes(n * 4, a.data(), b.data(), dev->stream()), "copy kernel");
        !s.ok()) {
      return s;
    }
    (void)e1->Record(dev->stream());
    if (absl::Status s = e1->Synchronize(); !s.ok()) return s;
    absl::StatusOr<float> ms = e1->ElapsedMs(*e0);
    if (!ms.ok()) return ms.status();
    if (r > 0) times.push_back(*ms / 1e3);  // the first is warm-up
  }
  return 2.0 * static_cast<double>(n * 4) / Median(times);
}

template <typename S>
absl::StatusOr<Run> RunOne(cu::Device* dev, ResidualMode mode, const std::string& dtype, int width,
                           int tokens, int streams, int active, int reps,
                           const std::vector<float>& state) {
  Run run;
  run.mode = std::string(rackrun::runtime::ResidualModeName(mode));
  run.dtype = dtype;
  run.width = width;
  ResidualConfig config = ResidualConfig::ForMode(mode, width, ResidualConfig::Transformer(1));
  config.streams = streams;
  config.active = active;
  config.fixed = std::min(config.fixed, active);
  absl::StatusOr<std::unique_ptr<cu::XhcStreams<S>>> made =
      cu::XhcStreams<S>::Create(dev, config, 1, cu::GemmPrecision::kTf32);
  if (!made.ok()) return made.status();
  cu::XhcStreams<S>& x = **made;
  // Random mapping parameters (the zero initialisation would make every map constant).
  for (const ParamRef<float>& p : x.Parameters()) {
    std::vector<float> v(static_cast<size_t>(p.size));
    FillUniform(v, static_cast<uint64_t>(p.size) + p.name.size());
    for (float& f : v) f *= 0.05f;
    if (absl::Status s = cu::CudaCheck(
            cudaMemcpy(p.value, v.data(), v.size() * 4, cudaMemcpyHostToDevice), "parameters");
        !s.ok()) {
      return s;
    }
  }
  absl::StatusOr<double> copy = CopyRate(dev, static_cast<int64_t>(state.size()) * sizeof(S), reps);
  if (!copy.ok()) return copy.status();
  run.copy_bytes_per_s = *copy;

  cu::DeviceTensor<float> u(dev, "u"), out(dev, "out"), y(dev, "y");
  for (cu::DeviceTensor<float>* t : {&u, &out, &y}) {
    if (absl::Status s = t->Resize({tokens, width}); !s.ok()) return s;
    if (absl::Status s = t->Zero(); !s.ok()) return s;
  }
  std::vector<float> body(static_cast<size_t>(tokens) * width);
  FillUniform(body, 99);
  if (absl::Status s = out.CopyFrom(body); !s.ok()) return s;
  // Sequences of 1024 tokens: the convolutions are cut at each start.
  std::vector<int32_t> starts;
  for (int t = 0; t < tokens; t += 1024) starts.push_back(t);
  if (absl::Status s = x.BeginBatch(tokens, starts); !s.ok()) return s;
  if (absl::Status s = x.SetState(state); !s.ok()) return s;

  // times[sublayer][op]
  std::vector<double> times[2][4];
  int64_t bytes[2][4] = {};
  std::vector<cu::KernelTraffic> kernels[2][4];
  absl::StatusOr<cu::Event> e0 = cu::Event::Create(true), e1 = cu::Event::Create(true);
  if (!e0.ok()) return e0.status();
  if (!e1.ok()) return e1.status();
  auto timed = [&](int l, int op, auto&& call) -> absl::Status {
    x.ResetTraffic();
    if (absl::Status s = e0->Record(dev->stream()); !s.ok()) return s;
    if (absl::Status s = call(); !s.ok()) return s;
    if (absl::Status s = e1->Record(dev->stream()); !s.ok()) return s;
    if (absl::Status s = e1->Synchronize(); !s.ok()) return s;
    absl::StatusOr<float> ms = e1->ElapsedMs(*e0);
    if (!ms.ok()) return ms.status();
    times[l][op].push_back(*ms / 1e3);
    bytes[l][op] = x.TrafficBytes();
    kernels[l][op] = x.traffic();
    return absl::OkStatus();
  };
  for (int r = 0; r < reps + 1; ++r) {
    if (r > 0) {
      if (absl::Status s = x.RestartFromInputState(); !s.ok()) return s;
    }
    for (int l = 0; l < 2; ++l) {
      if (absl::Status s = timed(l, 0, [&] { return x.ReadInput(l, u.data()); }); !s.ok()) return s;
      if (absl::Status s = timed(l, 1, [&] { return x.WriteOutput(l, out.data()); }); !s.ok())
        return s;
    }
    if (absl::Status s = x.Collapse(y.data()); !s.ok()) return s;
    if (absl::Status s = x.CollapseBackward(y.data()); !s.ok()) return s;
    for (int l = 1; l >= 0; --l) {
      if (absl::Status s = timed(l, 2, [&] { return x.WriteOutputBackward(l, u.data()); }); !s.ok())
        return s;
      if (absl::Status s = timed(l, 3, [&] { return x.ReadInputBackward(l, out.data()); }); !s.ok())
        return s;
    }
    if (r == 0)
      for (auto& sub : times)
        for (auto& op : sub) op.clear();  // warm-up: plans, allocations
  }
  for (int l = 0; l < 2; ++l)
    for (int op = 0; op < 4; ++op)
      run.ops.push_back({l == 0 ? "attention" : "mlp", kOps[op], Median(times[l][op]), bytes[l][op],
                         kernels[l][op]});
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  int tokens = 8192, streams = 16, active = 4, reps = 5;
  std::vector<int> widths = {1024, 4096};
  std::string dtypes = "fp32,bf16";
  // hc and mhc on request: the default keeps tools/gpu-check's run (all defaults, 200 s) near
  // its former length.
  std::vector<std::string> modes = {"xhc", "xhc_flash"};
  rackrun::bench::BenchStartup bench(
      argc, argv,
      "The xhc stream operations on a GPU against a copy kernel timed in the same run\n"
      "(this file's header says how).\n");
  rackrun::flags::FlagSet& flags = bench.flags();
  flags.Int("--tokens", &tokens, "T", "tokens").Range(1);
  flags.List("--widths", &widths, "LIST", "widths C").Range(1, 4096);
  flags.Int("--streams", &streams, "N", "streams").Range(2, 32);
  flags.Int("--active", &active, "K", "active streams").Range(1, 4);
  flags.Int("--reps", &reps, "R", "repetitions (medians)").Range(1);
  flags.String("--dtypes", &dtypes, "LIST", "state types: fp32, bf16 or both");
  flags.List("--modes", &modes, "LIST", "residual modes: xhc, xhc_flash, mhc, hc");
  if (std::optional<int> exit = bench.Start()) return *exit;
  std::vector<ResidualMode> parsed;
  for (const std::string& m : modes) {
    absl::StatusOr<ResidualMode> mode = rackrun::runtime::ParseResidualMode(m);
    if (!mode.ok() || (*mode != ResidualMode::kXhc && *mode != ResidualMode::kXhcFlash &&
                       *mode != ResidualMode::kMhc && *mode != ResidualMode::kHc)) {
      return flags.Fail(absl::InvalidArgumentError("--modes: xhc, xhc_flash, mhc or hc, got " + m),
                        2);
    }
    parsed.push_back(*mode);
  }
  if (absl::Status s = cu::GpuAvailable(); !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", bench.program().c_str(), std::string(s.message()).c_str());
    return 1;
  }
  absl::StatusOr<std::unique_ptr<cu::Device>> dev = cu::Device::Open(0);
  if (!dev.ok()) return flags.Fail(dev.status(), 1);
  const cu::GpuInfo& gpu = (*dev)->info();

  std::vector<Run> runs;
  for (ResidualMode mode : parsed)
    for (int width : widths) {
      // hc and mhc run their papers' 4 streams (the GPU's limit for them).
      const int n =
          mode == ResidualMode::kMhc || mode == ResidualMode::kHc ? cu::xhc::kDenseMaxN : streams;
      std::vector<float> state(static_cast<size_t>(tokens) * n * width);
      FillUniform(state, static_cast<uint64_t>(width));
      for (const std::string dtype : {"fp32", "bf16"}) {
        if (dtypes.find(dtype) == std::string::npos) continue;
        absl::StatusOr<Run> r =
            dtype == "fp32"
                ? RunOne<float>(dev->get(), mode, dtype, width, tokens, n, active, reps, state)
                : RunOne<cu::bf16>(dev->get(), mode, dtype, width, tokens, n, active, reps, state);
        if (!r.ok()) return flags.Fail(r.status(), 1);
        runs.push_back(*r);
        if (absl::Status s = (*dev)->allocator().ReleaseCache(); !s.ok()) return flags.Fail(s, 1);
      }
    }

  nlohmann::json j;
  j["gpu"] = gpu.name;
  j["tokens"] = tokens;
  j["streams"] = streams;
  j["active"] = active;
  j["reps"] = reps;
  for (const Run& r : runs) {
    nlohmann::json ops = nlohmann::json::array();
    for (const OpResult& o : r.ops) {
      const double rate = static_cast<double>(o.bytes) / o.seconds;
      nlohmann::json kernels = nlohmann::json::array();
      for (const cu::KernelTraffic& k : o.kernels)
        kernels.push_back({{"kernel", k.name}, {"read", k.read}, {"written", k.written}});
      ops.push_back({{"sublayer", o.sublayer},
                     {"op", o.op},
                     {"seconds", o.seconds},
                     {"bytes", o.bytes},
                     {"bytes_per_s", rate},
                     {"fraction_of_copy", rate / r.copy_bytes_per_s},
                     {"kernels", kernels}});
    }
    j["runs"].push_back({{"mode", r.mode},
                         {"dtype", r.dtype},
                         {"width", r.width},
                         {"copy_bytes_per_s", r.copy_bytes_per_s},
                         {"ops", ops}});
  }
  rackrun::bench::WriteToOut("bench_gpu_residual.json", j.dump(2) + "\n");
  if (bench.json()) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("%s, %d multiprocessors, %.1f GiB; tokens %d, N %d, k %d, medians of %d\n",
              gpu.name.c_str(), gpu.multiprocessors,
              static_cast<double>(gpu.total_bytes) / (1 << 30), tokens, streams, active, reps);
  std::printf("%-10s %-5s %5s %-9s %-9s %9s %11s %9s %7s %9s\n", "mode", "state", "C", "sublayer",
              "op", "ms", "C/token", "TB/s", "of copy", "paper C");
  for (const Run& r : runs) {
    const double unit = static_cast<double>(r.width) * (r.dtype == "fp32" ? 4 : 2) * tokens;
    for (const OpResult& o : r.ops) {
      const double rate = static_cast<double>(o.bytes) / o.seconds;
      // docs/design.md's xhc accounting of the whole forward sublayer (read + write).
      std::string paper = "";
      if (o.op == "write" && r.mode == "xhc")
        paper = o.sublayer == "attention" ? "70 (fwd)" : "77 (fwd)";
      std::printf("%-10s %-5s %5d %-9s %-9s %9.3f %11.2f %9.3f %6.0f%% %9s\n", r.mode.c_str(),
                  r.dtype.c_str(), r.width, o.sublayer.c_str(), o.op.c_str(), o.seconds * 1e3,
                  static_cast<double>(o.bytes) / unit, rate / 1e12, 100 * rate / r.copy_bytes_per_s,
                  paper.c_str());
    }
    double fwd[2] = {0, 0};
    for (const OpResult& o : r.ops)
      if (o.op == "read" || o.op == "write")
        fwd[o.sublayer == "mlp"] += static_cast<double>(o.bytes);
    std::printf(
        "%-10s %-5s %5d copy kernel %.3f TB/s; forward per sublayer: attention %.1f C, mlp %.1f C "
        "(%s)\n",
        r.mode.c_str(), r.dtype.c_str(), r.width, r.copy_bytes_per_s / 1e12, fwd[0] / unit,
        fwd[1] / unit,
        r.mode == "xhc"   ? "paper 70, 77"
        : r.mode == "mhc" ? "paper 34"
        : r.mode == "hc"  ? "no paper figure"
                          : "mean 52.5 in the paper's style, 51 in the paper");
  }
  return 0;
}
