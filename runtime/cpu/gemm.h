// Dense GEMM for the CPU backend: C = alpha * op(A) * op(B) + beta * C, row-major.
//
// Kernels: OpenBLAS with the kernel set this CPU's features call for (runtime/cpu/blas.h).
// Threads, outside a parallel region, one of two ways:
//   split:   the output is cut into fixed contiguous blocks (multiples of 16 rows or
//            columns), one single-threaded OpenBLAS call per OpenMP thread;
//   library: one call, threaded by OpenBLAS's OpenMP build on the same OpenMP pool.
// Neither wins everywhere: on a 2-core EPYC the split beat OpenBLAS's threads on the demo
// model's small GEMMs, on an Emerald Rapids Xeon it reached 0.55-0.63x of them. So the
// choice is made per process and thread count, at the first threaded GEMM, by measuring
// both on the demo model's shapes, but only where it cannot change a bit: the two must give
// bit-identical products on probe shapes first (OpenBLAS's SkylakeX kernels do, its Haswell
// ones do not: their results depend on how the rows are cut). Otherwise, and with the
// pthread build of OpenBLAS, the split. RACKRUN_GEMM_THREADING=split|library forces one.
// Inside a parallel region every call is single-threaded.
//
// Determinism: for a fixed thread count and kernel set, every output element is reduced over
// K by one kernel call in a fixed order, so results are bit-identical run to run.
#ifndef RACKRUN_RUNTIME_CPU_GEMM_H_
#define RACKRUN_RUNTIME_CPU_GEMM_H_

#include <string>

namespace rackrun::runtime::cpu {

// How a GEMM outside a parallel region is threaded over `threads` OpenMP threads.
enum class GemmThreading { kSerial, kSplit, kLibrary };

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

// Gemm threaded the way `how` says over `threads` threads, whatever the process chose:
// benchmarks compare the ways (kLibrary needs OpenBLAS's OpenMP build: Blas().openmp).
template <typename T>
void GemmWith(GemmThreading how, int threads, bool trans_a, bool trans_b, int m, int n, int k,
              T alpha, const T* a, int lda, const T* b, int ldb, T beta, T* c, int ldc);

// Seconds spent in Gemm() since process start (main thread only); callers take
// differences.
double GemmSeconds();

// "openblas-<corename>", e.g. "openblas-Haswell": the kernel set actually running.
std::string GemmBackendName();

struct GemmThreadingChoice {
  GemmThreading threading = GemmThreading::kSerial;
  std::string reason;        // why: "measured", "forced by RACKRUN_GEMM_THREADING", ...
  double split_seconds = 0;  // the measurement, when one was made
  double library_seconds = 0;
};
// The choice for `threads` (made on the first call for that count; later calls return it).
const GemmThreadingChoice& GemmThreadingFor(int threads);

// One line for the start-up log of programs that train: the BLAS, its kernels, and how a
// GEMM is threaded over `threads`: "openblas SkylakeX kernels (OpenMP build, chosen for this
// CPU's features); GEMM threads: library (measured: split 3.10 ms, library 1.92 ms)".
std::string GemmDescription(int threads);

}  // namespace rackrun::runtime::cpu

#endif  // RACKRUN_RUNTIME_CPU_GEMM_H_
