#include "jobspec/balancer.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jobspec/spec.h"
#include "runtime/job_config.h"
#include "runtime/model.h"

namespace rackrun::jobspec {
namespace {

using ::testing::HasSubstr;

constexpr char kYaml[] = R"(
model:
  width: 32
  blocks: 2
  heads: 2
  seq_len: 16
  vocab: 64
  moe:
    experts: 8
    top_k: 2
    expert_hidden: 48
data:
  train: train.tokens
training:
  steps: 10
balancer:
  slots: 3
  eps: 0.02
  min_replica_tokens: 4
  locality: false
  eplb_window: 5
  eplb_interval: 7
)";

rackrun::v1::JobSpec Spec(const std::vector<std::string>& overrides) {
  absl::StatusOr<rackrun::v1::JobSpec> spec = jobspec::ParseJobSpec(kYaml, overrides);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

TEST(BalancerTest, TrainingPolicyChoicesListTheDefaultFirst) {
  EXPECT_EQ(TrainingPolicyChoices(), "none, ultraep or eplb");
  // The spec offers exactly these, and names them when refusing another.
  for (const planner::PolicyTraits& p : planner::Policies()) {
    const std::string name(p.name);
    absl::StatusOr<rackrun::v1::JobSpec> spec =
        jobspec::ParseJobSpec(kYaml, {"balancer.policy=" + name});
    EXPECT_EQ(spec.ok(), p.for_training) << p.name;
    if (!spec.ok()) {
      EXPECT_EQ(spec.status().message(), absl::StrCat("<string>: balancer.policy: unknown policy '",
                                                      name, "'; choose none, ultraep or eplb"));
    }
  }
}

// The modes' table: the default first, every name found, and what a spec reads as.
TEST(BalancerTest, ModesAreKnownInOneTable) {
  ASSERT_FALSE(BalancerModes().empty());
  EXPECT_EQ(BalancerModes()[0].name, kDefaultBalancerMode);
  for (const BalancerModeTraits& m : BalancerModes()) EXPECT_EQ(FindBalancerMode(m.name), &m);
  EXPECT_EQ(FindBalancerMode(""), nullptr);
  EXPECT_EQ(FindBalancerMode("rack"), nullptr);
  EXPECT_EQ(BalancerModeChoices(), "inband or coordinator");

  EXPECT_EQ(BalancerModeOf(Spec({})), BalancerMode::kInBand);  // the default applied
  EXPECT_FALSE(PlannedByCoordinator(Spec({})));
  EXPECT_EQ(BalancerModeOf(Spec({"balancer.mode=coordinator"})), BalancerMode::kCoordinator);
  EXPECT_TRUE(PlannedByCoordinator(Spec({"balancer.mode=coordinator"})));
  rackrun::v1::JobSpec unset = Spec({});
  unset.mutable_balancer()->clear_mode();  // as a spec before its defaults
  EXPECT_EQ(BalancerModeOf(unset), BalancerMode::kInBand);

  absl::StatusOr<rackrun::v1::JobSpec> bad = jobspec::ParseJobSpec(kYaml, {"balancer.mode=rack"});
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("balancer.mode: unknown mode 'rack'; choose inband or coordinator"));
}

TEST(BalancerTest, SetupOfASpec) {
  const rackrun::v1::JobSpec spec = Spec({"balancer.policy=ultraep"});
  EXPECT_EQ(spec.balancer().policy(), "ultraep");
  absl::StatusOr<BalancerSetup> s = BalancerSetupOf(spec, 4);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->domain.ranks, 4);
  EXPECT_EQ(s->domain.masters_per_rank, 2);
  EXPECT_EQ(s->domain.slots_per_rank, 3);
  ASSERT_NE(s->policy, nullptr);
  EXPECT_EQ(s->policy->name, "ultraep");
  EXPECT_DOUBLE_EQ(s->planner.eps, 0.02);
  EXPECT_EQ(s->planner.min_replica_tokens, 4);
  EXPECT_FALSE(s->planner.locality_aware_split);
  EXPECT_EQ(s->planner.eplb_window, 5);
  EXPECT_EQ(s->planner.eplb_interval, 7);
  EXPECT_EQ(s->planner.expert_bytes, 3 * 32 * 48 * 4);
  EXPECT_TRUE(s->invariants.masters_at_home);
  EXPECT_TRUE(s->invariants.enforce_slot_budget);
  EXPECT_TRUE(s->shared_slots);  // the spec's default for ultraep
}

TEST(BalancerTest, EplbKeepsSlotsPerLayerAndMovesMasters) {
  absl::StatusOr<BalancerSetup> s = BalancerSetupOf(Spec({"balancer.policy=eplb"}), 2);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->policy->name, "eplb");
  EXPECT_FALSE(s->invariants.masters_at_home);
  EXPECT_FALSE(s->shared_slots);
  // The spec's choice wins over the policy's default.
  s = BalancerSetupOf(Spec({"balancer.policy=eplb", "balancer.shared_slots=true"}), 2);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->shared_slots);
  s = BalancerSetupOf(Spec({}), 2);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->policy->name, kDefaultBalancerPolicy);
}

// The coordinator plans with this expert size and the runtime's experts hold it: the two
// must agree, or coordinator-mode fan-out schedules would differ from in-band ones.
TEST(BalancerTest, ExpertBytesAreTheModelsExpertWeights) {
  const rackrun::v1::JobSpec spec = Spec({});
  absl::StatusOr<BalancerSetup> s = BalancerSetupOf(spec, 1);
  ASSERT_TRUE(s.ok()) << s.status();
  absl::StatusOr<std::unique_ptr<runtime::Model<float>>> model =
      runtime::Model<float>::Create(runtime::ModelConfigFromSpec(spec), 1);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(s->planner.expert_bytes,
            (*model)->moe(0).experts().expert_floats() * static_cast<int64_t>(sizeof(float)));
}

TEST(BalancerTest, ErrorsNameTheField) {
  const rackrun::v1::JobSpec spec = Spec({});
  absl::StatusOr<BalancerSetup> s = BalancerSetupOf(spec, 3);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.status().message(),
            "model.moe.experts: 8 experts cannot be sharded over 3 ranks; use a multiple of "
            "resources.ranks");
  rackrun::v1::JobSpec unknown = spec;
  unknown.mutable_balancer()->set_policy("greedy2");
  s = BalancerSetupOf(unknown, 2);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(),
              HasSubstr("balancer.policy: unknown planner policy 'greedy2'; valid policies: "
                        "ultraep, greedy, eplb, none, ideal"));
  rackrun::v1::JobSpec negative = spec;
  negative.mutable_balancer()->set_slots(-1);
  s = BalancerSetupOf(negative, 2);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr("slots_per_rank"));
}

}  // namespace
}  // namespace rackrun::jobspec
