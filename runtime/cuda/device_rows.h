// DeviceRows: comm/token_dispatch.h's RowMover on a GPU, so that the expert-parallel token
// dispatch moves a GPU engine's expert rows without a trip through host memory, over a channel
// that takes device buffers (DataChannel::takes_device_buffers: NCCL).
//
// - Gather (packing) is kernels::GatherRows and Scatter (unpacking) kernels::DispatchRows with
//   k 1, both on the device's compute stream: bytes as they are, so a dispatch moves the same
//   bits as the host's row copies.
// - The index lists (host) go up through pageable copies, which CUDA stages before
//   cudaMemcpyAsync returns: the caller may drop them at once. The last two lists uploaded
//   stay on the device, and a list equal to one of them (compared by content, never by
//   address) is not uploaded again: a dispatch's two lists go up once for its forward
//   dispatch and serve its combine and the backward pass's dispatch and combine.
// - The exchange buffers are device memory of the device's caching allocator.
// - BeforeExchange waits for the compute stream: the channel runs its AllToAllV on a stream of
//   its own. The channel's AllToAllV returns when the rows have arrived, so the unpacking,
//   queued after it on the compute stream, needs no wait.
#ifndef RACKRUN_RUNTIME_CUDA_DEVICE_ROWS_H_
#define RACKRUN_RUNTIME_CUDA_DEVICE_ROWS_H_

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/token_dispatch.h"
#include "runtime/cuda/device.h"

namespace rackrun::runtime::cuda {

class DeviceRows final : public comm::RowMover {
 public:
  // `device` must outlive this; `name` prefixes tensor names and errors.
  DeviceRows(Device* device, const std::string& name);

  absl::Status Gather(const float* src, std::span<const int64_t> index, int64_t divisor,
                      int64_t width, float* dst) override;
  absl::Status Scatter(const float* src, std::span<const int64_t> index, int64_t width,
                       float* dst) override;
  absl::StatusOr<float*> Buffer(int which, int64_t floats) override;
  absl::Status BeforeExchange() override { return device_->Synchronize(); }

  // Index lists uploaded so far (for tests: a list already on the device is not counted).
  int64_t uploads() const { return uploads_; }

 private:
  struct CachedIndex {
    std::vector<int64_t> host;
    DeviceTensor<int64_t> device;
    int64_t last_use = -1;
  };
  // `index` on the device: a cached copy equal to it, or the least recently used cache
  // entry overwritten with it (async, pageable source); InvalidArgument for a width CUDA's
  // launch cannot take.
  absl::StatusOr<const int64_t*> OnDevice(std::span<const int64_t> index, int64_t width);

  Device* device_;
  std::string name_;
  DeviceTensor<float> send_, recv_;
  std::array<CachedIndex, 2> index_;
  int64_t uses_ = 0;
  int64_t uploads_ = 0;
};

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_DEVICE_ROWS_H_
