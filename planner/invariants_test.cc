#include "planner/invariants.h"

#include <string>

#include "gtest/gtest.h"
#include "planner/plan.h"
#include "planner/planner.h"
#include "planner/quota_planner.h"

namespace rackrun::planner {
namespace {

// Expert 0 (rank 0) is hot: ultraep replicates it onto several ranks.
class InvariantsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    loads_ = LoadMatrix(domain_.ranks, domain_.experts());
    for (int s = 0; s < domain_.ranks; ++s) {
      for (int e = 0; e < domain_.experts(); ++e) loads_.at(s, e) = 10 + s + e;
      loads_.at(s, 0) = 400;
    }
    PlannerOptions options;
    options.fanout.min_destinations_for_relay = 2;  // so the base plan has a relay
    options.fanout.min_gain = 0;
    QuotaPlanner planner(domain_, options);
    absl::StatusOr<Plan> plan = planner.Solve(loads_, 0);
    ASSERT_TRUE(plan.ok());
    plan_ = *plan;
    ASSERT_GE(plan_.first[1] - plan_.first[0], 4) << "the base plan needs replicas of expert 0";
    ASSERT_TRUE(CheckPlanInvariants(domain_, loads_, plan_).ok())
        << CheckPlanInvariants(domain_, loads_, plan_);
  }

  // Fails the test unless the corrupted plan is rejected with `expected` in the message.
  void ExpectViolation(const Plan& plan, const std::string& expected,
                       const InvariantOptions& options = {}) {
    const absl::Status status = CheckPlanInvariants(domain_, loads_, plan, options);
    ASSERT_FALSE(status.ok()) << "accepted a plan that should violate: " << expected;
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(std::string(status.message()).find(expected), std::string::npos) << status;
  }

  // Index in plan_.split of (src, instance); the instance's expert must be replicated.
  size_t At(int src, int instance) const {
    const int32_t column = plan_.split_column[static_cast<size_t>(instance)];
    EXPECT_GE(column, 0) << "instance " << instance << " has no split column";
    return static_cast<size_t>(column) * static_cast<size_t>(plan_.ranks) +
           static_cast<size_t>(src);
  }

  Domain domain_{8, 2, 1};
  LoadMatrix loads_;
  Plan plan_;
};

TEST_F(InvariantsTest, TokenConservation) {
  Plan plan = plan_;
  plan.split[At(3, 1)] += 1;
  plan.quota[1] += 1;
  ExpectViolation(plan, "token conservation: source 3");
}

TEST_F(InvariantsTest, QuotaIsColumnSum) {
  Plan plan = plan_;
  plan.quota[2] += 5;
  ExpectViolation(plan, "split column sums to");
  // An unreplicated expert's instance takes all of the expert's tokens.
  plan = plan_;
  const int last = plan.num_instances() - 1;
  ASSERT_EQ(plan.split_column[static_cast<size_t>(last)], -1);
  plan.quota[static_cast<size_t>(last)] -= 1;
  ExpectViolation(plan, "but its only instance takes every source's tokens");
}

TEST_F(InvariantsTest, NonNegativeSplitAndQuota) {
  Plan plan = plan_;
  const int64_t moved = plan.split[At(2, 0)] + 1;
  plan.split[At(2, 0)] -= moved;
  plan.split[At(2, 1)] += moved;
  ExpectViolation(plan, "negative split");
  plan = plan_;
  plan.quota[1] = -1;
  ExpectViolation(plan, "negative quota");
}

TEST_F(InvariantsTest, SlotBudget) {
  // The same plan in a domain without slots.
  const Domain no_slots{8, 2, 0};
  const absl::Status status = CheckPlanInvariants(no_slots, loads_, plan_);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(std::string(status.message()).find("slot budget"), std::string::npos) << status;
  InvariantOptions unconstrained;
  unconstrained.enforce_slot_budget = false;
  EXPECT_TRUE(CheckPlanInvariants(no_slots, loads_, plan_, unconstrained).ok());
}

TEST_F(InvariantsTest, NoDuplicateInstanceOnARank) {
  Plan plan = plan_;
  plan.instances[1].rank = plan.instances[0].rank;
  ExpectViolation(plan, "two instances on rank");
}

TEST_F(InvariantsTest, DomainConfinement) {
  Plan plan = plan_;
  plan.instances[plan.first[1] - 1].rank = domain_.ranks;
  ExpectViolation(plan, "domain confinement");
}

TEST_F(InvariantsTest, MastersAtHome) {
  Plan plan = plan_;
  // Swap the masters of expert 5 (home rank 2) and expert 14 (home rank 7).
  plan.instances[static_cast<size_t>(plan.first[5])].rank = 7;
  plan.instances[static_cast<size_t>(plan.first[14])].rank = 2;
  ExpectViolation(plan, "not its home rank 2");
  InvariantOptions moved;
  moved.masters_at_home = false;
  EXPECT_TRUE(CheckPlanInvariants(domain_, loads_, plan, moved).ok())
      << CheckPlanInvariants(domain_, loads_, plan, moved);
}

TEST_F(InvariantsTest, MasterKeepsAToken) {
  Plan plan = plan_;
  // Move all of the master's tokens of source 0 ... to the first replica.
  for (int s = 0; s < domain_.ranks; ++s) {
    plan.split[At(s, 1)] += plan.split[At(s, 0)];
    plan.quota[1] += plan.split[At(s, 0)];
    plan.split[At(s, 0)] = 0;
  }
  plan.quota[0] = 0;
  EXPECT_TRUE(CheckPlanInvariants(domain_, loads_, plan).ok());
  InvariantOptions keep;
  keep.master_keeps_a_token = true;
  ExpectViolation(plan, "keeps no token", keep);
}

TEST_F(InvariantsTest, GroupingAndOrder) {
  Plan plan = plan_;
  plan.instances[1].expert = 3;
  ExpectViolation(plan, "grouping");
  plan = plan_;
  std::swap(plan.instances[1], plan.instances[2]);
  ExpectViolation(plan, "strictly ascending rank");
  plan = plan_;
  plan.instances[1].master = true;
  ExpectViolation(plan, "exactly one master");
}

TEST_F(InvariantsTest, Shapes) {
  Plan plan = plan_;
  plan.split.pop_back();
  ExpectViolation(plan, "shape: plan.split has");
  plan = plan_;
  plan.split_column.back() = 0;  // an unreplicated expert's instance has no column
  ExpectViolation(plan, "shape: plan.split_column[");
  plan = plan_;
  plan.split_column.pop_back();
  ExpectViolation(plan, "shape: plan.split_column has");
  plan = plan_;
  plan.first.pop_back();
  ExpectViolation(plan, "shape: first");
  plan = plan_;
  plan.ranks = 4;
  ExpectViolation(plan, "shape: plan is 4 ranks");
}

TEST_F(InvariantsTest, FanoutDeliversEachReplicaOnce) {
  ASSERT_FALSE(plan_.fanout.transfers.empty());
  Plan plan = plan_;
  plan.fanout.transfers.pop_back();
  ExpectViolation(plan, "receives its weights 0 times");
  plan = plan_;
  plan.fanout.transfers.push_back(plan.fanout.transfers.front());
  ExpectViolation(plan, "receives its weights 2 times");
  plan = plan_;
  plan.fanout.transfers.front().src_rank = 5;
  ExpectViolation(plan, "not the master's rank");
  plan = plan_;
  bool relayed = false;
  for (WeightTransfer& t : plan.fanout.transfers) {
    if (t.stage == 1) {
      t.src_rank = 6;  // rank 6 never receives expert 0 at stage 0
      relayed = true;
      break;
    }
  }
  ASSERT_TRUE(relayed) << "the base plan should relay";
  ExpectViolation(plan, "without receiving it at stage 0");
}

TEST_F(InvariantsTest, LoadsMustMatchTheDomain) {
  const absl::Status status = CheckPlanInvariants(domain_, LoadMatrix(8, 3), plan_);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rackrun::planner
