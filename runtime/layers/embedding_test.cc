#include "runtime/layers/embedding.h"

#include <vector>

#include "gtest/gtest.h"
#include "runtime/layers/gradient_check.h"

namespace rackrun::runtime {
namespace {

TEST(EmbeddingTest, GathersRowsAndScattersGradients) {
  Embedding<double> emb(5, 3, "embed");
  for (int64_t i = 0; i < 15; ++i) emb.table().value[i] = static_cast<double>(i);
  const std::vector<int32_t> tokens = {4, 0, 4};
  std::vector<double> out(9);
  emb.Forward(tokens.data(), 3, out.data());
  EXPECT_EQ(out, (std::vector<double>{12, 13, 14, 0, 1, 2, 12, 13, 14}));
  const std::vector<double> dout = {1, 2, 3, 10, 20, 30, 100, 200, 300};
  emb.Backward(tokens.data(), 3, dout.data());
  const double* g = emb.table().grad.data();
  EXPECT_EQ(g[0], 10);
  EXPECT_EQ(g[2], 30);
  EXPECT_EQ(g[12], 101);  // token 4 twice: gradients add
  EXPECT_EQ(g[14], 303);
  EXPECT_EQ(g[3], 0);
}

}  // namespace
}  // namespace rackrun::runtime
