#include "planner/simulator.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/baseline_planners.h"
#include "planner/planner.h"

namespace rackrun::planner {
namespace {

using ::testing::HasSubstr;

// A toy machine with round numbers so every expected time below is worked out by hand:
// one token is 8 bytes and costs 1 s of compute; all-to-all moves 1 token per second.
HardwareModel Toy() {
  HardwareModel hw;
  hw.name = "toy";
  hw.hidden = 4;
  hw.expert_intermediate = 8;
  hw.matrices_per_expert = 3;
  hw.bytes_per_element = 2;   // token_bytes = 8
  hw.gemm_flops_per_s = 192;  // flops_per_token = 2 * 3 * 4 * 8 = 192
  hw.a2a_bytes_per_s = 8;     // 1 token/s
  hw.a2a_latency_s = 0.5;
  hw.fanout.egress_bytes_per_s = 8;
  hw.fanout.latency_s = 0;
  hw.fanout.chunk_bytes = 8;
  return hw;
}

// Masters only: instance e is expert e at its home rank and takes all of its tokens.
Plan HomePlan(const LoadMatrix& loads) {
  Plan plan;
  plan.ranks = loads.ranks;
  plan.experts = loads.experts;
  const int per_rank = loads.experts / loads.ranks;
  for (int e = 0; e < loads.experts; ++e) {
    plan.first.push_back(e);
    plan.instances.push_back({e, e / per_rank, true});
    int64_t quota = 0;
    for (int src = 0; src < loads.ranks; ++src) quota += loads.at(src, e);
    plan.quota.push_back(quota);
  }
  plan.first.push_back(loads.experts);
  IndexSplitColumns(&plan);  // no replicated expert: no columns
  return plan;
}

LoadMatrix TwoByTwo() {
  LoadMatrix loads(2, 2);
  loads.at(0, 0) = 10;
  loads.at(0, 1) = 6;
  loads.at(1, 0) = 2;
  loads.at(1, 1) = 4;
  return loads;
}

TEST(SimulatorTest, HomePlanByHand) {
  // Rank loads 12 and 10. Dispatch: src0 sends 6 to rank 1, src1 sends 2 to rank 0; the
  // busiest rank moves 6 tokens: 6 s + 0.5 s latency. Combine mirrors it.
  const LayerTime t = SimulateLayer(HomePlan(TwoByTwo()), TwoByTwo(), Toy(), FanoutCost{});
  EXPECT_DOUBLE_EQ(t.dispatch_s, 6.5);
  EXPECT_DOUBLE_EQ(t.combine_s, 6.5);
  EXPECT_DOUBLE_EQ(t.compute_s, 12.0);
  EXPECT_EQ(t.max_rank_tokens, 12);
  EXPECT_DOUBLE_EQ(t.exposed_fanout_s, 0.0);
  EXPECT_DOUBLE_EQ(t.total_s, 25.0);
}

TEST(SimulatorTest, BalancedRoutingByHand) {
  // Sources send 16 and 6 tokens, 22 in all. Balanced routing: src0 sends 8 and receives 3;
  // src1 sends 3 and receives 8 -> 8.5 s per phase; each rank computes 11.
  const LayerTime ideal = SimulateBalancedRouting(TwoByTwo(), Toy());
  EXPECT_DOUBLE_EQ(ideal.dispatch_s, 8.5);
  EXPECT_DOUBLE_EQ(ideal.compute_s, 11.0);
  EXPECT_DOUBLE_EQ(ideal.total_s, 28.0);
}

TEST(SimulatorTest, BalancedRoutingOnlyIsNotTheBound) {
  // Balanced routing sends 1/G of every source's tokens to each rank. Here the `ideal`
  // policy's plan keeps more of them on their source rank (locality-first split), so its
  // layer beats balanced routing: rank 0 keeps 11 of expert 0 (src0's 10 locally), rank 1
  // takes 1 of it as a replica and all 10 of expert 1; src0 sends 6, src1 sends 1, so
  // 6.5 s per phase + 11 s = 24 s against 28 s (it was reported as 117% of ideal).
  // The ideal is the better of the two, so the `ideal` policy is exactly 100%.
  const LayerTime routed = SimulateBalancedRouting(TwoByTwo(), Toy());
  EXPECT_DOUBLE_EQ(routed.total_s, 28.0);
  const LayerTime ideal = SimulateForceBalanced(TwoByTwo(), Toy());
  IdealPlanner planner(Domain{2, 1, 0}, PlannerOptions{});
  absl::StatusOr<Plan> plan = planner.Solve(TwoByTwo(), 0);
  ASSERT_TRUE(plan.ok());
  const LayerTime own = SimulateLayer(*plan, TwoByTwo(), Toy(), {});
  EXPECT_DOUBLE_EQ(own.total_s, 24.0);
  EXPECT_DOUBLE_EQ(ideal.total_s, own.total_s);
  EXPECT_DOUBLE_EQ(PercentOfIdeal(ideal, own), 100.0);
}

// The 2000-rank case of issue #12: sources that route a share of their tokens to their own
// rank's expert (as real traces do), with per-rank token counts that differ. Before the
// ideal took the `ideal` policy's own plan into account, that policy reported above 100%.
TEST(SimulatorTest, IdealPolicyNeverExceedsTheIdealAtScale) {
  const HardwareModel hw = *HardwarePreset("h200-nvl72");
  for (const int ranks : {2000, 512}) {
    LoadMatrix loads(ranks, ranks);
    for (int s = 0; s < ranks; ++s) {
      const int64_t own = 20 + (s * 37) % 60;  // 20..79 tokens stay home
      loads.at(s, s) = own;
      for (int k = 1; k <= 8; ++k) loads.at(s, (s * 7 + k * 131) % ranks) += 3 + (s + k) % 5;
    }
    const Domain domain{ranks, 1, 2};
    const LayerTime ideal = SimulateForceBalanced(loads, hw);
    EXPECT_LE(ideal.total_s, SimulateBalancedRouting(loads, hw).total_s);
    auto planner = MakePlanner("ideal", domain, PlannerOptions{});
    ASSERT_TRUE(planner.ok());
    absl::StatusOr<Plan> plan = (*planner)->Solve(loads, 0);
    ASSERT_TRUE(plan.ok());
    const LayerTime own = SimulateLayer(*plan, loads, hw, {});
    EXPECT_LE(PercentOfIdeal(ideal, own), 100.0) << ranks << " ranks";
    // This trace is one where balanced routing alone was beaten: the case is exercised.
    EXPECT_GT(PercentOfIdeal(SimulateBalancedRouting(loads, hw), own), 100.0) << ranks;
  }
}

TEST(SimulatorTest, UniformLoadsUnderHomePlacementAreIdeal) {
  LoadMatrix loads(4, 8);
  for (int64_t& c : loads.counts) c = 3;
  const LayerTime home = SimulateLayer(HomePlan(loads), loads, Toy(), {});
  const LayerTime ideal = SimulateForceBalanced(loads, Toy());
  EXPECT_DOUBLE_EQ(home.total_s, ideal.total_s);
  EXPECT_DOUBLE_EQ(PercentOfIdeal(ideal, home), 100.0);
}

TEST(SimulatorTest, ReplicaPlanMovesWorkAndPaysItsTraffic) {
  // Expert 0 (home rank 0) gets 12 tokens from src0; half go to a replica on rank 1.
  Plan plan;
  plan.ranks = 2;
  plan.experts = 2;
  plan.instances = {{0, 0, true}, {0, 1, false}, {1, 1, true}};
  plan.first = {0, 2, 3};
  plan.quota = {6, 6, 0};
  ASSERT_EQ(IndexSplitColumns(&plan), 2);  // expert 0's two instances
  plan.split = {6, 0, /*replica: src0, src1*/ 6, 0};
  LoadMatrix loads(2, 2);
  loads.at(0, 0) = 12;
  const LayerTime t = SimulateLayer(plan, loads, Toy(), {});
  EXPECT_EQ(t.max_rank_tokens, 6);
  EXPECT_DOUBLE_EQ(t.compute_s, 6.0);
  EXPECT_DOUBLE_EQ(t.dispatch_s, 6.5);
  EXPECT_DOUBLE_EQ(t.total_s, 19.0);
}

TEST(SimulatorTest, FanoutHidesBehindDispatchUpToContention) {
  const Plan plan = HomePlan(TwoByTwo());  // busiest dispatch sender: 6 tokens = 48 bytes
  // A long fan-out: exposed = 10 - 6.5.
  LayerTime t = SimulateLayer(plan, TwoByTwo(), Toy(), FanoutCost{10.0, 16, 16});
  EXPECT_DOUBLE_EQ(t.fanout_s, 10.0);
  EXPECT_DOUBLE_EQ(t.exposed_fanout_s, 3.5);
  EXPECT_DOUBLE_EQ(t.total_s, 28.5);
  // A short fan-out still contends for egress: (48 + 8) / 8 = 7 s > 6.5 s of dispatch.
  t = SimulateLayer(plan, TwoByTwo(), Toy(), FanoutCost{1.0, 8, 8});
  EXPECT_DOUBLE_EQ(t.exposed_fanout_s, 0.5);
}

TEST(SimulatorTest, ReplacementIsSpreadOverRanksAndExposed) {
  const LayerTime t = SimulateLayer(HomePlan(TwoByTwo()), TwoByTwo(), Toy(), {}, 32);
  EXPECT_DOUBLE_EQ(t.replacement_s, 2.0);  // 32 bytes / (2 ranks x 8 B/s)
  EXPECT_DOUBLE_EQ(t.total_s, 27.0);
}

TEST(SimulatorTest, H200Nvl72Preset) {
  absl::StatusOr<HardwareModel> hw = HardwarePreset("h200-nvl72");
  ASSERT_TRUE(hw.ok());
  EXPECT_TRUE(hw->Validate().ok());
  EXPECT_EQ(hw->expert_bytes(), 3LL * 7168 * 2048 * 2);  // 84 MiB per DeepSeek-V3 expert
  EXPECT_EQ(hw->token_bytes(), 7168 * 2);
  // 8k tokens through one expert: about 1.2 ms at the stated achieved GEMM rate.
  EXPECT_NEAR(8192 * hw->flops_per_token() / hw->gemm_flops_per_s, 1.22e-3, 0.01e-3);
  absl::StatusOr<HardwareModel> bad = HardwarePreset("tpu");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("known presets: h200-nvl72"));
}

TEST(SimulatorTest, ValidateNamesTheField) {
  HardwareModel hw = Toy();
  hw.a2a_bytes_per_s = 0;
  EXPECT_THAT(std::string(hw.Validate().message()), HasSubstr("a2a_bytes_per_s"));
}

}  // namespace
}  // namespace rackrun::planner
