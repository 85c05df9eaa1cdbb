#include "planner/plan.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "planner/baseline_planners.h"
#include "planner/invariants.h"
#include "planner/planner.h"

namespace rackrun::planner {
namespace {

std::string MessageOf(const absl::Status& status) { return std::string(status.message()); }

TEST(DomainTest, ValidateNamesTheField) {
  EXPECT_TRUE((Domain{4, 2, 0}.Validate().ok()));
  EXPECT_EQ(
      MessageOf((Domain{4, 2, -1}.Validate())).find("domain.slots_per_rank must be >= 0, got -1"),
      0u);
  EXPECT_NE(MessageOf((Domain{0, 2, 1}.Validate())).find("domain.ranks must be > 0, got 0"),
            std::string::npos);
  EXPECT_NE(MessageOf((Domain{4, 0, 1}.Validate())).find("domain.masters_per_rank"),
            std::string::npos);
  EXPECT_EQ((Domain{4, 0, 1}.Validate().code()), absl::StatusCode::kInvalidArgument);
  const Domain d{4, 3, 2};
  EXPECT_EQ(d.experts(), 12);
  EXPECT_EQ(d.home_rank(7), 2);
  EXPECT_EQ(d.capacity_per_rank(), 5);
}

TEST(LoadMatrixTest, TotalsAndHomeLoads) {
  LoadMatrix loads(2, 4);
  loads.at(0, 0) = 1;
  loads.at(0, 3) = 2;
  loads.at(1, 0) = 3;
  loads.at(1, 2) = 4;
  EXPECT_EQ(loads.ExpertTotals(), (std::vector<int64_t>{4, 0, 4, 2}));
  EXPECT_EQ(loads.Total(), 10);
  EXPECT_EQ(HomeRankLoads(Domain{2, 2, 1}, loads), (std::vector<int64_t>{4, 6}));
}

TEST(LoadMatrixTest, ValidateLoadsNamesTheProblem) {
  const Domain domain{2, 2, 1};
  EXPECT_TRUE(ValidateLoads(domain, LoadMatrix(2, 4)).ok());
  EXPECT_NE(MessageOf(ValidateLoads(domain, LoadMatrix(3, 4))).find("loads.ranks is 3"),
            std::string::npos);
  EXPECT_NE(MessageOf(ValidateLoads(domain, LoadMatrix(2, 5))).find("loads.experts is 5"),
            std::string::npos);
  LoadMatrix bad(2, 4);
  bad.counts.pop_back();
  EXPECT_NE(MessageOf(ValidateLoads(domain, bad)).find("loads.counts has 7 entries"),
            std::string::npos);
  LoadMatrix negative(2, 4);
  negative.at(1, 2) = -1;
  EXPECT_NE(MessageOf(ValidateLoads(domain, negative)).find("loads[1][2] = -1"), std::string::npos);
  EXPECT_EQ(ValidateLoads(Domain{2, 2, -3}, LoadMatrix(2, 4)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LoadMatrixTest, ValidatedExpertTotalsChecksAndSumsInOnePass) {
  const Domain domain{2, 2, 1};
  LoadMatrix loads(2, 4);
  for (int s = 0; s < 2; ++s) {
    for (int e = 0; e < 4; ++e) loads.at(s, e) = 10 * s + e;
  }
  loads.at(1, 3) = int64_t{1} << 40;  // the largest count allowed
  std::vector<int64_t> totals;
  ASSERT_TRUE(ValidatedExpertTotals(domain, loads, &totals).ok());
  EXPECT_EQ(totals, loads.ExpertTotals());
  // Every error is ValidateLoads' own.
  for (const int64_t bad : {int64_t{-1}, (int64_t{1} << 40) + 1, int64_t{-(int64_t{1} << 62)}}) {
    LoadMatrix wrong = loads;
    wrong.at(1, 2) = bad;
    const absl::Status status = ValidatedExpertTotals(domain, wrong, &totals);
    EXPECT_EQ(status, ValidateLoads(domain, wrong)) << bad;
    EXPECT_NE(MessageOf(status).find("loads[1][2] = "), std::string::npos) << bad;
  }
  EXPECT_EQ(ValidatedExpertTotals(domain, LoadMatrix(3, 4), &totals),
            ValidateLoads(domain, LoadMatrix(3, 4)));
  EXPECT_EQ(ValidatedExpertTotals(Domain{2, 0, 1}, LoadMatrix(2, 4), &totals).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ImbalanceTest, MaxOverMean) {
  EXPECT_DOUBLE_EQ(Imbalance({1, 1, 1, 1}), 1.0);
  EXPECT_DOUBLE_EQ(Imbalance({4, 0, 0, 0}), 4.0);
  EXPECT_DOUBLE_EQ(Imbalance({3, 1}), 1.5);
  EXPECT_DOUBLE_EQ(Imbalance({0, 0}), 1.0);
  EXPECT_DOUBLE_EQ(Imbalance({}), 1.0);
}

TEST(PlanTest, RankLoadsAndReplicas) {
  Plan plan;
  plan.ranks = 3;
  plan.experts = 2;
  plan.instances = {{0, 0, true}, {0, 2, false}, {1, 1, true}};
  plan.first = {0, 2, 3};
  plan.quota = {5, 7, 11};
  EXPECT_EQ(plan.RankLoads(), (std::vector<int64_t>{5, 11, 7}));
  EXPECT_EQ(plan.num_replicas(), 1);
  EXPECT_EQ(plan.num_instances(), 3);
}

TEST(MakePlannerTest, KnowsEveryPolicy) {
  const Domain domain{4, 2, 1};
  for (const char* name : {"ultraep", "greedy", "eplb", "none", "ideal"}) {
    absl::StatusOr<std::unique_ptr<Planner>> planner = MakePlanner(name, domain, PlannerOptions{});
    ASSERT_TRUE(planner.ok()) << name;
    EXPECT_EQ((*planner)->name(), name);
    EXPECT_EQ((*planner)->last_replacement_bytes(), 0);
  }
  absl::StatusOr<std::unique_ptr<Planner>> unknown =
      MakePlanner("random", domain, PlannerOptions{});
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(MessageOf(unknown.status()).find("valid policies: ultraep, greedy, eplb, none, ideal"),
            std::string::npos);
}

TEST(MakePlannerTest, RejectsBadOptions) {
  const Domain domain{4, 2, 1};
  PlannerOptions options;
  options.eps = -0.1;
  EXPECT_NE(MessageOf(MakePlanner("ultraep", domain, options).status()).find("planner.eps"),
            std::string::npos);
  options = {};
  options.min_replica_tokens = 0;
  EXPECT_NE(MessageOf(MakePlanner("ultraep", domain, options).status())
                .find("planner.min_replica_tokens"),
            std::string::npos);
  options = {};
  options.eplb_window = 0;
  EXPECT_NE(MessageOf(MakePlanner("eplb", domain, options).status()).find("planner.eplb_window"),
            std::string::npos);
  options = {};
  options.eplb_interval = 0;
  EXPECT_NE(MessageOf(MakePlanner("eplb", domain, options).status()).find("planner.eplb_interval"),
            std::string::npos);
  EXPECT_NE(MessageOf(MakePlanner("none", (Domain{4, 2, -1}), PlannerOptions{}).status())
                .find("slots_per_rank"),
            std::string::npos);
}

TEST(BaselinesTest, NoneKeepsEverythingHome) {
  const Domain domain{3, 2, 2};
  LoadMatrix loads(3, 6);
  for (int s = 0; s < 3; ++s) {
    for (int e = 0; e < 6; ++e) loads.at(s, e) = s * 10 + e;
  }
  NoBalancePlanner none(domain);
  absl::StatusOr<Plan> plan = none.Solve(loads, 0);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->num_instances(), 6);
  EXPECT_EQ(plan->RankLoads(), HomeRankLoads(domain, loads));
  for (int s = 0; s < 3; ++s) {
    for (int e = 0; e < 6; ++e) EXPECT_EQ(plan->split_at(loads, s, e), loads.at(s, e));
  }
  // No expert is replicated: nothing is stored, the split is the loads.
  EXPECT_EQ(plan->split_column, std::vector<int32_t>(6, -1));
  EXPECT_TRUE(plan->split.empty());
  EXPECT_TRUE(CheckPlanInvariants(domain, loads, *plan).ok());
}

TEST(BaselinesTest, IdealGivesEveryRankTheMean) {
  const Domain domain{4, 1, 0};  // no slots: ideal ignores the budget
  LoadMatrix loads(4, 4);
  loads.at(0, 0) = 101;
  loads.at(3, 0) = 2;
  loads.at(2, 3) = 1;
  IdealPlanner ideal(domain, PlannerOptions{});
  absl::StatusOr<Plan> plan = ideal.Solve(loads, 0);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->RankLoads(), (std::vector<int64_t>{26, 26, 26, 26}));
  EXPECT_EQ(plan->num_replicas(), 3);
  InvariantOptions bound;
  bound.enforce_slot_budget = false;
  EXPECT_TRUE(CheckPlanInvariants(domain, loads, *plan, bound).ok())
      << CheckPlanInvariants(domain, loads, *plan, bound);
  EXPECT_FALSE(CheckPlanInvariants(domain, loads, *plan).ok());  // over the slot budget
}

TEST(PlanFingerprintTest, EqualPlansAgreeAndEveryFieldCounts) {
  Plan a;
  a.ranks = 2;
  a.experts = 2;
  a.instances = {{0, 0, true}, {0, 1, false}, {1, 1, true}};
  a.first = {0, 2, 3};
  a.quota = {3, 2, 4};
  ASSERT_EQ(IndexSplitColumns(&a), 2);
  a.split = {3, 0, 1, 1};  // expert 0's master column (src 0, 1), then its replica's
  a.fanout.transfers = {{0, 0, 1, 0}};
  const Plan b = a;
  EXPECT_EQ(PlanFingerprint(a), PlanFingerprint(b));
  const uint64_t base = PlanFingerprint(a);
  Plan c = a;
  c.split[1] = 2;
  EXPECT_NE(PlanFingerprint(c), base);
  c = a;
  c.split_column = {1, 0, -1};
  EXPECT_NE(PlanFingerprint(c), base);
  c = a;
  c.instances[1].rank = 0;
  EXPECT_NE(PlanFingerprint(c), base);
  c = a;
  c.quota[2] = 5;
  EXPECT_NE(PlanFingerprint(c), base);
  c = a;
  c.fanout.transfers[0].stage = 1;
  EXPECT_NE(PlanFingerprint(c), base);
  c = a;
  c.instances[1].master = true;
  EXPECT_NE(PlanFingerprint(c), base);
}

TEST(PlanTest, SplitColumnsAndDenseSplit) {
  // Expert 0: master on rank 0 and a replica on rank 1; expert 1 unreplicated; expert 2 on
  // three ranks.
  Plan plan;
  plan.ranks = 3;
  plan.experts = 3;
  plan.instances = {{0, 0, true}, {0, 1, false}, {1, 0, true},
                    {2, 1, true}, {2, 0, false}, {2, 2, false}};
  plan.first = {0, 2, 3, 6};
  ASSERT_EQ(IndexSplitColumns(&plan), 5);
  EXPECT_EQ(plan.split_column, (std::vector<int32_t>{0, 1, -1, 2, 3, 4}));
  EXPECT_EQ(plan.split.size(), 15u);
  EXPECT_EQ(plan.num_split_columns(), 5);
  LoadMatrix loads(3, 3);
  for (int s = 0; s < 3; ++s) {
    for (int e = 0; e < 3; ++e) loads.at(s, e) = 10 * s + e;
  }
  for (size_t m = 0; m < plan.split.size(); ++m) plan.split[m] = static_cast<int64_t>(100 + m);
  const std::vector<int64_t> dense = DenseSplit(plan, loads);
  ASSERT_EQ(dense.size(), 18u);
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(dense[static_cast<size_t>(s) * 6 + 2], loads.at(s, 1)) << s;   // implied
    EXPECT_EQ(dense[static_cast<size_t>(s) * 6 + 4], 100 + 3 * 3 + s) << s;  // column 3
    EXPECT_EQ(plan.split_at(loads, s, 1), 100 + 3 + s) << s;
  }
  EXPECT_TRUE(ValidateSplitShape(plan).ok());
  Plan bad = plan;
  bad.split.pop_back();
  EXPECT_NE(std::string(ValidateSplitShape(bad).message()).find("ranks x columns = 3 x 5"),
            std::string::npos)
      << ValidateSplitShape(bad);
  bad = plan;
  bad.split_column[2] = 2;
  EXPECT_NE(std::string(ValidateSplitShape(bad).message()).find("plan.split_column[2] = 2"),
            std::string::npos)
      << ValidateSplitShape(bad);
  bad = plan;
  bad.first = {0, 4, 3, 6};
  EXPECT_EQ(ValidateSplitShape(bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(ValidateSplitShape(bad).message()).find("not ascending at expert 1"),
            std::string::npos)
      << ValidateSplitShape(bad);
}

}  // namespace
}  // namespace rackrun::planner
