#include "runtime/residual/sinkhorn.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace rackrun::runtime {
namespace {

std::vector<double> RandomLogits(int n, double scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<double> z(static_cast<size_t>(n * n));
  for (double& v : z) v = normal(rng);
  return z;
}

TEST(SinkhornProjectionTest, RowsSumToOneColumnsApproximately) {
  for (int n : {2, 4, 7}) {
    SinkhornProjection<double> sk(n, 20);
    const std::vector<double> z = RandomLogits(n, 1.0, 11 + n);
    std::vector<double> h(z.size());
    sk.Forward(z.data(), h.data(), nullptr);
    for (int a = 0; a < n; ++a) {
      double row = 0, col = 0;
      for (int b = 0; b < n; ++b) {
        row += h[a * n + b];
        col += h[b * n + a];
        EXPECT_GT(h[a * n + b], 0.0);
      }
      EXPECT_NEAR(row, 1.0, 1e-5) << "n=" << n << " row " << a;
      EXPECT_LE(row, 1.0);
      EXPECT_NEAR(col, 1.0, 1e-3) << "n=" << n << " col " << a;
    }
  }
}

TEST(SinkhornProjectionTest, ColumnErrorGrowsWithLogitScale) {
  // Columns are only approximately normalised after a fixed number of iterations.
  SinkhornProjection<double> sk(4, 20);
  auto col_error = [&](double scale) {
    const std::vector<double> z = RandomLogits(4, scale, 5);
    std::vector<double> h(z.size());
    sk.Forward(z.data(), h.data(), nullptr);
    double worst = 0;
    for (int b = 0; b < 4; ++b) {
      double col = 0;
      for (int a = 0; a < 4; ++a) col += h[a * 4 + b];
      worst = std::max(worst, std::abs(col - 1));
    }
    return worst;
  };
  EXPECT_LT(col_error(0.5), 1e-5);  // eps-level
  EXPECT_GT(col_error(8.0), col_error(0.5));
}

TEST(SinkhornProjectionTest, BackwardMatchesCentralDifferences) {
  for (int n : {3, 4}) {
    for (int iters : {1, 5, 20}) {
      SinkhornProjection<double> sk(n, iters);
      const std::vector<double> z = RandomLogits(n, 1.5, 100 + n * 7 + iters);
      const std::vector<double> w = RandomLogits(n, 1.0, 200 + n);  // loss weights
      auto loss = [&](const std::vector<double>& zz) {
        std::vector<double> h(zz.size());
        sk.Forward(zz.data(), h.data(), nullptr);
        double s = 0;
        for (size_t i = 0; i < h.size(); ++i) s += w[i] * h[i] + 0.5 * h[i] * h[i];
        return s;
      };
      std::vector<double> h(z.size()), tape(static_cast<size_t>(sk.tape_size()));
      sk.Forward(z.data(), h.data(), tape.data());
      std::vector<double> dh(z.size()), dz(z.size());
      for (size_t i = 0; i < h.size(); ++i) dh[i] = w[i] + h[i];
      sk.Backward(z.data(), tape.data(), dh.data(), dz.data());
      for (size_t i = 0; i < z.size(); ++i) {
        std::vector<double> zp = z, zm = z;
        const double eps = 1e-6;
        zp[i] += eps;
        zm[i] -= eps;
        const double num = (loss(zp) - loss(zm)) / (2 * eps);
        EXPECT_NEAR(dz[i], num, 1e-7 + 1e-6 * std::abs(num))
            << "n=" << n << " iters=" << iters << " entry " << i;
      }
    }
  }
}

TEST(SinkhornProjectionTest, FloatMatchesDouble) {
  SinkhornProjection<double> skd(4, 20);
  SinkhornProjection<float> skf(4, 20);
  const std::vector<double> z = RandomLogits(4, 1.0, 9);
  std::vector<float> zf(z.begin(), z.end());
  std::vector<double> hd(16);
  std::vector<float> hf(16);
  skd.Forward(z.data(), hd.data(), nullptr);
  skf.Forward(zf.data(), hf.data(), nullptr);
  for (int i = 0; i < 16; ++i) EXPECT_NEAR(hf[i], hd[i], 1e-5);
}

// The algorithm as the header states it, one matrix at a time in plain scalar code.
std::vector<double> ReferenceForward(const std::vector<double>& z, int n, int iters) {
  std::vector<double> h(z.size());
  for (int a = 0; a < n; ++a) {
    double mx = z[a * n];
    for (int b = 1; b < n; ++b) mx = std::max(mx, z[a * n + b]);
    for (int b = 0; b < n; ++b) h[a * n + b] = std::exp(z[a * n + b] - mx);
  }
  for (int it = 0; it < iters; ++it) {
    for (int b = 0; b < n; ++b) {
      double c = 0;
      for (int a = 0; a < n; ++a) c += h[a * n + b];
      for (int a = 0; a < n; ++a) h[a * n + b] /= c + SinkhornProjection<double>::kEps;
    }
    for (int a = 0; a < n; ++a) {
      double r = 0;
      for (int b = 0; b < n; ++b) r += h[a * n + b];
      for (int b = 0; b < n; ++b) h[a * n + b] /= r + SinkhornProjection<double>::kEps;
    }
  }
  return h;
}

TEST(SinkhornProjectionTest, ForwardMatchesTheScalarAlgorithm) {
  for (int n : {1, 2, 4, 7, 16}) {
    SinkhornProjection<double> sk(n, 20);
    const std::vector<double> z = RandomLogits(n, 2.0, 300 + n);
    std::vector<double> h(z.size());
    sk.Forward(z.data(), h.data(), nullptr);
    const std::vector<double> ref = ReferenceForward(z, n, 20);
    for (size_t i = 0; i < h.size(); ++i)
      EXPECT_NEAR(h[i], ref[i], 1e-14) << "n=" << n << " entry " << i;
  }
}

// A batch runs its matrices one per vector lane: every matrix gets, bit for bit, what it
// gets alone, whatever the batch size and its place in the batch (forward and backward).
template <typename T>
void CheckBatchesAreLaneIndependent() {
  constexpr int kB = SinkhornProjection<T>::kBatch;
  for (int n : {1, 3, 4, 16}) {
    SinkhornProjection<T> sk(n, 7);
    const size_t nn = static_cast<size_t>(n * n);
    std::vector<std::vector<T>> z(kB), dh(kB), h1(kB), dz1(kB);
    for (int i = 0; i < kB; ++i) {
      const std::vector<double> zd = RandomLogits(n, 1.5, 400 + i * 31 + n);
      const std::vector<double> gd = RandomLogits(n, 1.0, 500 + i * 37 + n);
      z[i].assign(zd.begin(), zd.end());
      dh[i].assign(gd.begin(), gd.end());
      h1[i].resize(nn);
      dz1[i].resize(nn);
      std::vector<T> tape(static_cast<size_t>(sk.tape_size()));
      sk.Forward(z[i].data(), h1[i].data(), tape.data());
      sk.Backward(z[i].data(), tape.data(), dh[i].data(), dz1[i].data());
    }
    for (int count = 1; count <= kB; ++count) {
      for (int first = 0; first + count <= kB; first += std::max(1, kB - count)) {
        const T* zs[kB];
        const T* dhs[kB];
        T* hs[kB];
        T* dzs[kB];
        std::vector<std::vector<T>> h(kB, std::vector<T>(nn)), dz(kB, std::vector<T>(nn));
        for (int i = 0; i < count; ++i) {
          zs[i] = z[first + i].data();
          dhs[i] = dh[first + i].data();
          hs[i] = h[i].data();
          dzs[i] = dz[i].data();
        }
        std::vector<T> tape(static_cast<size_t>(sk.tape_size()));
        sk.ForwardBatch(count, zs, hs, tape.data());
        sk.BackwardBatch(count, zs, tape.data(), dhs, dzs);
        for (int i = 0; i < count; ++i) {
          EXPECT_EQ(h[i], h1[first + i]) << "n=" << n << " count=" << count << " lane " << i;
          EXPECT_EQ(dz[i], dz1[first + i]) << "n=" << n << " count=" << count << " lane " << i;
        }
      }
    }
  }
}

TEST(SinkhornProjectionTest, BatchesAreLaneIndependentFloat) {
  CheckBatchesAreLaneIndependent<float>();
}
TEST(SinkhornProjectionTest, BatchesAreLaneIndependentDouble) {
  CheckBatchesAreLaneIndependent<double>();
}

}  // namespace
}  // namespace rackrun::runtime
