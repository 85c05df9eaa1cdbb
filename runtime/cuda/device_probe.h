// Which GPUs this process can use, and whether `resources.device` names one that this build
// runs on. The header is free of CUDA so the CPU engine (runtime/job_config.cc) can ask;
// the answer comes from the CUDA runtime when the build has it (RACKRUN_HAVE_CUDA), and is
// "this build has no GPU engine" otherwise.
//
// Checks, in order, each an error naming resources.device, the cause and what to do:
//   1. the build has the GPU engine (FailedPrecondition otherwise);
//   2. a GPU is visible (no driver, an old driver and no device are told apart:
//      cudaGetDeviceCount's own error string is quoted);
//   3. the driver supports at least the CUDA version the build was compiled with;
//   4. the GPU index exists (cuda:N, or for plain "cuda" the local rank: a machine with R
//      ranks needs R GPUs);
//   5. its compute capability is at least the build's lowest architecture (9.0: sm_90a,
//      sm_100a and PTX for compute_90).
// Thread-safe; each call asks the runtime afresh.
#ifndef RACKRUN_RUNTIME_CUDA_DEVICE_PROBE_H_
#define RACKRUN_RUNTIME_CUDA_DEVICE_PROBE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "jobspec/device.h"

namespace rackrun::runtime::cuda {

struct GpuInfo {
  int index = 0;
  std::string name;          // "NVIDIA H200"
  int major = 0, minor = 0;  // compute capability
  int multiprocessors = 0;
  int64_t total_bytes = 0;
  int64_t free_bytes = 0;  // at the time of the probe
  int64_t l2_bytes = 0;
  int driver_version = 0;  // e.g. 13000 for CUDA 13.0
};

struct CudaBuildInfo {
  bool built = false;         // the GPU engine is in this build
  int runtime_version = 0;    // CUDA the build compiled against, e.g. 13000
  int min_compute = 0;        // lowest compute capability the code runs on, e.g. 90
  std::string architectures;  // "sm_90a sm_100a compute_90" (the last is PTX)
};

CudaBuildInfo BuildInfo();

// Every visible GPU, or the error of checks 1-3 above.
absl::StatusOr<std::vector<GpuInfo>> VisibleGpus();

// Checks 1-5 for the GPU that `device` names for a rank with local rank `local_rank` of
// `ranks_here` ranks on this machine; OK with that GPU's description. A cpu device is an
// InvalidArgument (callers ask only for cuda).
absl::StatusOr<GpuInfo> CheckDevice(const jobspec::DeviceSpec& device, int local_rank,
                                    int ranks_here);

// "13.0" from 13000.
std::string CudaVersionString(int version);

// Whether the GPU engine runs residual mode `mode` (model.residual): OK for every mode
// (vanilla, hc, mhc, xhc, xhc_flash, xhc_flash4); an Unimplemented error naming
// model.residual, the mode and the modes it runs for any other name. The shapes the GPU
// kernels support (e.g. xhc at most 4 active streams) are checked when the model is built.
// No GPU needed.
absl::Status CheckGpuResidualMode(absl::string_view mode);

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_DEVICE_PROBE_H_
