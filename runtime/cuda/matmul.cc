#include "runtime/cuda/matmul.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "runtime/cuda/kernels.h"

namespace rackrun::runtime::cuda {
MatMul::MatMul(Device* device, GemmPrecision precision)
    : device_(device),
      precision_(precision),
      gemm_(device),
      a16_(device, "bf16 GEMM operand A"),
      b16_(device, "bf16 GEMM operand B") {}

MatMul::~MatMul() = default;

GemmPrecision MatMul::PrecisionFor(const GemmShape& s, const void* a, const void* b,
                                   const void* c) const {
  if (precision_ == GemmPrecision::kFp32) return precision_;
  const bool aligned = s.lda % 8 == 0 && s.ldb % 8 == 0 && s.ldc % 8 == 0 && Aligned16(a) &&
                       Aligned16(b) && Aligned16(c);
  return aligned ? precision_ : GemmPrecision::kFp32;
}

absl::Status MatMul::Run(const GemmShape& s, float alpha, const float* a, const float* b,
                         float beta, float* c, bool rows_vary) {
  const GemmPrecision p = PrecisionFor(s, a, b, c);
  cudaStream_t stream = device_->stream();
  if (p != GemmPrecision::kBf16) {
    return rows_vary ? gemm_.RunVaryingRows(s, alpha, a, b, beta, c, p, DataType::kF32, stream)
                     : gemm_.Run(s, alpha, a, b, beta, c, p, stream);
  }
  if (s.m == 0 || s.n == 0 || s.k == 0) {
    return gemm_.Run(s, alpha, a, b, beta, c, GemmPrecision::kFp32, stream);
  }
  const int64_t na = ExtentA(s);
  const int64_t nb = ExtentB(s);
  if (absl::Status st = a16_.Resize({na}); !st.ok()) return st;
  if (absl::Status st = b16_.Resize({nb}); !st.ok()) return st;
  if (absl::Status st = CudaCheck(kernels::F32ToBf16(na, a, a16_.data(), stream), "GEMM A to bf16");
      !st.ok()) {
    return st;
  }
  if (absl::Status st = CudaCheck(kernels::F32ToBf16(nb, b, b16_.data(), stream), "GEMM B to bf16");
      !st.ok()) {
    return st;
  }
  return rows_vary ? gemm_.RunVaryingRows(s, alpha, a16_.data(), b16_.data(), beta, c,
                                          GemmPrecision::kBf16, DataType::kF32, stream)
                   : gemm_.Run(s, alpha, a16_.data(), b16_.data(), beta, c, GemmPrecision::kBf16,
                               DataType::kF32, stream);
}

absl::Status MatMul::LinearBackward(int rows, int in, int out, const float* x, const float* dy,
                                    const float* w, float* dw, float* dx, bool accumulate_dx,
                                    bool rows_vary) {
  if (absl::Status s =
          Run({.trans_a = true, .m = in, .n = out, .k = rows, .lda = in, .ldb = out, .ldc = out},
              1.0f, x, dy, 1.0f, dw, rows_vary);
      !s.ok()) {
    return s;
  }
  return Run({.trans_b = true, .m = rows, .n = in, .k = out, .lda = out, .ldb = out, .ldc = in},
             1.0f, dy, w, accumulate_dx ? 1.0f : 0.0f, dx, rows_vary);
}

absl::Status MatMul::RunExperts(const ExpertGemm& g, std::span<const ExpertBatch> batches,
                                ExpertGemmPath path) {
  if (path == ExpertGemmPath::kGrouped) return RunGrouped(g, batches);
  return RunPerExpert(g, batches);
}

absl::Status MatMul::RunPerExpert(const ExpertGemm& g, std::span<const ExpertBatch> batches) {
  for (const ExpertBatch& b : batches) {
    if (b.rows == 0) continue;
    if (absl::Status s =
            Run(ExpertShape(g, b), g.alpha, static_cast<const float*>(ExpertOperandAt(g.a, b)),
                static_cast<const float*>(ExpertOperandAt(g.b, b)), g.beta,
                static_cast<float*>(const_cast<void*>(ExpertOperandAt(g.c, b))),
                /*rows_vary=*/true);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status MatMul::RunGrouped(const ExpertGemm& g, std::span<const ExpertBatch> batches) {
  absl::StatusOr<GroupedProblems> p = BuildGroupedProblems(batches, g);
  if (!p.ok()) return p.status();
  if (p->count() == 0) return absl::OkStatus();
  // One precision for the group: fp32 where any problem's operands are not 16-byte aligned.
  const GemmShape& s = g.shape;
  const bool aligned = p->aligned16 && s.lda % 8 == 0 && s.ldb % 8 == 0 && s.ldc % 8 == 0;
  const GemmPrecision precision =
      precision_ == GemmPrecision::kFp32 || aligned ? precision_ : GemmPrecision::kFp32;
  if (grouped_ == nullptr) grouped_ = std::make_unique<GroupedGemm>(device_);
  if (precision != GemmPrecision::kBf16) return grouped_->Run(*p, precision);
  // cuBLAS refused grouped bf16 before (grouped_gemm.h): per expert, the same computation.
  if (!GroupedBf16Refusal().empty()) return RunPerExpert(g, batches);
  // bf16: A and B converted once each over what the group reads.
  cudaStream_t stream = device_->stream();
  for (absl::Status st : {a16_.Resize({p->a_extent}), b16_.Resize({p->b_extent})}) {
    if (!st.ok()) return st;
  }
  if (absl::Status st = CudaCheck(
          kernels::F32ToBf16(p->a_extent, static_cast<const float*>(g.a.base), a16_.data(), stream),
          "grouped GEMM A to bf16");
      !st.ok()) {
    return st;
  }
  if (absl::Status st = CudaCheck(
          kernels::F32ToBf16(p->b_extent, static_cast<const float*>(g.b.base), b16_.data(), stream),
          "grouped GEMM B to bf16");
      !st.ok()) {
    return st;
  }
  ExpertGemm h = g;
  h.a = {a16_.data(), g.a.row_stride, g.a.expert_stride, static_cast<int>(sizeof(bf16))};
  h.b = {b16_.data(), g.b.row_stride, g.b.expert_stride, static_cast<int>(sizeof(bf16))};
  absl::StatusOr<GroupedProblems> p16 = BuildGroupedProblems(batches, h);
  if (!p16.ok()) return p16.status();
  absl::Status st = grouped_->Run(*p16, GemmPrecision::kBf16);
  return absl::IsUnimplemented(st) ? RunPerExpert(g, batches) : st;
}

absl::Status MatMul::ExpertsLinear(int in, int out, const float* x, const float* w, float* y,
                                   std::span<const ExpertBatch> batches, ExpertGemmPath path) {
  const int64_t w_size = static_cast<int64_t>(in) * out;
  ExpertGemm g;
  g.shape = {.n = out, .k = in, .lda = in, .ldb = out, .ldc = out};
  g.a = {x, in, 0};
  g.b = {w, 0, w_size};
  g.c = {y, out, 0};
  return RunExperts(g, batches, path);
}

absl::Status MatMul::ExpertsLinearBackward(int in, int out, const float* x, const float* dy,
                                           const float* w, float* dw, float* dx,
                                           std::span<const ExpertBatch> batches,
                                           ExpertGemmPath path) {
  const int64_t w_size = static_cast<int64_t>(in) * out;
  // dW_e += x_b^T dy_b: the rows are the reduction.
  ExpertGemm dw_gemm;
  dw_gemm.shape = {.trans_a = true, .m = in, .n = out, .lda = in, .ldb = out, .ldc = out};
  dw_gemm.rows_in_k = true;
  dw_gemm.beta = 1.0f;
  dw_gemm.a = {x, in, 0};
  dw_gemm.b = {dy, out, 0};
  dw_gemm.c = {dw, 0, w_size};
  if (absl::Status s = RunExperts(dw_gemm, batches, path); !s.ok()) return s;
  // dx_b = dy_b W_e^T.
  ExpertGemm dx_gemm;
  dx_gemm.shape = {.trans_b = true, .n = in, .k = out, .lda = out, .ldb = out, .ldc = in};
  dx_gemm.a = {dy, out, 0};
  dx_gemm.b = {w, 0, w_size};
  dx_gemm.c = {dx, in, 0};
  return RunExperts(dx_gemm, batches, path);
}

absl::Status NormThenLinear(MatMul& matmul, PhaseClock* clock, int64_t tokens, int c, int n,
                            const float* u, const float* norm, float* xn, float* inv_rms,
                            const float* w, float* y, absl::string_view layer) {
  MarkPhase(clock, Phase::kOther);
  if (absl::Status s = CudaCheck(
          kernels::RmsNormForward(tokens, c, u, norm, xn, inv_rms, matmul.device()->stream()),
          absl::StrCat(layer, ": norm"));
      !s.ok()) {
    return s;
  }
  MarkPhase(clock, Phase::kGemm);
  const int t = static_cast<int>(tokens);
  return matmul.Run({.m = t, .n = n, .k = c, .lda = c, .ldb = n, .ldc = n}, 1.0f, xn, w, 0.0f, y);
}

}  // namespace rackrun::runtime::cuda
