#include "jobspec/device.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jobspec/spec.h"

namespace rackrun::jobspec {
namespace {

using ::testing::HasSubstr;

TEST(DeviceSpecTest, ParsesTheThreeForms) {
  absl::StatusOr<DeviceSpec> cpu = ParseDevice("cpu");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_FALSE(cpu->is_cuda());
  EXPECT_EQ(cpu->ToString(), "cpu");

  absl::StatusOr<DeviceSpec> empty = ParseDevice("");
  ASSERT_TRUE(empty.ok());
  EXPECT_FALSE(empty->is_cuda());

  absl::StatusOr<DeviceSpec> local = ParseDevice("cuda");
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_TRUE(local->is_cuda());
  EXPECT_EQ(local->index, -1);
  EXPECT_EQ(local->GpuFor(3), 3);  // the local rank's GPU
  EXPECT_EQ(local->ToString(), "cuda");

  absl::StatusOr<DeviceSpec> two = ParseDevice("cuda:2");
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->index, 2);
  EXPECT_EQ(two->GpuFor(0), 2);  // explicit: every rank of this machine on GPU 2
  EXPECT_EQ(two->ToString(), "cuda:2");
  EXPECT_EQ(ParseDevice("cuda:0")->index, 0);
}

TEST(DeviceSpecTest, BadFormsNameTheFieldAndTheChoices) {
  for (const char* bad : {"gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "cuda:+1", "cuda:1a",
                          "cuda:1.5", " cuda", "cuda:99999999999999999999"}) {
    absl::StatusOr<DeviceSpec> d = ParseDevice(bad);
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(d.status().message()), HasSubstr("resources.device: '")) << bad;
    EXPECT_THAT(std::string(d.status().message()), HasSubstr("use cpu, cuda")) << bad;
  }
  EXPECT_THAT(std::string(ParseDevice("cuda:5000").status().message()),
              HasSubstr("names GPU 5000, beyond any machine"));
}

TEST(DeviceSpecTest, SpecDefaultsToCpuAndValidatesTheField) {
  constexpr char kYaml[] = R"(
name: tiny
model: {width: 64, blocks: 1, heads: 2, seq_len: 16, residual: vanilla, moe: {experts: 4, top_k: 1}}
data: {train: t.tokens, batch_size: 2}
training: {steps: 1}
)";
  absl::StatusOr<rackrun::v1::JobSpec> spec = ParseJobSpec(kYaml, {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->resources().device(), "cpu");
  spec = ParseJobSpec(kYaml, {"resources.device=cuda:1"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->resources().device(), "cuda:1");
  spec = ParseJobSpec(kYaml, {"resources.device=cuda:one"});
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(std::string(spec.status().message()),
              HasSubstr("resources.device: 'cuda:one' has no decimal GPU index"));

  // model.precision: empty (fp32) by default; tf32 and bf16 only where a GPU computes.
  spec = ParseJobSpec(kYaml, {});
  EXPECT_EQ(spec->model().precision(), "");
  for (const char* p : {"fp32", "tf32", "bf16"}) {
    spec = ParseJobSpec(kYaml, {"resources.device=cuda", std::string("model.precision=") + p});
    EXPECT_TRUE(spec.ok()) << p << ": " << spec.status();
  }
  EXPECT_TRUE(ParseJobSpec(kYaml, {"model.precision=fp32"}).ok());
  spec = ParseJobSpec(kYaml, {"model.precision=bf16"});
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(std::string(spec.status().message()),
              HasSubstr("model.precision: bf16 is a GPU precision and this job computes on the "
                        "CPU"));
  spec = ParseJobSpec(kYaml, {"resources.device=cuda:0", "model.precision=fp16"});
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(std::string(spec.status().message()),
              HasSubstr("model.precision: unknown precision 'fp16'; choose fp32"));
}

}  // namespace
}  // namespace rackrun::jobspec
