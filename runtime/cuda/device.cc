#include "runtime/cuda/device.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/cuda/cublaslt_library.h"

namespace rackrun::runtime::cuda {
namespace {

constexpr size_t kBlasWorkspaceBytes = size_t{32} << 20;

}  // namespace

absl::Status CudaCheck(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

absl::Status GpuAvailable() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat("no CUDA device: ", cudaGetErrorString(e)));
  }
  if (count == 0) {
    return absl::FailedPreconditionError("no CUDA device: the driver shows none to this process");
  }
  return absl::OkStatus();
}

absl::StatusOr<void*> CudaMemory::Allocate(size_t bytes) {
  void* p = nullptr;
  if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
    return CudaCheck(e, absl::StrCat("cudaSetDevice(", device_, ")"));
  }
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // an allocation failure is not sticky; clear it
    return CudaCheck(e, absl::StrCat("cudaMalloc(", bytes, ")"));
  }
  return p;
}

void CudaMemory::Free(void* p) { (void)cudaFree(p); }

absl::Status CudaMemory::Synchronize() {
  return CudaCheck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

std::string CudaMemory::Describe() {
  size_t free_bytes = 0, total = 0;
  if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::StrCat("cuda:", device_, ": free memory unknown");
  }
  return absl::StrCat("cuda:", device_, ": ", FormatBytes(static_cast<int64_t>(free_bytes)),
                      " free of ", FormatBytes(static_cast<int64_t>(total)));
}

// ---- Stream, Event

absl::StatusOr<Stream> Stream::Create() {
  cudaStream_t s = nullptr;
  if (absl::Status st = CudaCheck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                                  "cudaStreamCreateWithFlags");
      !st.ok()) {
    return st;
  }
  return Stream(s);
}

Stream& Stream::operator=(Stream&& o) noexcept {
  if (this != &o) {
    if (s_ != nullptr) (void)cudaStreamDestroy(s_);
    s_ = std::exchange(o.s_, nullptr);
  }
  return *this;
}

Stream::~Stream() {
  if (s_ != nullptr) (void)cudaStreamDestroy(s_);
}

absl::Status Stream::Synchronize() const {
  return CudaCheck(cudaStreamSynchronize(s_), "cudaStreamSynchronize");
}

absl::StatusOr<Event> Event::Create(bool timing) {
  cudaEvent_t e = nullptr;
  const unsigned flags = timing ? cudaEventDefault : cudaEventDisableTiming;
  if (absl::Status st = CudaCheck(cudaEventCreateWithFlags(&e, flags), "cudaEventCreate");
      !st.ok()) {
    return st;
  }
  return Event(e);
}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    if (e_ != nullptr) (void)cudaEventDestroy(e_);
    e_ = std::exchange(o.e_, nullptr);
  }
  return *this;
}

Event::~Event() {
  if (e_ != nullptr) (void)cudaEventDestroy(e_);
}

absl::Status Event::Record(cudaStream_t stream) const {
  return CudaCheck(cudaEventRecord(e_, stream), "cudaEventRecord");
}

absl::Status Event::MakeWait(cudaStream_t stream) const {
  return CudaCheck(cudaStreamWaitEvent(stream, e_, 0), "cudaStreamWaitEvent");
}

absl::Status Event::Synchronize() const {
  return CudaCheck(cudaEventSynchronize(e_), "cudaEventSynchronize");
}

absl::StatusOr<bool> Event::Done() const {
  const cudaError_t e = cudaEventQuery(e_);
  if (e == cudaErrorNotReady) {
    // Not an error, but CUDA keeps it as the thread's last error: cleared, so that the next
    // kernel launch's cudaGetLastError does not report it.
    (void)cudaGetLastError();
    return false;
  }
  if (absl::Status s = CudaCheck(e, "cudaEventQuery"); !s.ok()) return s;
  return true;
}

absl::StatusOr<float> Event::ElapsedMs(const Event& start) const {
  float ms = 0;
  if (absl::Status s = CudaCheck(cudaEventElapsedTime(&ms, start.e_, e_), "cudaEventElapsedTime");
      !s.ok()) {
    return s;
  }
  return ms;
}

// ---- PinnedBuffer

template <typename T>
absl::StatusOr<PinnedBuffer<T>> PinnedBuffer<T>::Allocate(int64_t size, absl::string_view what) {
  void* p = nullptr;
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(size, 1)) * sizeof(T);
  if (absl::Status st = CudaCheck(cudaHostAlloc(&p, bytes, cudaHostAllocDefault),
                                  absl::StrCat("cudaHostAlloc (", what, ", ", bytes, " bytes)"));
      !st.ok()) {
    return st;
  }
  return PinnedBuffer(static_cast<T*>(p), size);
}

template <typename T>
absl::Status PinnedBuffer<T>::Reserve(int64_t size, absl::string_view what) {
  if (size_ >= size) return absl::OkStatus();
  absl::StatusOr<PinnedBuffer> p = Allocate(size, what);
  if (!p.ok()) return p.status();
  *this = *std::move(p);
  return absl::OkStatus();
}

template <typename T>
PinnedBuffer<T>& PinnedBuffer<T>::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    Free();
    p_ = std::exchange(o.p_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

template <typename T>
void PinnedBuffer<T>::Free() {
  if (p_ != nullptr) (void)cudaFreeHost(p_);
  p_ = nullptr;
  size_ = 0;
}

template class PinnedBuffer<int32_t>;
template class PinnedBuffer<float>;
template class PinnedBuffer<double>;

// ---- Device

namespace {

absl::StatusOr<bool> PoisonAllocationsFromEnvironment() {
  const char* env = std::getenv("RACKRUN_CUDA_POISON_ALLOCATIONS");
  const std::string v = env == nullptr ? "" : env;
  if (v.empty() || v == "0") return false;
  if (v == "1") return true;
  return absl::InvalidArgumentError(absl::StrCat("RACKRUN_CUDA_POISON_ALLOCATIONS=", v,
                                                 ": use 1 (poison) or 0 (off), or leave it unset"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Device>> Device::Open(int index) {
  jobspec::DeviceSpec spec;
  spec.kind = jobspec::DeviceSpec::Kind::kCuda;
  spec.index = index;
  absl::StatusOr<GpuInfo> info = CheckDevice(spec, 0, 1);
  if (!info.ok()) return info.status();
  // cuBLASLt is opened with the first device, not at program start (cublaslt_library.h).
  if (absl::StatusOr<const CublasLtLibrary*> lt = LoadCublasLt(); !lt.ok()) return lt.status();
  std::unique_ptr<Device> d(new Device());
  absl::StatusOr<bool> poison = PoisonAllocationsFromEnvironment();
  if (!poison.ok()) return poison.status();
  d->poison_ = *poison;
  d->info_ = *info;
  if (absl::Status s = CudaCheck(cudaSetDevice(index), "cudaSetDevice"); !s.ok()) return s;
  absl::StatusOr<Stream> stream = Stream::Create();
  if (!stream.ok()) return stream.status();
  d->compute_ = std::move(*stream);
  d->allocator_ = std::make_unique<CachingAllocator>(std::make_unique<CudaMemory>(index));
  absl::StatusOr<CachingAllocator::Block> ws =
      d->allocator_->Allocate(kBlasWorkspaceBytes, d->stream(), "cuBLASLt workspace");
  if (!ws.ok()) return ws.status();
  d->workspace_ = *ws;
  cublasLtHandle_t h = nullptr;
  if (cublasStatus_t st = CublasLt().Create(&h); st != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("cublasLtCreate: ", CublasLt().GetStatusName(st), ": ",
                                            CublasLt().GetStatusString(st)));
  }
  d->blas_ = h;
  return d;
}

Device::~Device() {
  if (compute_.get() != nullptr) (void)compute_.Synchronize();
  if (blas_ != nullptr) (void)CublasLt().Destroy(static_cast<cublasLtHandle_t>(blas_));
  if (workspace_.ptr != nullptr && allocator_) (void)allocator_->Free(workspace_.ptr);
}

// ---- DeviceTensor

template <DeviceElement T>
DeviceTensor<T>::DeviceTensor(DeviceTensor&& o) noexcept
    : device_(o.device_),
      name_(std::move(o.name_)),
      block_(std::exchange(o.block_, {})),
      size_(std::exchange(o.size_, 0)),
      rank_(std::exchange(o.rank_, 0)) {
  std::copy(o.shape_, o.shape_ + 4, shape_);
}

template <DeviceElement T>
DeviceTensor<T>& DeviceTensor<T>::operator=(DeviceTensor&& o) noexcept {
  if (this != &o) {
    Release();
    device_ = o.device_;
    name_ = std::move(o.name_);
    block_ = std::exchange(o.block_, {});
    size_ = std::exchange(o.size_, 0);
    rank_ = std::exchange(o.rank_, 0);
    std::copy(o.shape_, o.shape_ + 4, shape_);
  }
  return *this;
}

template <DeviceElement T>
DeviceTensor<T>::~DeviceTensor() {
  Release();
}

template <DeviceElement T>
void DeviceTensor<T>::Release() {
  if (block_.ptr != nullptr) (void)device_->allocator().Free(block_.ptr);
  block_ = {};
}

template <DeviceElement T>
absl::Status DeviceTensor<T>::Resize(std::initializer_list<int64_t> shape) {
  if (shape.size() > 4) return absl::InvalidArgumentError(absl::StrCat(name_, ": rank above 4"));
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat(name_, ": negative dimension"));
    n *= d;
  }
  const size_t bytes = static_cast<size_t>(n) * sizeof(T);
  // With poisoning: the bytes not kept, [from, to), become all-ones.
  size_t from = std::min(bytes, this->bytes()), to = std::max(bytes, this->bytes());
  if (block_.ptr == nullptr || bytes > block_.class_bytes) {
    Release();
    absl::StatusOr<CachingAllocator::Block> b =
        device_->allocator().Allocate(bytes, device_->stream(), name_);
    if (!b.ok()) return b.status();
    block_ = *b;
    from = 0;
    to = block_.class_bytes;
  }
  if (device_->poison_allocations() && to > from) {
    if (absl::Status s = CudaCheck(cudaMemsetAsync(static_cast<char*>(block_.ptr) + from, 0xff,
                                                   to - from, device_->stream()),
                                   absl::StrCat("poisoning ", name_));
        !s.ok()) {
      return s;
    }
  }
  size_ = n;
  rank_ = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t d : shape) shape_[i++] = d;
  for (; i < 4; ++i) shape_[i] = 1;
  return absl::OkStatus();
}

template <DeviceElement T>
absl::Status DeviceTensor<T>::Zero() {
  return CudaCheck(cudaMemsetAsync(block_.ptr, 0, bytes(), device_->stream()),
                   absl::StrCat("zeroing ", name_));
}

template <DeviceElement T>
absl::Status DeviceTensor<T>::CopyFrom(std::span<const T> host) {
  if (static_cast<int64_t>(host.size()) != size_) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": copying ", host.size(), " elements into a tensor of ", size_));
  }
  return CudaCheck(
      cudaMemcpyAsync(block_.ptr, host.data(), bytes(), cudaMemcpyHostToDevice, device_->stream()),
      absl::StrCat("copying ", name_, " to the device"));
}

template <DeviceElement T>
absl::Status DeviceTensor<T>::CopyTo(std::vector<T>* host) const {
  host->resize(static_cast<size_t>(size_));
  // An empty tensor copies nothing, and CUDA need not wait for the stream then.
  if (bytes() == 0) return device_->Synchronize();
  // A copy to pageable memory returns once it has completed (CUDA's API synchronisation
  // rules), so the compute stream's work before it is done too: no synchronize after it.
  return CudaCheck(
      cudaMemcpyAsync(host->data(), block_.ptr, bytes(), cudaMemcpyDeviceToHost, device_->stream()),
      absl::StrCat("copying ", name_, " to the host"));
}

template class DeviceTensor<float>;
template class DeviceTensor<bf16>;
template class DeviceTensor<int32_t>;
template class DeviceTensor<double>;
template class DeviceTensor<int64_t>;

}  // namespace rackrun::runtime::cuda
