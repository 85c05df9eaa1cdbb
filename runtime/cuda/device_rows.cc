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
      index_{CachedIndex{{}, DeviceTensor<int64_t>(device, name + " dispatch index 0")},
             CachedIndex{{}, DeviceTensor<int64_t>(device, name + " dispatch index 1")}} {}

absl::StatusOr<const int64_t*> DeviceRows::OnDevice(std::span<const int64_t> index, int64_t width) {
  if (width < 1 || width > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, " (device rows): width ", width, " is outside [1, 2^31)"));
  }
  ++uses_;
  for (CachedIndex& c : index_) {
    if (c.last_use >= 0 && std::equal(index.begin(), index.end(), c.host.begin(), c.host.end())) {
      c.last_use = uses_;
      return c.device.data();
    }
  }
  CachedIndex& c = index_[0].last_use <= index_[1].last_use ? index_[0] : index_[1];
  c.last_use = -1;  // until the upload is queued
  c.host.assign(index.begin(), index.end());
  // Resizing and overwriting are queued on the compute stream, after every launch that read
  // the entry's old list.
  if (absl::Status s = c.device.Resize({static_cast<int64_t>(index.size())}); !s.ok()) return s;
  if (absl::Status s = c.device.CopyFrom(index); !s.ok()) return s;
  c.last_use = uses_;
  ++uploads_;
  return c.device.data();
}

absl::Status DeviceRows::Gather(const float* src, std::span<const int64_t> index, int64_t divisor,
                                int64_t width, float* dst) {
  if (index.empty()) return absl::OkStatus();
  absl::StatusOr<const int64_t*> on_device = OnDevice(index, width);
  if (!on_device.ok()) return on_device.status();
  return CudaCheck(
      kernels::GatherRows(static_cast<int64_t>(index.size()), divisor, static_cast<int>(width),
                          *on_device, src, dst, device_->stream()),
      absl::StrCat(name_, " (device rows): packing rows"));
}

absl::Status DeviceRows::Scatter(const float* src, std::span<const int64_t> index, int64_t width,
                                 float* dst) {
  if (index.empty()) return absl::OkStatus();
  absl::StatusOr<const int64_t*> on_device = OnDevice(index, width);
  if (!on_device.ok()) return on_device.status();
  return CudaCheck(
      kernels::DispatchRows(static_cast<int64_t>(index.size()), 1, static_cast<int>(width),
                            *on_device, src, dst, device_->stream()),
      absl::StrCat(name_, " (device rows): unpacking rows"));
}

absl::StatusOr<float*> DeviceRows::Buffer(int which, int64_t floats) {
  DeviceTensor<float>& b = which == 0 ? send_ : recv_;
  if (absl::Status s = b.Resize({std::max<int64_t>(floats, 1)}); !s.ok()) return s;
  return b.data();
}

}  // namespace rackrun::runtime::cuda
