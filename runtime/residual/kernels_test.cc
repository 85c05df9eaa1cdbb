// The residual component's all-token projection kernels against plain double loops:
// ProjectRows (packed-weight projection of many rows onto few outputs) and BatchGemm
// (OpenBLAS split over the threads). Tolerances: float results within 1e-5 of the
// reference relative to sum |x||w| (the error scale of a K-term float sum), double within
// 1e-12; ProjectRows must give bit-identical outputs however the rows are split.
#include "runtime/residual/kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace rackrun::runtime::residual_internal {
namespace {

template <typename T>
std::vector<T> Random(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<T> v(n);
  for (T& x : v) x = static_cast<T>(normal(rng));
  return v;
}

template <typename T>
void CheckProjectRows(int rows, int P, int64_t K, double tol) {
  const int64_t ldx = K + 3;  // rows not contiguous, as the saved active rows are
  const std::vector<T> x = Random<T>(static_cast<size_t>(rows * ldx), 1);
  const std::vector<T> w = Random<T>(static_cast<size_t>(P * K), 2);
  const int Ppad = PaddedOutputs<T>(P);
  ASSERT_EQ(Ppad % kLanes<T>, 0);
  ASSERT_GE(Ppad, P);
  std::vector<T> wt(static_cast<size_t>(K * Ppad));
  PackTransposed(w.data(), K, P, K, wt.data());
  std::vector<T> z(static_cast<size_t>(rows * Ppad), T(-7));
  ProjectRows(x.data(), ldx, rows, wt.data(), Ppad, K, z.data(), Ppad);
  for (int r = 0; r < rows; ++r)
    for (int p = 0; p < Ppad; ++p) {
      double ref = 0, mag = 0;
      if (p < P)
        for (int64_t e = 0; e < K; ++e) {
          ref += static_cast<double>(x[r * ldx + e]) * w[p * K + e];
          mag += std::abs(static_cast<double>(x[r * ldx + e]) * w[p * K + e]);
        }
      ASSERT_NEAR(z[r * Ppad + p], ref, tol * (mag + 1))
          << "rows " << rows << " P " << P << " K " << K << " at " << r << "," << p;
    }
  // Any split of the rows gives the same bits.
  std::vector<T> z2(z.size());
  for (int r0 = 0; r0 < rows; r0 += 3)
    ProjectRows(x.data() + r0 * ldx, ldx, std::min(3, rows - r0), wt.data(), Ppad, K,
                z2.data() + r0 * Ppad, Ppad);
  for (size_t i = 0; i < z.size(); ++i)
    ASSERT_EQ(z[i], z2[i]) << "rows " << rows << " P " << P << " K " << K << " at " << i;
}

TEST(ResidualKernelsTest, ProjectRowsMatchesReference) {
  for (int P : {1, 5, 20, 32, 48, 80})
    for (int64_t K : {int64_t{1}, int64_t{37}, int64_t{512}, int64_t{3000}})
      for (int rows : {1, 2, 7, 40}) {
        CheckProjectRows<float>(rows, P, K, 1e-5);
        CheckProjectRows<double>(rows, P, K, 1e-12);
      }
}

TEST(ResidualKernelsTest, ProjectRowsCrossesRowBlocks) {
  CheckProjectRows<float>(300, 20, 64, 1e-5);
}

template <typename T>
void CheckBatchGemm(bool ta, bool tb, int m, int n, int k, double tol) {
  const int lda = ta ? m : k, ldb = tb ? k : n, ldc = n;
  const std::vector<T> a = Random<T>(static_cast<size_t>((ta ? k : m) * lda), 3);
  const std::vector<T> b = Random<T>(static_cast<size_t>((tb ? n : k) * ldb), 4);
  const std::vector<T> c0 = Random<T>(static_cast<size_t>(m * ldc), 5);
  std::vector<T> serial = c0, par = c0, par2 = c0;
  BatchGemm<T>(false, ta, tb, m, n, k, T(1), a.data(), lda, b.data(), ldb, T(1), serial.data(),
               ldc);
  BatchGemm<T>(true, ta, tb, m, n, k, T(1), a.data(), lda, b.data(), ldb, T(1), par.data(), ldc);
  BatchGemm<T>(true, ta, tb, m, n, k, T(1), a.data(), lda, b.data(), ldb, T(1), par2.data(), ldc);
  EXPECT_EQ(par, par2);  // run to run
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double ref = c0[i * ldc + j], mag = std::abs(static_cast<double>(c0[i * ldc + j]));
      for (int e = 0; e < k; ++e) {
        const double av = ta ? a[e * lda + i] : a[i * lda + e];
        const double bv = tb ? b[j * ldb + e] : b[e * ldb + j];
        ref += av * bv;
        mag += std::abs(av * bv);
      }
      ASSERT_NEAR(serial[i * ldc + j], ref, tol * (mag + 1));
      ASSERT_NEAR(par[i * ldc + j], ref, tol * (mag + 1));
    }
}

TEST(ResidualKernelsTest, BatchGemmMatchesReference) {
  // The three shapes the xhc backward uses: dX += c W (m >= n: split by rows),
  // dW += c^T X (m < n: split by columns), and a square one.
  CheckBatchGemm<float>(false, false, 100, 40, 20, 1e-5);
  CheckBatchGemm<float>(true, false, 20, 300, 70, 1e-5);
  CheckBatchGemm<float>(false, true, 50, 50, 50, 1e-5);
  CheckBatchGemm<double>(false, false, 100, 40, 20, 1e-12);
  CheckBatchGemm<double>(true, false, 20, 300, 70, 1e-12);
}

}  // namespace
}  // namespace rackrun::runtime::residual_internal
