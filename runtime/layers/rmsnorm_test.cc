#include "runtime/layers/rmsnorm.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/layers/gradient_check.h"

namespace rackrun::runtime {
namespace {

using testing::Dot;
using testing::FillUniform;

TEST(RmsNormTest, NormalisesEachRowToUnitRms) {
  RmsNorm<double> norm(8, "n");
  std::vector<double> x(3 * 8), y(3 * 8);
  FillUniform(x.data(), 24, 1, 3.0);
  norm.Forward(x.data(), 3, y.data());
  for (int r = 0; r < 3; ++r) {
    double ss = 0;
    for (int i = 0; i < 8; ++i) ss += y[r * 8 + i] * y[r * 8 + i];
    EXPECT_NEAR(ss / 8, 1.0, 1e-5);
  }
}

TEST(RmsNormTest, GradientCheckFp64) {
  const int rows = 5, c = 12;
  RmsNorm<double> norm(c, "n");
  FillUniform(norm.gain().value.data(), c, 2, 1.0);
  std::vector<double> x(rows * c), y(rows * c), r(rows * c), dx(rows * c);
  FillUniform(x.data(), rows * c, 3, 2.0);
  FillUniform(r.data(), rows * c, 4, 1.0);
  auto loss = [&] {
    norm.Forward(x.data(), rows, y.data());
    return Dot(y.data(), r.data(), rows * c);
  };
  loss();
  norm.Backward(x.data(), r.data(), rows, dx.data());
  testing::ExpectGradientMatches("x", x.data(), dx.data(), rows * c, loss, 60);
  testing::ExpectParameterGradientsMatch({norm.gain().Ref()}, loss);
}

}  // namespace
}  // namespace rackrun::runtime
