#include "runtime/spec.h"
#include "runtime/job_config.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::runtime {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr char kYaml[] = R"(
name: tiny
model:
  width: 128
  blocks: 4
  heads: 4
  seq_len: 128
  residual: xhc
  streams: 16
  active: 4
  moe:
    experts: 16
    top_k: 2
data:
  train: train.tokens
  validation: val.tokens
  batch_size: 4
training:
  steps: 300
  lr: 0.003
  seed: 7
)";

std::string ErrorOf(const std::string& text, const std::vector<std::string>& overrides = {}) {
  absl::StatusOr<rackrun::v1::JobSpec> spec = ParseJobSpec(text, overrides, "spec.yaml");
  EXPECT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(spec.status().message());
}

TEST(JobSpecTest, ParsesYamlAndFillsDefaults) {
  absl::StatusOr<rackrun::v1::JobSpec> spec = ParseJobSpec(kYaml, {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model().moe().top_k(), 2);
  EXPECT_EQ(spec->model().fixed(), 2);
  EXPECT_EQ(spec->model().moe().expert_hidden(), 256);
  EXPECT_EQ(spec->training().seed(), 7u);
  EXPECT_DOUBLE_EQ(spec->training().min_lr(), 0.0003);
  EXPECT_EQ(spec->training().warmup_steps(), 15);
  EXPECT_DOUBLE_EQ(spec->training().weight_decay(), 0.1);
  EXPECT_EQ(spec->balancer().policy(), "none");
  EXPECT_EQ(spec->checkpoint().keep(), 2);
  const TrainConfig c = TrainConfigFromSpec(*spec);
  EXPECT_EQ(c.seq_len, 128);
  EXPECT_EQ(c.batch_size, 4);
  EXPECT_DOUBLE_EQ(c.schedule.lr, 0.003);
  EXPECT_TRUE(c.schedule.cosine);
}

TEST(JobSpecTest, ExplicitZeroKeepsOptionalFields) {
  absl::StatusOr<rackrun::v1::JobSpec> spec =
      ParseJobSpec(kYaml, {"training.weight_decay=0", "training.grad_clip=0",
                           "training.warmup_steps=0", "balancer.slots=0"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->balancer().slots(), 0);  // no replica slots, not the default 2
  EXPECT_EQ(spec->training().weight_decay(), 0);
  EXPECT_EQ(spec->training().grad_clip(), 0);
  EXPECT_EQ(spec->training().warmup_steps(), 0);
}

TEST(JobSpecTest, SharedSlotsDefaultFollowsThePolicy) {
  for (const auto& [policy, shared] : std::vector<std::pair<std::string, bool>>{
           {"ultraep", true}, {"none", true}, {"eplb", false}}) {
    absl::StatusOr<rackrun::v1::JobSpec> spec = ParseJobSpec(kYaml, {"balancer.policy=" + policy});
    ASSERT_TRUE(spec.ok()) << spec.status();
    EXPECT_EQ(spec->balancer().shared_slots(), shared) << policy;
  }
  absl::StatusOr<rackrun::v1::JobSpec> spec =
      ParseJobSpec(kYaml, {"balancer.policy=ultraep", "balancer.shared_slots=false"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_FALSE(spec->balancer().shared_slots());
}

TEST(JobSpecTest, JsonIsAcceptedToo) {
  const std::string json = R"({"model": {"width": 64, "blocks": 2, "heads": 2, "seq_len": 32,
      "residual": "vanilla", "moe": {"experts": 4, "top_k": 1}},
      "data": {"train": "t.tokens"}, "training": {"steps": 5}})";
  absl::StatusOr<rackrun::v1::JobSpec> spec = ParseJobSpec(json, {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model().streams(), 1);
  EXPECT_EQ(spec->model().moe().top_k(), 1);
}

TEST(JobSpecTest, OverridesWinAndCanCreateSections) {
  absl::StatusOr<rackrun::v1::JobSpec> spec =
      ParseJobSpec(kYaml, {"training.steps=50", "model.moe.top_k=4", "checkpoint.dir=/tmp/x",
                           "balancer.policy=ultraep"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->training().steps(), 50);
  EXPECT_EQ(spec->model().moe().top_k(), 4);
  EXPECT_EQ(spec->checkpoint().dir(), "/tmp/x");
  EXPECT_EQ(spec->balancer().policy(), "ultraep");
}

TEST(JobSpecTest, UnknownFieldNamesTheFullPathAndSuggests) {
  const std::string e = ErrorOf(std::string(kYaml) + "\n", {"model.moe.topk=3"});
  EXPECT_THAT(e, HasSubstr("model.moe.topk: unknown field"));
  EXPECT_THAT(e, HasSubstr("did you mean 'top_k'"));
  EXPECT_THAT(ErrorOf("trainer:\n  steps: 3\n"), HasSubstr("trainer: unknown field"));
}

TEST(JobSpecTest, ImpossibleShapesNameTheFieldAndTheFix) {
  EXPECT_THAT(ErrorOf(kYaml, {"model.heads=3"}),
              HasSubstr("model.heads: model.width 128 is not divisible by heads 3"));
  EXPECT_THAT(ErrorOf(kYaml, {"model.moe.top_k=17"}),
              HasSubstr("model.moe.top_k: top_k 17 must lie in [1, experts = 16]"));
  EXPECT_THAT(ErrorOf(kYaml, {"model.active=20"}),
              HasSubstr("model.active: active streams k = 20 must lie in [1, streams N = 16]"));
  EXPECT_THAT(ErrorOf(kYaml, {"model.fixed=5"}), HasSubstr("model.fixed:"));
  EXPECT_THAT(ErrorOf(kYaml, {"model.residual=vanilla"}), HasSubstr("model.streams:"));
  EXPECT_THAT(ErrorOf(kYaml, {"model.residual=xhx"}), HasSubstr("choose vanilla, hc, mhc"));
  EXPECT_THAT(ErrorOf(kYaml, {"balancer.policy=greedy"}), HasSubstr("balancer.policy:"));
  EXPECT_THAT(ErrorOf(kYaml, {"checkpoint.keep=1"}), HasSubstr("checkpoint.keep:"));
}

TEST(JobSpecTest, MissingRequiredFieldsAndBadValues) {
  EXPECT_THAT(ErrorOf("model: {width: 64}\n"), HasSubstr("model.blocks: required"));
  EXPECT_THAT(ErrorOf(kYaml, {"data.train="}), HasSubstr("data.train: required"));
  EXPECT_THAT(ErrorOf(kYaml, {"training.steps=many"}),
              HasSubstr("training.steps: 'many' is not a valid int64 value"));
  EXPECT_THAT(ErrorOf(kYaml, {"training.seed=-1"}), HasSubstr("training.seed:"));
  EXPECT_THAT(ErrorOf(kYaml, {"model=3"}), HasSubstr("model: expected a mapping"));
  EXPECT_THAT(ErrorOf(kYaml, {"steps"}), HasSubstr("expected FIELD=VALUE"));
  EXPECT_THAT(ErrorOf("model: [1, 2\n"), StartsWith("spec.yaml:"));
}

TEST(JobSpecTest, MissingFileIsAnInvalidArgumentNamingIt) {
  absl::StatusOr<rackrun::v1::JobSpec> spec = LoadJobSpec("/nonexistent/spec.yaml", {});
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(spec.status().message(), HasSubstr("/nonexistent/spec.yaml"));
}

TEST(JobSpecTest, DataPathsResolveBesideTheSpecFile) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "spec_test";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "train.tokens") << "x";
  std::ofstream(dir / "spec.yaml") << kYaml;
  absl::StatusOr<rackrun::v1::JobSpec> spec = LoadJobSpec((dir / "spec.yaml").string(), {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->data().train(), (dir / "train.tokens").string());
  EXPECT_EQ(spec->data().validation(), "val.tokens");  // not beside the spec: unchanged
}

TEST(JobSpecTest, ExampleSpecsAreValid) {
  const std::filesystem::path examples =
      std::filesystem::path(__FILE__).parent_path().parent_path() / "examples";
  absl::StatusOr<rackrun::v1::JobSpec> spec =
      LoadJobSpec((examples / "tiny-moe.yaml").string(), {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model().residual(), "xhc");
  EXPECT_EQ(spec->model().streams(), 16);
  EXPECT_EQ(spec->model().active(), 4);
  EXPECT_EQ(spec->model().moe().experts(), 16);
  EXPECT_EQ(spec->model().moe().top_k(), 2);
  // The comparison script's overrides give valid specs for every mode.
  for (const char* mode : {"vanilla", "hc", "mhc", "xhc", "xhc_flash", "xhc_flash4"}) {
    spec = LoadJobSpec((examples / "tiny-moe.yaml").string(),
                       {std::string("model.residual=") + mode, "model.streams=0", "model.active=0",
                        "model.fixed=0"});
    EXPECT_TRUE(spec.ok()) << mode << ": " << spec.status();
  }
}

TEST(JobSpecTest, RestartPolicyAndChannel) {
  absl::StatusOr<rackrun::v1::JobSpec> spec = ParseJobSpec(kYaml, {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->resources().channel(), "gloo");
  EXPECT_EQ(spec->restart().max_attempts(), 1);
  ASSERT_EQ(spec->restart().on_size(), 3);
  EXPECT_EQ(spec->restart().on(0), "worker_lost");
  EXPECT_EQ(spec->restart().backoff_s(), 1);

  spec = ParseJobSpec(std::string(kYaml) + "restart:\n  max_attempts: 3\n  on: [hang, error]\n",
                      {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->restart().max_attempts(), 3);
  ASSERT_EQ(spec->restart().on_size(), 2);
  EXPECT_EQ(spec->restart().on(1), "error");

  spec = ParseJobSpec(kYaml, {"restart.on=worker_lost, hang"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_EQ(spec->restart().on_size(), 2);
  EXPECT_EQ(spec->restart().on(1), "hang");

  spec = ParseJobSpec(kYaml, {"restart.on=worker_lost,crash"});
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("restart.on: unknown failure kind 'crash'"));
  spec = ParseJobSpec(kYaml, {"resources.channel=mpi"});
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("resources.channel"));
  spec = ParseJobSpec(kYaml, {"restart.max_attempts=-1"});
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("restart.max_attempts"));
}

TEST(JobSpecTest, PathsMadeAbsolute) {
  absl::StatusOr<rackrun::v1::JobSpec> spec =
      ParseJobSpec(kYaml, {"checkpoint.dir=out/ck", "logging.json=/abs/log.jsonl"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  const std::string train = spec->data().train();
  MakeSpecPathsAbsolute(*spec, "/home/u/run");
  EXPECT_EQ(spec->checkpoint().dir(), "/home/u/run/out/ck");
  EXPECT_EQ(spec->logging().json(), "/abs/log.jsonl");
  if (!train.empty() && train[0] != '/') {
    EXPECT_EQ(spec->data().train(), "/home/u/run/" + train);
  }
  EXPECT_TRUE(spec->logging().load_trace().empty());  // empty stays empty
}

TEST(JobSpecTest, JsonDumpRoundTrips) {
  absl::StatusOr<rackrun::v1::JobSpec> spec = ParseJobSpec(kYaml, {});
  ASSERT_TRUE(spec.ok());
  absl::StatusOr<rackrun::v1::JobSpec> again = ParseJobSpec(JobSpecToJson(*spec), {});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->SerializeAsString(), spec->SerializeAsString());
}

}  // namespace
}  // namespace rackrun::runtime
