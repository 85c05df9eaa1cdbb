// cuBLASLt opened at first use (dlopen), not linked: loading libcublasLt costs about 210 MB of
// resident memory (measured on the 2-core dev VM: an empty program linked to CUDA 13's
// libcublasLt.so.13 peaks at 212 MB, one linked to libcudart at 3 MB), which every `rackrun`
// command and every worker would pay although most never compute on a GPU. Device::Open loads
// it; everything that calls cuBLASLt holds a Device, so CublasLt() is valid there.
#ifndef RACKRUN_RUNTIME_CUDA_CUBLASLT_LIBRARY_H_
#define RACKRUN_RUNTIME_CUDA_CUBLASLT_LIBRARY_H_

#include <cublasLt.h>

#include "absl/status/statusor.h"

namespace rackrun::runtime::cuda {

// The entry points the engine calls, named as cuBLASLt's without the prefix.
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

// Loads libcublasLt.so.<the build's CUDA major> once (thread-safe); FailedPrecondition naming
// the file, the loader's reason and the fix when it is missing or lacks an entry point.
absl::StatusOr<const CublasLtLibrary*> LoadCublasLt();

// The loaded library; only after LoadCublasLt succeeded (Device::Open's first step).
const CublasLtLibrary& CublasLt();

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_CUBLASLT_LIBRARY_H_
