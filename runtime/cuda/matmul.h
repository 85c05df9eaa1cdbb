// MatMul: the GPU layers' GEMM over fp32 operands in device memory, in the job's compute
// precision (model.precision):
//   fp32  cuBLASLt with fp32 arithmetic (the CPU engine's numbers up to summation order);
//   tf32  fp32 operands on the tensor cores (TF32 rounding), fp32 accumulation;
//   bf16  A and B converted to bf16 scratch here, fp32 accumulation, C in fp32.
// Parameters, their gradients and every activation stay fp32 (fp32 master weights): only a
// GEMM's inputs are rounded, as autocast does.
//
// The tensor-core precisions want 16-byte aligned rows: when a leading dimension is not a
// multiple of 8 elements or an operand not 16-byte aligned (a vocabulary of 257, say), the
// GEMM runs in fp32 instead (exact, slower) rather than fail.
//
// `rows_vary` in Run: m or k differ call to call (an expert's rows): cuBLASLt's algorithm is
// chosen once per power-of-two bucket of them (Gemm's cache would otherwise ask its heuristic
// for every new row count).
//
// The MoE layer's expert GEMMs (RunExperts, ExpertsLinear, ExpertsLinearBackward) take every
// batch of the expert-row buffer at once, on one of two paths (grouped_gemm.h): per expert (one
// Run with rows_vary per batch with rows) or grouped (one cublasGemmGroupedBatchedEx per
// matrix; the group falls back to fp32 as a whole where an operand is not 16-byte aligned;
// under bf16, A and B are converted once each over the extent the group reads; where cuBLAS
// refuses bf16 operands with an fp32 C, bf16 expert GEMMs run per expert: GroupedBf16Refusal).
// Both compute every output from the same inputs in the same precision; the grouped path is not
// run on a GPU yet.
//
// Not thread-safe: one per stream owner (the scratch is reused call to call, ordered by the
// device's compute stream).
#ifndef RACKRUN_RUNTIME_CUDA_MATMUL_H_
#define RACKRUN_RUNTIME_CUDA_MATMUL_H_

#include <memory>
#include <span>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "runtime/cuda/device.h"
#include "runtime/cuda/expert_permutation.h"
#include "runtime/cuda/gemm.h"
#include "runtime/cuda/grouped_gemm.h"
#include "runtime/cuda/phase_clock.h"

namespace rackrun::runtime::cuda {

class MatMul {
 public:
  MatMul(Device* device, GemmPrecision precision);
  ~MatMul();

  GemmPrecision precision() const { return precision_; }
  Device* device() const { return device_; }
  // C = alpha op(A) op(B) + beta C (gemm.h's convention); errors as Gemm::Run's.
  absl::Status Run(const GemmShape& shape, float alpha, const float* a, const float* b, float beta,
                   float* c, bool rows_vary = false);
  // The backward of a linear map y [rows x out] = x [rows x in] W [in x out], dense
  // row-major operands: dW += x^T dy, then dx = dy W^T (added to dx when accumulate_dx).
  absl::Status LinearBackward(int rows, int in, int out, const float* x, const float* dy,
                              const float* w, float* dw, float* dx, bool accumulate_dx = false,
                              bool rows_vary = false);
  // The precision a GEMM of this shape and these operands runs in (the fall back to fp32).
  GemmPrecision PrecisionFor(const GemmShape& shape, const void* a, const void* b,
                             const void* c) const;

  // `g` over the batches with rows on `path` (fp32 operands; errors as Run's, then
  // BuildGroupedProblems' and GroupedGemm::Run's).
  absl::Status RunExperts(const ExpertGemm& g, std::span<const ExpertBatch> batches,
                          ExpertGemmPath path);
  // Per batch b of expert e: y_b [rows x out] = x_b W_e, with x and y the expert-row buffers
  // (rows from b.offset) and W [E x in x out].
  absl::Status ExpertsLinear(int in, int out, const float* x, const float* w, float* y,
                             std::span<const ExpertBatch> batches, ExpertGemmPath path);
  // Its backward: dW_e += x_b^T dy_b for every batch, then dx_b = dy_b W_e^T (overwritten).
  absl::Status ExpertsLinearBackward(int in, int out, const float* x, const float* dy,
                                     const float* w, float* dw, float* dx,
                                     std::span<const ExpertBatch> batches, ExpertGemmPath path);

 private:
  absl::Status RunGrouped(const ExpertGemm& g, std::span<const ExpertBatch> batches);
  absl::Status RunPerExpert(const ExpertGemm& g, std::span<const ExpertBatch> batches);
  Device* device_;
  GemmPrecision precision_;
  Gemm gemm_;
  DeviceTensor<bf16> a16_, b16_;
  std::unique_ptr<GroupedGemm> grouped_;  // created by the first grouped call
};

// The layers' opening (attention, MoE): xn = RMSNorm(u) with gain `norm` (inv_rms kept for the
// backward; phase `other` on `clock`), then y [tokens x n] = xn W [c x n] (phase `gemm`).
// A kernel error is named "<layer>: norm".
absl::Status NormThenLinear(MatMul& matmul, PhaseClock* clock, int64_t tokens, int c, int n,
                            const float* u, const float* norm, float* xn, float* inv_rms,
                            const float* w, float* y, absl::string_view layer);

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_MATMUL_H_
