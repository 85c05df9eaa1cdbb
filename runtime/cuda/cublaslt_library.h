// cuBLASLt and cuBLAS opened at first use (dlopen), not linked: loading libcublasLt costs about
// 210 MB of resident memory (measured on the 2-core dev VM: an empty program linked to CUDA 13's
// libcublasLt.so.13 peaks at 212 MB, one linked to libcudart at 3 MB), which every `rackrun`
// command and every worker would pay although most never compute on a GPU. Device::Open loads
// cuBLASLt; everything that calls it holds a Device, so CublasLt() is valid there. cuBLAS
// (libcublas.so.<major>, for its grouped GEMM, grouped_gemm.h) is loaded only by the first
// grouped GEMM, so a run on the per-expert path never maps it.
//
// Both go through SharedLibrary: dlopen once (never closed), each entry point bound by name; a
// missing file or entry point is a FailedPrecondition naming the library, the file, the
// loader's reason and the fix.
#ifndef RACKRUN_RUNTIME_CUDA_CUBLASLT_LIBRARY_H_
#define RACKRUN_RUNTIME_CUDA_CUBLASLT_LIBRARY_H_

#include <cublasLt.h>
#include <cublas_api.h>

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rackrun::runtime::cuda {

// A shared library opened with dlopen (RTLD_NOW | RTLD_LOCAL; never closed) and its entry
// points bound by name.
class SharedLibrary {
 public:
  // `what` names the library in errors ("cuBLAS"); `fix` says how to install it.
  // FailedPrecondition "<what>: cannot load <file> (<loader's reason>); <fix>" on failure.
  static absl::StatusOr<SharedLibrary> Open(const std::string& file, absl::string_view what,
                                            absl::string_view fix);
  // Binds `fn` to the entry point `symbol` (null when missing; Check reports the first one).
  template <typename F>
  void Bind(F*& fn, const char* symbol) {
    fn = reinterpret_cast<F*>(Find(symbol));
  }
  // OK, or FailedPrecondition "<what>: <file> has no <symbol>; it is not the build's <what>"
  // for the first entry point Bind did not find.
  absl::Status Check() const;

 private:
  SharedLibrary(void* handle, std::string file, std::string what)
      : handle_(handle), file_(std::move(file)), what_(std::move(what)) {}
  void* Find(const char* symbol);
  void* handle_ = nullptr;
  std::string file_, what_, missing_;
};

// The cuBLASLt entry points the engine calls, named as cuBLASLt's without the prefix.
struct CublasLtLibrary {
  decltype(&::cublasLtCreate) Create = nullptr;
  decltype(&::cublasLtDestroy) Destroy = nullptr;
  decltype(&::cublasLtGetStatusName) GetStatusName = nullptr;
  decltype(&::cublasLtGetStatusString) GetStatusString = nullptr;
  decltype(&::cublasLtMatmul) Matmul = nullptr;
  decltype(&::cublasLtMatmulAlgoCheck) MatmulAlgoCheck = nullptr;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic = nullptr;
  decltype(&::cublasLtMatmulDescCreate) MatmulDescCreate = nullptr;
  decltype(&::cublasLtMatmulDescDestroy) MatmulDescDestroy = nullptr;
  decltype(&::cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute = nullptr;
  decltype(&::cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate = nullptr;
  decltype(&::cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute = nullptr;
  decltype(&::cublasLtMatrixLayoutCreate) MatrixLayoutCreate = nullptr;
  decltype(&::cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy = nullptr;
};

// The cuBLAS entry points of the grouped GEMM (cublas_api.h's names without the prefix and
// the _v2 suffix).
struct CublasLibrary {
  decltype(&::cublasCreate_v2) Create = nullptr;
  decltype(&::cublasDestroy_v2) Destroy = nullptr;
  decltype(&::cublasSetStream_v2) SetStream = nullptr;
  decltype(&::cublasSetWorkspace_v2) SetWorkspace = nullptr;
  decltype(&::cublasGetStatusName) GetStatusName = nullptr;
  decltype(&::cublasGetStatusString) GetStatusString = nullptr;
  decltype(&::cublasGemmGroupedBatchedEx) GemmGroupedBatchedEx = nullptr;
};

// Loads libcublasLt.so.<the build's CUDA major> once (thread-safe); the errors above.
absl::StatusOr<const CublasLtLibrary*> LoadCublasLt();

// The loaded library; only after LoadCublasLt succeeded (Device::Open's first step).
const CublasLtLibrary& CublasLt();

// Loads libcublas.so.<the build's CUDA major> once (thread-safe); the errors above.
absl::StatusOr<const CublasLibrary*> LoadCublas();

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_CUBLASLT_LIBRARY_H_
