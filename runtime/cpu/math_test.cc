#include "runtime/cpu/math.h"

#include <cmath>

#include "gtest/gtest.h"

namespace rackrun::runtime::cpu {
namespace {

TEST(MathTest, FloatExpMatchesLibmToAFewUlp) {
  double worst = 0;
  for (int i = -870000; i <= 883000; ++i) {
    const float x = static_cast<float>(i) * 1e-4f;
    const double ref = std::exp(static_cast<double>(x));
    const double rel = std::abs(static_cast<double>(Exp(x)) - ref) / ref;
    worst = std::max(worst, rel);
  }
  EXPECT_LT(worst, 4e-7);
  EXPECT_EQ(Exp(0.0f), 1.0f);
}

TEST(MathTest, FloatExpClampsInsteadOfOverflowing) {
  EXPECT_TRUE(std::isfinite(Exp(1000.0f)));
  EXPECT_GE(Exp(-1000.0f), 0.0f);
  EXPECT_LT(Exp(-1000.0f), 1e-37f);
}

TEST(MathTest, SigmoidIsSymmetric) {
  for (float x : {-5.0f, -1.0f, 0.0f, 0.5f, 3.0f}) {
    EXPECT_NEAR(Sigmoid(x) + Sigmoid(-x), 1.0f, 1e-6f);
    EXPECT_NEAR(Sigmoid(static_cast<double>(x)), 1.0 / (1.0 + std::exp(-static_cast<double>(x))),
                1e-15);
  }
}

}  // namespace
}  // namespace rackrun::runtime::cpu
