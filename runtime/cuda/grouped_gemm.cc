#include "runtime/cuda/grouped_gemm.h"

#include <algorithm>
#include <climits>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "runtime/cuda/cublaslt_library.h"

namespace rackrun::runtime::cuda {
namespace {

int64_t StartOf(const ExpertOperand& o, const ExpertBatch& b) {
  return b.offset * o.row_stride + static_cast<int64_t>(b.expert) * o.expert_stride;
}

absl::Mutex refusal_mu;
std::string& Refusal() ABSL_EXCLUSIVE_LOCKS_REQUIRED(refusal_mu) {
  static std::string refusal;
  return refusal;
}

std::string BatchName(const ExpertBatch& b) {
  return absl::StrCat("grouped GEMM: batch of expert ", b.expert, " (instance ", b.instance,
                      ", offset ", b.offset, ", rows ", b.rows, ")");
}

}  // namespace

absl::StatusOr<ExpertGemmPath> ParseExpertGemmPath(absl::string_view name,
                                                   absl::string_view field) {
  if (name == "per_expert") return ExpertGemmPath::kPerExpert;
  if (name == "grouped") return ExpertGemmPath::kGrouped;
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": unknown expert GEMM path '", name, "'; use per_expert or grouped"));
}

absl::string_view ExpertGemmPathName(ExpertGemmPath path) {
  return path == ExpertGemmPath::kGrouped ? "grouped" : "per_expert";
}

std::string GroupedBf16Refusal() {
  absl::MutexLock lock(&refusal_mu);
  return Refusal();
}

void ForgetGroupedBf16RefusalForTesting() {
  absl::MutexLock lock(&refusal_mu);
  Refusal().clear();
}

GemmShape ExpertShape(const ExpertGemm& g, const ExpertBatch& b) {
  GemmShape s = g.shape;
  (g.rows_in_k ? s.k : s.m) = static_cast<int>(b.rows);
  return s;
}

const void* ExpertOperandAt(const ExpertOperand& o, const ExpertBatch& b) {
  return static_cast<const char*>(o.base) + StartOf(o, b) * o.element_bytes;
}

absl::StatusOr<GroupedProblems> BuildGroupedProblems(std::span<const ExpertBatch> batches,
                                                     const ExpertGemm& g) {
  GroupedProblems p;
  for (const ExpertBatch& b : batches) {
    if (b.offset < 0 || b.rows < 0 || b.expert < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(BatchName(b), ": negative offset, rows or expert"));
    }
    if (b.rows > INT_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat(BatchName(b), ": more rows than a GEMM dimension holds (", INT_MAX, ")"));
    }
    if (b.rows == 0) continue;  // left out: an empty expert's output or gradient is untouched
    const GemmShape s = ExpertShape(g, b);
    if (absl::Status st = CheckGemmArgs(s, GemmPrecision::kFp32, DataType::kF32); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(BatchName(b), ": ", st.message()));
    }
    if (s.m == 0 || s.n == 0) continue;
    if (s.k == 0) {
      if (g.beta == 1.0f) continue;
      return absl::InvalidArgumentError(
          absl::StrCat(BatchName(b), ": k = 0 with beta != 1; scale C instead"));
    }
    const void* a = ExpertOperandAt(g.a, b);
    const void* bb = ExpertOperandAt(g.b, b);
    void* c = const_cast<void*>(ExpertOperandAt(g.c, b));  // c.base is the written output
    // Column-major: C^T (n x m) = op(B)^T (n x k) op(A)^T (k x m).
    p.transa.push_back(s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
    p.transb.push_back(s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
    p.m.push_back(s.n);
    p.n.push_back(s.m);
    p.k.push_back(s.k);
    p.lda.push_back(s.ldb);
    p.ldb.push_back(s.lda);
    p.ldc.push_back(s.ldc);
    p.group_size.push_back(1);
    p.alpha.push_back(g.alpha);
    p.beta.push_back(g.beta);
    p.a.push_back(bb);
    p.b.push_back(a);
    p.c.push_back(c);
    p.expert.push_back(b.expert);
    p.a_extent = std::max(p.a_extent, StartOf(g.a, b) + ExtentA(s));
    p.b_extent = std::max(p.b_extent, StartOf(g.b, b) + ExtentB(s));
    p.aligned16 = p.aligned16 && Aligned16(a) && Aligned16(bb) && Aligned16(c);
  }
  return p;
}

GroupedGemm::GroupedGemm(Device* device)
    : device_(device), pointers_(device, "grouped GEMM pointer arrays") {}

GroupedGemm::~GroupedGemm() {
  if (handle_ != nullptr) (void)(*LoadCublas())->Destroy(handle_);
}

absl::Status GroupedGemm::Init() {
  absl::StatusOr<const CublasLibrary*> lib = LoadCublas();
  if (!lib.ok()) return lib.status();
  const auto check = [&](cublasStatus_t s, const char* call) {
    if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
    return absl::InternalError(
        absl::StrCat(call, ": ", (*lib)->GetStatusName(s), ": ", (*lib)->GetStatusString(s)));
  };
  if (absl::Status s = check((*lib)->Create(&handle_), "cublasCreate"); !s.ok()) return s;
  // SetStream resets the workspace to cuBLAS's own pool: set it first, then ours (the
  // cuBLASLt GEMMs use it on the same stream, so never at the same time).
  if (absl::Status s = check((*lib)->SetStream(handle_, device_->stream()), "cublasSetStream");
      !s.ok()) {
    return s;
  }
  return check(
      (*lib)->SetWorkspace(handle_, device_->blas_workspace(), device_->blas_workspace_bytes()),
      "cublasSetWorkspace");
}

absl::Status GroupedGemm::Run(const GroupedProblems& p, GemmPrecision precision) {
  const int n = p.count();
  if (n == 0) return absl::OkStatus();
  if (handle_ == nullptr) {
    if (absl::Status s = Init(); !s.ok()) return s;
  }
  const CublasLibrary& lib = **LoadCublas();
  // The pointer arrays: A's, B's, C's, one device copy (pageable: staged before it returns).
  host_pointers_.resize(static_cast<size_t>(3 * n));
  for (int i = 0; i < n; ++i) {
    const size_t j = static_cast<size_t>(i);
    host_pointers_[j] = reinterpret_cast<intptr_t>(p.a[j]);
    host_pointers_[static_cast<size_t>(n) + j] = reinterpret_cast<intptr_t>(p.b[j]);
    host_pointers_[static_cast<size_t>(2 * n) + j] = reinterpret_cast<intptr_t>(p.c[j]);
  }
  if (absl::Status s = pointers_.Resize({3 * static_cast<int64_t>(n)}); !s.ok()) return s;
  if (absl::Status s = pointers_.CopyFrom(host_pointers_); !s.ok()) return s;
  const auto* a = reinterpret_cast<const void* const*>(pointers_.data());
  const auto* c = reinterpret_cast<void* const*>(pointers_.data() + 2 * n);
  const cudaDataType_t ab = precision == GemmPrecision::kBf16 ? CUDA_R_16BF : CUDA_R_32F;
  const cublasComputeType_t compute =
      precision == GemmPrecision::kTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const cublasStatus_t st = lib.GemmGroupedBatchedEx(
      handle_, p.transa.data(), p.transb.data(), p.m.data(), p.n.data(), p.k.data(), p.alpha.data(),
      a, ab, p.lda.data(), a + n, ab, p.ldb.data(), p.beta.data(), c, CUDA_R_32F, p.ldc.data(), n,
      p.group_size.data(), compute);
  if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message =
      absl::StrCat("cublasGemmGroupedBatchedEx (", n, " problems, ", GemmPrecisionName(precision),
                   ", C fp32): ", lib.GetStatusName(st), ": ", lib.GetStatusString(st));
  if (precision == GemmPrecision::kBf16 &&
      (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE)) {
    absl::MutexLock lock(&refusal_mu);
    if (Refusal().empty()) Refusal() = lib.GetStatusName(st);
    return absl::UnimplementedError(message);
  }
  return absl::InternalError(message);
}

}  // namespace rackrun::runtime::cuda
