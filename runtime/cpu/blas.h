// The BLAS library the CPU engine's GEMMs run on, loaded once per process with the kernels
// that fit this CPU.
//
// Why the runtime loads it itself: Debian's OpenBLAS (0.3.21, DYNAMIC_ARCH) picks its kernel
// set ("core") from a table of CPU models when it is loaded, and a CPU newer than the table
// gets its oldest kernels: an Emerald Rapids Xeon (AVX-512) ran the Prescott SSE3 kernels,
// 2.9x slower than the SkylakeX ones, and nothing said so. OpenBLAS reads OPENBLAS_CORETYPE
// only while it loads, so the runtime does not link it: on first use it names the core that
// the CPU's features call for (never its model number; `CoreForFeatures`), then dlopen()s
// the library. A user's OPENBLAS_CORETYPE wins; kernels older than the CPU supports, from
// whatever cause, are reported once on stderr with the fix.
//
// Which build: OpenBLAS's OpenMP build (Debian's libopenblas0-openmp) when installed: it
// threads on the process's one OpenMP pool and runs single-threaded inside a parallel
// region, so a GEMM may use OpenBLAS's own threading (runtime/cpu/gemm.h chooses). Else
// the system's libopenblas.so.0 (the pthread build), kept single-threaded. RACKRUN_OPENBLAS
// names a library file to load instead.
//
// Thread-safety: Blas() may be called from any thread; the library is loaded once.
#ifndef RACKRUN_RUNTIME_CPU_BLAS_H_
#define RACKRUN_RUNTIME_CPU_BLAS_H_

#include <string>
#include <string_view>

namespace rackrun::runtime::cpu {

// What an x86 CPU offers that decides a BLAS kernel set.
struct CpuVectorFeatures {
  bool amd = false;  // vendor: AMD's cores get OpenBLAS's Zen tuning of the AVX2 kernels
  bool avx = false, avx2 = false, fma = false;
  bool avx512f = false, avx512cd = false, avx512bw = false, avx512dq = false, avx512vl = false;
  bool avx512bf16 = false;
};

// This CPU's features (cpuid through __builtin_cpu_supports).
CpuVectorFeatures DetectCpuVectorFeatures();

// The OpenBLAS core for `f`: AVX-512 F/CD/BW/DQ/VL -> "Cooperlake" with AVX512-BF16 (its
// SkylakeX kernels plus bf16 ones), else "SkylakeX"; AVX2 + FMA -> "Zen" on AMD, "Haswell"
// otherwise; AVX -> "Sandybridge"; older: "" (OpenBLAS knows every such CPU).
std::string CoreForFeatures(const CpuVectorFeatures& f);

// The vector instruction level of an OpenBLAS core name (case-insensitive): 4 for the
// AVX-512 cores, 3 for AVX2 ones, 2 for AVX, 1 for anything older or unknown.
int CoreLevel(std::string_view core);

// CBLAS's argument values (fixed by the CBLAS interface).
inline constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112;

// The loaded library: entry points and what was chosen.
struct BlasLibrary {
  using Sgemm = void (*)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                         const float* a, int lda, const float* b, int ldb, float beta, float* c,
                         int ldc);
  using Dgemm = void (*)(int order, int trans_a, int trans_b, int m, int n, int k, double alpha,
                         const double* a, int lda, const double* b, int ldb, double beta, double* c,
                         int ldc);
  Sgemm sgemm = nullptr;
  Dgemm dgemm = nullptr;
  std::string path;        // the file loaded
  std::string core;        // the kernels running ("SkylakeX")
  std::string requested;   // the core the runtime asked for ("" when it left the choice)
  bool user_core = false;  // OPENBLAS_CORETYPE was the user's
  bool openmp = false;     // the OpenMP build: may thread on the process's pool
  std::string warning;     // non-empty: kernels older than the CPU supports, and the fix
};

// The process's BLAS, loaded on the first call (the warning, if any, printed then). A
// library that cannot be loaded ends the process with a message naming the file and the
// package to install: no GEMM can run without it.
const BlasLibrary& Blas();

// One line for logs: "openblas SkylakeX kernels (OpenMP build, chosen for AVX-512)".
std::string BlasDescription();

}  // namespace rackrun::runtime::cpu

#endif  // RACKRUN_RUNTIME_CPU_BLAS_H_
