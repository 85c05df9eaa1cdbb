// The CUDA simulator's cuBLASLt and cuBLAS (tests only): the entry points the GPU engine binds
// (cublaslt_library.h), computed on the CPU. Built as one shared library that the engine dlopens
// in place of libcublasLt.so.13 and libcublas.so.13; it needs the simulator's runtime (runtime.h)
// for streams and for telling device memory from host memory.
//
// Contract:
// - What is computed: column-major D = alpha op(A) op(B) + beta C, op(X) = X (N) or X^T (T):
//   * compute CUBLAS_COMPUTE_32F: A, B fp32 and C, D fp32; or A, B bf16 and C, D fp32 or bf16;
//   * compute CUBLAS_COMPUTE_32F_FAST_TF32: A, B fp32, each element rounded to TF32 (10 mantissa
//     bits, to nearest even) before multiplying; C, D fp32;
//   * alpha and beta fp32 (the scale type), read from the host when the call is made.
//   Each element's products are summed over k ascending in double (a product of two floats is
//   exact in double, so the sum does not depend on whether the compiler fuses multiply and add),
//   then alpha * sum + beta * C is rounded once to float (and that float to bf16, to nearest
//   even, for a bf16 D). Where beta = 0, C is not read (BLAS's rule: it may hold NaNs); alpha = 0
//   still multiplies A by B (NaNs in them propagate).
// - Order: every GEMM is queued with sim::Enqueue on its stream (the grouped GEMM's is the one
//   cublasSetStream gave its handle) and runs there, in order. Everything it needs is copied when
//   the call is made (descriptors may be destroyed, alpha and beta changed right after), except
//   the grouped GEMM's device pointer arrays, read when it runs, as a GPU reads them.
// - CUBLAS_STATUS_NOT_SUPPORTED: compute, scale or data types, or combinations of them, other
//   than the above; operations other than N and T; attributes other than those SetDescAttribute
//   and SetPreferenceAttribute name, or values of them other than the above (the device pointer
//   modes, epilogues, ...); sizes or leading dimensions above INT_MAX; A, B, C or D less aligned
//   than the algorithm assumes (the heuristic's algorithm assumes the preference's minimum
//   alignments, rounded down to a power of two of at most 256 bytes, as cuBLASLt's may; with no
//   algorithm given, only each element's alignment). A descriptor or preference that refused
//   a value remembers it and fails every later call with CUBLAS_STATUS_NOT_SUPPORTED: a caller
//   that ignores the setter's status would otherwise get another GEMM than the one it asked for.
// - CUBLAS_STATUS_INVALID_VALUE: layouts that do not fit the operation (op(A) m x k, op(B)
//   k x n, C and D m x n); a leading dimension below the rows; in place (C == D) with C's layout
//   not D's; A, B, C or D whose first or last element is not in memory from cudaMalloc (host
//   memory, pinned or not, is refused; C too where beta = 0); alpha or beta in device memory; a
//   workspace smaller than the algorithm needs (0 bytes here) or not in device memory; an
//   algorithm made for other types; the grouped GEMM's pointer arrays not in device memory, or
//   its per-group arrays (sizes, alpha, beta, ...) in it; a cuBLAS workspace not 256-byte aligned.
// - The grouped GEMM's matrices are checked when it runs (only then are their pointers known):
//   one outside device memory, an illegal address on a GPU, ends the process with a message
//   naming the problem and the pointers.
// - Thread-safe: handles and descriptors are separate objects; a cuBLAS handle's stream and
//   workspace are guarded by its mutex; the only global is an atomic algorithm counter. Changing
//   a descriptor while another thread uses it is the caller's race, as with cuBLAS.
#include <cublasLt.h>
#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/cuda/sim/runtime.h"

// cuBLAS's headers declare the handles' structs and never define them: these are the simulator's.
struct cublasLtContext {};

struct cublasContext {
  std::mutex mu;
  cudaStream_t stream = nullptr;  // cublasSetStream's; the legacy default stream at first
  void* workspace = nullptr;      // accepted, never used: no algorithm here needs one
  size_t workspace_bytes = 0;
};

namespace rackrun::runtime::cuda::sim {
namespace {

// ---- Numbers ------------------------------------------------------------------------------

float Bf16ToFloat(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaNs stay NaNs (quiet), overflow goes to infinity.
uint16_t FloatToBf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// TF32 keeps fp32's exponent and 10 of its 23 mantissa bits: round to nearest even at bit 13.
float RoundToTf32(float x) {
  if (!std::isfinite(x)) return x;
  const uint32_t u = std::bit_cast<uint32_t>(x);
  return std::bit_cast<float>((u + 0xfffu + ((u >> 13) & 1u)) & ~0x1fffu);
}

size_t ElementBytes(cudaDataType_t t) { return t == CUDA_R_16BF ? 2 : 4; }

float Load(cudaDataType_t t, const void* base, int64_t index) {
  if (t == CUDA_R_16BF) return Bf16ToFloat(static_cast<const uint16_t*>(base)[index]);
  return static_cast<const float*>(base)[index];
}

// ---- One GEMM, as the queued work sees it -----------------------------------------------------

struct Operand {
  cudaDataType_t type = CUDA_R_32F;
  const void* data = nullptr;
  int64_t ld = 0;
};

// Column-major D (m x n) = alpha op(A) op(B) + beta C; everything by value.
struct GemmWork {
  bool trans_a = false, trans_b = false, tf32 = false;
  int64_t m = 0, n = 0, k = 0;
  float alpha = 1.0f, beta = 0.0f;
  Operand a, b, c;
  cudaDataType_t d_type = CUDA_R_32F;
  void* d = nullptr;
  int64_t ldd = 0;
};

constexpr int64_t kPanel = 32;    // columns of D per pass
constexpr int64_t kDepth = 256;   // products per pass (op(B)'s rows of a panel stay in L1/L2)
constexpr int64_t kRowBlock = 4;  // rows of D whose sums are carried together (in registers)

// op(A) as m rows of k floats (TF32-rounded under TF32).
std::vector<float> PackA(const GemmWork& w) {
  std::vector<float> out(static_cast<size_t>(w.m * w.k));
  for (int64_t i = 0; i < w.m; ++i) {
    for (int64_t p = 0; p < w.k; ++p) {
      const int64_t at = w.trans_a ? p + i * w.a.ld : i + p * w.a.ld;
      const float x = Load(w.a.type, w.a.data, at);
      out[static_cast<size_t>(i * w.k + p)] = w.tf32 ? RoundToTf32(x) : x;
    }
  }
  return out;
}

// Columns j0 .. j0 + width of op(B) as k rows of kPanel doubles (zeros past `width`).
void PackPanelB(const GemmWork& w, int64_t j0, int64_t width, std::vector<double>& out) {
  out.assign(static_cast<size_t>(w.k * kPanel), 0.0);
  for (int64_t p = 0; p < w.k; ++p) {
    for (int64_t jj = 0; jj < width; ++jj) {
      const int64_t j = j0 + jj;
      const int64_t at = w.trans_b ? j + p * w.b.ld : p + j * w.b.ld;
      const float x = Load(w.b.type, w.b.data, at);
      out[static_cast<size_t>(p * kPanel + jj)] = w.tf32 ? RoundToTf32(x) : x;
    }
  }
}

// D's columns j0 .. j0 + width from their sums (m rows of kPanel).
void StorePanel(const GemmWork& w, int64_t j0, int64_t width, const std::vector<double>& sums) {
  for (int64_t jj = 0; jj < width; ++jj) {
    const int64_t j = j0 + jj;
    for (int64_t i = 0; i < w.m; ++i) {
      const double sum = sums[static_cast<size_t>(i * kPanel + jj)];
      const double alpha = w.alpha, beta = w.beta;
      // beta * C is exact in double, so the epilogue rounds once (then once more to float).
      const double v = w.beta == 0.0f
                           ? alpha * sum
                           : std::fma(alpha, sum, beta * Load(w.c.type, w.c.data, i + j * w.c.ld));
      const float f = static_cast<float>(v);
      const int64_t at = i + j * w.ldd;
      if (w.d_type == CUDA_R_16BF) {
        static_cast<uint16_t*>(w.d)[at] = FloatToBf16(f);
      } else {
        static_cast<float*>(w.d)[at] = f;
      }
    }
  }
}

// kRows rows of a panel's sums (`sums`; their rows of op(A) at `a`) over the products p0 .. p1,
// in local accumulators (no aliasing: they stay in registers); each sum adds in p order.
template <int64_t kRows>
void AccumulateRows(const float* a, int64_t k, const double* b, int64_t p0, int64_t p1,
                    double* sums) {
  double acc[kRows][kPanel];
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t jj = 0; jj < kPanel; ++jj) acc[r][jj] = sums[r * kPanel + jj];
  }
  for (int64_t p = p0; p < p1; ++p) {
    const double* bp = b + p * kPanel;
    for (int64_t r = 0; r < kRows; ++r) {
      const double x = a[r * k + p];
      for (int64_t jj = 0; jj < kPanel; ++jj) acc[r][jj] += x * bp[jj];
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t jj = 0; jj < kPanel; ++jj) sums[r * kPanel + jj] = acc[r][jj];
  }
}

// Each sum runs over k ascending whatever the blocking: a panel's sums persist across passes.
void RunGemm(const GemmWork& w) {
  if (w.m == 0 || w.n == 0) return;
  const std::vector<float> a = PackA(w);
  std::vector<double> b, sums;
  for (int64_t j0 = 0; j0 < w.n; j0 += kPanel) {
    const int64_t width = std::min(kPanel, w.n - j0);
    PackPanelB(w, j0, width, b);  // zero-padded to kPanel columns
    sums.assign(static_cast<size_t>(w.m * kPanel), 0.0);
    for (int64_t p0 = 0; p0 < w.k; p0 += kDepth) {
      const int64_t p1 = std::min(w.k, p0 + kDepth);
      int64_t i = 0;
      for (; i + kRowBlock <= w.m; i += kRowBlock) {
        AccumulateRows<kRowBlock>(&a[static_cast<size_t>(i * w.k)], w.k, b.data(), p0, p1,
                                  &sums[static_cast<size_t>(i * kPanel)]);
      }
      for (; i < w.m; ++i) {
        AccumulateRows<1>(&a[static_cast<size_t>(i * w.k)], w.k, b.data(), p0, p1,
                          &sums[static_cast<size_t>(i * kPanel)]);
      }
    }
    StorePanel(w, j0, width, sums);
  }
}

// ---- Checks shared by both libraries ----------------------------------------------------------

bool IsDevice(const void* p) { return Classify(p) == Memory::kDevice; }

// Whether the rows x cols matrix at `p` (columns `ld` apart) starts and ends in device memory.
bool MatrixOnDevice(const void* p, int64_t rows, int64_t cols, int64_t ld, size_t bytes) {
  if (rows == 0 || cols == 0) return true;
  if (p == nullptr) return false;
  const uintptr_t first = reinterpret_cast<uintptr_t>(p);
  const uintptr_t last = first + static_cast<uintptr_t>((cols - 1) * ld + rows) * bytes - 1;
  return IsDevice(p) && IsDevice(reinterpret_cast<const void*>(last));
}

bool OperandOnDevice(const Operand& o, int64_t rows, int64_t cols) {
  return MatrixOnDevice(o.data, rows, cols, o.ld, ElementBytes(o.type));
}

// A, B, C and D of `w` in device memory (C too where beta = 0 leaves it unread: a host C is a
// bug that beta hides).
bool GemmOnDevice(const GemmWork& w) {
  return OperandOnDevice(w.a, w.trans_a ? w.k : w.m, w.trans_a ? w.m : w.k) &&
         OperandOnDevice(w.b, w.trans_b ? w.n : w.k, w.trans_b ? w.k : w.n) &&
         OperandOnDevice(w.c, w.m, w.n) &&
         MatrixOnDevice(w.d, w.m, w.n, w.ldd, ElementBytes(w.d_type));
}

// The type combinations computed here (cuBLASLt's table, narrowed to the engine's).
bool SupportedTypes(cublasComputeType_t compute, cudaDataType_t a, cudaDataType_t b,
                    cudaDataType_t c, cudaDataType_t d) {
  if (a != b || c != d) return false;
  if (a == CUDA_R_32F) {
    return c == CUDA_R_32F &&
           (compute == CUBLAS_COMPUTE_32F || compute == CUBLAS_COMPUTE_32F_FAST_TF32);
  }
  if (a == CUDA_R_16BF) {
    return compute == CUBLAS_COMPUTE_32F && (c == CUDA_R_32F || c == CUDA_R_16BF);
  }
  return false;
}

// N -> false, T -> true; CUBLAS_STATUS_NOT_SUPPORTED for the conjugate ones.
cublasStatus_t ParseOperation(cublasOperation_t op, bool* trans) {
  if (op != CUBLAS_OP_N && op != CUBLAS_OP_T) return CUBLAS_STATUS_NOT_SUPPORTED;
  *trans = op == CUBLAS_OP_T;
  return CUBLAS_STATUS_SUCCESS;
}

const char* StatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char* StatusString(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "the library was not initialized (null handle)";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "a resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "an invalid value was passed (simulator: sizes, layouts, or memory not from "
             "cudaMalloc)";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "the device lacks a required architectural feature";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "the requested functionality is not supported (by the simulator: see "
             "runtime/cuda/sim/blas.cc)";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "a license check failed";
  }
  return "unknown cuBLAS status";
}

// ---- cuBLASLt's objects -----------------------------------------------------------------------

struct alignas(cublasLtMatrixLayoutOpaque_t) Layout {
  cudaDataType_t type = CUDA_R_32F;
  int64_t rows = 0, cols = 0, ld = 0;
};

constexpr int kNoneRefused = -1;

// Aligned as the opaque types the handles point to, so the casts below round-trip.
struct alignas(cublasLtMatmulDescOpaque_t) MatmulDesc {
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cudaDataType_t scale = CUDA_R_32F;
  cublasOperation_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
  int refused = kNoneRefused;  // an attribute given a value refused here
};

struct alignas(cublasLtMatmulPreferenceOpaque_t) Preference {
  uint64_t max_workspace = 0;
  uint32_t min_alignment[4] = {256, 256, 256, 256};  // A, B, C, D
  int refused = kNoneRefused;
};

// The opaque handles point at the objects above (callers never look inside).
Layout* Get(cublasLtMatrixLayout_t h) { return reinterpret_cast<Layout*>(h); }
MatmulDesc* Get(cublasLtMatmulDesc_t h) { return reinterpret_cast<MatmulDesc*>(h); }
Preference* Get(cublasLtMatmulPreference_t h) { return reinterpret_cast<Preference*>(h); }

// The algorithm record: what it was chosen for, in cublasLtMatmulAlgo_t's 8 words.
constexpr uint64_t kAlgoMagic = 0x7261636b73696d31;  // "racksim1"
enum AlgoWord { kMagic, kSerial, kTypes, kAlignments, kWorkspace };
std::atomic<uint64_t> algo_serial{0};

uint64_t TypeKey(const MatmulDesc& desc, const Layout& a, const Layout& b, const Layout& c,
                 const Layout& d) {
  const auto byte = [](int v) { return static_cast<uint64_t>(v) & 0xff; };
  return byte(desc.compute) | byte(desc.scale) << 8 | byte(a.type) << 16 | byte(b.type) << 24 |
         byte(c.type) << 32 | byte(d.type) << 40;
}

// What an algorithm chosen for buffers aligned to `preference` bytes may assume: the largest
// power of two, at most 256, dividing it (0 promises nothing: 1).
uint32_t AssumedAlignment(uint32_t preference) {
  if (preference == 0) return 1;
  uint32_t a = 256;
  while (a > 1 && preference % a != 0) a /= 2;
  return a;
}

uint32_t AlgoAlignment(const cublasLtMatmulAlgo_t& algo, int operand) {
  return static_cast<uint32_t>(algo.data[kAlignments] >> (16 * operand)) & 0xffff;
}

// Checks the descriptors against each other and fills `w`'s shape, types and operations.
cublasStatus_t Describe(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la,
                        cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc,
                        cublasLtMatrixLayout_t ld, GemmWork* w) {
  if (op == nullptr || la == nullptr || lb == nullptr || lc == nullptr || ld == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const MatmulDesc& desc = *Get(op);
  const Layout &a = *Get(la), &b = *Get(lb), &c = *Get(lc), &d = *Get(ld);
  if (desc.refused != kNoneRefused) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (!SupportedTypes(desc.compute, a.type, b.type, c.type, d.type)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  w->trans_a = desc.trans_a == CUBLAS_OP_T;
  w->trans_b = desc.trans_b == CUBLAS_OP_T;
  w->tf32 = desc.compute == CUBLAS_COMPUTE_32F_FAST_TF32;
  w->m = d.rows;
  w->n = d.cols;
  w->k = w->trans_a ? a.rows : a.cols;
  if ((w->trans_a ? a.cols : a.rows) != w->m) return CUBLAS_STATUS_INVALID_VALUE;
  if ((w->trans_b ? b.cols : b.rows) != w->k || (w->trans_b ? b.rows : b.cols) != w->n) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (c.rows != w->m || c.cols != w->n) return CUBLAS_STATUS_INVALID_VALUE;
  w->a = {a.type, nullptr, a.ld};
  w->b = {b.type, nullptr, b.ld};
  w->c = {c.type, nullptr, c.ld};
  w->d_type = d.type;
  w->ldd = d.ld;
  return CUBLAS_STATUS_SUCCESS;
}

// `algo` is one of ours, made for these types.
bool AlgoFits(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la,
              cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc, cublasLtMatrixLayout_t ld) {
  return algo.data[kMagic] == kAlgoMagic &&
         algo.data[kTypes] == TypeKey(*Get(op), *Get(la), *Get(lb), *Get(lc), *Get(ld));
}

// The pointers of a described GEMM against the algorithm's assumptions (null algo: only the
// elements' own alignment) and against where they live.
cublasStatus_t CheckPointers(const GemmWork& w, const cublasLtMatmulAlgo_t* algo) {
  const void* ptrs[4] = {w.a.data, w.b.data, w.c.data, w.d};
  const cudaDataType_t types[4] = {w.a.type, w.b.type, w.c.type, w.d_type};
  for (int i = 0; i < 4; ++i) {
    const uint64_t need =
        std::max<uint64_t>(ElementBytes(types[i]), algo != nullptr ? AlgoAlignment(*algo, i) : 1);
    if (reinterpret_cast<uintptr_t>(ptrs[i]) % need != 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return GemmOnDevice(w) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

// An int32 attribute value from `buf` (cuBLASLt's size check).
bool ReadInt32(const void* buf, size_t size, int32_t* v) {
  if (buf == nullptr || size != sizeof(int32_t)) return false;
  std::memcpy(v, buf, sizeof(int32_t));
  return true;
}

// The descriptor attributes computed here, all 4-byte values (attributes 0 to 7): compute type
// (32F, 32F_FAST_TF32), scale type (fp32), pointer mode (host), TRANSA and TRANSB (N, T), TRANSC
// (N), fill mode (full), epilogue (default).
cublasStatus_t SetDescAttribute(MatmulDesc& d, cublasLtMatmulDescAttributes_t attr, const void* buf,
                                size_t size) {
  int32_t v = 0;
  const bool handled =
      attr >= CUBLASLT_MATMUL_DESC_COMPUTE_TYPE && attr <= CUBLASLT_MATMUL_DESC_EPILOGUE;
  if (handled && !ReadInt32(buf, size, &v)) return CUBLAS_STATUS_INVALID_VALUE;
  bool ok = false;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE:
      ok = v == CUBLAS_COMPUTE_32F || v == CUBLAS_COMPUTE_32F_FAST_TF32;
      if (ok) d.compute = static_cast<cublasComputeType_t>(v);
      break;
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE:
      ok = v == CUDA_R_32F;
      break;
    case CUBLASLT_MATMUL_DESC_POINTER_MODE:
      ok = v == CUBLASLT_POINTER_MODE_HOST;
      break;
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB: {
      bool trans = false;
      ok = ParseOperation(static_cast<cublasOperation_t>(v), &trans) == CUBLAS_STATUS_SUCCESS;
      if (ok) {
        (attr == CUBLASLT_MATMUL_DESC_TRANSA ? d.trans_a : d.trans_b) =
            static_cast<cublasOperation_t>(v);
      }
      break;
    }
    case CUBLASLT_MATMUL_DESC_TRANSC:
      ok = v == CUBLAS_OP_N;
      break;
    case CUBLASLT_MATMUL_DESC_FILL_MODE:
      ok = v == CUBLAS_FILL_MODE_FULL;
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      ok = v == CUBLASLT_EPILOGUE_DEFAULT;
      break;
    default:
      ok = false;
  }
  if (ok) return CUBLAS_STATUS_SUCCESS;
  d.refused = static_cast<int>(attr);
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

// The preference attributes honoured here: the workspace limit and the minimum alignments.
cublasStatus_t SetPreferenceAttribute(Preference& p, cublasLtMatmulPreferenceAttributes_t attr,
                                      const void* buf, size_t size) {
  if (buf == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
      if (size != sizeof(uint64_t)) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(&p.max_workspace, buf, sizeof(uint64_t));
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
      if (size != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(&p.min_alignment[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES], buf,
                  sizeof(uint32_t));
      return CUBLAS_STATUS_SUCCESS;
    default:
      p.refused = static_cast<int>(attr);
      return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}

cublasStatus_t GetHeuristic(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la,
                            cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc,
                            cublasLtMatrixLayout_t ld, cublasLtMatmulPreference_t pref,
                            int requested, cublasLtMatmulHeuristicResult_t* results, int* count) {
  if (count == nullptr || results == nullptr || requested <= 0 || pref == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  *count = 0;
  GemmWork w;
  if (cublasStatus_t s = Describe(op, la, lb, lc, ld, &w); s != CUBLAS_STATUS_SUCCESS) return s;
  const Preference& p = *Get(pref);
  if (p.refused != kNoneRefused) return CUBLAS_STATUS_NOT_SUPPORTED;
  constexpr uint64_t kWorkspaceNeeded = 0;
  if (kWorkspaceNeeded > p.max_workspace) return CUBLAS_STATUS_NOT_SUPPORTED;
  const cudaDataType_t types[4] = {w.a.type, w.b.type, w.c.type, w.d_type};
  uint64_t alignments = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t a = AssumedAlignment(p.min_alignment[i]);
    if (a < ElementBytes(types[i])) return CUBLAS_STATUS_NOT_SUPPORTED;  // no algorithm
    alignments |= static_cast<uint64_t>(a) << (16 * i);
  }
  cublasLtMatmulHeuristicResult_t r{};
  r.algo.data[kMagic] = kAlgoMagic;
  r.algo.data[kSerial] = algo_serial.fetch_add(1) + 1;
  r.algo.data[kTypes] = TypeKey(*Get(op), *Get(la), *Get(lb), *Get(lc), *Get(ld));
  r.algo.data[kAlignments] = alignments;
  r.algo.data[kWorkspace] = kWorkspaceNeeded;
  r.workspaceSize = kWorkspaceNeeded;
  r.state = CUBLAS_STATUS_SUCCESS;
  r.wavesCount = 1.0f;
  results[0] = r;
  *count = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t Matmul(cublasLtMatmulDesc_t op, const void* alpha, const void* a,
                      cublasLtMatrixLayout_t la, const void* b, cublasLtMatrixLayout_t lb,
                      const void* beta, const void* c, cublasLtMatrixLayout_t lc, void* d,
                      cublasLtMatrixLayout_t ld, const cublasLtMatmulAlgo_t* algo,
                      const void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  GemmWork w;
  if (cublasStatus_t s = Describe(op, la, lb, lc, ld, &w); s != CUBLAS_STATUS_SUCCESS) return s;
  if (alpha == nullptr || beta == nullptr || IsDevice(alpha) || IsDevice(beta)) {
    return CUBLAS_STATUS_INVALID_VALUE;  // host pointer mode: both on the host
  }
  std::memcpy(&w.alpha, alpha, sizeof(float));
  std::memcpy(&w.beta, beta, sizeof(float));
  w.a.data = a;
  w.b.data = b;
  w.c.data = c;
  w.d = d;
  if (algo != nullptr) {
    if (!AlgoFits(*algo, op, la, lb, lc, ld)) return CUBLAS_STATUS_INVALID_VALUE;
    if (workspace_bytes < algo->data[kWorkspace]) return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (workspace_bytes > 0 && (workspace == nullptr || !IsDevice(workspace))) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  // In place needs C's layout to be D's (cuBLASLt: C == D requires Cdesc == Ddesc).
  if (c == d && (w.c.type != w.d_type || w.c.ld != w.ldd)) return CUBLAS_STATUS_INVALID_VALUE;
  if (cublasStatus_t s = CheckPointers(w, algo); s != CUBLAS_STATUS_SUCCESS) return s;
  Enqueue(stream, Work::kBlas, [w] { RunGemm(w); });
  return CUBLAS_STATUS_SUCCESS;
}

// Layout and descriptor sizes the simulator indexes with int64_t without overflow.
bool WithinInt(uint64_t v) { return v <= static_cast<uint64_t>(INT_MAX); }

// ---- cuBLAS's grouped GEMM --------------------------------------------------------------------

// The shape of one group from the host arrays; CUBLAS_STATUS_INVALID_VALUE for sizes BLAS
// refuses (negative, leading dimensions below the stored rows).
cublasStatus_t GroupShape(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, int lda,
                          int ldb, int ldc, GemmWork* w) {
  if (ParseOperation(ta, &w->trans_a) != CUBLAS_STATUS_SUCCESS ||
      ParseOperation(tb, &w->trans_b) != CUBLAS_STATUS_SUCCESS) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (lda < std::max(1, w->trans_a ? k : m) || ldb < std::max(1, w->trans_b ? n : k) ||
      ldc < std::max(1, m)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  w->m = m;
  w->n = n;
  w->k = k;
  w->a.ld = lda;
  w->b.ld = ldb;
  w->c.ld = ldc;
  w->ldd = ldc;
  return CUBLAS_STATUS_SUCCESS;
}

const void* ReadPointer(const void* const* array, size_t i) {
  const void* p = nullptr;
  std::memcpy(&p, &array[i], sizeof(p));
  return p;
}

// The queued grouped GEMM: reads each problem's matrices from the device pointer arrays now.
void RunGrouped(const std::vector<GemmWork>& problems, const void* const* a_array,
                const void* const* b_array, void* const* c_array) {
  for (size_t i = 0; i < problems.size(); ++i) {
    GemmWork w = problems[i];
    w.a.data = ReadPointer(a_array, i);
    w.b.data = ReadPointer(b_array, i);
    w.d = const_cast<void*>(ReadPointer(const_cast<const void* const*>(c_array), i));
    w.c.data = w.d;
    if (!GemmOnDevice(w)) {
      std::fprintf(stderr,
                   "simulated cublasGemmGroupedBatchedEx: problem %zu (m %lld, n %lld, k %lld): A "
                   "%p, B %p or C %p is not device memory (an illegal address on a GPU)\n",
                   i, static_cast<long long>(w.m), static_cast<long long>(w.n),
                   static_cast<long long>(w.k), w.a.data, w.b.data, w.d);
      std::abort();
    }
    RunGemm(w);
  }
}

struct GroupedArgs {
  const cublasOperation_t* transa;
  const cublasOperation_t* transb;
  const int *m, *n, *k;
  const void* alpha;
  const void* const* a;
  cudaDataType_t a_type;
  const int* lda;
  const void* const* b;
  cudaDataType_t b_type;
  const int* ldb;
  const void* beta;
  void* const* c;
  cudaDataType_t c_type;
  const int* ldc;
  int group_count;
  const int* group_size;
  cublasComputeType_t compute;
};

// Every host array given and on the host (cuBLAS reads them there).
bool HostArrays(const GroupedArgs& g) {
  const void* arrays[] = {g.transa, g.transb, g.m,   g.n,    g.k,         g.alpha,
                          g.lda,    g.ldb,    g.ldc, g.beta, g.group_size};
  for (const void* p : arrays) {
    if (p == nullptr || IsDevice(p)) return false;
  }
  return true;
}

// RACKRUN_CUDASIM_GROUPED_TYPES=matching: the grouped GEMM refuses operands whose type is not
// C's (bf16 A and B with an fp32 C), as cuBLAS may (README.md); read at every call, so a test
// may set it for one call. Unset or `mixed`: accepted, as cuBLASLt's GEMMs accept them.
bool GroupedTypesMatchingOnly() {
  const char* env = std::getenv("RACKRUN_CUDASIM_GROUPED_TYPES");
  const std::string v = env == nullptr ? "" : env;
  if (v.empty() || v == "mixed") return false;
  if (v == "matching") return true;
  std::fprintf(stderr, "cuda sim: RACKRUN_CUDASIM_GROUPED_TYPES=%s: use mixed or matching\n",
               v.c_str());
  std::abort();
}

cublasStatus_t GroupedGemm(cublasContext* handle, const GroupedArgs& g) {
  if (g.group_count < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (g.group_count == 0) return CUBLAS_STATUS_SUCCESS;
  if (!HostArrays(g)) return CUBLAS_STATUS_INVALID_VALUE;
  if (!SupportedTypes(g.compute, g.a_type, g.b_type, g.c_type, g.c_type) ||
      (g.a_type != g.c_type && GroupedTypesMatchingOnly())) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  std::vector<GemmWork> problems;
  for (int i = 0; i < g.group_count; ++i) {
    if (g.group_size[i] < 0) return CUBLAS_STATUS_INVALID_VALUE;
    GemmWork w;
    if (cublasStatus_t s = GroupShape(g.transa[i], g.transb[i], g.m[i], g.n[i], g.k[i], g.lda[i],
                                      g.ldb[i], g.ldc[i], &w);
        s != CUBLAS_STATUS_SUCCESS) {
      return s;
    }
    w.tf32 = g.compute == CUBLAS_COMPUTE_32F_FAST_TF32;
    w.alpha = static_cast<const float*>(g.alpha)[i];
    w.beta = static_cast<const float*>(g.beta)[i];
    w.a.type = g.a_type;
    w.b.type = g.b_type;
    w.c.type = g.c_type;
    w.d_type = g.c_type;
    problems.insert(problems.end(), static_cast<size_t>(g.group_size[i]), w);
  }
  const int64_t total = static_cast<int64_t>(problems.size());
  const size_t bytes = sizeof(void*);
  if (!MatrixOnDevice(g.a, total, 1, total, bytes) ||
      !MatrixOnDevice(g.b, total, 1, total, bytes) ||
      !MatrixOnDevice(g.c, total, 1, total, bytes)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  cudaStream_t stream = nullptr;
  {
    std::lock_guard<std::mutex> lock(handle->mu);
    stream = handle->stream;
  }
  Enqueue(stream, Work::kBlas, [problems = std::move(problems), a = g.a, b = g.b, c = g.c] {
    RunGrouped(problems, a, b, c);
  });
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace
}  // namespace rackrun::runtime::cuda::sim

namespace sim = rackrun::runtime::cuda::sim;

// ---- cuBLASLt ---------------------------------------------------------------------------------

extern "C" cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" const char* cublasLtGetStatusName(cublasStatus_t status) {
  return sim::StatusName(status);
}

extern "C" const char* cublasLtGetStatusString(cublasStatus_t status) {
  return sim::StatusString(status);
}

extern "C" cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout,
                                                     cudaDataType type, uint64_t rows,
                                                     uint64_t cols, int64_t ld) {
  if (layout == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (type != CUDA_R_32F && type != CUDA_R_16BF) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (!sim::WithinInt(rows) || !sim::WithinInt(cols) || ld > INT_MAX) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (ld < std::max<int64_t>(1, static_cast<int64_t>(rows))) return CUBLAS_STATUS_INVALID_VALUE;
  auto* l = new sim::Layout{type, static_cast<int64_t>(rows), static_cast<int64_t>(cols), ld};
  *layout = reinterpret_cast<cublasLtMatrixLayout_t>(l);
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete sim::Get(layout);
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc,
                                                   cublasComputeType_t compute,
                                                   cudaDataType_t scale) {
  if (desc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if ((compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_FAST_TF32) ||
      scale != CUDA_R_32F) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  auto* d = new sim::MatmulDesc;
  d->compute = compute;
  d->scale = scale;
  *desc = reinterpret_cast<cublasLtMatmulDesc_t>(d);
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete sim::Get(desc);
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc,
                                                         cublasLtMatmulDescAttributes_t attr,
                                                         const void* buf, size_t size) {
  if (desc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  return sim::SetDescAttribute(*sim::Get(desc), attr, buf, size);
}

extern "C" cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (pref == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *pref = reinterpret_cast<cublasLtMatmulPreference_t>(new sim::Preference);
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete sim::Get(pref);
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatmulPreferenceSetAttribute(
    cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
    size_t size) {
  if (pref == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  return sim::SetPreferenceAttribute(*sim::Get(pref), attr, buf, size);
}

extern "C" cublasStatus_t cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t handle, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
    cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
    cublasLtMatmulPreference_t pref, int requested, cublasLtMatmulHeuristicResult_t results[],
    int* count) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  return sim::GetHeuristic(op, a, b, c, d, pref, requested, results, count);
}

extern "C" cublasStatus_t cublasLtMatmulAlgoCheck(
    cublasLtHandle_t handle, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
    cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
    const cublasLtMatmulAlgo_t* algo, cublasLtMatmulHeuristicResult_t* result) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (algo == nullptr || result == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  sim::GemmWork w;
  if (cublasStatus_t s = sim::Describe(op, a, b, c, d, &w); s != CUBLAS_STATUS_SUCCESS) return s;
  if (!sim::AlgoFits(*algo, op, a, b, c, d)) return CUBLAS_STATUS_INVALID_VALUE;
  // result->algo is left as it is (it may be *algo; cuBLASLt never writes it here).
  result->workspaceSize = algo->data[sim::kWorkspace];
  result->state = CUBLAS_STATUS_SUCCESS;
  result->wavesCount = 1.0f;
  std::fill(std::begin(result->reserved), std::end(result->reserved), 0);
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t op,
                                         const void* alpha, const void* A,
                                         cublasLtMatrixLayout_t Adesc, const void* B,
                                         cublasLtMatrixLayout_t Bdesc, const void* beta,
                                         const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                                         cublasLtMatrixLayout_t Ddesc,
                                         const cublasLtMatmulAlgo_t* algo, void* workspace,
                                         size_t workspaceSizeInBytes, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  return sim::Matmul(op, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace,
                     workspaceSizeInBytes, stream);
}

// ---- cuBLAS -----------------------------------------------------------------------------------

extern "C" cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  std::lock_guard<std::mutex> lock(handle->mu);
  handle->stream = stream;
  // As cuBLAS does: a new stream returns the handle to the library's own workspace.
  handle->workspace = nullptr;
  handle->workspace_bytes = 0;
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace,
                                                size_t workspaceSizeInBytes) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (workspaceSizeInBytes > 0 &&
      (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 256 != 0 ||
       !sim::IsDevice(workspace))) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  std::lock_guard<std::mutex> lock(handle->mu);
  handle->workspace = workspace;
  handle->workspace_bytes = workspaceSizeInBytes;
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" const char* cublasGetStatusName(cublasStatus_t status) {
  return sim::StatusName(status);
}

extern "C" const char* cublasGetStatusString(cublasStatus_t status) {
  return sim::StatusString(status);
}

extern "C" cublasStatus_t cublasGemmGroupedBatchedEx(
    cublasHandle_t handle, const cublasOperation_t transa_array[],
    const cublasOperation_t transb_array[], const int m_array[], const int n_array[],
    const int k_array[], const void* alpha_array, const void* const Aarray[], cudaDataType_t Atype,
    const int lda_array[], const void* const Barray[], cudaDataType_t Btype, const int ldb_array[],
    const void* beta_array, void* const Carray[], cudaDataType_t Ctype, const int ldc_array[],
    int group_count, const int group_size[], cublasComputeType_t computeType) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  return sim::GroupedGemm(
      handle, {transa_array, transb_array, m_array, n_array, k_array, alpha_array, Aarray, Atype,
               lda_array, Barray, Btype, ldb_array, beta_array, Carray, Ctype, ldc_array,
               group_count, group_size, computeType});
}
