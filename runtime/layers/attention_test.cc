#include "runtime/layers/attention.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/layers/gradient_check.h"

namespace rackrun::runtime {
namespace {

using testing::Dot;
using testing::FillUniform;

// doc_start for `batch` rows of `seq` tokens, with an extra document starting at
// `split` inside row 1 (when split > 0).
std::vector<int32_t> DocStarts(int batch, int seq, int split) {
  std::vector<int32_t> ds(static_cast<size_t>(batch * seq), 0);
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < seq; ++i) ds[b * seq + i] = (b == 1 && split > 0 && i >= split) ? split : 0;
  }
  return ds;
}

TEST(AttentionTest, GradientCheckFp64WithDocumentsInsideARow) {
  const int batch = 2, seq = 7, c = 8, heads = 2;
  Attention<double> attn(c, heads, seq, 10000.0, "a");
  NormalInit rng(11);
  attn.Init(rng, 0.4, 0.3);
  auto params = attn.Parameters();
  FillUniform(params[0].value, c, 12, 1.0);  // non-trivial norm gain
  const int64_t n = static_cast<int64_t>(batch) * seq * c;
  std::vector<double> u(n), out(n), r(n), du(n);
  FillUniform(u.data(), n, 13, 1.0);
  FillUniform(r.data(), n, 14, 1.0);
  const std::vector<int32_t> ds = DocStarts(batch, seq, 3);
  auto loss = [&] {
    attn.Forward(u.data(), batch, seq, ds.data(), out.data());
    return Dot(out.data(), r.data(), n);
  };
  loss();
  attn.Backward(r.data(), du.data());
  testing::ExpectGradientMatches("u", u.data(), du.data(), n, loss, 60);
  testing::ExpectParameterGradientsMatch(params, loss, 24);
}

TEST(AttentionTest, GradientCheckFp64AcrossCausalBlocks) {
  // seq 150 spans three 64-row query blocks; documents start at 40 and 100 (inside
  // blocks) in row 0.
  const int batch = 1, seq = 150, c = 4, heads = 2;
  Attention<double> attn(c, heads, seq, 10000.0, "a");
  NormalInit rng(31);
  attn.Init(rng, 0.5, 0.5);
  const int64_t n = static_cast<int64_t>(batch) * seq * c;
  std::vector<double> u(n), out(n), r(n), du(n);
  FillUniform(u.data(), n, 32, 1.0);
  FillUniform(r.data(), n, 33, 1.0);
  std::vector<int32_t> ds(seq);
  for (int i = 0; i < seq; ++i) ds[i] = i >= 100 ? 100 : (i >= 40 ? 40 : 0);
  auto loss = [&] {
    attn.Forward(u.data(), batch, seq, ds.data(), out.data());
    return Dot(out.data(), r.data(), n);
  };
  loss();
  attn.Backward(r.data(), du.data());
  testing::ExpectGradientMatches("u", u.data(), du.data(), n, loss, 40);
  testing::ExpectParameterGradientsMatch(attn.Parameters(), loss, 12);
}

TEST(AttentionTest, IsCausalAndStaysInsideDocuments) {
  const int batch = 2, seq = 6, c = 8, heads = 2;
  Attention<double> attn(c, heads, seq, 10000.0, "a");
  NormalInit rng(5);
  attn.Init(rng, 0.5, 0.5);
  const int64_t n = static_cast<int64_t>(batch) * seq * c;
  std::vector<double> u(n), out1(n), out2(n);
  FillUniform(u.data(), n, 6, 1.0);
  const std::vector<int32_t> ds = DocStarts(batch, seq, 3);
  attn.Forward(u.data(), batch, seq, ds.data(), out1.data());
  // Change token 4 of row 0 (future for tokens 0..3) and token 1 of row 1 (another
  // document for tokens 3..5 of row 1).
  for (int i = 0; i < c; ++i) {
    u[4 * c + i] += 1.0;
    u[(seq + 1) * c + i] -= 1.0;
  }
  attn.Forward(u.data(), batch, seq, ds.data(), out2.data());
  for (int t = 0; t < 4; ++t) {
    for (int i = 0; i < c; ++i) EXPECT_EQ(out1[t * c + i], out2[t * c + i]) << "row0 token " << t;
  }
  EXPECT_NE(out1[4 * c], out2[4 * c]);
  for (int t = 3; t < 6; ++t) {
    for (int i = 0; i < c; ++i) {
      EXPECT_EQ(out1[(seq + t) * c + i], out2[(seq + t) * c + i]) << "row1 token " << t;
    }
  }
}

TEST(AttentionTest, DocumentMidRowMatchesTheSameDocumentAtARowStart) {
  // Rotary attention depends on relative positions only: a document starting at index 3
  // gives the same outputs as the same tokens at the start of a row.
  const int seq = 6, c = 8, heads = 2;
  Attention<double> attn(c, heads, seq, 10000.0, "a");
  NormalInit rng(8);
  attn.Init(rng, 0.5, 0.5);
  std::vector<double> doc(3 * c);
  FillUniform(doc.data(), 3 * c, 9, 1.0);
  std::vector<double> shifted(seq * c), at_start(3 * c), out_shifted(seq * c), out_start(3 * c);
  FillUniform(shifted.data(), 3 * c, 10, 1.0);
  std::copy(doc.begin(), doc.end(), shifted.begin() + 3 * c);
  const std::vector<int32_t> ds_shifted = {0, 0, 0, 3, 3, 3};
  const std::vector<int32_t> ds_start = {0, 0, 0};
  attn.Forward(shifted.data(), 1, seq, ds_shifted.data(), out_shifted.data());
  attn.Forward(doc.data(), 1, 3, ds_start.data(), out_start.data());
  for (int i = 0; i < 3 * c; ++i) EXPECT_NEAR(out_shifted[3 * c + i], out_start[i], 1e-12);
}

}  // namespace
}  // namespace rackrun::runtime
