// The compute device of a job (`resources.device`): "cpu", "cuda" (the local rank's GPU)
// or "cuda:N" (GPU N of the machine, as CUDA numbers the visible ones). Parsing only: the
// question "is that GPU here and usable" needs the CUDA runtime and is asked where a job
// starts (runtime/cuda/device_probe.h).
#ifndef RACKRUN_JOBSPEC_DEVICE_H_
#define RACKRUN_JOBSPEC_DEVICE_H_

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace rackrun::jobspec {

struct DeviceSpec {
  enum class Kind { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  // kCuda: the GPU index, or -1 for "the local rank's GPU" (plain "cuda").
  int index = -1;

  bool is_cuda() const { return kind == Kind::kCuda; }
  // The GPU a rank with local rank `local_rank` uses (kCuda only).
  int GpuFor(int local_rank) const { return index >= 0 ? index : local_rank; }
  // "cpu", "cuda" or "cuda:N": the form it was parsed from.
  std::string ToString() const;
};

// Empty text is "cpu" (the default). InvalidArgument naming resources.device and the
// accepted forms otherwise (unknown names, "cuda:" without a decimal index, negative or
// absurd indices).
absl::StatusOr<DeviceSpec> ParseDevice(std::string_view text);

}  // namespace rackrun::jobspec

#endif  // RACKRUN_JOBSPEC_DEVICE_H_
