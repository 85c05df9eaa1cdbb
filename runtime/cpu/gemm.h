// Dense GEMM for the CPU backend: C = alpha * op(A) * op(B) + beta * C, row-major.
//
// Backend (chosen by measurement, see tools/bench/train_step_bench.cc): Debian's OpenBLAS
// 0.3.21 in single-threaded mode, with the output split into fixed contiguous blocks
// across the OpenMP threads. OpenBLAS's DYNAMIC_ARCH picks its Haswell kernels on this
// AVX2 EPYC (no AVX-512 here, so OPENBLAS_CORETYPE=SkylakeX would fault); one OpenMP pool
// beats OpenBLAS's own pthread pool on the step's small GEMMs (about 150 vs 120 GFLOP/s
// on 2 threads) and leaves one thread pool in the process.
//
// Determinism: the split depends only on the shape and the thread count, and every
// output element is reduced over K by one kernel call in a fixed order, so results are
// bit-identical run to run for a fixed thread count.
#ifndef RACKRUN_RUNTIME_CPU_GEMM_H_
#define RACKRUN_RUNTIME_CPU_GEMM_H_

#include <string>

namespace rackrun::runtime::cpu {

// Row-major GEMM. op(A) is m x k, op(B) is k x n, C is m x n. Runs on all OpenMP threads
// when called outside a parallel region, single-threaded inside one. Adds its wall time
// to GemmSeconds() when called outside a parallel region.
template <typename T>
void Gemm(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a, int lda, const T* b,
          int ldb, T beta, T* c, int ldc);

// Single-threaded GEMM for use inside a parallel region; never timed.
template <typename T>
void GemmSerial(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a, int lda,
                const T* b, int ldb, T beta, T* c, int ldc);

// Seconds spent in Gemm() since process start (main thread only); callers take
// differences.
double GemmSeconds();

// "openblas-<corename>", e.g. "openblas-Haswell": the kernel set actually running.
std::string GemmBackendName();

}  // namespace rackrun::runtime::cpu

#endif  // RACKRUN_RUNTIME_CPU_GEMM_H_
