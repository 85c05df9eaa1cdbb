// What one training step of the GPU engine asks of the GPU, counted on the CUDA simulator
// (runtime/cuda/sim, sim::Census): kernel launches, cuBLAS(Lt) calls, copies by direction,
// memsets, calls that make the host wait for the device, and allocations, for the
// benchmark shapes (tools/bench/train_step.h: demo, c1024) in every residual mode of the GPU
// engine and both expert-GEMM paths. A step issued from the host costs a few microseconds of
// host time per launch or copy, and each wait empties the device's queue: the counts say how
// launch-bound a shape is and what CUDA graphs would have to cover, on any machine, without
// a GPU. They are counts, not times (bench_gpu_train_step_bench times the step on a GPU).
//
//   bench_sim_step_census [--configs demo,c1024] [--residual vanilla,xhc,...]
//                         [--expert-gemm per_expert,grouped] [--full-width] [--json]
//
// The step is the one bench_gpu_train_step_bench times: ZeroGrad, ForwardBackward (one
// microbatch), GradNorm (clip 1), OptimizerStep; the second of two steps is counted (the first
// fills the caching allocator). By default the shapes keep their structure (blocks, heads,
// experts, top-k, the residual mode's N and k) at narrow widths (C = 16 x heads, F = C,
// seq 64, batch 4) so that the census takes seconds: the launches follow the structure, not
// the widths, except that the per-expert path skips the GEMMs of an expert that received no
// rows (the table's expert GEMM counts can differ from a full-width step's by those).
// --full-width counts the shapes as they are (demo: about 45 s a step here; c1024: hours).
//
// JSON: with --json on stdout, and always to $OUT/bench_sim_step_census.json when OUT is set.
// Built only with the simulator (runtime/cuda/sim: nvcc found, no sanitizer).
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "runtime/cuda/device_probe.h"
#include "runtime/cuda/sim/runtime.h"
#include "runtime/device_engine.h"
#include "tools/bench/gpu_step.h"
#include "tools/bench/startup.h"
#include "tools/bench/train_step.h"

namespace {

namespace cu = rackrun::runtime::cuda;
namespace sim = rackrun::runtime::cuda::sim;

struct Options {
  std::vector<std::string> configs = {"demo", "c1024"};
  std::vector<std::string> residual = {"vanilla", "hc", "mhc", "xhc", "xhc_flash", "xhc_flash4"};
  std::vector<std::string> expert_gemm = {"per_expert", "grouped"};
  bool full_width = false;
};

struct Row {
  rackrun::bench::TrainStepShape shape;  // its name is the row's config
  std::string residual, expert_gemm;
  sim::Census census;
  std::string note;  // why nothing was counted
};

rackrun::bench::TrainStepShape Narrow(rackrun::bench::TrainStepShape s) {
  s.width = 16 * s.heads;  // the smallest head dim the attention kernels take
  s.expert_hidden = s.width;
  s.seq = 64;
  s.batch = 4;
  return s;
}

Row Count(const rackrun::bench::TrainStepShape& shape, const std::string& residual,
          const std::string& expert_gemm) {
  Row row{shape, residual, expert_gemm, {}, ""};
  if (absl::Status s = cu::CheckGpuResidualMode(residual); !s.ok()) {
    row.note = "not in the GPU engine";
    return row;
  }
  absl::StatusOr<rackrun::bench::GpuStepModel> model =
      rackrun::bench::MakeGpuStepModel(shape, residual, "", expert_gemm);
  if (!model.ok()) {
    row.note = std::string(model.status().message());
    return row;
  }
  const rackrun::bench::StepTokens tokens = rackrun::bench::RandomStepTokens(shape);
  for (int step = 0; step < 2; ++step) {
    sim::TakeCensus();
    if (absl::StatusOr<double> loss =
            rackrun::bench::EngineStep(*model->engine, tokens, shape.batch);
        !loss.ok()) {
      row.note = absl::StrCat("step ", step + 1, ": ", loss.status().message());
      return row;
    }
    row.census = sim::TakeCensus();
  }
  return row;
}

nlohmann::json Json(const Options& o, const std::vector<Row>& rows) {
  nlohmann::json j;
  j["bench"] = "sim_step_census";
  j["widths"] = o.full_width ? "full" : "narrow";
  j["rows"] = nlohmann::json::array();
  for (const Row& r : rows) {
    const sim::Census& c = r.census;
    j["rows"].push_back({{"config", r.shape.name},
                         {"shape", r.shape.Describe()},
                         {"tokens", r.shape.tokens()},
                         {"residual", r.residual},
                         {"expert_gemm", r.expert_gemm},
                         {"note", r.note},
                         {"kernels", c.kernels},
                         {"blas", c.blas},
                         {"copies_to_device", c.copies_to_device},
                         {"copies_to_host", c.copies_to_host},
                         {"copies_on_device", c.copies_on_device},
                         {"pageable_copies", c.pageable_copies},
                         {"memsets", c.memsets},
                         {"host_waits", c.host_waits},
                         {"allocations", c.allocations},
                         {"frees", c.frees}});
  }
  return j;
}

void PrintTable(const Options& o, const std::vector<Row>& rows) {
  std::printf(
      "One training step's calls to the GPU (the second step), counted on the CUDA "
      "simulator, %s widths\n",
      o.full_width ? "full" : "narrow");
  for (const std::string& name : o.configs) {
    for (const Row& r : rows) {
      if (r.shape.name != name) continue;
      std::printf("  %-5s %s, batch %d x seq %d\n", name.c_str(), r.shape.Describe().c_str(),
                  r.shape.batch, r.shape.seq);
      break;
    }
  }
  rackrun::bench::Table t({{"config", 6, true},
                           {"residual", 10, true},
                           {"expert gemm", 11, true},
                           {"kernels", 7},
                           {"blas", 5},
                           {"h2d", 4},
                           {"d2h", 4},
                           {"d2d", 4},
                           {"memset", 6},
                           {"calls", 6},
                           {"waits", 5},
                           {"allocs", 6},
                           {"note", 4, true, 2}});
  for (const Row& r : rows) {
    const sim::Census& c = r.census;
    const auto n = [&](int64_t v) { return r.note.empty() ? std::to_string(v) : "-"; };
    const int64_t calls =
        c.kernels + c.blas + c.copies_to_device + c.copies_to_host + c.copies_on_device + c.memsets;
    t.AddRow({r.shape.name, r.residual, r.expert_gemm, n(c.kernels), n(c.blas),
              n(c.copies_to_device), n(c.copies_to_host), n(c.copies_on_device), n(c.memsets),
              n(calls), n(c.host_waits), n(c.allocations + c.frees), r.note});
  }
  std::printf("%s", t.ToString().c_str());
  std::printf(
      "(calls: kernels + blas + copies + memsets, each a host-side launch; waits: calls that "
      "block the host until the device is done; allocs: cudaMalloc and cudaFree, 0 once the "
      "caching allocator is warm)\n");
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  rackrun::bench::BenchStartup startup(
      argc, argv,
      "One training step's launches, copies and host waits on the GPU engine, counted on the\n"
      "CUDA simulator (this file's header says how).\n");
  rackrun::flags::FlagSet& flags = startup.flags();
  flags.List("--configs", &o.configs, "LIST", "model shapes: demo, c1024");
  flags.List("--residual", &o.residual, "LIST", "residual modes");
  flags.List("--expert-gemm", &o.expert_gemm, "LIST",
             "the MoE expert GEMMs' paths, a row each: per_expert, grouped");
  flags.Switch("--full-width", "count the shapes at their widths (slow on the simulator)",
               [&o] { o.full_width = true; });
  if (std::optional<int> exit = startup.Start()) return *exit;
  std::vector<rackrun::bench::TrainStepShape> shapes;
  for (const std::string& name : o.configs) {
    absl::StatusOr<rackrun::bench::TrainStepShape> s =
        rackrun::bench::ShapeNamed(name, "--configs");
    if (!s.ok()) return flags.Fail(s.status());
    shapes.push_back(o.full_width ? *s : Narrow(*s));
  }
  if (std::optional<int> exit = rackrun::bench::CheckGpuStepFlags(flags, o.expert_gemm, o.residual))
    return *exit;
  std::vector<Row> rows;
  for (const rackrun::bench::TrainStepShape& shape : shapes) {
    for (const std::string& mode : o.residual) {
      for (const std::string& path : o.expert_gemm) {
        rows.push_back(Count(shape, mode, path));
        std::fprintf(stderr, "%s: %s %s %s: %s\n", startup.program().c_str(), shape.name.c_str(),
                     mode.c_str(), path.c_str(),
                     rows.back().note.empty()
                         ? absl::StrCat(rows.back().census.kernels, " kernels").c_str()
                         : rows.back().note.c_str());
      }
    }
  }
  const nlohmann::json j = Json(o, rows);
  rackrun::bench::WriteToOut("bench_sim_step_census.json", j.dump(2) + "\n");
  if (startup.json()) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  PrintTable(o, rows);
  return 0;
}
