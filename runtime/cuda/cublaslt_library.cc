#include "runtime/cuda/cublaslt_library.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace rackrun::runtime::cuda {
namespace {

constexpr absl::string_view kCublasFix =
    "install CUDA's cuBLAS (or NVIDIA's nvidia-cublas wheel) and put its folder on "
    "LD_LIBRARY_PATH";

// Opens <stem>.so.<the build's CUDA major> and binds `Lib`'s entry points with `bind`.
template <typename Lib, typename BindAll>
absl::StatusOr<Lib> OpenCuda(absl::string_view stem, absl::string_view what, BindAll bind) {
#ifdef RACKRUN_CUDA_SIM
  // The engine on the CUDA simulator (sim/README.md): its cuBLASLt and cuBLAS in one file.
  (void)stem;
  absl::StatusOr<SharedLibrary> so = SharedLibrary::Open(RACKRUN_CUDASIM_BLAS, what, kCublasFix);
#else
  absl::StatusOr<SharedLibrary> so =
      SharedLibrary::Open(absl::StrCat(stem, ".so.", CUDART_VERSION / 1000), what, kCublasFix);
#endif
  if (!so.ok()) return so.status();
  Lib lib;
  bind(*so, lib);
  if (absl::Status s = so->Check(); !s.ok()) return s;
  return lib;
}

absl::StatusOr<CublasLtLibrary> OpenCublasLt() {
  return OpenCuda<CublasLtLibrary>(
      "libcublasLt", "cuBLASLt", [](SharedLibrary& so, CublasLtLibrary& lib) {
        so.Bind(lib.Create, "cublasLtCreate");
        so.Bind(lib.Destroy, "cublasLtDestroy");
        so.Bind(lib.GetStatusName, "cublasLtGetStatusName");
        so.Bind(lib.GetStatusString, "cublasLtGetStatusString");
        so.Bind(lib.Matmul, "cublasLtMatmul");
        so.Bind(lib.MatmulAlgoCheck, "cublasLtMatmulAlgoCheck");
        so.Bind(lib.MatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic");
        so.Bind(lib.MatmulDescCreate, "cublasLtMatmulDescCreate");
        so.Bind(lib.MatmulDescDestroy, "cublasLtMatmulDescDestroy");
        so.Bind(lib.MatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute");
        so.Bind(lib.MatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate");
        so.Bind(lib.MatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy");
        so.Bind(lib.MatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute");
        so.Bind(lib.MatrixLayoutCreate, "cublasLtMatrixLayoutCreate");
        so.Bind(lib.MatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy");
      });
}

absl::StatusOr<CublasLibrary> OpenCublas() {
  return OpenCuda<CublasLibrary>("libcublas", "cuBLAS", [](SharedLibrary& so, CublasLibrary& lib) {
    so.Bind(lib.Create, "cublasCreate_v2");
    so.Bind(lib.Destroy, "cublasDestroy_v2");
    so.Bind(lib.SetStream, "cublasSetStream_v2");
    so.Bind(lib.SetWorkspace, "cublasSetWorkspace_v2");
    so.Bind(lib.GetStatusName, "cublasGetStatusName");
    so.Bind(lib.GetStatusString, "cublasGetStatusString");
    so.Bind(lib.GemmGroupedBatchedEx, "cublasGemmGroupedBatchedEx");
  });
}

}  // namespace

absl::StatusOr<SharedLibrary> SharedLibrary::Open(const std::string& file, absl::string_view what,
                                                  absl::string_view fix) {
  void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": cannot load ", file, " (", why != nullptr ? why : "not found", "); ", fix));
  }
  return SharedLibrary(handle, file, std::string(what));
}

void* SharedLibrary::Find(const char* symbol) {
  void* p = dlsym(handle_, symbol);
  if (p == nullptr && missing_.empty()) missing_ = symbol;
  return p;
}

absl::Status SharedLibrary::Check() const {
  if (missing_.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(what_, ": ", file_, " has no ", missing_, "; it is not the build's ", what_));
}

absl::StatusOr<const CublasLtLibrary*> LoadCublasLt() {
  static const absl::StatusOr<CublasLtLibrary> lib = OpenCublasLt();  // once, thread-safe
  if (!lib.ok()) return lib.status();
  return &*lib;
}

const CublasLtLibrary& CublasLt() { return **LoadCublasLt(); }

absl::StatusOr<const CublasLibrary*> LoadCublas() {
  static const absl::StatusOr<CublasLibrary> lib = OpenCublas();  // once, thread-safe
  if (!lib.ok()) return lib.status();
  return &*lib;
}

}  // namespace rackrun::runtime::cuda
