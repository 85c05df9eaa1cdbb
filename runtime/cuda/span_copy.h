// SpanCopy: a fixed list of device-to-device copies (kernels::CopySpan: `size` floats from
// `from` to `to`) run as one launch on the device's compute stream. The list's tables go to
// the device once, when it is created (a pageable copy, staged by CUDA before Create
// returns); every Run after that is one kernel. The GPU engine packs a job's gradients into
// one buffer for the all-reduce, and back, with two of these instead of one cudaMemcpyAsync
// per tensor and direction. The pointers must stay valid while the SpanCopy is used; spans
// must not overlap.
#ifndef RACKRUN_RUNTIME_CUDA_SPAN_COPY_H_
#define RACKRUN_RUNTIME_CUDA_SPAN_COPY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/cuda/device.h"
#include "runtime/cuda/kernels.h"

namespace rackrun::runtime::cuda {

class SpanCopy {
 public:
  // `name` names the copies in errors ("packing gradients").
  static absl::StatusOr<std::unique_ptr<SpanCopy>> Create(Device* device, std::string name,
                                                          std::vector<kernels::CopySpan> spans);
  // Queues every copy on the device's compute stream.
  absl::Status Run();
  // The floats the copies move.
  int64_t floats() const { return floats_; }

 private:
  SpanCopy(Device* device, std::string name);

  Device* device_;
  std::string name_;
  int64_t chunks_ = 0;
  int64_t floats_ = 0;
  DeviceTensor<int32_t> spans_;  // CopySpan records, as bytes
  DeviceTensor<int32_t> chunk_span_;
  DeviceTensor<int64_t> chunk_start_;
};

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_SPAN_COPY_H_
