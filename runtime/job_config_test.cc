// The settings the runtime takes from a spec (job_config.h), and the memory estimate
// (jobspec/job_memory.h: EstimateJobMemory) against what the runtime really allocates: the
// model's parameter count, and the resident memory that building the model, AdamW's state
// and one microbatch's forward + backward take. Here, not beside the estimate, because it
// builds models (the jobspec module does not link the runtime).
#include "runtime/job_config.h"

#include <malloc.h>
#include <omp.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jobspec/job_memory.h"
#include "jobspec/spec.h"
#include "runtime/cuda/device_probe.h"
#include "runtime/model.h"
#include "runtime/optimizer.h"

namespace rackrun::runtime {
namespace {

using jobspec::EstimateJobMemory;
using jobspec::FormatBytes;
using jobspec::JobMemoryEstimate;
using jobspec::ParseJobSpec;

// Width 128, 4 blocks of xhc (16 streams, 4 active), 16 experts top-2; every case below
// overrides what it measures.
constexpr char kYaml[] =
    "model: {width: 128, blocks: 4, heads: 4, seq_len: 128, residual: xhc, streams: 16,\n"
    "        active: 4, moe: {experts: 16, top_k: 2}}\n"
    "data: {train: train.tokens, validation: val.tokens, batch_size: 4}\n"
    "training: {steps: 300, lr: 0.003, seed: 7}\n";

TEST(JobConfigTest, TrainConfigFromTheDefaultedSpec) {
  absl::StatusOr<rackrun::v1::JobSpec> spec = ParseJobSpec(kYaml, {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  const TrainConfig c = TrainConfigFromSpec(*spec);
  EXPECT_EQ(c.seq_len, 128);
  EXPECT_EQ(c.batch_size, 4);
  EXPECT_DOUBLE_EQ(c.schedule.lr, 0.003);
  EXPECT_TRUE(c.schedule.cosine);
}

// resources.device: cpu passes; cuda fails before anything is allocated, with the cause
// named, on a machine without a usable GPU (or a build without the GPU engine): the probe's
// reason. On one with a GPU, every residual mode passes (the GPU engine runs them all).
TEST(JobConfigTest, DeviceIsCheckedWhereTheJobStarts) {
  absl::StatusOr<rackrun::v1::JobSpec> spec = ParseJobSpec(kYaml, {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(CheckJobDevice(*spec, 1).ok());
  for (const char* device : {"cuda", "cuda:0", "cuda:7"}) {
    spec = ParseJobSpec(kYaml, {std::string("resources.device=") + device});
    ASSERT_TRUE(spec.ok()) << spec.status();
    const absl::Status s = CheckJobDevice(*spec, 1);
    ASSERT_FALSE(s.ok()) << device;
    EXPECT_THAT(std::string(s.message()), ::testing::StartsWith("resources.device: ")) << s;
    absl::StatusOr<std::vector<cuda::GpuInfo>> gpus = cuda::VisibleGpus();
    if (!gpus.ok()) {
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
      EXPECT_EQ(s.message(), gpus.status().message());  // the probe's cause, as is
    } else if (std::string(device) == "cuda:7" && gpus->size() <= 7) {
      EXPECT_THAT(std::string(s.message()),
                  ::testing::HasSubstr("names GPU 7, but this machine has"));
    } else {
      continue;  // a GPU the engine runs on: the mode decides (below)
    }
    // CheckJobFitsThisMachine asks first.
    absl::StatusOr<JobMemoryEstimate> fits = CheckJobFitsThisMachine(*spec, 1, 1, 0);
    ASSERT_FALSE(fits.ok());
    EXPECT_EQ(fits.status(), s);
  }
}

TEST(JobConfigTest, GpuResidualModesAreCheckedWhereTheJobStarts) {
  if (!cuda::VisibleGpus().ok()) GTEST_SKIP() << "no GPU here: the probe refuses first";
  for (const std::vector<std::string>& overrides :
       {std::vector<std::string>{"resources.device=cuda:0"},
        std::vector<std::string>{"resources.device=cuda:0", "model.residual=vanilla",
                                 "model.streams=1", "model.active=0"},
        std::vector<std::string>{"resources.device=cuda:0", "model.residual=mhc", "model.streams=4",
                                 "model.active=0", "model.fixed=0"},
        std::vector<std::string>{"resources.device=cuda:0", "model.residual=hc", "model.streams=4",
                                 "model.active=0", "model.fixed=0"},
        std::vector<std::string>{"resources.device=cuda:0", "model.residual=xhc_flash"},
        std::vector<std::string>{"resources.device=cuda:0", "model.residual=xhc_flash4"}}) {
    absl::StatusOr<rackrun::v1::JobSpec> spec = ParseJobSpec(kYaml, overrides);
    ASSERT_TRUE(spec.ok()) << spec.status();
    EXPECT_TRUE(CheckJobDevice(*spec, 1).ok()) << spec->model().residual();
  }
}

// Runs without a GPU: the list of modes is the engine's, not the machine's.
TEST(JobConfigTest, GpuResidualModesAreNamed) {
  EXPECT_TRUE(cuda::CheckGpuResidualMode("vanilla").ok());
  EXPECT_TRUE(cuda::CheckGpuResidualMode("xhc").ok());
  EXPECT_TRUE(cuda::CheckGpuResidualMode("xhc_flash").ok());
  EXPECT_TRUE(cuda::CheckGpuResidualMode("xhc_flash4").ok());
  EXPECT_TRUE(cuda::CheckGpuResidualMode("mhc").ok());
  EXPECT_TRUE(cuda::CheckGpuResidualMode("hc").ok());
  for (const char* mode : {"hyper"}) {
    const absl::Status s = cuda::CheckGpuResidualMode(mode);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << mode;
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr(std::string("mode ") + mode + " "));
  }
}

// The estimate counts the parameters the model actually allocates, for every residual
// mode, a shared expert, and an expert shard of an expert-parallel rank.
TEST(JobMemoryTest, ParameterCountMatchesTheModel) {
  struct Case {
    std::vector<std::string> overrides;
    int ranks;
  };
  const std::vector<Case> cases = {
      {{"model.residual=vanilla", "model.streams=0", "model.active=0", "model.fixed=0"}, 1},
      {{"model.residual=hc", "model.streams=0", "model.active=0", "model.fixed=0"}, 1},
      {{"model.residual=mhc", "model.streams=0", "model.active=0", "model.fixed=0"}, 1},
      {{"model.residual=xhc"}, 1},
      {{"model.residual=xhc_flash"}, 1},
      {{"model.residual=xhc_flash", "model.blocks=3"}, 1},
      {{"model.residual=xhc_flash4"}, 1},
      {{"model.moe.shared_expert=true", "model.moe.shared_hidden=48"}, 1},
      {{"model.residual=xhc"}, 4},
  };
  for (const Case& c : cases) {
    std::vector<std::string> overrides = {"model.vocab=300", "model.width=32", "model.heads=2",
                                          "model.seq_len=16", "model.moe.expert_hidden=40"};
    overrides.insert(overrides.end(), c.overrides.begin(), c.overrides.end());
    absl::StatusOr<rackrun::v1::JobSpec> spec = ParseJobSpec(kYaml, overrides);
    ASSERT_TRUE(spec.ok()) << spec.status();
    ModelConfig mc = ModelConfigFromSpec(*spec);
    mc.expert_ranks = c.ranks;
    absl::StatusOr<std::unique_ptr<Model<float>>> model = Model<float>::Create(mc, 1);
    ASSERT_TRUE(model.ok()) << model.status();
    absl::StatusOr<JobMemoryEstimate> e = EstimateJobMemory(*spec, {.ranks = c.ranks});
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(e->parameter_count, (*model)->ParameterCount())
        << absl::StrJoin(c.overrides, " ") << " ranks " << c.ranks;
  }
}

int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// The estimate against what the process really holds: resident memory grown by building
// the model, AdamW's state and one microbatch's forward + backward (everything but the
// process overhead, the token files and the loader's batch, which this test does not have).
TEST(JobMemoryTest, EstimateIsCloseToMeasuredResidentMemory) {
  const std::vector<std::vector<std::string>> configs = {
      // Vocabulary-dominated: embedding, LM head and logits.
      {"model.vocab=30000", "model.width=64", "model.heads=2", "model.blocks=1",
       "model.residual=vanilla", "model.streams=0", "model.active=0", "model.fixed=0",
       "model.seq_len=64", "data.batch_size=8"},
      // Activation-dominated: xhc streams, attention probabilities, expert hidden states.
      {"model.vocab=257", "model.width=128", "model.heads=4", "model.blocks=2", "model.seq_len=256",
       "data.batch_size=8", "model.moe.experts=8", "model.moe.top_k=2"},
      // mhc saves every sublayer's input state.
      {"model.vocab=257", "model.width=64", "model.heads=2", "model.blocks=2", "model.residual=mhc",
       "model.streams=0", "model.active=0", "model.fixed=0", "model.seq_len=128",
       "data.batch_size=16"},
  };
  omp_set_num_threads(1);
  // A fixed mmap threshold: every large tensor is its own mapping, returned on free, so
  // one configuration's freed memory does not hide the next one's growth.
  mallopt(M_MMAP_THRESHOLD, 256 * 1024);
  for (const std::vector<std::string>& overrides : configs) {
    malloc_trim(0);
    absl::StatusOr<rackrun::v1::JobSpec> spec = ParseJobSpec(kYaml, overrides);
    ASSERT_TRUE(spec.ok()) << spec.status();
    absl::StatusOr<JobMemoryEstimate> estimate =
        EstimateJobMemory(*spec, {.ranks = 1, .threads = 1});
    ASSERT_TRUE(estimate.ok()) << estimate.status();
    const JobMemoryEstimate& e = *estimate;
    const int64_t expected = e.parameters + e.gradients + e.optimizer + e.activations;
    const int64_t before = ResidentBytes();
    {
      absl::StatusOr<std::unique_ptr<Model<float>>> model =
          Model<float>::Create(ModelConfigFromSpec(*spec), 1);
      ASSERT_TRUE(model.ok()) << model.status();
      std::vector<OptimizedTensor> tensors;
      for (const ParamRef<float>& p : (*model)->Parameters()) {
        tensors.push_back({p.name, p.value, p.grad, p.size, true});
      }
      AdamW adam(AdamWConfig{}, std::move(tensors));
      const int batch = spec->data().batch_size(), seq = spec->model().seq_len();
      std::vector<int32_t> inputs(static_cast<size_t>(batch) * seq), targets(inputs.size());
      for (size_t i = 0; i < inputs.size(); ++i) {
        inputs[i] = static_cast<int32_t>((i * 7919) % static_cast<size_t>(spec->model().vocab()));
        targets[i] =
            static_cast<int32_t>((i * 104729) % static_cast<size_t>(spec->model().vocab()));
      }
      absl::StatusOr<double> loss = (*model)->ForwardBackward(inputs, targets, batch, {}, 1.0f);
      ASSERT_TRUE(loss.ok()) << loss.status();
      adam.Step(1e-3);
      const int64_t measured = ResidentBytes() - before;
      const double ratio = static_cast<double>(expected) / static_cast<double>(measured);
      std::printf("estimate %s, measured resident growth %s, ratio %.3f (%s)\n",
                  FormatBytes(expected).c_str(), FormatBytes(measured).c_str(), ratio,
                  absl::StrJoin(overrides, " ").c_str());
      EXPECT_GT(ratio, 0.85) << absl::StrJoin(overrides, " ");
      EXPECT_LT(ratio, 1.25) << absl::StrJoin(overrides, " ");
    }
  }
}

}  // namespace
}  // namespace rackrun::runtime
