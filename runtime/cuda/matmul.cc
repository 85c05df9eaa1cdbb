#include "runtime/cuda/matmul.h"

#include <cstdint>

#include "runtime/cuda/kernels.h"

namespace rackrun::runtime::cuda {
namespace {

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Elements of a row-major operand with `rows` rows of `cols` used values, `ld` apart.
int64_t Extent(int rows, int cols, int ld) {
  return rows == 0 || cols == 0 ? 0 : static_cast<int64_t>(rows - 1) * ld + cols;
}

}  // namespace

MatMul::MatMul(Device* device, GemmPrecision precision)
    : device_(device),
      precision_(precision),
      gemm_(device),
      a16_(device, "bf16 GEMM operand A"),
      b16_(device, "bf16 GEMM operand B") {}

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
  const int64_t na = s.trans_a ? Extent(s.k, s.m, s.lda) : Extent(s.m, s.k, s.lda);
  const int64_t nb = s.trans_b ? Extent(s.n, s.k, s.ldb) : Extent(s.k, s.n, s.ldb);
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

}  // namespace rackrun::runtime::cuda
