#include "planner/fanout.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "planner/plan.h"

namespace rackrun::planner {
namespace {

// A plan (instances and first[] only) where expert e's master is on rank masters[e] and
// its replicas on replicas[e] (ascending).
Plan ReplicaPlan(int ranks, const std::vector<int>& masters,
                 const std::vector<std::vector<int>>& replicas) {
  Plan plan;
  plan.ranks = ranks;
  plan.experts = static_cast<int>(masters.size());
  plan.first.push_back(0);
  for (size_t e = 0; e < masters.size(); ++e) {
    plan.instances.push_back(ExpertInstance{static_cast<int32_t>(e), masters[e], true});
    for (int r : replicas[e])
      plan.instances.push_back(ExpertInstance{static_cast<int32_t>(e), r, false});
    plan.first.push_back(static_cast<int32_t>(plan.instances.size()));
  }
  return plan;
}

std::vector<int> Range(int begin, int end) {
  std::vector<int> v;
  for (int i = begin; i < end; ++i) v.push_back(i);
  return v;
}

TEST(RelayFanoutTest, RelaysFollowTheDesignRule) {
  const FanoutScheduler relay;
  EXPECT_EQ(relay.RelaysFor(1), 0);
  EXPECT_EQ(relay.RelaysFor(3), 0);  // n < 4
  EXPECT_EQ(relay.RelaysFor(4), 2);  // r = 2, gain 4 - max(2, 1) = 2
  EXPECT_EQ(relay.RelaysFor(8), 2);  // gain 8 - max(2, 3) = 5
  EXPECT_EQ(relay.RelaysFor(9), 3);
  EXPECT_EQ(relay.RelaysFor(16), 4);
  EXPECT_EQ(relay.RelaysFor(32), 5);
  EXPECT_EQ(relay.RelaysFor(100), 8);  // at most 8
  FanoutOptions one_relay;
  one_relay.max_relays = 1;  // gain n - max(1, n - 1) = 1 < 2: direct
  EXPECT_EQ(FanoutScheduler(one_relay).RelaysFor(16), 0);
  FanoutOptions picky;
  picky.min_gain = 3;  // n = 4 gains only 2
  EXPECT_EQ(FanoutScheduler(picky).RelaysFor(4), 0);
  EXPECT_EQ(FanoutScheduler(picky).RelaysFor(5), 2);
  FanoutOptions direct;
  direct.mode = FanoutMode::kDirect;
  EXPECT_EQ(FanoutScheduler(direct).RelaysFor(32), 0);
}

TEST(RelayFanoutTest, TwoStageSchedule) {
  const Plan plan = ReplicaPlan(10, {0}, {Range(1, 10)});  // n = 9: r = 3
  const FanoutSchedule schedule = PlanFanout(plan, FanoutOptions{});
  ASSERT_EQ(schedule.transfers.size(), 9u);
  std::vector<int> relays;
  std::set<int> reached;
  for (const WeightTransfer& t : schedule.transfers) {
    EXPECT_EQ(t.expert, 0);
    if (t.stage == 0) {
      EXPECT_EQ(t.src_rank, 0);
      relays.push_back(t.dst_rank);
    }
    reached.insert(t.dst_rank);
  }
  EXPECT_EQ(relays, (std::vector<int>{1, 2, 3}));  // fresh ranks, equal sends: lowest ids
  EXPECT_EQ(reached.size(), 9u);
  // Leaves 4..9: the first three one per relay, then to the least-loaded relay.
  std::vector<int> per_relay(10, 0);
  for (const WeightTransfer& t : schedule.transfers) {
    if (t.stage == 1) ++per_relay[static_cast<size_t>(t.src_rank)];
  }
  EXPECT_EQ(per_relay[1], 2);
  EXPECT_EQ(per_relay[2], 2);
  EXPECT_EQ(per_relay[3], 2);
  EXPECT_EQ(schedule.transfers[3], (WeightTransfer{0, 1, 4, 1}));
  EXPECT_EQ(schedule.transfers[4], (WeightTransfer{0, 2, 5, 1}));
  EXPECT_EQ(schedule.transfers[5], (WeightTransfer{0, 3, 6, 1}));
}

TEST(RelayFanoutTest, PrefersRanksNotYetRelaying) {
  // Expert 0 (n = 5) picks relays first, then expert 1 (n = 4) over the same ranks.
  const Plan plan = ReplicaPlan(8, {0, 7}, {{1, 2, 3, 4, 5}, {1, 2, 3, 4}});
  const FanoutSchedule schedule = PlanFanout(plan, FanoutOptions{});
  std::vector<int> relays0;
  std::vector<int> relays1;
  for (const WeightTransfer& t : schedule.transfers) {
    if (t.stage == 0) (t.expert == 0 ? relays0 : relays1).push_back(t.dst_rank);
  }
  EXPECT_EQ(relays0, (std::vector<int>{1, 2}));
  EXPECT_EQ(relays1, (std::vector<int>{3, 4}));
}

TEST(RelayFanoutTest, DirectModeSendsEverythingFromTheMaster) {
  FanoutOptions direct;
  direct.mode = FanoutMode::kDirect;
  const FanoutSchedule schedule = PlanFanout(ReplicaPlan(17, {0}, {Range(1, 17)}), direct);
  ASSERT_EQ(schedule.transfers.size(), 16u);
  for (const WeightTransfer& t : schedule.transfers) {
    EXPECT_EQ(t.src_rank, 0);
    EXPECT_EQ(t.stage, 0);
  }
  EXPECT_TRUE(PlanFanout(ReplicaPlan(4, {0, 1}, {{}, {}}), FanoutOptions{}).transfers.empty());
}

TEST(EstimateFanoutTest, SingleAndDirectTransfers) {
  FanoutCostModel model;
  model.egress_bytes_per_s = 1e9;
  model.latency_s = 1e-6;
  model.chunk_bytes = 1 << 20;
  const int64_t bytes = 8 << 20;  // 8 chunks
  FanoutSchedule one;
  one.transfers.push_back(WeightTransfer{0, 0, 1, 0});
  FanoutCost cost = EstimateFanout(one, 2, bytes, model);
  EXPECT_DOUBLE_EQ(cost.seconds, 8.0 * (1 << 20) / 1e9 + 1e-6);
  EXPECT_EQ(cost.bytes, bytes);
  EXPECT_EQ(cost.max_rank_bytes, bytes);
  // n direct transfers share the master's egress: n * bytes / bandwidth, plus one latency.
  FanoutOptions direct;
  direct.mode = FanoutMode::kDirect;
  cost = EstimateFanout(PlanFanout(ReplicaPlan(5, {0}, {Range(1, 5)}), direct), 5, bytes, model);
  EXPECT_NEAR(cost.seconds, 4.0 * bytes / 1e9 + 1e-6, 1e-12);
  EXPECT_EQ(cost.bytes, 4 * bytes);
  EXPECT_EQ(cost.max_rank_bytes, 4 * bytes);
}

TEST(EstimateFanoutTest, RelayPipelinesChunks) {
  // n = 4, r = 2: the master interleaves chunks to two relays; each forwards chunk i as
  // soon as it has it. With C chunks of c seconds and latency l: the last chunk reaches
  // relay 2 at (2C) c + l and its leaf at (2C + 1) c + 2 l.
  FanoutCostModel model;
  model.egress_bytes_per_s = 1000;
  model.latency_s = 0.25;
  model.chunk_bytes = 100;  // c = 0.1 s
  const FanoutSchedule schedule = PlanFanout(ReplicaPlan(5, {0}, {Range(1, 5)}), FanoutOptions{});
  const FanoutCost cost = EstimateFanout(schedule, 5, 400, model);  // C = 4
  EXPECT_NEAR(cost.seconds, 9 * 0.1 + 2 * 0.25, 1e-12);
  EXPECT_EQ(cost.bytes, 4 * 400);
  EXPECT_EQ(cost.max_rank_bytes, 2 * 400);
}

TEST(EstimateFanoutTest, RelayBeatsDirectForWideFanouts) {
  FanoutCostModel model;
  model.egress_bytes_per_s = 50e9;
  model.latency_s = 5e-6;
  model.chunk_bytes = 256 << 10;
  const int64_t bytes = 44 << 20;  // one expert of a large MoE, bf16
  FanoutOptions direct;
  direct.mode = FanoutMode::kDirect;
  for (int n : {8, 16, 32}) {
    const Plan plan = ReplicaPlan(n + 1, {0}, {Range(1, n + 1)});
    const FanoutCost relay_cost =
        EstimateFanout(PlanFanout(plan, FanoutOptions{}), n + 1, bytes, model);
    const FanoutCost direct_cost = EstimateFanout(PlanFanout(plan, direct), n + 1, bytes, model);
    EXPECT_LT(relay_cost.seconds, direct_cost.seconds / 1.5) << n << " destinations";
    EXPECT_LT(relay_cost.max_rank_bytes, direct_cost.max_rank_bytes) << n;
  }
}

TEST(EstimateFanoutTest, DirectWhenGainBelowTwo) {
  FanoutOptions one_relay;
  one_relay.max_relays = 1;
  const Plan plan = ReplicaPlan(9, {0}, {Range(1, 9)});
  const FanoutSchedule schedule = PlanFanout(plan, one_relay);
  for (const WeightTransfer& t : schedule.transfers) EXPECT_EQ(t.stage, 0);
  FanoutOptions direct;
  direct.mode = FanoutMode::kDirect;
  EXPECT_EQ(schedule, PlanFanout(plan, direct));
}

TEST(EstimateFanoutTest, EmptyAndDegenerate) {
  FanoutCostModel model;
  model.egress_bytes_per_s = 1e9;
  EXPECT_EQ(EstimateFanout(FanoutSchedule{}, 4, 1 << 20, model).seconds, 0.0);
  FanoutSchedule orphan;  // a forward whose relay never receives the expert
  orphan.transfers.push_back(WeightTransfer{0, 1, 2, 1});
  orphan.transfers.push_back(WeightTransfer{0, 0, 3, 0});
  EXPECT_TRUE(std::isinf(EstimateFanout(orphan, 4, 1 << 20, model).seconds));
}

}  // namespace
}  // namespace rackrun::planner
