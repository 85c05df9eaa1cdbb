#include "runtime/cuda/device_rows.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "runtime/cuda/kernels.h"

namespace rackrun::runtime::cuda {

DeviceRows::DeviceRows(Device* device, const std::string& name)
    : device_(device),
      name_(name),
      send_(device, name + " dispatch send rows"),
      recv_(device, name + " dispatch received rows"),
      gather_(device, name + " dispatch packing index"),
      scatter_(device, name + " dispatch unpacking index") {}

absl::Status DeviceRows::Upload(std::span<const int64_t> index, int64_t width,
                                DeviceTensor<int64_t>& on_device) {
  if (width < 1 || width > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, " (device rows): width ", width, " is outside [1, 2^31)"));
  }
  if (absl::Status s = on_device.Resize({static_cast<int64_t>(index.size())}); !s.ok()) return s;
  return on_device.CopyFrom(index);
}

absl::Status DeviceRows::Gather(const float* src, std::span<const int64_t> index, int64_t divisor,
                                int64_t width, float* dst) {
  if (index.empty()) return absl::OkStatus();
  if (absl::Status s = Upload(index, width, gather_); !s.ok()) return s;
  return CudaCheck(
      kernels::GatherRows(static_cast<int64_t>(index.size()), divisor, static_cast<int>(width),
                          gather_.data(), src, dst, device_->stream()),
      absl::StrCat(name_, " (device rows): packing rows"));
}

absl::Status DeviceRows::Scatter(const float* src, std::span<const int64_t> index, int64_t width,
                                 float* dst) {
  if (index.empty()) return absl::OkStatus();
  if (absl::Status s = Upload(index, width, scatter_); !s.ok()) return s;
  return CudaCheck(
      kernels::DispatchRows(static_cast<int64_t>(index.size()), 1, static_cast<int>(width),
                            scatter_.data(), src, dst, device_->stream()),
      absl::StrCat(name_, " (device rows): unpacking rows"));
}

absl::StatusOr<float*> DeviceRows::Buffer(int which, int64_t floats) {
  DeviceTensor<float>& b = which == 0 ? send_ : recv_;
  if (absl::Status s = b.Resize({std::max<int64_t>(floats, 1)}); !s.ok()) return s;
  return b.data();
}

}  // namespace rackrun::runtime::cuda
