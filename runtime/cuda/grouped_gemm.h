// The MoE layer's expert GEMMs as one cuBLAS grouped GEMM (cublasGemmGroupedBatchedEx) per
// matrix instead of one cuBLASLt call per expert (issue 35: the demo shape is launch-bound).
//
// ExpertGemm describes one matrix's GEMMs over every batch of the expert-row buffer
// (expert_permutation.h's ExpertBatch): gemm.h's row-major convention, with the batch's row
// count in m (forward, input gradients) or in k (weight gradients), and operands that step by
// rows (activations) or by experts (weights). BuildGroupedProblems turns it into cuBLAS's
// column-major group arrays (host code, tested on the CPU): one group of one problem per batch
// with rows, so an expert without rows is left out (its weight gradient untouched, as the
// per-expert path leaves it). GroupedGemm runs them: the per-group arrays stay on the host,
// the A, B and C pointer arrays go to device memory (one pageable copy on the compute stream,
// staged by CUDA before the call returns), then one cublasGemmGroupedBatchedEx on that stream
// with the Device's cuBLASLt workspace. cuBLAS is loaded (dlopen, cublaslt_library.h) and its
// handle created at the first Run, so the per-expert path never maps libcublas.
//
// Types: A and B fp32 (compute CUBLAS_COMPUTE_32F, or CUBLAS_COMPUTE_32F_FAST_TF32 under tf32)
// or bf16 (CUBLAS_COMPUTE_32F), C fp32; MatMul::RunExperts picks them as MatMul::Run does.
// bf16 A and B with an fp32 C: hipBLAS's mirror of the call documents the combination, cuBLAS's
// table has not been checked on a GPU. If cuBLAS refuses it (CUBLAS_STATUS_NOT_SUPPORTED or
// _INVALID_VALUE: it launches nothing), Run says Unimplemented and the process remembers the
// status (GroupedBf16Refusal); MatMul then runs its bf16 expert GEMMs per expert, which
// compute the same outputs from the same bf16 inputs.
// Not run on a GPU yet: runtime/cuda/moe_test.cc compares the grouped path with MoeLayer<float>
// and with the per-expert path.
#ifndef RACKRUN_RUNTIME_CUDA_GROUPED_GEMM_H_
#define RACKRUN_RUNTIME_CUDA_GROUPED_GEMM_H_

#include <cublas_api.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "runtime/cuda/device.h"
#include "runtime/cuda/expert_permutation.h"
#include "runtime/cuda/gemm.h"

namespace rackrun::runtime::cuda {

// How the MoE layers run their expert GEMMs: one cuBLASLt call per expert and matrix, or one
// cuBLAS grouped GEMM per matrix.
enum class ExpertGemmPath { kPerExpert, kGrouped };

// "per_expert" | "grouped"; InvalidArgument naming `field` otherwise.
absl::StatusOr<ExpertGemmPath> ParseExpertGemmPath(absl::string_view name, absl::string_view field);
absl::string_view ExpertGemmPathName(ExpertGemmPath path);

// An operand of the experts' GEMMs: batch b's matrix starts at element
// b.offset * row_stride + b.expert * expert_stride of `base` (elements of element_bytes).
struct ExpertOperand {
  const void* base = nullptr;
  int64_t row_stride = 0;
  int64_t expert_stride = 0;
  int element_bytes = 4;
};

// One matrix's GEMMs over the batches: C_b = alpha op(A_b) op(B_b) + beta C_b, with `shape`'s
// m (rows_in_k false) or k (rows_in_k true) replaced by the batch's rows. C is fp32 and
// written through c.base.
struct ExpertGemm {
  GemmShape shape;
  bool rows_in_k = false;
  float alpha = 1.0f, beta = 0.0f;
  ExpertOperand a, b, c;
};

// Batch b's shape and operands.
GemmShape ExpertShape(const ExpertGemm& g, const ExpertBatch& b);
const void* ExpertOperandAt(const ExpertOperand& o, const ExpertBatch& b);

// cublasGemmGroupedBatchedEx's arguments (column-major: C^T = op(B)^T op(A)^T, so our B is
// cuBLAS's A), one group of one problem per batch with rows.
struct GroupedProblems {
  std::vector<cublasOperation_t> transa, transb;
  std::vector<int> m, n, k, lda, ldb, ldc, group_size;
  std::vector<float> alpha, beta;
  std::vector<const void*> a, b;  // cuBLAS's A (our B) and B (our A)
  std::vector<void*> c;
  std::vector<int> expert;  // each problem's expert (for errors and tests)
  // Elements of our A and B from their bases that the problems read (what a bf16 copy covers).
  int64_t a_extent = 0, b_extent = 0;
  // Every A, B and C pointer 16-byte aligned (the tensor-core precisions need it).
  bool aligned16 = true;

  int count() const { return static_cast<int>(m.size()); }
};

// The problems of `g` over `batches` (empty batches left out). InvalidArgument naming the batch
// for a negative offset, row count or expert, rows beyond int, or a shape Gemm::Run refuses
// (gemm.h's CheckGemmArgs); k = 0 outside the rows with beta != 1 likewise.
absl::StatusOr<GroupedProblems> BuildGroupedProblems(std::span<const ExpertBatch> batches,
                                                     const ExpertGemm& g);

// The status cuBLAS refused grouped bf16 operands with an fp32 C with in this process
// ("CUBLAS_STATUS_NOT_SUPPORTED"), or empty while it has not (thread-safe). A property of the
// loaded cuBLAS and the GPU, so it holds for every GroupedGemm from then on.
std::string GroupedBf16Refusal();
// Tests only: forgets the refusal (a simulated cuBLAS may accept again).
void ForgetGroupedBf16RefusalForTesting();

// Runs GroupedProblems on a Device's compute stream (not thread-safe: one per stream owner).
class GroupedGemm {
 public:
  explicit GroupedGemm(Device* device);
  ~GroupedGemm();
  GroupedGemm(const GroupedGemm&) = delete;
  GroupedGemm& operator=(const GroupedGemm&) = delete;

  // One grouped call (none for zero problems). A and B are bf16 under kBf16, else fp32; C fp32.
  // Errors: cuBLAS's loader's (naming the file), then cuBLAS's status naming the call, the
  // problem count and the precision: Unimplemented when cuBLAS refuses bf16 operands with an
  // fp32 C (recorded for GroupedBf16Refusal; nothing ran), Internal otherwise.
  absl::Status Run(const GroupedProblems& p, GemmPrecision precision);

 private:
  absl::Status Init();
  Device* device_;
  cublasHandle_t handle_ = nullptr;
  std::vector<int64_t> host_pointers_;
  DeviceTensor<int64_t> pointers_;
};

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_GROUPED_GEMM_H_
