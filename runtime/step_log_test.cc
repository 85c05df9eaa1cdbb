#include "runtime/step_log.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::runtime {
namespace {

using ::testing::HasSubstr;

TEST(StepLogTest, BalancingShareIsThePlanWithoutItsExchangePlusFanOutAndReduce) {
  // plan 3 ms of which 2 ms exchange, fan-out 4 ms, reduce 1 ms: 6 ms of a 200 ms step.
  EXPECT_DOUBLE_EQ(BalancingShare(0.003, 0.002, 0.004, 0.001, 0.2), 0.006 / 0.2);
  // The token all-to-alls are not part of it; an exchange timed above its plan counts as 0.
  EXPECT_DOUBLE_EQ(BalancingShare(0.001, 0.002, 0, 0, 0.1), 0);
  EXPECT_DOUBLE_EQ(BalancingShare(0.003, 0, 0, 0, 0), 0) << "no step time, no share";
}

TEST(StepLogTest, ThePhasesTextEndsWithTheBalancingShare) {
  EXPECT_EQ(BalancingPhasesText(0.0007, 0.0006, 0.0004, 0.0086, 0.0001, 0.05),
            "plan(exch)/fan/a2a/red ms 0.7(0.6)/0.4/8.6/0.1 bal 1.2%");
}

TEST(StepLogTest, AnExpertParallelLogLineCarriesThePhasesAndTheShare) {
  StepRecord r;
  r.step = 3;
  r.ranks = 2;
  r.rank_imbalance_before = {1.5};
  r.rank_imbalance_after = {1.0};
  r.plan_s = 0.002;
  r.plan_exchange_s = 0.001;
  r.fanout_s = 0.003;
  r.reduce_s = 0.001;
  r.step_s = 0.5;
  const std::string line = r.ToLogLine(10);
  EXPECT_THAT(line, HasSubstr("ranks 1.50>1.00"));
  EXPECT_THAT(line, HasSubstr("plan(exch)/fan/a2a/red ms 2.0(1.0)/3.0/0.0/1.0 bal 1.0%"));
  // The JSON record carries the step's seconds and the share itself.
  const std::string json = r.ToJson();
  EXPECT_THAT(json, HasSubstr("\"step_s\": 0.5, \"balancing_share\": 0.01"));
}

}  // namespace
}  // namespace rackrun::runtime
