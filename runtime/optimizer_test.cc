#include "runtime/optimizer.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace rackrun::runtime {
namespace {

TEST(AdamWTest, MatchesAHandComputationOverTwoSteps) {
  std::vector<float> w = {1.0f, -0.5f};
  std::vector<float> g = {0.2f, -0.4f};
  std::vector<float> gain = {1.0f};
  std::vector<float> gain_grad = {0.1f};
  AdamWConfig config{.beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.1};
  AdamW adam(config, {{"layer.w", w.data(), g.data(), 2, true},
                      {"layer.norm", gain.data(), gain_grad.data(), 1, false}});
  // Reference in double, written out from the update rule.
  double ref_w[2] = {1.0, -0.5}, m[2] = {0, 0}, v[2] = {0, 0};
  double ref_gain = 1.0, mg = 0, vg = 0;
  const double lrs[2] = {0.01, 0.005};
  for (int t = 1; t <= 2; ++t) {
    const double lr = lrs[t - 1];
    adam.Step(lr);
    const double c1 = 1 - std::pow(0.9, t), c2 = 1 - std::pow(0.99, t);
    for (int i = 0; i < 2; ++i) {
      m[i] = 0.9 * m[i] + 0.1 * g[static_cast<size_t>(i)];
      v[i] = 0.99 * v[i] + 0.01 * g[static_cast<size_t>(i)] * g[static_cast<size_t>(i)];
      ref_w[i] = ref_w[i] * (1 - lr * 0.1) - lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + 1e-8);
    }
    mg = 0.9 * mg + 0.1 * 0.1;
    vg = 0.99 * vg + 0.01 * 0.01;
    ref_gain = ref_gain - lr * (mg / c1) / (std::sqrt(vg / c2) + 1e-8);  // no decay
  }
  EXPECT_NEAR(w[0], ref_w[0], 1e-6);
  EXPECT_NEAR(w[1], ref_w[1], 1e-6);
  EXPECT_NEAR(gain[0], ref_gain, 1e-6);
  EXPECT_EQ(adam.step(), 2);
}

TEST(AdamWTest, GradScaleIsAppliedBeforeTheMoments) {
  std::vector<float> a = {1.0f}, b = {1.0f};
  std::vector<float> ga = {4.0f}, gb = {1.0f};
  AdamW scaled({}, {{"a", a.data(), ga.data(), 1, false}});
  AdamW plain({}, {{"b", b.data(), gb.data(), 1, false}});
  scaled.Step(0.1, 0.25);
  plain.Step(0.1, 1.0);
  EXPECT_FLOAT_EQ(a[0], b[0]);
  EXPECT_FLOAT_EQ(scaled.first_moment(0)[0], plain.first_moment(0)[0]);
}

TEST(GlobalGradNormTest, IsTheL2NormOverAllTensors) {
  std::vector<float> g1(10000, 0.5f), g2 = {3.0f, 4.0f};
  std::vector<float> v1(10000), v2(2);
  const double norm = GlobalGradNorm(
      {{"x", v1.data(), g1.data(), 10000, true}, {"y", v2.data(), g2.data(), 2, true}});
  EXPECT_NEAR(norm, std::sqrt(10000 * 0.25 + 25.0), 1e-9);
}

TEST(LearningRateScheduleTest, WarmupThenCosineToMinimum) {
  LearningRateSchedule s{.lr = 1.0, .min_lr = 0.1, .warmup = 10, .total = 110, .cosine = true};
  EXPECT_DOUBLE_EQ(s.At(0), 0.1);
  EXPECT_DOUBLE_EQ(s.At(4), 0.5);
  EXPECT_DOUBLE_EQ(s.At(9), 1.0);
  EXPECT_DOUBLE_EQ(s.At(10), 1.0);
  EXPECT_NEAR(s.At(60), 0.55, 1e-12);  // halfway: (1 + 0.1) / 2
  EXPECT_NEAR(s.At(110), 0.1, 1e-12);
  EXPECT_NEAR(s.At(500), 0.1, 1e-12);
  s.cosine = false;
  EXPECT_DOUBLE_EQ(s.At(60), 1.0);
}

TEST(DecaysWeightTest, MatricesDecayNormsBiasesAndGatesDoNot) {
  EXPECT_TRUE(DecaysWeight("embed"));
  EXPECT_TRUE(DecaysWeight("blocks.0.attn.wqkv"));
  EXPECT_TRUE(DecaysWeight("blocks.1.moe.w13"));
  EXPECT_TRUE(DecaysWeight("blocks.1.moe.router"));
  EXPECT_TRUE(DecaysWeight("residual.sublayer3.w_pre"));
  EXPECT_FALSE(DecaysWeight("blocks.0.attn.norm"));
  EXPECT_FALSE(DecaysWeight("final_norm"));
  EXPECT_FALSE(DecaysWeight("residual.sublayer3.b_pre"));
  EXPECT_FALSE(DecaysWeight("residual.sublayer3.a_res"));
  EXPECT_FALSE(DecaysWeight("blocks.1.moe.router_bias"));
}

}  // namespace
}  // namespace rackrun::runtime
