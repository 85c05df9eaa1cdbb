// The policy table (PolicyTraits) against the planners it describes: every trait a caller
// relies on is checked on the plans of the policy's own planner.
#include "planner/planner.h"

#include <cstdint>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "planner/invariants.h"
#include "planner/plan.h"

namespace rackrun::planner {
namespace {

TEST(PolicyTraitsTest, TheTableIsTheFactorysPolicies) {
  std::set<std::string_view> names;
  for (const PolicyTraits& p : Policies()) {
    EXPECT_TRUE(names.insert(p.name).second) << p.name << " is listed twice";
    EXPECT_EQ(FindPolicy(p.name), &p);
    absl::StatusOr<std::unique_ptr<Planner>> planner =
        MakePlanner(p.name, Domain{4, 2, 1}, PlannerOptions{});
    ASSERT_TRUE(planner.ok()) << p.name << ": " << planner.status();
    EXPECT_EQ((*planner)->name(), p.name);
  }
  EXPECT_EQ(FindPolicy("random"), nullptr);
  EXPECT_EQ(FindPolicy(""), nullptr);
  EXPECT_EQ(PolicyNames(), "ultraep, greedy, eplb, none, ideal");
  const PolicyTraits* ideal = FindPolicy("ideal");
  ASSERT_NE(ideal, nullptr);
  EXPECT_FALSE(ideal->invariants().enforce_slot_budget);
  EXPECT_FALSE(FindPolicy("eplb")->invariants().masters_at_home);
  EXPECT_TRUE(FindPolicy("ultraep")->invariants().masters_at_home);
}

// Loads with a hot expert that moves every microbatch, so that a policy planning from the
// current loads changes its placement and one planning from history lags behind.
LoadMatrix Loads(const Domain& domain, int64_t microbatch, std::mt19937& rng) {
  std::uniform_int_distribution<int> tokens(10, 60);
  LoadMatrix loads(domain.ranks, domain.experts());
  const int hot = static_cast<int>(microbatch * 3 % domain.experts());
  for (int s = 0; s < domain.ranks; ++s) {
    for (int e = 0; e < domain.experts(); ++e) loads.at(s, e) = tokens(rng) * (e == hot ? 12 : 1);
  }
  return loads;
}

class PolicyTraitsPlans : public ::testing::TestWithParam<std::string> {};

TEST_P(PolicyTraitsPlans, DescribeThePlannersPlans) {
  const PolicyTraits* traits = FindPolicy(GetParam());
  ASSERT_NE(traits, nullptr);
  const Domain domain{4, 3, 1};
  PlannerOptions options;
  options.eplb_window = 4;
  options.eplb_interval = 3;
  options.expert_bytes = 1000;
  absl::StatusOr<std::unique_ptr<Planner>> planner = MakePlanner(traits->name, domain, options);
  ASSERT_TRUE(planner.ok()) << planner.status();
  std::mt19937 rng(11);
  InvariantOptions strict;  // masters at home and the slot budget
  bool any_replica = false, masters_moved = false, over_budget = false, placement_changed = false,
       changed_between_replans = false;
  std::vector<ExpertInstance> previous;
  for (int64_t mb = 0; mb < 12; ++mb) {
    const LoadMatrix loads = Loads(domain, mb, rng);
    Plan plan;
    ASSERT_TRUE((*planner)->SolveInto(loads, /*layer=*/0, &plan).ok());
    // The invariants callers check this policy's plans with hold.
    EXPECT_TRUE(CheckPlanInvariants(domain, loads, plan, traits->invariants()).ok())
        << "microbatch " << mb;
    const absl::Status s = CheckPlanInvariants(domain, loads, plan, strict);
    masters_moved |= !s.ok() && s.message().find("not its home rank") != std::string::npos;
    over_budget |= !s.ok() && s.message().find("slot budget") != std::string::npos;
    any_replica |= plan.num_replicas() > 0;
    if (traits->split == TokenSplit::kMastersOnly) {
      EXPECT_EQ(plan.num_replicas(), 0);
    }
    if (mb > 0 && !(plan.instances == previous)) {
      placement_changed = true;
      // EPLB replans at microbatch 1 and every interval after it, and keeps its placement
      // in between.
      changed_between_replans |= (mb - 1) % options.eplb_interval != 0;
    }
    previous = plan.instances;
  }
  EXPECT_EQ(!(*planner)->SaveState().empty(), traits->needs_load_history);
  EXPECT_EQ(masters_moved, !traits->masters_at_home);
  EXPECT_EQ(over_budget, traits->bound);
  EXPECT_EQ(any_replica, traits->split != TokenSplit::kMastersOnly);
  EXPECT_EQ(placement_changed, traits->split != TokenSplit::kMastersOnly);
  EXPECT_EQ(changed_between_replans, traits->replanning == Replanning::kEveryMicrobatch &&
                                         traits->split != TokenSplit::kMastersOnly);
  // Only a policy that keeps replicas between replans reports re-placement bytes.
  if (!traits->resident_replicas) {
    EXPECT_EQ((*planner)->last_replacement_bytes(), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(EveryPolicy, PolicyTraitsPlans,
                         ::testing::Values("ultraep", "greedy", "eplb", "none", "ideal"));

}  // namespace
}  // namespace rackrun::planner
