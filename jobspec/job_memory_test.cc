#include "jobspec/job_memory.h"

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jobspec/spec.h"

namespace rackrun::jobspec {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// Width 128, 4 blocks, 16 experts top-2 of hidden 256, 4 sequences of 128 tokens.
constexpr char kYaml[] = R"(
model: {width: 128, blocks: 4, heads: 4, seq_len: 128, moe: {experts: 16, top_k: 2}}
data: {train: train.tokens, batch_size: 4}
training: {steps: 300}
)";

JobMemoryEstimate EstimateOf(const rackrun::v1::JobSpec& spec, int ranks = 1, int threads = 1) {
  JobMemoryInputs in;
  in.ranks = ranks;
  in.threads = threads;
  absl::StatusOr<JobMemoryEstimate> e = EstimateJobMemory(spec, in);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *e : JobMemoryEstimate{};
}

TEST(JobMemoryTest, MachineMemoryParsing) {
  const std::string meminfo =
      "MemTotal:       16314228 kB\nMemFree:         1000000 kB\nMemAvailable:    8000000 kB\n";
  MachineMemory m = ParseMachineMemory(meminfo, "max\n", "123\n");
  EXPECT_EQ(m.total, 16314228ll * 1024);
  EXPECT_EQ(m.available, 8000000ll * 1024);
  EXPECT_EQ(m.cgroup_limit, 0);
  EXPECT_EQ(m.usable(), 8000000ll * 1024);
  m = ParseMachineMemory(meminfo, "4294967296\n", "1073741824\n");  // 4 GiB limit, 1 GiB used
  EXPECT_EQ(m.usable(), 3ll << 30);
  EXPECT_THAT(m.Describe(), HasSubstr("cgroup limit 4.0 GiB"));
  // cgroup v1's "unlimited" (a page-rounded huge number) is no limit.
  m = ParseMachineMemory(meminfo, "9223372036854771712\n", "5\n");
  EXPECT_EQ(m.cgroup_limit, 0);
  const MachineMemory here = ReadMachineMemory();
  EXPECT_GT(here.total, 0);
  EXPECT_GT(here.usable(), 0);
}

TEST(JobMemoryTest, TooLargeForTheMachineNamesFieldEstimateAndMachine) {
  absl::StatusOr<rackrun::v1::JobSpec> spec = ParseJobSpec(kYaml, {"model.vocab=100000000"});
  ASSERT_TRUE(spec.ok()) << spec.status();  // fits *some* machine: refused where it runs
  const JobMemoryEstimate e = EstimateOf(*spec);
  EXPECT_GT(e.total, 100000000ll * 128 * 2 * 16);  // embedding + head, 16 bytes per parameter
  MachineMemory machine;
  machine.total = 16ll << 30;
  machine.available = 8ll << 30;
  const absl::Status s = CheckJobMemory(e, 1, machine);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  const std::string message(s.message());
  EXPECT_THAT(message, StartsWith("model.vocab, model.width: the job needs an estimated "));
  EXPECT_THAT(message, HasSubstr("but this machine has 8.0 GiB usable (MemAvailable 8.0 GiB of "
                                 "MemTotal 16.0 GiB)"));
  EXPECT_THAT(message, HasSubstr("LM-head logits [tokens x vocab]"));
  machine.available = 1ll << 40;
  EXPECT_TRUE(CheckJobMemory(e, 1, machine).ok());
  EXPECT_FALSE(CheckJobMemory(e, 100, machine).ok());  // 100 ranks on one machine
}

// A cuda job's parameters, gradients and AdamW moments (fp32: 16 bytes a parameter) against
// its GPU's memory: refused when they alone exceed it, naming the fields that size the
// largest weights, the bytes and the GPU.
TEST(JobMemoryTest, DeviceStateAgainstTheGpu) {
  absl::StatusOr<rackrun::v1::JobSpec> spec =
      ParseJobSpec(kYaml, {"model.moe.experts=64", "model.moe.expert_hidden=1024"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  const JobMemoryEstimate e = EstimateOf(*spec);
  const int64_t state = DeviceStateBytes(e);
  EXPECT_EQ(state, e.parameters + e.gradients + 8 * e.parameter_count);
  EXPECT_GE(state, 16 * e.parameter_count);
  EXPECT_TRUE(CheckDeviceMemory(e, state, "cuda:0 (test GPU)").ok());
  EXPECT_TRUE(CheckDeviceMemory(e, 0, "cuda:0 (unknown)").ok());
  const absl::Status s = CheckDeviceMemory(e, state - 1, "cuda:0 (test GPU)");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  const std::string message(s.message());
  EXPECT_THAT(message, StartsWith("model.moe.experts"));
  EXPECT_THAT(message, HasSubstr(absl::StrCat(e.parameter_count, " parameters x 16 bytes")));
  EXPECT_THAT(message, HasSubstr("more than cuda:0 (test GPU)'s"));
}

// A cuda job's host model never runs a step: its host estimate leaves the activations out
// (the CPU layout's; the GPU engine's are on the GPU), everything else as for cpu.
TEST(JobMemoryTest, ACudaJobsActivationsAreNotCountedOnTheHost) {
  absl::StatusOr<rackrun::v1::JobSpec> cpu = ParseJobSpec(kYaml, {});
  absl::StatusOr<rackrun::v1::JobSpec> gpu = ParseJobSpec(kYaml, {"resources.device=cuda"});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const JobMemoryEstimate on_cpu = EstimateOf(*cpu), on_gpu = EstimateOf(*gpu);
  EXPECT_FALSE(on_cpu.activations_on_gpu);
  EXPECT_TRUE(on_gpu.activations_on_gpu);
  EXPECT_GT(on_cpu.activations, 0);
  EXPECT_EQ(on_gpu.activations, 0);
  EXPECT_EQ(on_gpu.total, on_cpu.total - on_cpu.activations);
  EXPECT_EQ(DeviceStateBytes(on_gpu), DeviceStateBytes(on_cpu));
  EXPECT_THAT(on_gpu.Describe(), HasSubstr("activations on the GPU"));
  // Issue 35's c1024 shape (docs/failure-model.md quotes the printed figures): the host
  // estimate drops gigabytes of CPU activations the host never allocates.
  const char* c1024 =
      "model: {vocab: 256, width: 1024, blocks: 4, heads: 16, seq_len: 1024, residual: xhc,\n"
      "        moe: {experts: 64, top_k: 4, expert_hidden: 1024}}\n"
      "data: {train: train.tokens, batch_size: 8}\ntraining: {steps: 10}\n";
  cpu = ParseJobSpec(c1024, {});
  gpu = ParseJobSpec(c1024, {"resources.device=cuda"});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const JobMemoryEstimate big_cpu = EstimateOf(*cpu, 1, 16), big_gpu = EstimateOf(*gpu, 1, 16);
  std::printf("c1024 on cpu: %s\nc1024 on cuda: %s; on the GPU at least %s\n",
              big_cpu.Describe().c_str(), big_gpu.Describe().c_str(),
              FormatBytes(DeviceStateBytes(big_gpu)).c_str());
  EXPECT_GT(big_cpu.activations, int64_t{12} << 30);
  EXPECT_EQ(big_gpu.total, big_cpu.total - big_cpu.activations);
}

TEST(JobMemoryTest, ExpertParallelEstimateIsPerRank) {
  absl::StatusOr<rackrun::v1::JobSpec> spec =
      ParseJobSpec(kYaml, {"model.moe.experts=64", "model.moe.expert_hidden=1024"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  const JobMemoryEstimate one = EstimateOf(*spec, 1), four = EstimateOf(*spec, 4);
  EXPECT_LT(four.parameters, one.parameters / 2);  // experts dominate and are sharded
  EXPECT_GT(four.expert_slots, 0);                 // but replica slots are added
  EXPECT_EQ(one.expert_slots, 0);
  EXPECT_THAT(four.Describe(), HasSubstr("per rank"));
}

}  // namespace
}  // namespace rackrun::jobspec
