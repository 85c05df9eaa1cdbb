// The cuBLASLt GEMM against runtime/cpu/gemm.h's Gemm (the CPU engine's), every transpose
// combination, odd shapes, padded leading dimensions, accumulation (beta = 1), in the three
// precisions. Tolerances, relative to the largest |C|: fp32 1e-5 (same arithmetic, another
// summation order); TF32 5e-3 (10-bit mantissa inputs: 2^-11 relative per product, summed
// over K with cancellation); bf16 inputs 2e-2 (8-bit mantissa).
#include "runtime/cuda/gemm.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "runtime/cpu/gemm.h"
#include "runtime/cuda/kernels.h"
#include "runtime/cuda/test_util.h"

namespace rackrun::runtime::cuda {
namespace {

using testing::Download;
using testing::RandomVector;
using testing::Upload;

struct Case {
  bool ta, tb;
  int m, n, k;
};

// Leading dimensions past the rows' lengths: odd ones in fp32; multiples of 8 elements (16
// bytes, the tensor-core kernels' alignment, as the engine's own buffers are) in TF32 and
// bf16.
int Ld(int row, int pad, GemmPrecision p) {
  return p == GemmPrecision::kFp32 ? row + pad : (row + 7) / 8 * 8 + 8;
}

void RunCase(Device* dev, Gemm& gemm, const Case& c, GemmPrecision precision, float beta,
             double tol) {
  const int lda = Ld(c.ta ? c.m : c.k, 3, precision), ldb = Ld(c.tb ? c.k : c.n, 1, precision),
            ldc = Ld(c.n, 5, precision);
  const int a_rows = c.ta ? c.k : c.m, b_rows = c.tb ? c.n : c.k;
  std::vector<float> a = RandomVector(int64_t{a_rows} * lda, 1);
  std::vector<float> b = RandomVector(int64_t{b_rows} * ldb, 2);
  std::vector<float> cc = RandomVector(int64_t{c.m} * ldc, 3);
  std::vector<float> expect = cc;
  if (precision == GemmPrecision::kBf16) {
    // The oracle sees the inputs the GPU sees: rounded to bf16.
    for (float& v : a) v = __bfloat162float(__float2bfloat16_rn(v));
    for (float& v : b) v = __bfloat162float(__float2bfloat16_rn(v));
  }
  cpu::Gemm<float>(c.ta, c.tb, c.m, c.n, c.k, 1.5f, a.data(), lda, b.data(), ldb, beta,
                   expect.data(), ldc);
  DeviceTensor<float> da = Upload(dev, "a", a), db = Upload(dev, "b", b), dc = Upload(dev, "c", cc);
  const GemmShape shape{c.ta, c.tb, c.m, c.n, c.k, lda, ldb, ldc};
  absl::Status s;
  if (precision == GemmPrecision::kBf16) {
    DeviceTensor<bf16> ha(dev, "a16"), hb(dev, "b16");
    ASSERT_TRUE(ha.Resize({da.size()}).ok());
    ASSERT_TRUE(hb.Resize({db.size()}).ok());
    ASSERT_EQ(kernels::F32ToBf16(da.size(), da.data(), ha.data(), dev->stream()), cudaSuccess);
    ASSERT_EQ(kernels::F32ToBf16(db.size(), db.data(), hb.data(), dev->stream()), cudaSuccess);
    s = gemm.Run(shape, 1.5f, ha.data(), hb.data(), beta, dc.data(), precision, DataType::kF32);
  } else {
    s = gemm.Run(shape, 1.5f, da.data(), db.data(), beta, dc.data(), precision);
  }
  ASSERT_TRUE(s.ok()) << s;
  const std::vector<float> got = Download(dc);
  // Padding columns of C stay untouched.
  for (int i = 0; i < c.m; ++i)
    for (int j = c.n; j < ldc; ++j) ASSERT_EQ(got[i * ldc + j], cc[i * ldc + j]);
  RACKRUN_EXPECT_CLOSE(got, expect, tol);
}

class GemmPrecisionTest : public ::testing::TestWithParam<GemmPrecision> {};

TEST_P(GemmPrecisionTest, MatchesTheCpuGemm) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  Gemm gemm(dev.get());
  const GemmPrecision p = GetParam();
  const double tol = p == GemmPrecision::kFp32 ? 1e-5 : (p == GemmPrecision::kTf32 ? 5e-3 : 2e-2);
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (const Case& c : {Case{ta, tb, 1, 1, 1}, Case{ta, tb, 37, 19, 53},
                            Case{ta, tb, 256, 128, 512}, Case{ta, tb, 5, 300, 7}}) {
        SCOPED_TRACE(absl::StrCat("ta ", c.ta, " tb ", c.tb, " m ", c.m, " n ", c.n, " k ", c.k));
        RunCase(dev.get(), gemm, c, p, 0.0f, tol);
        RunCase(dev.get(), gemm, c, p, 1.0f, tol);
      }
}

INSTANTIATE_TEST_SUITE_P(Precisions, GemmPrecisionTest,
                         ::testing::Values(GemmPrecision::kFp32, GemmPrecision::kTf32,
                                           GemmPrecision::kBf16),
                         [](const ::testing::TestParamInfo<GemmPrecision>& param) {
                           return std::string(GemmPrecisionName(param.param));
                         });

TEST(GemmTest, BadShapesAreErrors) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  Gemm gemm(dev.get());
  float* p = nullptr;
  EXPECT_FALSE(gemm.Run(GemmShape{false, false, 4, 4, 4, 2, 4, 4}, 1, p, p, 0, p).ok());  // lda < k
  EXPECT_FALSE(gemm.Run(GemmShape{false, false, 4, 4, 0, 1, 4, 4}, 1, p, p, 0, p).ok());  // beta 0
  EXPECT_TRUE(gemm.Run(GemmShape{false, false, 4, 4, 0, 1, 4, 4}, 1, p, p, 1, p).ok());   // no-op
  EXPECT_TRUE(gemm.Run(GemmShape{false, false, 0, 4, 4, 4, 4, 4}, 1, p, p, 0, p).ok());
}

TEST(GemmTest, PrecisionNames) {
  EXPECT_EQ(ParseGemmPrecision("tf32").value(), GemmPrecision::kTf32);
  EXPECT_EQ(GemmPrecisionName(GemmPrecision::kBf16), "bf16");
  absl::StatusOr<GemmPrecision> bad = ParseGemmPrecision("fp16");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("model.precision"), std::string::npos);
}

}  // namespace
}  // namespace rackrun::runtime::cuda
