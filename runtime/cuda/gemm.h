// Dense GEMM on the GPU through cuBLASLt, in runtime/cpu/gemm.h's convention:
// C = alpha * op(A) * op(B) + beta * C, row-major, op(A) m x k, op(B) k x n, C m x n.
//
// Precisions (the job's model.precision, issue 35):
//   kFp32  fp32 operands, fp32 arithmetic (CUBLAS_COMPUTE_32F): the CPU engine's numbers;
//   kTf32  fp32 operands rounded to TF32 on the tensor cores, fp32 accumulation;
//   kBf16  bf16 A and B, fp32 accumulation, C in fp32 or bf16.
// Row-major is cuBLAS's column-major transposed: C^T = op(B)^T op(A)^T, so B goes first.
//
// Algorithms come from cuBLASLt's heuristic once per shape, types and pointer alignment,
// then from a cache (one per Gemm object; not thread-safe: one per stream owner).
#ifndef RACKRUN_RUNTIME_CUDA_GEMM_H_
#define RACKRUN_RUNTIME_CUDA_GEMM_H_

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "runtime/cuda/device.h"

namespace rackrun::runtime::cuda {

enum class GemmPrecision { kFp32, kTf32, kBf16 };
enum class DataType { kF32, kBF16 };

// "fp32" | "tf32" | "bf16"; InvalidArgument naming model.precision otherwise.
absl::StatusOr<GemmPrecision> ParseGemmPrecision(absl::string_view name);
absl::string_view GemmPrecisionName(GemmPrecision p);

struct GemmShape {
  bool trans_a = false, trans_b = false;
  int m = 0, n = 0, k = 0;
  int lda = 0, ldb = 0, ldc = 0;
};

// The arguments Gemm::Run refuses: negative sizes, leading dimensions below the rows'
// lengths, a bf16 C without bf16 precision (InvalidArgument).
absl::Status CheckGemmArgs(const GemmShape& s, GemmPrecision precision, DataType c_type);

// Elements of A (of B) a GEMM of this shape reads from its start, rows `ld` apart.
int64_t ExtentA(const GemmShape& s);
int64_t ExtentB(const GemmShape& s);

// Whether `p` is 16-byte aligned (what the TF32 and bf16 GEMM paths need of their operands).
inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

class Gemm {
 public:
  explicit Gemm(Device* device) : device_(device) {}
  ~Gemm();

  // A and B are fp32 for kFp32/kTf32 and bf16 for kBf16; C is fp32 unless `c_type` says
  // bf16 (kBf16 only). The tensor-core precisions (TF32, bf16) want 16-byte aligned rows
  // (leading dimensions a multiple of 8 elements); for others cuBLASLt may offer no
  // algorithm, which is an Internal error naming the shape. Leading dimensions as in row-major
  // storage (>= the row length). InvalidArgument for inconsistent shapes or types; cuBLAS errors
  // name the call and the shape. m or n of 0 is a no-op, and so is k = 0 with beta = 1 (an empty
  // product accumulated); k = 0 with another beta is an InvalidArgument.
  absl::Status Run(const GemmShape& s, float alpha, const void* a, const void* b, float beta,
                   void* c, GemmPrecision precision, DataType c_type = DataType::kF32,
                   cudaStream_t stream = nullptr);

  // The same for GEMMs whose m or k differ call to call (an expert's rows): the algorithm is
  // chosen once per power-of-two bucket of m and k (operands at least 16-byte aligned) and
  // reused with the actual sizes; where cuBLASLt refuses it for a size, that size gets its
  // own (Run's path).
  absl::Status RunVaryingRows(const GemmShape& s, float alpha, const void* a, const void* b,
                              float beta, void* c, GemmPrecision precision,
                              DataType c_type = DataType::kF32, cudaStream_t stream = nullptr);

  // Convenience for fp32 operands.
  absl::Status Run(const GemmShape& s, float alpha, const float* a, const float* b, float beta,
                   float* c, GemmPrecision precision = GemmPrecision::kFp32,
                   cudaStream_t stream = nullptr) {
    return Run(s, alpha, static_cast<const void*>(a), static_cast<const void*>(b), beta,
               static_cast<void*>(c), precision, DataType::kF32, stream);
  }

 private:
  struct Plan;
  absl::Status Launch(const GemmShape& s, float alpha, const void* a, const void* b, float beta,
                      void* c, GemmPrecision precision, DataType c_type, cudaStream_t stream,
                      bool bucketed);
  Device* device_;
  // Key: shape (m and k as their buckets for RunVaryingRows), precision, C type, the operands'
  // alignments, bucketed or not. shared_ptr: Plan is complete
  // only in gemm.cc, and its deleter travels with it.
  std::map<std::array<int, 14>, std::shared_ptr<Plan>> plans_;
};

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_GEMM_H_
