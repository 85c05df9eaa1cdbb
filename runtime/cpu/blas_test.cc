#include "runtime/cpu/blas.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::runtime::cpu {
namespace {

CpuVectorFeatures Avx512(bool bf16) {
  CpuVectorFeatures f;
  f.avx = f.avx2 = f.fma = true;
  f.avx512f = f.avx512cd = f.avx512bw = f.avx512dq = f.avx512vl = true;
  f.avx512bf16 = bf16;
  return f;
}

TEST(BlasTest, CoreFollowsFeaturesNotModels) {
  EXPECT_EQ(CoreForFeatures(Avx512(false)), "SkylakeX");
  EXPECT_EQ(CoreForFeatures(Avx512(true)), "Cooperlake");  // Zen 4, Sapphire/Emerald Rapids
  CpuVectorFeatures amd = Avx512(true);
  amd.amd = true;
  EXPECT_EQ(CoreForFeatures(amd), "Cooperlake");  // the vendor only tunes the AVX2 kernels

  // AVX-512 without all of the subsets OpenBLAS's SkylakeX kernels use: AVX2 kernels.
  CpuVectorFeatures partial = Avx512(false);
  partial.avx512bw = false;
  EXPECT_EQ(CoreForFeatures(partial), "Haswell");

  CpuVectorFeatures avx2;
  avx2.avx = avx2.avx2 = avx2.fma = true;
  EXPECT_EQ(CoreForFeatures(avx2), "Haswell");  // e.g. Intel's hybrid client CPUs
  avx2.amd = true;
  EXPECT_EQ(CoreForFeatures(avx2), "Zen");

  CpuVectorFeatures avx;
  avx.avx = true;
  EXPECT_EQ(CoreForFeatures(avx), "Sandybridge");
  EXPECT_EQ(CoreForFeatures(CpuVectorFeatures{}), "");  // OpenBLAS's own choice
}

TEST(BlasTest, CoreLevels) {
  EXPECT_EQ(CoreLevel("SkylakeX"), 4);
  EXPECT_EQ(CoreLevel("COOPERLAKE"), 4);  // OpenBLAS's own spelling varies in case
  EXPECT_EQ(CoreLevel("Haswell"), 3);
  EXPECT_EQ(CoreLevel("Zen"), 3);
  EXPECT_EQ(CoreLevel("Sandybridge"), 2);
  EXPECT_EQ(CoreLevel("Prescott"), 1);
  EXPECT_EQ(CoreLevel("Skylake"), 1);  // unknown names rank lowest
  EXPECT_EQ(CoreLevel(""), 1);
}

// On this machine, unless the user asked for other kernels: the loaded kernels are the ones
// the features call for, and nothing is reported.
TEST(BlasTest, LoadsTheKernelsThisCpuCallsFor) {
  const BlasLibrary& lib = Blas();
  ASSERT_NE(lib.sgemm, nullptr);
  ASSERT_NE(lib.dgemm, nullptr);
  EXPECT_FALSE(lib.path.empty());
  if (lib.user_core) GTEST_SKIP() << "OPENBLAS_CORETYPE is set: the user's kernels run";
  const std::string best = CoreForFeatures(DetectCpuVectorFeatures());
  EXPECT_EQ(lib.requested, best);
  if (!best.empty()) {
    EXPECT_EQ(CoreLevel(lib.core), CoreLevel(best)) << lib.core << " vs " << best;
  }
  EXPECT_EQ(lib.warning, "");
  EXPECT_THAT(BlasDescription(), ::testing::HasSubstr("openblas " + lib.core + " kernels"));
}

}  // namespace
}  // namespace rackrun::runtime::cpu
