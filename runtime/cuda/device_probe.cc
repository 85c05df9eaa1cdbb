#include "runtime/cuda/device_probe.h"

#include "absl/strings/str_cat.h"

#if RACKRUN_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace rackrun::runtime::cuda {
namespace {

constexpr char kField[] = "resources.device: ";

#if RACKRUN_HAVE_CUDA
std::string CudaError(const char* call, cudaError_t e) {
  return absl::StrCat(call, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}
#endif

[[maybe_unused]] absl::Status NoEngine() {
  return absl::FailedPreconditionError(
      absl::StrCat(kField,
                   "this build has no GPU engine (configured without nvcc, or with "
                   "RACKRUN_WITH_CUDA=OFF); rebuild on a machine with the CUDA toolkit, or use "
                   "resources.device: cpu"));
}

}  // namespace

std::string CudaVersionString(int version) {
  return absl::StrCat(version / 1000, ".", (version % 1000) / 10);
}

absl::Status CheckGpuResidualMode(absl::string_view mode) {
  if (mode == "vanilla" || mode == "hc" || mode == "mhc" || mode == "xhc" || mode == "xhc_flash" ||
      mode == "xhc_flash4") {
    return absl::OkStatus();
  }
  return absl::UnimplementedError(
      absl::StrCat("model.residual: mode ", mode,
                   " does not run on the GPU yet (the GPU engine runs vanilla, hc, mhc, xhc, "
                   "xhc_flash and xhc_flash4); use resources.device: cpu for ",
                   mode, ", or a mode the GPU runs"));
}

CudaBuildInfo BuildInfo() {
  CudaBuildInfo b;
#if RACKRUN_HAVE_CUDA
  b.built = true;
  b.runtime_version = CUDART_VERSION;
  b.min_compute = RACKRUN_CUDA_MIN_COMPUTE;
  b.architectures = RACKRUN_CUDA_ARCHITECTURES;
#endif
  return b;
}

absl::StatusOr<std::vector<GpuInfo>> VisibleGpus() {
#if !RACKRUN_HAVE_CUDA
  return NoEngine();
#else
  int driver = 0;
  // Never fails for a missing driver: it reports 0.
  (void)cudaDriverGetVersion(&driver);
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky, but leave no error behind
    if (driver == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          kField, "no CUDA device: no NVIDIA driver is loadable on this machine (",
          CudaError("cudaGetDeviceCount", e),
          "); run on a machine with a GPU and its driver, or use resources.device: cpu"));
    }
    if (driver < CUDART_VERSION) {
      return absl::FailedPreconditionError(
          absl::StrCat(kField, "the NVIDIA driver supports CUDA ", CudaVersionString(driver),
                       ", older than the CUDA ", CudaVersionString(CUDART_VERSION),
                       " this build was compiled with; update the driver (",
                       CudaError("cudaGetDeviceCount", e), ")"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat(kField, "no CUDA device: ", CudaError("cudaGetDeviceCount", e),
                     "; check nvidia-smi and CUDA_VISIBLE_DEVICES, or use resources.device: cpu"));
  }
  if (count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(kField, "no CUDA device: the driver (CUDA ", CudaVersionString(driver),
                     ") shows none to this process; check nvidia-smi and CUDA_VISIBLE_DEVICES"));
  }
  if (driver < CUDART_VERSION) {
    return absl::FailedPreconditionError(
        absl::StrCat(kField, "the NVIDIA driver supports CUDA ", CudaVersionString(driver),
                     ", older than the CUDA ", CudaVersionString(CUDART_VERSION),
                     " this build was compiled with; update the driver"));
  }
  std::vector<GpuInfo> gpus;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    if (cudaError_t pe = cudaGetDeviceProperties(&p, i); pe != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat(kField, "GPU ", i, ": ", CudaError("cudaGetDeviceProperties", pe)));
    }
    GpuInfo g;
    g.index = i;
    g.name = p.name;
    g.major = p.major;
    g.minor = p.minor;
    g.multiprocessors = p.multiProcessorCount;
    g.total_bytes = static_cast<int64_t>(p.totalGlobalMem);
    g.l2_bytes = p.l2CacheSize;
    g.driver_version = driver;
    gpus.push_back(std::move(g));
  }
  return gpus;
#endif
}

absl::StatusOr<GpuInfo> CheckDevice(const jobspec::DeviceSpec& device, int local_rank,
                                    int ranks_here) {
  if (!device.is_cuda()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kField, "'", device.ToString(), "' is not a GPU device"));
  }
  absl::StatusOr<std::vector<GpuInfo>> gpus = VisibleGpus();
  if (!gpus.ok()) return gpus.status();
  const int count = static_cast<int>(gpus->size());
  const std::string seen = absl::StrCat(count, " visible GPU", count == 1 ? "" : "s", " (cuda:0",
                                        count > 1 ? absl::StrCat("..cuda:", count - 1) : "", ")");
  if (device.index < 0 && ranks_here > count) {
    return absl::FailedPreconditionError(
        absl::StrCat(kField, "cuda gives each local rank its own GPU, and ", ranks_here,
                     " ranks run on this machine with ", seen,
                     "; run at most one rank per GPU, or name one with cuda:N"));
  }
  const int index = device.GpuFor(local_rank);
  if (index >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat(kField, device.ToString(), " (local rank ", local_rank, ") names GPU ", index,
                     ", but this machine has ", seen, "; choose an index below ", count));
  }
  GpuInfo g = (*gpus)[static_cast<size_t>(index)];
#if RACKRUN_HAVE_CUDA
  if (g.major * 10 + g.minor < RACKRUN_CUDA_MIN_COMPUTE) {
    return absl::FailedPreconditionError(absl::StrCat(
        kField, "GPU ", index, " (", g.name, ") has compute capability ", g.major, ".", g.minor,
        "; this build runs on ", RACKRUN_CUDA_MIN_COMPUTE / 10, ".", RACKRUN_CUDA_MIN_COMPUTE % 10,
        " or newer (", RACKRUN_CUDA_ARCHITECTURES,
        "); use a Hopper or Blackwell GPU, or rebuild with RACKRUN_CUDA_GENCODE for it"));
  }
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaSetDevice(index) == cudaSuccess &&
      cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    g.free_bytes = static_cast<int64_t>(free_bytes);
  }
  (void)cudaGetLastError();
#endif
  return g;
}

}  // namespace rackrun::runtime::cuda
