// What the GPU engine's step benchmarks share (bench_gpu_train_step_bench times the step on a
// GPU; bench_sim_step_census counts its calls to the GPU on the CUDA simulator): the engine
// for a shape's host model, the step's tokens, the step itself and the checks of the flags
// that choose them. Header-only: each program links its own engine (rackrun_gpu_engine, or
// rackrun_gpu_engine_sim on the simulator).
#ifndef RACKRUN_TOOLS_BENCH_GPU_STEP_H_
#define RACKRUN_TOOLS_BENCH_GPU_STEP_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "flags/flags.h"
#include "rackrun/v1/job_spec.pb.h"
#include "runtime/cuda/engine.h"
#include "runtime/cuda/grouped_gemm.h"
#include "runtime/cuda/moe.h"
#include "runtime/device_engine.h"
#include "runtime/model.h"
#include "runtime/residual/residual_streams.h"
#include "tools/bench/train_step.h"

namespace rackrun::bench {

// The GPU engine on cuda:0 for `host`'s weights in residual mode `residual`, its GEMMs at
// `precision` (empty: the spec's default), its MoE layers' expert GEMMs on `expert_gemm`'s
// path ("per_expert" or "grouped": the process default, which the engine's layers take).
inline absl::StatusOr<std::unique_ptr<runtime::DeviceEngine>> MakeGpuEngine(
    runtime::Model<float>& host, const std::string& residual, const std::string& precision,
    const std::string& expert_gemm) {
  absl::StatusOr<runtime::cuda::ExpertGemmPath> path =
      runtime::cuda::ParseExpertGemmPath(expert_gemm, "--expert-gemm");
  if (!path.ok()) return path.status();
  runtime::cuda::SetDefaultExpertGemmPath(*path);
  rackrun::v1::JobSpec spec;
  if (!precision.empty()) spec.mutable_model()->set_precision(precision);
  spec.mutable_model()->set_residual(residual);
  runtime::DeviceEngineSetup setup;
  setup.spec = &spec;
  setup.device.kind = jobspec::DeviceSpec::Kind::kCuda;
  setup.device.index = 0;
  setup.model = &host;
  return runtime::cuda::GpuEngineFactory()(setup);
}

// A model of `shape` in residual mode `residual`, initialised with seed 1, and its GPU engine
// (MakeGpuEngine's `precision` and `expert_gemm`): what the simulator's step benches run.
struct GpuStepModel {
  std::unique_ptr<runtime::Model<float>> host;
  std::unique_ptr<runtime::DeviceEngine> engine;
};
inline absl::StatusOr<GpuStepModel> MakeGpuStepModel(const TrainStepShape& shape,
                                                     const std::string& residual,
                                                     const std::string& precision,
                                                     const std::string& expert_gemm) {
  GpuStepModel m;
  absl::StatusOr<std::unique_ptr<runtime::Model<float>>> host =
      runtime::Model<float>::Create(ModelConfigOf(shape, residual), 1);
  if (!host.ok()) return host.status();
  m.host = *std::move(host);
  absl::StatusOr<std::unique_ptr<runtime::DeviceEngine>> engine =
      MakeGpuEngine(*m.host, residual, precision, expert_gemm);
  if (!engine.ok()) return engine.status();
  m.engine = *std::move(engine);
  return m;
}

// A step's tokens: one microbatch of `shape`, uniform over its vocabulary (seed 1).
struct StepTokens {
  std::vector<int32_t> inputs, targets;
};
inline StepTokens RandomStepTokens(const TrainStepShape& shape) {
  std::mt19937 rng(1);
  std::vector<int32_t> data(static_cast<size_t>(shape.tokens()) + 1);
  for (auto& t : data) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(shape.vocab));
  return {std::vector<int32_t>(data.begin(), data.end() - 1),
          std::vector<int32_t>(data.begin() + 1, data.end())};
}

// One training step as the trainer runs it on one GPU: ZeroGrad, ForwardBackward (one
// microbatch of `batch` sequences), GradNorm (clip 1), OptimizerStep (lr 1e-3). The loss.
inline absl::StatusOr<double> EngineStep(runtime::DeviceEngine& engine, const StepTokens& tokens,
                                         int batch) {
  if (absl::Status s = engine.ZeroGrad(); !s.ok()) return s;
  absl::StatusOr<double> loss =
      engine.ForwardBackward(tokens.inputs, tokens.targets, batch, {}, 1.0f);
  if (!loss.ok()) return loss.status();
  absl::StatusOr<double> norm = engine.GradNorm(1.0);
  if (!norm.ok()) return norm.status();
  if (absl::Status s = engine.OptimizerStep(1e-3); !s.ok()) return s;
  return *loss;
}

// The --expert-gemm paths and --residual modes checked: the exit code of the flag's error,
// or nullopt when every name is known.
inline std::optional<int> CheckGpuStepFlags(const flags::FlagSet& flags,
                                            const std::vector<std::string>& expert_gemm,
                                            const std::vector<std::string>& residual) {
  for (const std::string& path : expert_gemm) {
    if (absl::Status s = runtime::cuda::ParseExpertGemmPath(path, "--expert-gemm").status();
        !s.ok())
      return flags.Fail(s);
  }
  for (const std::string& mode : residual) {
    if (absl::Status s = runtime::ParseResidualMode(mode).status(); !s.ok())
      return flags.Fail("--residual", std::string(s.message()));
  }
  return std::nullopt;
}

}  // namespace rackrun::bench

#endif  // RACKRUN_TOOLS_BENCH_GPU_STEP_H_
