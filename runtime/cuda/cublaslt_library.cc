#include "runtime/cuda/cublaslt_library.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace rackrun::runtime::cuda {
namespace {

absl::StatusOr<CublasLtLibrary> Open() {
  const std::string name = absl::StrCat("libcublasLt.so.", CUDART_VERSION / 1000);
  void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return absl::FailedPreconditionError(absl::StrCat(
        "cuBLASLt: cannot load ", name, " (", why != nullptr ? why : "not found",
        "); install CUDA's cuBLAS (or NVIDIA's nvidia-cublas wheel) and put its folder on "
        "LD_LIBRARY_PATH"));
  }
  CublasLtLibrary lib;
  std::string missing;
  const auto symbol = [&](auto& fn, const char* symbol_name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(handle, symbol_name));
    if (fn == nullptr && missing.empty()) missing = symbol_name;
  };
  symbol(lib.Create, "cublasLtCreate");
  symbol(lib.Destroy, "cublasLtDestroy");
  symbol(lib.GetStatusName, "cublasLtGetStatusName");
  symbol(lib.GetStatusString, "cublasLtGetStatusString");
  symbol(lib.Matmul, "cublasLtMatmul");
  symbol(lib.MatmulAlgoCheck, "cublasLtMatmulAlgoCheck");
  symbol(lib.MatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic");
  symbol(lib.MatmulDescCreate, "cublasLtMatmulDescCreate");
  symbol(lib.MatmulDescDestroy, "cublasLtMatmulDescDestroy");
  symbol(lib.MatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute");
  symbol(lib.MatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate");
  symbol(lib.MatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy");
  symbol(lib.MatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute");
  symbol(lib.MatrixLayoutCreate, "cublasLtMatrixLayoutCreate");
  symbol(lib.MatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy");
  if (!missing.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuBLASLt: ", name, " has no ", missing, "; it is not the build's cuBLAS"));
  }
  return lib;
}

}  // namespace

absl::StatusOr<const CublasLtLibrary*> LoadCublasLt() {
  static const absl::StatusOr<CublasLtLibrary> lib = Open();  // once, thread-safe
  if (!lib.ok()) return lib.status();
  return &*lib;
}

const CublasLtLibrary& CublasLt() { return **LoadCublasLt(); }

}  // namespace rackrun::runtime::cuda
