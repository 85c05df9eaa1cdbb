#include "runtime/cpu/gemm.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <string>

extern "C" {
char* openblas_get_corename(void);
void openblas_set_num_threads(int);
}

namespace rackrun::runtime::cpu {
namespace {

double g_gemm_seconds = 0;

// OpenBLAS must stay single-threaded: we parallelise outside it. Done once, before the
// first call, from a static initializer so every binary linking the runtime gets it.
struct OpenBlasSingleThreaded {
  OpenBlasSingleThreaded() { openblas_set_num_threads(1); }
};
const OpenBlasSingleThreaded g_openblas_single_threaded;

inline void Call(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n,
              k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void Call(bool ta, bool tb, int m, int n, int k, double alpha, const double* a, int lda,
                 const double* b, int ldb, double beta, double* c, int ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n,
              k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// Below this many multiply-adds one thread is faster than forking.
constexpr double kParallelThreshold = 64.0 * 64.0 * 64.0;

}  // namespace

template <typename T>
void GemmSerial(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a, int lda,
                const T* b, int ldb, T beta, T* c, int ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) c[static_cast<long>(i) * ldc + j] *= beta;
    return;
  }
  Call(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

template <typename T>
void Gemm(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a, int lda, const T* b,
          int ldb, T beta, T* c, int ldc) {
  if (m <= 0 || n <= 0) return;
  const bool timed = !omp_in_parallel();
  const auto start = std::chrono::steady_clock::now();
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const double work = static_cast<double>(m) * n * std::max(k, 1);
  if (threads <= 1 || work < kParallelThreshold || k <= 0) {
    GemmSerial(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else if (m >= n) {
    // Split rows of C (rows of op(A)) into `threads` fixed blocks, multiples of 16.
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      const int blocks = (m + 15) / 16;
      const int b0 = static_cast<int>(static_cast<long>(blocks) * t / threads) * 16;
      const int b1 =
          std::min(m, static_cast<int>(static_cast<long>(blocks) * (t + 1) / threads) * 16);
      if (b1 > b0) {
        const T* a0 = trans_a ? a + b0 : a + static_cast<long>(b0) * lda;
        GemmSerial(trans_a, trans_b, b1 - b0, n, k, alpha, a0, lda, b, ldb, beta,
                   c + static_cast<long>(b0) * ldc, ldc);
      }
    }
  } else {
    // Split columns of C (columns of op(B)).
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      const int blocks = (n + 15) / 16;
      const int b0 = static_cast<int>(static_cast<long>(blocks) * t / threads) * 16;
      const int b1 =
          std::min(n, static_cast<int>(static_cast<long>(blocks) * (t + 1) / threads) * 16);
      if (b1 > b0) {
        const T* bb = trans_b ? b + static_cast<long>(b0) * ldb : b + b0;
        GemmSerial(trans_a, trans_b, m, b1 - b0, k, alpha, a, lda, bb, ldb, beta, c + b0, ldc);
      }
    }
  }
  if (timed) {
    g_gemm_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
}

double GemmSeconds() { return g_gemm_seconds; }

std::string GemmBackendName() { return std::string("openblas-") + openblas_get_corename(); }

template void Gemm<float>(bool, bool, int, int, int, float, const float*, int, const float*, int,
                          float, float*, int);
template void Gemm<double>(bool, bool, int, int, int, double, const double*, int, const double*,
                           int, double, double*, int);
template void GemmSerial<float>(bool, bool, int, int, int, float, const float*, int, const float*,
                                int, float, float*, int);
template void GemmSerial<double>(bool, bool, int, int, int, double, const double*, int,
                                 const double*, int, double, double*, int);

}  // namespace rackrun::runtime::cpu
