// AdamW on the GPU (runtime/optimizer.h's update, bias corrections and weight-decay rule):
// every tensor in one launch over a table of chunks, the global gradient norm and the
// clipping factor computed on the device (no host round trip between them), moments in fp32
// on the device. One D2H copy of the norm when the caller asks for it (the log line).
#ifndef RACKRUN_RUNTIME_CUDA_OPTIMIZER_H_
#define RACKRUN_RUNTIME_CUDA_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/cuda/device.h"
#include "runtime/cuda/kernels.h"
#include "runtime/optimizer.h"

namespace rackrun::runtime::cuda {

// One tensor as the device optimizer sees it: device pointers.
struct DeviceOptimizedTensor {
  std::string name;
  float* value = nullptr;
  const float* grad = nullptr;
  int64_t size = 0;
  bool decay = true;
};

class DeviceAdamW {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceAdamW>> Create(
      Device* device, AdamWConfig config, std::vector<DeviceOptimizedTensor> tensors);

  // The global gradient norm and the clipping factor (clip / norm when clip > 0 and the
  // norm exceeds it, else 1), on the device. `norm` (nullable) receives the norm on the host
  // (a synchronising copy).
  absl::Status GradNorm(double clip, double* norm);
  // Each tensor's sum of squared gradients, in double: partial sums of kernels::kChunk
  // elements on the device, added in chunk order on the host (one synchronising copy).
  // For a norm the caller combines with other ranks' (several ranks, the trainer).
  absl::Status TensorSquares(std::vector<double>* squares);
  // Sets the clipping factor the next Step(lr, true) applies to `scale` (rounded to float, as
  // GradNorm's kernel and the CPU AdamW round it), in place of a GradNorm's.
  absl::Status SetClipFactor(double scale);
  // One update with learning rate `lr`; the gradients are scaled by the clipping factor (of
  // the last GradNorm or SetClipFactor) when `use_clip_factor`, else by 1.
  absl::Status Step(double lr, bool use_clip_factor);

  int64_t step() const { return step_; }
  // The bias-correction step, after moments are restored (a resume).
  void set_step(int64_t step) { step_ = step; }
  absl::Status MomentsToHost(size_t i, std::vector<float>* m, std::vector<float>* v);
  // Every tensor's moments at once (m[i] and v[i] hold tensor i's size): one copy of the
  // whole buffer each way, for checkpoints and resumes.
  absl::Status CopyMomentsTo(const std::vector<std::span<float>>& m,
                             const std::vector<std::span<float>>& v);
  absl::Status CopyMomentsFrom(const std::vector<std::span<const float>>& m,
                               const std::vector<std::span<const float>>& v);

 private:
  DeviceAdamW(Device* device, AdamWConfig config, std::vector<DeviceOptimizedTensor> tensors);
  absl::Status Init();
  // The tensor table (pointers, sizes, decay flags), once: it never changes.
  absl::Status UploadTable();

  Device* device_;
  AdamWConfig config_;
  std::vector<DeviceOptimizedTensor> tensors_;
  DeviceTensor<float> moments_;  // m then v of every tensor, back to back
  std::vector<int64_t> moment_offset_;
  std::vector<int32_t> chunk_tensor_host_;  // chunk q's tensor
  DeviceTensor<int32_t> chunk_tensor_;
  DeviceTensor<int64_t> chunk_start_;
  DeviceTensor<int32_t> table_;  // AdamTensor records, as bytes
  DeviceTensor<double> partial_, norm_;
  DeviceTensor<float> scale_;
  int64_t chunks_ = 0;
  int64_t step_ = 0;
};

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_OPTIMIZER_H_
