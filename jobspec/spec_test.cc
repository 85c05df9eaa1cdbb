#include "jobspec/spec.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jobspec/data_blend.h"

namespace rackrun::jobspec {
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

// data.blend: Megatron's --data-path form ([W1, PATH1, ...] or paths only), instead of
// data.train (issue 36).
TEST(JobSpecTest, BlendsAreMegatronsDataPathAndReplaceDataTrain) {
  absl::StatusOr<rackrun::v1::JobSpec> spec =
      ParseJobSpec(kYaml, {"data.train=", "data.blend=0.3,a,0.7,b"}, "spec.yaml");
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<std::vector<BlendItem>> blend = TrainBlendOf(spec->data());
  ASSERT_TRUE(blend.ok()) << blend.status();
  ASSERT_EQ(blend->size(), 2u);
  EXPECT_EQ((*blend)[0].weight, 0.3);
  EXPECT_EQ((*blend)[1].path, "b");
  spec = ParseJobSpec(kYaml, {"data.train=", "data.blend=a,b"}, "spec.yaml");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ((*TrainBlendOf(spec->data()))[1].weight, -1);  // by size
  EXPECT_THAT(ErrorOf(kYaml, {"data.blend=0.5,b"}),
              HasSubstr("data.blend: give the training data either as data.train or as "
                        "data.blend, not both"));
  EXPECT_THAT(ErrorOf(kYaml, {"data.train=", "data.blend=0.5,b,c"}),
              HasSubstr("data.blend: write it as Megatron's --data-path does, [W1, PATH1, W2"));
  EXPECT_THAT(ErrorOf(kYaml, {"data.train=", "data.blend=0,b,1,c"}),
              HasSubstr("data.blend[0]: the weight of 'b' is 0; weights must be positive"));
  EXPECT_THAT(ErrorOf(kYaml, {"data.validation_blend=1,v"}),
              HasSubstr("data.validation_blend: give the validation data either as "
                        "data.validation or as data.validation_blend"));
  // Every path, with its field, for whoever resolves or confines them.
  spec = ParseJobSpec(
      kYaml,
      {"data.train=", "data.blend=0.3,a,0.7,b", "data.validation=", "data.validation_blend=v1,v2"},
      "spec.yaml");
  ASSERT_TRUE(spec.ok()) << spec.status();
  std::vector<std::string> fields;
  for (const auto& [field, path] : MutableDataPaths(*spec)) fields.push_back(field + "=" + *path);
  EXPECT_THAT(fields,
              ::testing::ElementsAre("data.blend[1]=a", "data.blend[3]=b",
                                     "data.validation_blend[0]=v1", "data.validation_blend[1]=v2"));
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
  // A Megatron dataset is a prefix: PREFIX.idx beside the spec resolves it, in blends too.
  std::ofstream(dir / "brown.idx") << "x";
  spec = LoadJobSpec((dir / "spec.yaml").string(), {"data.train=", "data.blend=1,brown,1,far"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->data().blend(1), (dir / "brown").string());
  EXPECT_EQ(spec->data().blend(3), "far");
}

TEST(JobSpecTest, ExampleSpecsAreValid) {
  const std::filesystem::path examples = std::filesystem::path(RACKRUN_SOURCE_DIR) / "examples";
  absl::StatusOr<rackrun::v1::JobSpec> spec =
      LoadJobSpec((examples / "tiny-moe.yaml").string(), {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model().residual(), "xhc");
  EXPECT_EQ(spec->model().streams(), 16);
  EXPECT_EQ(spec->model().active(), 4);
  EXPECT_EQ(spec->model().moe().experts(), 16);
  EXPECT_EQ(spec->model().moe().top_k(), 2);
  // The BPE demo: the same model on SentencePiece data.
  absl::StatusOr<rackrun::v1::JobSpec> bpe =
      LoadJobSpec((examples / "tiny-moe-bpe.yaml").string(), {});
  ASSERT_TRUE(bpe.ok()) << bpe.status();
  EXPECT_EQ(bpe->data().train(), "out/corpus/brown-bpe4096/brown");
  EXPECT_EQ(bpe->model().SerializeAsString(), spec->model().SerializeAsString());
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
  EXPECT_EQ(spec->resources().channel(), "ucx");
  EXPECT_EQ(spec->restart().max_attempts(), 1);
  ASSERT_EQ(spec->restart().on_size(), 3);
  EXPECT_EQ(spec->restart().on(0), "worker_lost");
  EXPECT_EQ(spec->restart().backoff_s(), 1);

  spec =
      ParseJobSpec(std::string(kYaml) + "restart:\n  max_attempts: 3\n  on: [hang, error]\n", {});
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
  EXPECT_THAT(std::string(spec.status().message()),
              HasSubstr("restart.on: unknown failure kind 'crash'"));
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

// ---- Strict scalars and documents (issue #12) ----

TEST(JobSpecStrictnessTest, IntegersAreDecimal) {
  // YAML 1.1 (yaml-cpp's default) reads 0100 as octal 64; a spec reads it as decimal.
  absl::StatusOr<rackrun::v1::JobSpec> spec =
      ParseJobSpec(std::string(kYaml) + "\n", {"training.steps=0100"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->training().steps(), 100);
  std::string yaml = kYaml;
  yaml.replace(yaml.find("steps: 300"), 10, "steps: 0100");
  spec = ParseJobSpec(yaml, {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->training().steps(), 100);
  spec = ParseJobSpec(R"({"model": {"width": 64, "blocks": 2, "heads": 2, "seq_len": 032,
      "residual": "vanilla", "moe": {"experts": 4, "top_k": 1}},
      "data": {"train": "t.tokens"}, "training": {"steps": 5}})",
                      {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model().seq_len(), 32);
  EXPECT_THAT(ErrorOf(kYaml, {"training.steps=0x10"}),
              HasSubstr("training.steps: '0x10' is a hexadecimal, octal or binary literal"));
  EXPECT_THAT(ErrorOf(kYaml, {"training.seed=0o17"}), HasSubstr("training.seed: '0o17' is a"));
  EXPECT_THAT(ErrorOf(kYaml, {"training.steps=1e3"}),
              HasSubstr("training.steps: '1e3' is not a whole decimal number"));
  EXPECT_THAT(ErrorOf(kYaml, {"training.steps=1_000"}), HasSubstr("not a whole decimal number"));
  EXPECT_THAT(ErrorOf(kYaml, {"model.width=3000000000"}),
              HasSubstr("model.width: '3000000000' is out of range for a int32"));
  EXPECT_THAT(ErrorOf(kYaml, {"training.seed=-1"}),
              HasSubstr("training.seed: '-1' is out of range"));
  spec = ParseJobSpec(kYaml, {"training.seed=18446744073709551615", "model.width=+128"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->training().seed(), 18446744073709551615ull);
  EXPECT_THAT(ErrorOf(kYaml, {"training.lr=.inf"}),
              HasSubstr("training.lr: '.inf' is not a finite double"));
  EXPECT_THAT(ErrorOf(kYaml, {"training.lr=.nan"}),
              HasSubstr("training.lr: '.nan' is not a finite"));
}

TEST(JobSpecStrictnessTest, DuplicateKeysExtraDocumentsAndBadTextAreErrors) {
  EXPECT_THAT(ErrorOf(std::string(kYaml) + "  steps: 400\n"),
              HasSubstr("training.steps: given twice (lines 19 and 22); keep one"));
  EXPECT_THAT(ErrorOf(std::string(kYaml) + "model:\n  width: 64\n"),
              HasSubstr("model: given twice"));
  EXPECT_THAT(ErrorOf(R"({"training": {"steps": 5, "steps": 6}})"),
              HasSubstr("training.steps: given twice"));
  EXPECT_THAT(
      ErrorOf(std::string(kYaml) + "---\ntraining: {steps: 5}\n"),
      HasSubstr("spec.yaml:22: a second YAML document starts here (after a '---' or '...' line)"));
  EXPECT_THAT(ErrorOf(std::string(kYaml) + "...\ntraining: {steps: 5}\n"),
              HasSubstr("spec.yaml:23: a second YAML document starts here"));
  EXPECT_TRUE(ParseJobSpec("---\n" + std::string(kYaml) + "...\n# the end\n", {}).ok());
  // yaml-cpp's LoadAll looped forever on this (found by fuzz_job_spec): now an error.
  EXPECT_FALSE(ParseJobSpec(", \"balanmodel\": {\"width\":\n", {}).ok());
  EXPECT_THAT(ErrorOf(std::string(kYaml) + "logging: {json: \"a\\0b\"}\n"),
              HasSubstr("logging.json: the value contains a NUL byte"));
  EXPECT_THAT(ErrorOf(std::string(kYaml) + std::string("name: a\0b\n", 10)),
              HasSubstr("spec.yaml:22:8: contains a NUL byte"));
  EXPECT_THAT(ErrorOf(std::string(kYaml) + "logging: {json: a\xff"
                                           "b}\n"),
              HasSubstr("spec.yaml:22:18: not valid UTF-8 (byte 0xff)"));
  EXPECT_THAT(ErrorOf(kYaml, {"checkpoint.dir=ck\xc3"}),
              HasSubstr("checkpoint.dir: the value is not valid UTF-8 (byte 0xc3 at offset 2)"));
  EXPECT_THAT(ErrorOf(std::string(kYaml) + "? [a, b]\n: 1\n"), HasSubstr("keys are field names"));
  // Valid UTF-8 stays accepted.
  EXPECT_TRUE(
      ParseJobSpec(std::string(kYaml) + "logging: {json: \"r\xc3\xa9sum\xc3\xa9.jsonl\"}\n", {})
          .ok());
}

TEST(JobSpecStrictnessTest, DeepNestingSaysSo) {
  std::string deep = std::string(kYaml) + "logging: ";
  for (int i = 0; i < 1000; ++i) deep += "[";
  for (int i = 0; i < 1000; ++i) deep += "]";
  std::string e = ErrorOf(deep + "\n");
  EXPECT_THAT(e, HasSubstr("nested more than"));
  EXPECT_THAT(e, ::testing::Not(HasSubstr("bad file")));
  std::string moderate = "model: ";  // below yaml-cpp's guard, above any spec
  for (int i = 0; i < 40; ++i) moderate += "{a: ";
  moderate += "1" + std::string(40, '}') + "\n";
  EXPECT_THAT(ErrorOf(moderate), HasSubstr("nested more than 16 levels deep"));
}

// ---- Messages say what is wrong (issue #12) ----

TEST(JobSpecMessagesTest, NegativeIsNotMissing) {
  for (const char* field : {"model.width", "model.blocks", "model.heads", "model.seq_len",
                            "model.moe.experts", "training.steps"}) {
    const std::string e = ErrorOf(kYaml, {std::string(field) + "=-4"});
    EXPECT_THAT(e, HasSubstr(std::string(field) + ": is -4; it must be positive")) << e;
    EXPECT_THAT(e, ::testing::Not(HasSubstr("required"))) << e;
  }
  EXPECT_THAT(ErrorOf(kYaml, {"training.steps=0"}), HasSubstr("training.steps: required"));
  EXPECT_THAT(ErrorOf(kYaml, {"data.batch_size=-2"}),
              HasSubstr("data.batch_size: is -2; it must be >= 1 (0 = the default 8)"));
  EXPECT_THAT(
      ErrorOf(kYaml, {"model.moe.expert_hidden=-1"}),
      HasSubstr("model.moe.expert_hidden: is -1; it must be positive (0 = 2 x model.width)"));
  EXPECT_THAT(ErrorOf(kYaml, {"training.microbatches=-1"}),
              HasSubstr("training.microbatches: is -1"));
  EXPECT_THAT(ErrorOf(kYaml, {"logging.interval=-3"}), HasSubstr("logging.interval: is -3"));
}

TEST(JobSpecMessagesTest, RangesBlameTheRightField) {
  EXPECT_THAT(ErrorOf(kYaml, {"model.init_std=1e300"}),
              HasSubstr("model.init_std: is 1e+300; the initial weights' standard deviation must "
                        "lie in (0, 1]"));
  EXPECT_THAT(ErrorOf(kYaml, {"model.init_std=-0.1"}), HasSubstr("model.init_std: is -0.1"));
  EXPECT_THAT(ErrorOf(kYaml, {"model.rope_theta=0.5"}), HasSubstr("model.rope_theta: is 0.5"));
  EXPECT_THAT(ErrorOf(kYaml, {"model.moe.experts=128", "model.moe.top_k=65"}),
              HasSubstr("model.moe.top_k: top_k 65 exceeds 64"));
  EXPECT_THAT(ErrorOf(kYaml, {"model.residual=xhc_flash4", "model.blocks=3"}),
              HasSubstr("model.blocks: 3 blocks give 6 sublayers, not a multiple of xhc_flash4's "
                        "group of 4"));
  EXPECT_THAT(ErrorOf(kYaml, {"resources.threads=100000"}),
              HasSubstr("resources.threads: is 100000; more than 4096 threads per rank"));
  EXPECT_THAT(ErrorOf(kYaml, {"resources.device=gpu"}),
              HasSubstr("resources.device: 'gpu' is not a device; use cpu, cuda"));
  EXPECT_THAT(ErrorOf(kYaml, {"training.beta2=1"}), HasSubstr("training.beta2: is 1; it must lie"));
}

// parallelism.expert_parallel (issue 24): G ranks per domain, D = ranks / G domains; the
// coordinator's Submit sees the same errors through ValidateJobSpec when resources.ranks
// is set.
TEST(JobSpecTest, ExpertParallelDomains) {
  absl::StatusOr<rackrun::v1::JobSpec> spec =
      ParseJobSpec(kYaml, {"parallelism.expert_parallel=4"}, "spec.yaml");
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<ExpertParallelLayout> layout = ExpertParallelLayoutOf(*spec, 8);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->expert_parallel, 4);
  EXPECT_EQ(layout->data_parallel, 2);
  EXPECT_THAT(std::string(ExpertParallelLayoutOf(*spec, 6).status().message()),
              HasSubstr("parallelism.expert_parallel: 4 ranks per domain do not divide the "
                        "job's 6 ranks into whole domains; set a divisor of 6"));
  // 0 (the default): one domain of every rank, today's layout.
  absl::StatusOr<rackrun::v1::JobSpec> all = ParseJobSpec(kYaml, {}, "spec.yaml");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->parallelism().expert_parallel(), 0);
  layout = ExpertParallelLayoutOf(*all, 4);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->expert_parallel, 4);
  EXPECT_EQ(layout->data_parallel, 1);
  EXPECT_THAT(std::string(ExpertParallelLayoutOf(*all, 3).status().message()),
              HasSubstr("model.moe.experts: 16 experts cannot be split evenly over 3 ranks"));

  EXPECT_THAT(ErrorOf(kYaml, {"parallelism.expert_parallel=-1"}),
              HasSubstr("parallelism.expert_parallel: is -1; it is the ranks per expert-parallel "
                        "domain"));
  EXPECT_THAT(ErrorOf(kYaml, {"parallelism.expert_parallel=3"}),
              HasSubstr("parallelism.expert_parallel: 16 experts (model.moe.experts) cannot be "
                        "split evenly over 3 ranks per domain; set a divisor of 16"));
  // With resources.ranks known (the coordinator's Submit), the domains must tile them.
  EXPECT_THAT(ErrorOf(kYaml, {"parallelism.expert_parallel=4", "resources.ranks=6"}),
              HasSubstr("parallelism.expert_parallel: 4 ranks per domain do not divide the "
                        "job's 6 ranks"));
  // The coordinator plans each domain separately (coordinator/planning.h).
  EXPECT_TRUE(ParseJobSpec(kYaml,
                           {"parallelism.expert_parallel=2", "resources.ranks=4",
                            "balancer.mode=coordinator"},
                           "spec.yaml")
                  .ok());
  EXPECT_THAT(ErrorOf(kYaml, {"resources.ranks=3"}),
              HasSubstr("model.moe.experts: 16 experts cannot be split evenly over 3 ranks"));
  EXPECT_TRUE(
      ParseJobSpec(kYaml, {"parallelism.expert_parallel=2", "resources.ranks=8"}, "spec.yaml")
          .ok());
}

// Sizes no machine holds are refused by ValidateJobSpec, on every path.
TEST(JobMemoryTest, ImpossibleSizesAreRefusedEverywhere) {
  const std::string huge =
      ErrorOf(kYaml, {"model.vocab=2000000000", "model.width=2000000000", "model.heads=1000000000",
                      "model.moe.expert_hidden=2000000000"});
  EXPECT_THAT(huge, HasSubstr("the job would need an estimated more than 8 EiB (sizes overflow)"));
  EXPECT_THAT(huge, HasSubstr("beyond any machine"));
  EXPECT_THAT(ErrorOf(kYaml, {"model.vocab=100000000", "model.width=1000000",
                              "model.moe.expert_hidden=64"}),
              HasSubstr("model.vocab, model.width: the job would need an estimated"));
  EXPECT_THAT(ErrorOf(kYaml, {"data.batch_size=100000", "model.seq_len=100000"}),
              HasSubstr("data.batch_size: 100000 sequences x model.seq_len 100000"));
  EXPECT_THAT(ErrorOf(kYaml, {"model.width=2000000000", "model.heads=1000000000"}),
              HasSubstr("model.moe.expert_hidden: required: the default 2 x model.width"));
}

}  // namespace
}  // namespace rackrun::jobspec
