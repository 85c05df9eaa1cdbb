#include "runtime/cpu/gemm.h"

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/cpu/blas.h"
#include "runtime/layers/parameter.h"

namespace rackrun::runtime::cpu {
namespace {

template <typename T>
void NaiveGemm(bool ta, bool tb, int m, int n, int k, T alpha, const T* a, int lda, const T* b,
               int ldb, T beta, T* c, int ldc) {
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      long double acc = 0;
      for (int p = 0; p < k; ++p) {
        const T av = ta ? a[p * lda + i] : a[i * lda + p];
        const T bv = tb ? b[j * ldb + p] : b[p * ldb + j];
        acc += static_cast<long double>(av) * bv;
      }
      c[i * ldc + j] = static_cast<T>(alpha * acc + beta * c[i * ldc + j]);
    }
  }
}

// Gemm as the process chose to thread it, or one of the ways forced.
template <typename T>
using GemmFunction = void (*)(bool, bool, int, int, int, T, const T*, int, const T*, int, T, T*,
                              int);

template <typename T>
void CheckAgainstNaive(int m, int n, int k, double tol, GemmFunction<T> gemm = &Gemm<T>) {
  NormalInit rng(static_cast<uint64_t>(m * 131 + n * 7 + k));
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      // Leading dimensions larger than the logical width, as the layers use them.
      const int lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 5, ldc = n + 2;
      std::vector<T> a(static_cast<size_t>((ta ? k : m) * lda));
      std::vector<T> b(static_cast<size_t>((tb ? n : k) * ldb));
      std::vector<T> c(static_cast<size_t>(m * ldc));
      for (auto& x : a) x = static_cast<T>(rng.Next());
      for (auto& x : b) x = static_cast<T>(rng.Next());
      for (auto& x : c) x = static_cast<T>(rng.Next());
      std::vector<T> expect = c;
      NaiveGemm<T>(ta, tb, m, n, k, T(0.5), a.data(), lda, b.data(), ldb, T(0.25), expect.data(),
                   ldc);
      gemm(ta, tb, m, n, k, T(0.5), a.data(), lda, b.data(), ldb, T(0.25), c.data(), ldc);
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          ASSERT_NEAR(c[i * ldc + j], expect[i * ldc + j], tol * std::sqrt(static_cast<double>(k)))
              << "ta=" << ta << " tb=" << tb << " m=" << m << " n=" << n << " k=" << k << " at "
              << i << "," << j;
        }
      }
    }
  }
}

TEST(GemmTest, FloatMatchesNaiveReference) {
  CheckAgainstNaive<float>(7, 5, 3, 1e-5);
  CheckAgainstNaive<float>(200, 96, 64, 1e-5);  // large enough to split rows over threads
  CheckAgainstNaive<float>(33, 260, 70, 1e-5);  // splits columns
}

TEST(GemmTest, DoubleMatchesNaiveReference) {
  CheckAgainstNaive<double>(7, 5, 3, 1e-13);
  CheckAgainstNaive<double>(200, 96, 64, 1e-13);
  CheckAgainstNaive<double>(33, 260, 70, 1e-13);
}

template <GemmThreading how>
void GemmForced(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
                const float* b, int ldb, float beta, float* c, int ldc) {
  GemmWith<float>(how, 2, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

TEST(GemmTest, EveryWayOfThreadingMatchesTheNaiveReference) {
  CheckAgainstNaive<float>(200, 96, 64, 1e-5, &GemmForced<GemmThreading::kSerial>);
  CheckAgainstNaive<float>(33, 260, 70, 1e-5, &GemmForced<GemmThreading::kSplit>);
  CheckAgainstNaive<float>(200, 96, 64, 1e-5, &GemmForced<GemmThreading::kSplit>);
  if (!Blas().openmp) GTEST_SKIP() << "OpenBLAS's OpenMP build is not loaded: " << Blas().path;
  CheckAgainstNaive<float>(200, 96, 64, 1e-5, &GemmForced<GemmThreading::kLibrary>);
  CheckAgainstNaive<float>(33, 260, 70, 1e-5, &GemmForced<GemmThreading::kLibrary>);
}

// The choice by measurement is only made where it cannot change a bit: then the split and
// OpenBLAS's threads give the same products on the demo model's shapes too.
TEST(GemmTest, AMeasuredChoiceCannotChangeBits) {
  const GemmThreadingChoice& choice = GemmThreadingFor(2);
  if (choice.reason != "measured") {
    EXPECT_EQ(choice.threading, GemmThreading::kSplit) << choice.reason;
    GTEST_SKIP() << "no measured choice on this machine: " << choice.reason;
  }
  EXPECT_GT(choice.split_seconds, 0);
  EXPECT_GT(choice.library_seconds, 0);
  NormalInit rng(11);
  for (const auto& [m, n, k, tb] : std::vector<std::tuple<int, int, int, bool>>{
           {2048, 384, 128, true}, {256, 512, 128, true}, {128, 512, 256, false}}) {
    std::vector<float> a(static_cast<size_t>(m) * k), b(static_cast<size_t>(k) * n);
    for (auto& x : a) x = static_cast<float>(rng.Next());
    for (auto& x : b) x = static_cast<float>(rng.Next());
    std::vector<float> split(static_cast<size_t>(m) * n), library(split.size());
    const int ldb = tb ? k : n;
    GemmWith<float>(GemmThreading::kSplit, 2, false, tb, m, n, k, 1.0f, a.data(), k, b.data(), ldb,
                    0.0f, split.data(), n);
    GemmWith<float>(GemmThreading::kLibrary, 2, false, tb, m, n, k, 1.0f, a.data(), k, b.data(),
                    ldb, 0.0f, library.data(), n);
    EXPECT_EQ(split, library) << m << "x" << n << "x" << k;
  }
}

TEST(GemmTest, DescriptionNamesKernelsAndThreading) {
  const std::string line = GemmDescription(2);
  EXPECT_THAT(line, ::testing::HasSubstr("openblas " + Blas().core + " kernels"));
  EXPECT_THAT(line, ::testing::HasSubstr("GEMM threads: 2, "));
  EXPECT_THAT(GemmDescription(1), ::testing::HasSubstr("GEMM threads: 1, one thread"));
}

TEST(GemmTest, ZeroDepthScalesByBeta) {
  std::vector<float> c = {1, 2, 3, 4};
  Gemm<float>(false, false, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.5f, c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>{0.5f, 1, 1.5f, 2}));
}

TEST(GemmTest, RepeatedCallsAreBitIdentical) {
  const int m = 512, n = 384, k = 128;
  NormalInit rng(3);
  std::vector<float> a(m * k), b(k * n), c1(m * n), c2(m * n);
  for (auto& x : a) x = static_cast<float>(rng.Next());
  for (auto& x : b) x = static_cast<float>(rng.Next());
  Gemm<float>(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c1.data(), n);
  Gemm<float>(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c2.data(), n);
  EXPECT_EQ(c1, c2);
}

TEST(GemmTest, BackendIsOpenBlasWithANamedCore) {
  const std::string name = GemmBackendName();
  EXPECT_EQ(name.rfind("openblas-", 0), 0u) << name;
  EXPECT_GT(name.size(), std::string("openblas-").size());
}

}  // namespace
}  // namespace rackrun::runtime::cpu
