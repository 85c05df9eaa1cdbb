#include "base/random.h"

#include <vector>

#include "gtest/gtest.h"

namespace rackrun::base {
namespace {

// Reference values of the published algorithms: SplitMix64 from state 0 starts
// 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4; xoshiro256** from state {1, 2, 3, 4} starts
// 11520, 0, 1509978240, 1215971899390074240.
TEST(RandomTest, MatchesPublishedReferenceStreams) {
  EXPECT_EQ(SplitMix64(0), 0xe220a8397b1dcdafULL);
  EXPECT_EQ(SplitMix64(0x9e3779b97f4a7c15ULL), 0x6e789e6aa1b965f4ULL);
  Xoshiro256 x({1, 2, 3, 4});
  EXPECT_EQ(x.Next(), 11520u);
  EXPECT_EQ(x.Next(), 0u);
  EXPECT_EQ(x.Next(), 1509978240u);
  EXPECT_EQ(x.Next(), 1215971899390074240u);
}

TEST(RandomTest, SeedingsDifferAndAreDeterministic) {
  EXPECT_EQ(Xoshiro256::FromSeed(7).state(), Xoshiro256::FromSeed(7).state());
  EXPECT_NE(Xoshiro256::FromSeed(7).state(), Xoshiro256::FromSeed(8).state());
  EXPECT_NE(Xoshiro256::FromSeed(7).state(), Xoshiro256::FromSeedChained(7).state());
  const Xoshiro256::State chained = Xoshiro256::FromSeedChained(7).state();
  EXPECT_EQ(chained[0], SplitMix64(7));
  EXPECT_EQ(chained[1], SplitMix64(chained[0]));
}

TEST(RandomTest, BelowAndUniformStayInRange) {
  Xoshiro256 x = Xoshiro256::FromSeed(1);
  std::vector<int> hits(7, 0);
  for (int i = 0; i < 7000; ++i) {
    const uint64_t v = x.Below(7);
    ASSERT_LT(v, 7u);
    ++hits[v];
    const double u = x.Uniform();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
  }
  for (const int h : hits) EXPECT_GT(h, 800);  // roughly uniform (expected 1000)
}

}  // namespace
}  // namespace rackrun::base
