#include "runtime/tensor.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace rackrun::runtime {
namespace {

TEST(TensorTest, ShapeSizeAndAlignment) {
  Tensor<float> t({3, 4, 5});
  EXPECT_EQ(t.rank(), 3);
  EXPECT_EQ(t.size(), 60);
  EXPECT_EQ(t.dim(0), 3);
  EXPECT_EQ(t.dim(2), 5);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % kTensorAlignment, 0u);
  for (int64_t i = 0; i < t.size(); ++i) EXPECT_EQ(t[i], 0.0f);
  EXPECT_EQ(t.row(2), t.data() + 40);
}

TEST(TensorTest, ResizeReusesTheBufferWhenItFits) {
  Tensor<double> t({16, 8});
  t.Fill(2.0);
  const double* before = t.data();
  t.Resize({4, 8});
  EXPECT_EQ(t.data(), before);
  EXPECT_EQ(t.size(), 32);
  EXPECT_EQ(t[31], 2.0);  // contents kept
  t.Resize({16, 8});
  EXPECT_EQ(t.data(), before);
  t.Resize({17, 8});
  EXPECT_NE(t.size(), 0);
  EXPECT_EQ(t.size(), 136);
  EXPECT_GE(t.capacity_bytes(), 136 * sizeof(double));
}

TEST(TensorTest, CopyIsDeepAndMoveTransfers) {
  Tensor<float> a({2, 2});
  a[3] = 7;
  Tensor<float> b = a;
  b[3] = 1;
  EXPECT_EQ(a[3], 7);
  const float* p = a.data();
  Tensor<float> c = std::move(a);
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(c[3], 7);
  EXPECT_EQ(a.size(), 0);  // NOLINT(bugprone-use-after-move): moved-from state is empty
}

}  // namespace
}  // namespace rackrun::runtime
