#include "runtime/cuda/gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "runtime/cuda/cublaslt_library.h"

namespace rackrun::runtime::cuda {
namespace {

absl::Status BlasCheck(cublasStatus_t s, absl::string_view call, const GemmShape& g) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(call, " (m ", g.m, ", n ", g.n, ", k ", g.k, ", ta ", g.trans_a, ", tb ",
                   g.trans_b, ", lda ", g.lda, ", ldb ", g.ldb, ", ldc ", g.ldc,
                   "): ", CublasLt().GetStatusName(s), ": ", CublasLt().GetStatusString(s)));
}

// The largest power of two (at most 256) dividing the address.
int AlignmentOf(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && v % static_cast<uintptr_t>(a) != 0) a /= 2;
  return a;
}

// One GEMM's operand types and operations in cuBLASLt's column-major view:
// C^T (n x m) = op(B)^T (n x k) op(A)^T (k x m).
struct Operands {
  const GemmShape& s;
  cudaDataType_t ab_type;
  cudaDataType_t cc_type;
  cublasOperation_t ta;
  cublasOperation_t tb;

  // The three layouts of an mm x n x kk problem (A' = our B, B' = our A).
  absl::Status MakeLayouts(int mm, int kk, cublasLtMatrixLayout_t* la, cublasLtMatrixLayout_t* lb,
                           cublasLtMatrixLayout_t* lc) const {
    const uint64_t a_rows = ta == CUBLAS_OP_N ? s.n : kk, a_cols2 = ta == CUBLAS_OP_N ? kk : s.n;
    const uint64_t b_rows = tb == CUBLAS_OP_N ? kk : mm, b_cols2 = tb == CUBLAS_OP_N ? mm : kk;
    if (absl::Status st = BlasCheck(
            CublasLt().MatrixLayoutCreate(la, ab_type, a_rows, a_cols2, s.ldb), "layout A", s);
        !st.ok()) {
      return st;
    }
    if (absl::Status st = BlasCheck(
            CublasLt().MatrixLayoutCreate(lb, ab_type, b_rows, b_cols2, s.lda), "layout B", s);
        !st.ok()) {
      return st;
    }
    return BlasCheck(CublasLt().MatrixLayoutCreate(lc, cc_type, static_cast<uint64_t>(s.n),
                                                   static_cast<uint64_t>(mm), s.ldc),
                     "layout C", s);
  }
};

// Elements of a row-major operand with `rows` rows of `cols` used values, `ld` apart.
int64_t Extent(int rows, int cols, int ld) {
  return rows == 0 || cols == 0 ? 0 : static_cast<int64_t>(rows - 1) * ld + cols;
}

}  // namespace

int64_t ExtentA(const GemmShape& s) {
  return s.trans_a ? Extent(s.k, s.m, s.lda) : Extent(s.m, s.k, s.lda);
}

int64_t ExtentB(const GemmShape& s) {
  return s.trans_b ? Extent(s.n, s.k, s.ldb) : Extent(s.k, s.n, s.ldb);
}

absl::Status CheckGemmArgs(const GemmShape& s, GemmPrecision precision, DataType c_type) {
  if (s.m < 0 || s.n < 0 || s.k < 0) return absl::InvalidArgumentError("gemm: negative size");
  const int a_cols = s.trans_a ? s.m : s.k;  // row length of A as stored
  const int b_cols = s.trans_b ? s.k : s.n;
  if (s.lda < std::max(1, a_cols) || s.ldb < std::max(1, b_cols) || s.ldc < std::max(1, s.n)) {
    return absl::InvalidArgumentError(absl::StrCat("gemm: leading dimensions ", s.lda, ", ", s.ldb,
                                                   ", ", s.ldc, " below the rows' lengths ", a_cols,
                                                   ", ", b_cols, ", ", s.n));
  }
  if (c_type == DataType::kBF16 && precision != GemmPrecision::kBf16) {
    return absl::InvalidArgumentError("gemm: a bf16 C needs bf16 precision");
  }
  return absl::OkStatus();
}

absl::StatusOr<GemmPrecision> ParseGemmPrecision(absl::string_view name) {
  if (name == "fp32") return GemmPrecision::kFp32;
  if (name == "tf32") return GemmPrecision::kTf32;
  if (name == "bf16") return GemmPrecision::kBf16;
  return absl::InvalidArgumentError(
      absl::StrCat("model.precision: unknown precision '", name, "'; use fp32, tf32 or bf16"));
}

absl::string_view GemmPrecisionName(GemmPrecision p) {
  switch (p) {
    case GemmPrecision::kFp32:
      return "fp32";
    case GemmPrecision::kTf32:
      return "tf32";
    case GemmPrecision::kBf16:
      return "bf16";
  }
  return "?";
}

struct Gemm::Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  // Creates the descriptor and the m x n x k layouts of `o`, then takes cuBLASLt's first
  // algorithm for them with operands aligned to al_a, al_b, al_c bytes (A', B' and C).
  absl::Status Choose(const Operands& o, cublasComputeType_t compute, int m, int k, uint32_t al_a,
                      uint32_t al_b, uint32_t al_c, GemmPrecision precision, Device& device) {
    const GemmShape& s = o.s;
    const cublasOperation_t ta = o.ta;
    const cublasOperation_t tb = o.tb;
    if (absl::Status st = BlasCheck(CublasLt().MatmulDescCreate(&op, compute, CUDA_R_32F),
                                    "cublasLtMatmulDescCreate", s);
        !st.ok()) {
      return st;
    }
    CublasLt().MatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    CublasLt().MatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    if (absl::Status st = o.MakeLayouts(m, k, &a, &b, &c); !st.ok()) return st;
    cublasLtMatmulPreference_t pref = nullptr;
    CublasLt().MatmulPreferenceCreate(&pref);
    const uint64_t ws = device.blas_workspace_bytes();
    CublasLt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                            sizeof(ws));
    CublasLt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a,
                                            sizeof(al_a));
    CublasLt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b,
                                            sizeof(al_b));
    CublasLt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c,
                                            sizeof(al_c));
    CublasLt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c,
                                            sizeof(al_c));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t hs =
        CublasLt().MatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(device.blas_handle()), op,
                                          a, b, c, c, pref, 1, &result, &found);
    CublasLt().MatmulPreferenceDestroy(pref);
    if (absl::Status st = BlasCheck(hs, "cublasLtMatmulAlgoGetHeuristic", s); !st.ok()) return st;
    if (found == 0) {
      return absl::InternalError(absl::StrCat("cuBLASLt has no algorithm for this GEMM (m ", s.m,
                                              ", n ", s.n, ", k ", s.k, ", ",
                                              GemmPrecisionName(precision), ")"));
    }
    algo = result.algo;
    return absl::OkStatus();
  }
  ~Plan() {
    if (a != nullptr) CublasLt().MatrixLayoutDestroy(a);
    if (b != nullptr) CublasLt().MatrixLayoutDestroy(b);
    if (c != nullptr) CublasLt().MatrixLayoutDestroy(c);
    if (op != nullptr) CublasLt().MatmulDescDestroy(op);
  }
};

Gemm::~Gemm() = default;

absl::Status Gemm::Run(const GemmShape& s, float alpha, const void* a, const void* b, float beta,
                       void* c, GemmPrecision precision, DataType c_type, cudaStream_t stream) {
  return Launch(s, alpha, a, b, beta, c, precision, c_type, stream, /*bucketed=*/false);
}

absl::Status Gemm::RunVaryingRows(const GemmShape& s, float alpha, const void* a, const void* b,
                                  float beta, void* c, GemmPrecision precision, DataType c_type,
                                  cudaStream_t stream) {
  const bool aligned = AlignmentOf(a) >= 16 && AlignmentOf(b) >= 16 && AlignmentOf(c) >= 16;
  return Launch(s, alpha, a, b, beta, c, precision, c_type, stream, /*bucketed=*/aligned);
}

absl::Status Gemm::Launch(const GemmShape& s, float alpha, const void* a, const void* b, float beta,
                          void* c, GemmPrecision precision, DataType c_type, cudaStream_t stream,
                          bool bucketed) {
  if (absl::Status st = CheckGemmArgs(s, precision, c_type); !st.ok()) return st;
  if (s.m == 0 || s.n == 0) return absl::OkStatus();
  if (s.k == 0) {
    // An empty product (an expert with no rows in a weight gradient): C stays beta C.
    if (beta == 1.0f) return absl::OkStatus();
    return absl::InvalidArgumentError("gemm: k = 0 with beta != 1; scale C instead");
  }
  if (stream == nullptr) stream = device_->stream();

  const bool bf = precision == GemmPrecision::kBf16;
  const cudaDataType_t ab_type = bf ? CUDA_R_16BF : CUDA_R_32F;
  const cudaDataType_t cc_type = c_type == DataType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
  const cublasComputeType_t compute =
      precision == GemmPrecision::kTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  // Bucketed plans are chosen for the next power of two of m and k (at least 16) and 16-byte
  // alignment, then run with the actual sizes.
  const auto bucket = [](int x) {
    int up = 16;
    while (up < x) up *= 2;
    return up;
  };
  const int m = bucketed ? bucket(s.m) : s.m;
  const int k = bucketed ? bucket(s.k) : s.k;
  const auto align = [bucketed](const void* p) {
    return bucketed ? std::min(16, AlignmentOf(p)) : AlignmentOf(p);
  };
  const std::array<int, 14> key = {s.trans_a,
                                   s.trans_b,
                                   m,
                                   s.n,
                                   k,
                                   s.lda,
                                   s.ldb,
                                   s.ldc,
                                   static_cast<int>(precision),
                                   static_cast<int>(c_type),
                                   align(a),
                                   align(b),
                                   align(c),
                                   bucketed};
  // Column-major view: C^T (n x m) = op(B)^T (n x k) op(A)^T (k x m).
  const Operands ops{s, ab_type, cc_type, s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                     s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    auto plan = std::make_shared<Plan>();
    // A' is our B, B' our A. A bucket's layouts hold the bucket's rows: leading dimensions
    // below them are not layouts cuBLASLt accepts.
    GemmShape planned = s;
    if (bucketed) {
      planned.lda = std::max(s.lda, s.trans_a ? m : k);
      planned.ldb = std::max(s.ldb, s.trans_b ? k : s.n);
    }
    const Operands plan_ops{planned, ab_type, cc_type, ops.ta, ops.tb};
    if (absl::Status st = plan->Choose(plan_ops, compute, m, k, static_cast<uint32_t>(align(b)),
                                       static_cast<uint32_t>(align(a)),
                                       static_cast<uint32_t>(align(c)), precision, *device_);
        !st.ok()) {
      return st;
    }
    it = plans_.emplace(key, std::move(plan)).first;
  }
  const Plan& p = *it->second;
  const auto matmul = [&](cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                          cublasLtMatrixLayout_t lc) {
    return CublasLt().Matmul(static_cast<cublasLtHandle_t>(device_->blas_handle()), p.op, &alpha, b,
                             la, a, lb, &beta, c, lc, c, lc, &p.algo, device_->blas_workspace(),
                             device_->blas_workspace_bytes(), stream);
  };
  if (!bucketed) return BlasCheck(matmul(p.a, p.b, p.c), "cublasLtMatmul", s);
  // The bucket's algorithm on this problem's own layouts.
  Plan actual;
  if (absl::Status st = ops.MakeLayouts(s.m, s.k, &actual.a, &actual.b, &actual.c); !st.ok()) {
    return st;
  }
  // An algorithm chosen for the bucket's sizes need not suit these: cuBLASLt says which.
  cublasLtMatmulHeuristicResult_t check{};
  if (CublasLt().MatmulAlgoCheck(static_cast<cublasLtHandle_t>(device_->blas_handle()), p.op,
                                 actual.a, actual.b, actual.c, actual.c, &p.algo,
                                 &check) != CUBLAS_STATUS_SUCCESS ||
      check.workspaceSize > device_->blas_workspace_bytes()) {
    return Launch(s, alpha, a, b, beta, c, precision, c_type, stream, /*bucketed=*/false);
  }
  return BlasCheck(matmul(actual.a, actual.b, actual.c), "cublasLtMatmul (bucketed algorithm)", s);
}

}  // namespace rackrun::runtime::cuda
