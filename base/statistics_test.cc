#include "base/statistics.h"

#include "gtest/gtest.h"

namespace rackrun::base {
namespace {

TEST(StatisticsTest, MeanAndMedian) {
  EXPECT_EQ(Mean({}), 0);
  EXPECT_DOUBLE_EQ(Mean({1, 2, 6}), 3);
  EXPECT_EQ(Median({}), 0);
  EXPECT_DOUBLE_EQ(Median({5, 1, 3}), 3);
  EXPECT_DOUBLE_EQ(Median({4, 1, 3, 2}), 2.5);
}

TEST(StatisticsTest, NearestRankPercentile) {
  std::vector<double> v;
  for (int i = 100; i >= 1; --i) v.push_back(i);  // 1..100, unsorted
  EXPECT_EQ(Percentile(v, 0.5), 50);
  EXPECT_EQ(Percentile(v, 0.99), 99);
  EXPECT_EQ(Percentile(v, 1.0), 100);
  EXPECT_EQ(Percentile(v, 0.0), 1);
  EXPECT_EQ(Percentile(v, 2.0), 100);  // clamped
  EXPECT_EQ(Percentile({7}, 0.99), 7);
  EXPECT_EQ(Percentile({}, 0.5), 0);
  EXPECT_EQ(Percentile({1, 2, 3}, 0.5), 2);
}

TEST(StatisticsTest, MaxOverMean) {
  EXPECT_DOUBLE_EQ(MaxOverMean({1, 1, 4}), 2);
  EXPECT_EQ(MaxOverMean({0, 0}), 0);
  EXPECT_EQ(MaxOverMean({}), 0);
}

}  // namespace
}  // namespace rackrun::base
