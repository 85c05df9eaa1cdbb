#include "runtime/cpu/gemm.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "runtime/cpu/blas.h"

namespace rackrun::runtime::cpu {
namespace {

double g_gemm_seconds = 0;

inline void Call(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
  Blas().sgemm(kCblasRowMajor, ta ? kCblasTrans : kCblasNoTrans, tb ? kCblasTrans : kCblasNoTrans,
               m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void Call(bool ta, bool tb, int m, int n, int k, double alpha, const double* a, int lda,
                 const double* b, int ldb, double beta, double* c, int ldc) {
  Blas().dgemm(kCblasRowMajor, ta ? kCblasTrans : kCblasNoTrans, tb ? kCblasTrans : kCblasNoTrans,
               m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// The least work (multiply-adds) of one thread's piece of a split GEMM. Below it forking
// costs more than it saves, and OpenBLAS may take another code path: its SkylakeX kernels
// multiply products under 1e6 multiply-adds with "small matrix" kernels that round
// differently, so a piece that small would make the split's bits differ from one call's.
constexpr double kMinPieceWork = 2.0 * 1024 * 1024;

// One call on the calling thread alone. Inside an active parallel region OpenBLAS's OpenMP
// build is single-threaded by itself; outside one it threads over the calling thread's
// OpenMP thread count, so that count is 1 for the call.
template <typename T>
void CallSingleThreaded(bool ta, bool tb, int m, int n, int k, T alpha, const T* a, int lda,
                        const T* b, int ldb, T beta, T* c, int ldc) {
  if (omp_in_parallel() || !Blas().openmp) {
    Call(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  const int before = omp_get_max_threads();
  omp_set_num_threads(1);
  Call(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  omp_set_num_threads(before);
}

// The split: fixed blocks of rows (m >= n) or columns of C, multiples of 16, one per thread,
// as many as `threads` while each piece keeps kMinPieceWork.
template <typename T>
void SplitGemm(int max_threads, bool trans_a, bool trans_b, int m, int n, int k, T alpha,
               const T* a, int lda, const T* b, int ldb, T beta, T* c, int ldc) {
  const double work = static_cast<double>(m) * n * k;
  const int threads = static_cast<int>(
      std::min<double>({static_cast<double>(max_threads), std::floor(work / kMinPieceWork),
                        static_cast<double>((std::max(m, n) + 15) / 16)}));
  if (threads <= 1) {
    CallSingleThreaded(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  if (m >= n) {
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      const int blocks = (m + 15) / 16;
      const int b0 = static_cast<int>(static_cast<long>(blocks) * t / threads) * 16;
      const int b1 =
          std::min(m, static_cast<int>(static_cast<long>(blocks) * (t + 1) / threads) * 16);
      if (b1 > b0) {
        const T* a0 = trans_a ? a + b0 : a + static_cast<long>(b0) * lda;
        Call(trans_a, trans_b, b1 - b0, n, k, alpha, a0, lda, b, ldb, beta,
             c + static_cast<long>(b0) * ldc, ldc);
      }
    }
  } else {
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      const int blocks = (n + 15) / 16;
      const int b0 = static_cast<int>(static_cast<long>(blocks) * t / threads) * 16;
      const int b1 =
          std::min(n, static_cast<int>(static_cast<long>(blocks) * (t + 1) / threads) * 16);
      if (b1 > b0) {
        const T* bb = trans_b ? b + static_cast<long>(b0) * ldb : b + b0;
        Call(trans_a, trans_b, m, b1 - b0, k, alpha, a, lda, bb, ldb, beta, c + b0, ldc);
      }
    }
  }
}

// OpenBLAS's own threads over `threads` OpenMP threads (its OpenMP build only).
template <typename T>
void LibraryGemm(int threads, bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a,
                 int lda, const T* b, int ldb, T beta, T* c, int ldc) {
  const int before = omp_get_max_threads();
  if (before != threads) omp_set_num_threads(threads);
  Call(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  if (before != threads) omp_set_num_threads(before);
}

// A GEMM shape with its transposes.
struct Shape {
  int m, n, k;
  bool ta, tb;
};

// Whether the split and the library give the same bits as one call for `threads`, on odd
// shapes that cut rows, columns and both transposes differently.
bool ThreadingCannotChangeBits(int threads) {
  // Odd shapes, all transposes, with pieces just above the least piece (a 2-way split of the
  // first gives pieces of 2.1 and 2.2 million multiply-adds).
  constexpr std::array<Shape, 5> kProbes = {{{265, 131, 125, false, false},
                                             {203, 177, 129, false, true},
                                             {61, 701, 150, true, false},
                                             {333, 145, 96, true, true},
                                             {2053, 129, 131, false, true}}};
  for (const Shape& s : kProbes) {
    std::vector<float> a(static_cast<size_t>(s.m) * s.k), b(static_cast<size_t>(s.k) * s.n);
    uint32_t h = 2463534242u;
    const auto next = [&h] {  // xorshift: full mantissas, so orders round differently
      h ^= h << 13;
      h ^= h >> 17;
      h ^= h << 5;
      return static_cast<float>(h % 20011) / 10007.0f - 1.0f;
    };
    for (float& x : a) x = next();
    for (float& x : b) x = next();
    const int lda = s.ta ? s.m : s.k, ldb = s.tb ? s.k : s.n;
    std::vector<float> one(static_cast<size_t>(s.m) * s.n), split(one.size()), library(one.size());
    CallSingleThreaded(s.ta, s.tb, s.m, s.n, s.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f,
                       one.data(), s.n);
    SplitGemm(threads, s.ta, s.tb, s.m, s.n, s.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f,
              split.data(), s.n);
    LibraryGemm(threads, s.ta, s.tb, s.m, s.n, s.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f,
                library.data(), s.n);
    const size_t bytes = one.size() * sizeof(float);
    if (std::memcmp(one.data(), split.data(), bytes) != 0 ||
        std::memcmp(one.data(), library.data(), bytes) != 0) {
      return false;
    }
  }
  return true;
}

// Seconds for the demo model's GEMMs (2048 tokens, C = 128: QKV, output and LM-head shapes;
// an expert's 256 tokens through its 256-wide hidden layer, forward and backward), each way,
// the fastest of five rounds per shape, rounds alternating between the two.
void MeasureThreading(int threads, double* split_seconds, double* library_seconds) {
  constexpr std::array<Shape, 6> kShapes = {{{2048, 384, 128, false, true},
                                             {2048, 128, 128, false, true},
                                             {2048, 256, 128, false, true},
                                             {256, 512, 128, false, true},
                                             {256, 128, 256, false, false},
                                             {512, 128, 2048, true, false}}};
  *split_seconds = *library_seconds = 0;
  for (const Shape& s : kShapes) {
    std::vector<float> a(static_cast<size_t>(s.m) * s.k, 0.5f),
        b(static_cast<size_t>(s.k) * s.n, 0.25f), c(static_cast<size_t>(s.m) * s.n);
    const int lda = s.ta ? s.m : s.k, ldb = s.tb ? s.k : s.n;
    double best_split = 1e30, best_library = 1e30;
    for (int round = 0; round < 5; ++round) {
      for (const bool library : {false, true}) {
        const auto start = std::chrono::steady_clock::now();
        if (library) {
          LibraryGemm(threads, s.ta, s.tb, s.m, s.n, s.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f,
                      c.data(), s.n);
        } else {
          SplitGemm(threads, s.ta, s.tb, s.m, s.n, s.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f,
                    c.data(), s.n);
        }
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        double& best = library ? best_library : best_split;
        best = std::min(best, seconds);
      }
    }
    *split_seconds += best_split;
    *library_seconds += best_library;
  }
}

GemmThreadingChoice Decide(int threads) {
  GemmThreadingChoice choice;
  if (threads <= 1) {
    choice.reason = "one thread";
    return choice;
  }
  const char* forced = std::getenv("RACKRUN_GEMM_THREADING");
  const std::string_view force = forced != nullptr ? forced : "";
  if (force == "split" || (!Blas().openmp && force != "library")) {
    choice.threading = GemmThreading::kSplit;
    choice.reason = force == "split" ? "forced by RACKRUN_GEMM_THREADING"
                                     : "OpenBLAS's pthread build stays single-threaded";
    return choice;
  }
  if (force == "library") {
    if (!Blas().openmp) {
      std::fprintf(stderr,
                   "rackrun: RACKRUN_GEMM_THREADING=library needs OpenBLAS's OpenMP build "
                   "(Debian's libopenblas0-openmp), not %s; splitting GEMMs instead\n",
                   Blas().path.c_str());
      choice.threading = GemmThreading::kSplit;
      choice.reason = "RACKRUN_GEMM_THREADING=library without OpenBLAS's OpenMP build";
      return choice;
    }
    choice.threading = GemmThreading::kLibrary;
    choice.reason = "forced by RACKRUN_GEMM_THREADING";
    return choice;
  }
  if (!force.empty() && force != "auto") {
    std::fprintf(stderr,
                 "rackrun: RACKRUN_GEMM_THREADING=%s is not split, library or auto; "
                 "choosing by measurement\n",
                 forced);
  }
  if (!ThreadingCannotChangeBits(threads)) {
    choice.threading = GemmThreading::kSplit;
    choice.reason = absl::StrCat("OpenBLAS's ", Blas().core,
                                 " kernels give other bits when a GEMM is cut otherwise");
    return choice;
  }
  MeasureThreading(threads, &choice.split_seconds, &choice.library_seconds);
  // The split unless the library is clearly faster: within 10% either is within 0.9x of the
  // better one, and a margin keeps a noisy machine from flipping between runs.
  choice.threading = choice.library_seconds < 0.9 * choice.split_seconds ? GemmThreading::kLibrary
                                                                         : GemmThreading::kSplit;
  choice.reason = "measured";
  return choice;
}

const char* ThreadingName(GemmThreading t) {
  switch (t) {
    case GemmThreading::kSerial:
      return "one thread";
    case GemmThreading::kSplit:
      return "split";
    case GemmThreading::kLibrary:
      return "library";
  }
  return "?";
}

// The warning of blas.h, once, at the first GEMM (not at load: programs that never multiply
// a matrix, such as `rackrun status`, stay quiet).
void WarnOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (!Blas().warning.empty()) std::fprintf(stderr, "%s\n", Blas().warning.c_str());
  });
}

}  // namespace

const GemmThreadingChoice& GemmThreadingFor(int threads) {
  static std::mutex mu;
  static std::map<int, GemmThreadingChoice> choices;  // nodes never move: references stay
  std::lock_guard<std::mutex> lock(mu);
  auto it = choices.find(threads);
  if (it == choices.end()) it = choices.emplace(threads, Decide(threads)).first;
  return it->second;
}

template <typename T>
void GemmSerial(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a, int lda,
                const T* b, int ldb, T beta, T* c, int ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) c[static_cast<long>(i) * ldc + j] *= beta;
    return;
  }
  CallSingleThreaded(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

template <typename T>
void Gemm(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a, int lda, const T* b,
          int ldb, T beta, T* c, int ldc) {
  if (m <= 0 || n <= 0) return;
  const bool timed = !omp_in_parallel();
  const auto start = std::chrono::steady_clock::now();
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const double work = static_cast<double>(m) * n * std::max(k, 1);
  WarnOnce();
  if (threads <= 1 || work < 2 * kMinPieceWork || k <= 0) {
    GemmSerial(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else if (GemmThreadingFor(threads).threading == GemmThreading::kLibrary) {
    LibraryGemm(threads, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    SplitGemm(threads, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  if (timed) {
    g_gemm_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
}

template <typename T>
void GemmWith(GemmThreading how, int threads, bool trans_a, bool trans_b, int m, int n, int k,
              T alpha, const T* a, int lda, const T* b, int ldb, T beta, T* c, int ldc) {
  if (m <= 0 || n <= 0) return;
  if (how == GemmThreading::kSerial || threads <= 1 || k <= 0) {
    GemmSerial(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else if (how == GemmThreading::kLibrary) {
    LibraryGemm(threads, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    SplitGemm(threads, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

double GemmSeconds() { return g_gemm_seconds; }

std::string GemmBackendName() { return std::string("openblas-") + Blas().core; }

std::string GemmDescription(int threads) {
  const GemmThreadingChoice& choice = GemmThreadingFor(threads);
  std::string line = absl::StrCat(BlasDescription(), "; GEMM threads: ", threads, ", ",
                                  ThreadingName(choice.threading), " (", choice.reason);
  if (choice.split_seconds > 0) {
    absl::StrAppendFormat(&line, ": split %.2f ms, library %.2f ms", choice.split_seconds * 1e3,
                          choice.library_seconds * 1e3);
  }
  line += ")";
  return line;
}

template void Gemm<float>(bool, bool, int, int, int, float, const float*, int, const float*, int,
                          float, float*, int);
template void Gemm<double>(bool, bool, int, int, int, double, const double*, int, const double*,
                           int, double, double*, int);
template void GemmWith<float>(GemmThreading, int, bool, bool, int, int, int, float, const float*,
                              int, const float*, int, float, float*, int);
template void GemmSerial<float>(bool, bool, int, int, int, float, const float*, int, const float*,
                                int, float, float*, int);
template void GemmSerial<double>(bool, bool, int, int, int, double, const double*, int,
                                 const double*, int, double, double*, int);

}  // namespace rackrun::runtime::cpu
