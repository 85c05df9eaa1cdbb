#include "runtime/layers/lm_head.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/layers/gradient_check.h"

namespace rackrun::runtime {
namespace {

using testing::FillUniform;

TEST(LmHeadTest, UniformLogitsGiveLogVocab) {
  LmHead<double> head(4, 10, "h");
  std::vector<double> x(3 * 4, 0.5);
  const std::vector<int32_t> targets = {1, 7, 3};
  int64_t counted = 0;
  EXPECT_NEAR(head.Forward(x.data(), targets.data(), 3, &counted), std::log(10.0), 1e-12);
  EXPECT_EQ(counted, 3);
}

TEST(LmHeadTest, NegativeTargetsAreNotCounted) {
  LmHead<double> head(4, 10, "h");
  FillUniform(head.weight().value.data(), 40, 1, 1.0);
  std::vector<double> x(2 * 4);
  FillUniform(x.data(), 8, 2, 1.0);
  int64_t counted = 0;
  const std::vector<int32_t> one = {3, -1};
  const std::vector<int32_t> only = {3};
  const double a = head.Forward(x.data(), one.data(), 2, &counted);
  EXPECT_EQ(counted, 1);
  const double b = head.Forward(x.data(), only.data(), 1, &counted);
  EXPECT_DOUBLE_EQ(a, b);
}

TEST(LmHeadTest, GradientCheckFp64) {
  const int rows = 6, c = 5, v = 11;
  LmHead<double> head(c, v, "h");
  FillUniform(head.weight().value.data(), c * v, 3, 1.0);
  std::vector<double> x(rows * c), dx(rows * c);
  FillUniform(x.data(), rows * c, 4, 1.5);
  const std::vector<int32_t> targets = {0, 10, 5, -1, 2, 2};
  const double scale = 0.75;
  auto loss = [&] { return scale * head.Forward(x.data(), targets.data(), rows, nullptr); };
  loss();
  head.Backward(x.data(), scale, dx.data());
  testing::ExpectGradientMatches("x", x.data(), dx.data(), rows * c, loss, 30);
  testing::ExpectParameterGradientsMatch({head.weight().Ref()}, loss, 30);
}

}  // namespace
}  // namespace rackrun::runtime
