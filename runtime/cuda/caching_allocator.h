// CachingAllocator: the GPU engine's device memory. Plain allocations from a raw backend
// (cudaMalloc on a GPU: never managed memory), kept after Free in per-stream free lists by
// size class and handed out again, so the steady-state training step calls cudaMalloc and
// cudaFree (which synchronise the device) never.
//
// Size classes: up to 1 MiB, multiples of 512 bytes; above, eight classes per power of two
// (1.125, 1.25, ... 2 x 2^p), so a block wastes less than 12.5% of its size; above 1 GiB,
// multiples of 2 MiB. Blocks that large are the ones allocated once (a model's parameters,
// their gradients, the optimizer's moments), where an eighth of a power of two wasted up to
// 0.5 GiB each and nothing else could reuse the slack (c1024: 0.75 GiB over three). A block is
// reused only for its own class and its own stream: work queued on one stream that still
// reads a freed block cannot race with a new owner on another stream (a block used on two
// streams is freed after they are joined, by the caller).
//
// Out of memory: the allocator waits for the device (RawMemory::Synchronize), returns every
// cached block to the backend and tries once more; if that fails too, the error is a
// ResourceExhausted naming what the memory was for, the bytes asked, the bytes in use and
// cached, the peak, the largest live blocks by name, and the backend's own account (for a
// GPU: its free and total memory).
//
// Where the peak went: each live block keeps the name it was allocated for, and the blocks
// live when the requested bytes last reached a new peak are recorded (PeakBlocks), so a
// benchmark can say which tensors make up the peak. Recording copies the live list (names
// and sizes) at each new peak: during a model's first step, then rarely.
//
// The bookkeeping is host code without CUDA: tests run it on the CPU over HostBudgetMemory
// (host memory with a byte budget); the GPU backend is runtime/cuda/device.h's.
//
// Thread-safe (one mutex). Pointers stay valid until Free.
#ifndef RACKRUN_RUNTIME_CUDA_CACHING_ALLOCATOR_H_
#define RACKRUN_RUNTIME_CUDA_CACHING_ALLOCATOR_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace rackrun::runtime::cuda {

// A stream as the allocator sees it: an opaque key (a cudaStream_t on a GPU; nullptr is the
// default stream).
using StreamKey = const void*;

// Where blocks come from.
class RawMemory {
 public:
  virtual ~RawMemory() = default;
  // `bytes` > 0. ResourceExhausted when the backend has no room (any other error is
  // returned as is and not retried).
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual void Free(void* p) = 0;
  // Returns when no queued work can still touch a cached block (a GPU: the device is idle).
  virtual absl::Status Synchronize() = 0;
  // The backend's own account for error messages, e.g. "cuda:0 (NVIDIA H200): 1.2 GiB free
  // of 139.8 GiB".
  virtual std::string Describe() = 0;
};

// Host memory with a byte budget: the allocator's tests run on the CPU with it.
class HostBudgetMemory final : public RawMemory {
 public:
  explicit HostBudgetMemory(size_t budget_bytes) : budget_(budget_bytes) {}
  ~HostBudgetMemory() override;
  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Free(void* p) override;
  absl::Status Synchronize() override {
    ++synchronizations_;
    return absl::OkStatus();
  }
  std::string Describe() override;

  size_t used() const { return used_; }
  int synchronizations() const { return synchronizations_; }

 private:
  size_t budget_;
  size_t used_ = 0;
  int synchronizations_ = 0;
  std::unordered_map<void*, size_t> sizes_;
};

struct AllocatorStats {
  int64_t in_use_bytes = 0;     // class bytes of live blocks
  int64_t requested_bytes = 0;  // bytes asked for by live blocks (<= in_use_bytes)
  int64_t peak_in_use_bytes = 0;
  int64_t peak_requested_bytes = 0;  // the highest requested_bytes (not the size classes')
  int64_t cached_bytes = 0;          // freed blocks held for reuse
  int64_t reserved_bytes = 0;        // in use + cached: what the backend has given
  int64_t peak_reserved_bytes = 0;
  int64_t live_blocks = 0;
  int64_t allocations = 0;      // Allocate calls that succeeded
  int64_t cache_hits = 0;       // ... served from a free list
  int64_t raw_allocations = 0;  // RawMemory::Allocate calls that succeeded
  int64_t raw_frees = 0;
  int64_t cache_flushes = 0;  // times the cache went back to the backend
};

// "1.50 GiB", "512 B": sizes in messages.
std::string FormatBytes(int64_t bytes);

class CachingAllocator {
 public:
  static constexpr size_t kSmallLimit = size_t{1} << 20;
  static constexpr size_t kSmallStep = 512;
  static constexpr size_t kHugeLimit = size_t{1} << 30;
  static constexpr size_t kHugeStep = size_t{2} << 20;

  struct Block {
    void* ptr = nullptr;
    size_t bytes = 0;        // asked for
    size_t class_bytes = 0;  // held (SizeClass(bytes))
    StreamKey stream = nullptr;
  };

  explicit CachingAllocator(std::unique_ptr<RawMemory> raw);
  // Returns cached blocks and any block still live to the backend.
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // A block of at least `bytes` (0 gets the smallest class) for use on `stream`. `what`
  // names the tensor or buffer in the out-of-memory error.
  absl::StatusOr<Block> Allocate(size_t bytes, StreamKey stream, absl::string_view what);
  // Back to its stream's free list. InvalidArgument for a pointer this allocator does not
  // hold (a double free, or another allocator's block).
  absl::Status Free(void* ptr);
  // Waits for the device, then returns every cached block to the backend.
  absl::Status ReleaseCache();

  AllocatorStats stats() const;
  // Clears the peaks (to the current values; the peak's blocks to the live ones) and the
  // counters, e.g. per benchmark phase.
  void ResetPeaks();

  // A block live at the requested peak: the name it was allocated for and the bytes asked.
  struct NamedBlock {
    std::string what;
    int64_t bytes = 0;
  };
  // The live blocks when requested_bytes last set its peak, largest first (ties by name).
  std::vector<NamedBlock> PeakBlocks() const;
  RawMemory& raw() { return *raw_; }

  static size_t SizeClass(size_t bytes);

 private:
  absl::Status ReleaseCacheLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The live blocks, in no order.
  std::vector<NamedBlock> LiveBlocksLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  struct Live {
    Block block;
    std::string what;
  };

  mutable absl::Mutex mu_;
  std::unique_ptr<RawMemory> raw_ ABSL_GUARDED_BY(mu_);
  // (stream, class bytes) -> free pointers of that class, last freed last.
  std::map<std::pair<StreamKey, size_t>, std::vector<void*>> free_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<void*, Live> live_ ABSL_GUARDED_BY(mu_);
  AllocatorStats stats_ ABSL_GUARDED_BY(mu_);
  // Recorded unsorted at each new peak (during a model's first step, often); sorted once, by
  // the first PeakBlocks after it (the engine's StepStats asks every step).
  mutable std::vector<NamedBlock> peak_blocks_ ABSL_GUARDED_BY(mu_);
  mutable bool peak_blocks_sorted_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_CACHING_ALLOCATOR_H_
