// The GPU a rank computes on: its caching allocator over cudaMalloc, its streams (one
// compute stream; copy streams on request), events, the cuBLASLt handle, and device
// tensors. Requires the GPU engine (RACKRUN_HAVE_CUDA).
//
//   absl::StatusOr<std::unique_ptr<Device>> dev = Device::Open(0);
//   DeviceTensor<float> x(dev->get(), "blocks.0.attn.q");
//   RETURN_IF_ERROR(x.Resize({tokens, width}));         // through the caching allocator
//   RETURN_IF_ERROR(x.CopyFrom(host_span));             // on the compute stream
//   ... kernels on dev->stream() ...
//   RETURN_IF_ERROR(x.CopyTo(host_vector));             // synchronises that stream
//
// Errors: every CUDA failure becomes an absl::Status naming the call, the CUDA error and
// what was being done (CudaCheck below). Out of memory names the tensor and the bytes
// (CachingAllocator).
//
// Threads: a Device may be used from several threads only with external ordering; kernels
// are enqueued on its streams, so calls from one thread at a time is the model.
//
// RACKRUN_CUDA_POISON_ALLOCATIONS=1 (a debugging aid, like compute-sanitizer's initcheck; the
// simulated GPU tests run with it): every byte of a DeviceTensor that its Resize did not keep
// is set to all-ones (NaN as floats, -1 as integers) on the compute stream: a new block whole,
// a kept block's bytes between its old and new size. The caching allocator hands back blocks
// holding another tensor's numbers, and a GPU's fresh memory is usually zeros, so a kernel
// that reads what nobody wrote would otherwise read plausible values; poisoned, it reads NaN
// and fails its comparison. Unset or 0: off (no memsets). Another value: Device::Open fails
// naming the variable.
#ifndef RACKRUN_RUNTIME_CUDA_DEVICE_H_
#define RACKRUN_RUNTIME_CUDA_DEVICE_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "runtime/cuda/caching_allocator.h"
#include "runtime/cuda/device_probe.h"

namespace rackrun::runtime::cuda {

using bf16 = __nv_bfloat16;

// OK, or an Internal error "<what>: <cudaGetErrorName>: <cudaGetErrorString>"
// (ResourceExhausted for cudaErrorMemoryAllocation).
absl::Status CudaCheck(cudaError_t e, absl::string_view what);

// OK when a GPU is usable here; otherwise the cause, starting "no CUDA device: " followed by
// the CUDA runtime's own error string (what the gpu tests print when they skip).
absl::Status GpuAvailable();

// cudaMalloc / cudaFree on one GPU.
class CudaMemory final : public RawMemory {
 public:
  explicit CudaMemory(int device) : device_(device) {}
  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Free(void* p) override;
  absl::Status Synchronize() override;
  std::string Describe() override;

 private:
  int device_;
};

class Stream {
 public:
  // A non-blocking stream (does not synchronise with the legacy default stream).
  static absl::StatusOr<Stream> Create();
  Stream() = default;
  Stream(Stream&& o) noexcept : s_(o.s_) { o.s_ = nullptr; }
  Stream& operator=(Stream&& o) noexcept;
  ~Stream();
  cudaStream_t get() const { return s_; }
  absl::Status Synchronize() const;

 private:
  explicit Stream(cudaStream_t s) : s_(s) {}
  cudaStream_t s_ = nullptr;
};

class Event {
 public:
  // `timing`: the event records a timestamp (ElapsedMs); otherwise it only orders work.
  static absl::StatusOr<Event> Create(bool timing = false);
  Event() = default;
  Event(Event&& o) noexcept : e_(o.e_) { o.e_ = nullptr; }
  Event& operator=(Event&& o) noexcept;
  ~Event();
  cudaEvent_t get() const { return e_; }
  absl::Status Record(cudaStream_t stream) const;
  // `stream` waits (on the device) for the work before the last Record.
  absl::Status MakeWait(cudaStream_t stream) const;
  absl::Status Synchronize() const;
  // Whether the work before the last Record has run (cudaEventQuery), without waiting.
  absl::StatusOr<bool> Done() const;
  // Milliseconds from `start` to this event (both recorded, both timing events).
  absl::StatusOr<float> ElapsedMs(const Event& start) const;

 private:
  explicit Event(cudaEvent_t e) : e_(e) {}
  cudaEvent_t e_ = nullptr;
};

// Page-locked host memory (cudaHostAlloc), so that a device-to-host cudaMemcpyAsync into it
// runs in the stream's order without blocking the host (pageable memory would): for copies the
// host waits on later through an Event. Allocated once by its owner, freed on destruction.
template <typename T>
class PinnedBuffer {
 public:
  // `what` names the buffer in the error.
  static absl::StatusOr<PinnedBuffer> Allocate(int64_t size, absl::string_view what);
  // At least `size` elements: a smaller buffer is replaced (its contents are not kept). The
  // caller makes sure no queued copy still uses the old one.
  absl::Status Reserve(int64_t size, absl::string_view what);
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  ~PinnedBuffer() { Free(); }

  T* data() { return p_; }
  const T* data() const { return p_; }
  int64_t size() const { return size_; }
  std::span<const T> view() const { return {p_, static_cast<size_t>(size_)}; }

 private:
  PinnedBuffer(T* p, int64_t size) : p_(p), size_(size) {}
  void Free();
  T* p_ = nullptr;
  int64_t size_ = 0;
};

class Device {
 public:
  // Makes `index` the calling thread's device, creates the compute stream and the
  // allocator. Errors as device_probe.h's CheckDevice, then CUDA's; InvalidArgument for a
  // RACKRUN_CUDA_POISON_ALLOCATIONS other than 0 or 1.
  static absl::StatusOr<std::unique_ptr<Device>> Open(int index);
  ~Device();

  int index() const { return info_.index; }
  const GpuInfo& info() const { return info_; }
  cudaStream_t stream() const { return compute_.get(); }
  CachingAllocator& allocator() { return *allocator_; }
  // A workspace for cuBLASLt (32 MiB, Hopper's recommendation), on the compute stream.
  void* blas_workspace() const { return workspace_.ptr; }
  size_t blas_workspace_bytes() const { return workspace_.bytes; }
  // cublasLtHandle_t, kept opaque here so this header does not need cuBLAS.
  void* blas_handle() const { return blas_; }
  absl::Status Synchronize() const { return compute_.Synchronize(); }
  // RACKRUN_CUDA_POISON_ALLOCATIONS=1 at Open.
  bool poison_allocations() const { return poison_; }

 private:
  Device() = default;
  bool poison_ = false;
  GpuInfo info_;
  Stream compute_;
  std::unique_ptr<CachingAllocator> allocator_;
  CachingAllocator::Block workspace_;
  void* blas_ = nullptr;
};

// Element types a DeviceTensor holds.
template <typename T>
concept DeviceElement = std::is_same_v<T, float> || std::is_same_v<T, bf16> ||
    std::is_same_v<T, int32_t> || std::is_same_v<T, double> || std::is_same_v<T, int64_t>;

// A contiguous row-major device array with a name (for out-of-memory errors) and up to
// four dimensions, allocated on the device's compute stream. Resize keeps the block when it
// is large enough (contents kept), so a step that reuses its shapes allocates nothing.
template <DeviceElement T>
class DeviceTensor {
 public:
  DeviceTensor(Device* device, std::string name) : device_(device), name_(std::move(name)) {}
  DeviceTensor(DeviceTensor&& o) noexcept;
  DeviceTensor& operator=(DeviceTensor&& o) noexcept;
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor();

  absl::Status Resize(std::initializer_list<int64_t> shape);
  // Async zero fill on the compute stream.
  absl::Status Zero();
  // Host -> device (size must equal size()), async on the compute stream; `host` must stay
  // valid until the stream has run it (Device::Synchronize), or be pageable (then CUDA
  // copies it before returning).
  absl::Status CopyFrom(std::span<const T> host);
  // Device -> host, resizing `host`; returns when the compute stream has run everything
  // before it (the copy to pageable memory waits for it; an empty tensor synchronises).
  absl::Status CopyTo(std::vector<T>* host) const;

  T* data() { return static_cast<T*>(block_.ptr); }
  const T* data() const { return static_cast<const T*>(block_.ptr); }
  int64_t size() const { return size_; }
  int64_t dim(int i) const { return shape_[static_cast<size_t>(i)]; }
  int rank() const { return rank_; }
  size_t bytes() const { return static_cast<size_t>(size_) * sizeof(T); }
  const std::string& name() const { return name_; }

 private:
  void Release();
  Device* device_;
  std::string name_;
  CachingAllocator::Block block_;
  int64_t size_ = 0;
  int rank_ = 0;
  int64_t shape_[4] = {1, 1, 1, 1};
};

extern template class PinnedBuffer<int32_t>;
extern template class PinnedBuffer<float>;
extern template class PinnedBuffer<double>;
extern template class DeviceTensor<float>;
extern template class DeviceTensor<bf16>;
extern template class DeviceTensor<int32_t>;
extern template class DeviceTensor<double>;
extern template class DeviceTensor<int64_t>;

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_DEVICE_H_
