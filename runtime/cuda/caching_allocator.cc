#include "runtime/cuda/caching_allocator.h"

#include <algorithm>
#include <bit>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace rackrun::runtime::cuda {
namespace {

// Alignment of host test blocks: that of cudaMalloc (256 bytes).
constexpr size_t kHostAlignment = 256;

void SortLargestFirst(std::vector<CachingAllocator::NamedBlock>& blocks) {
  std::sort(blocks.begin(), blocks.end(),
            [](const CachingAllocator::NamedBlock& x, const CachingAllocator::NamedBlock& y) {
              return x.bytes != y.bytes ? x.bytes > y.bytes : x.what < y.what;
            });
}

}  // namespace

std::string FormatBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / (1 << 30));
  if (bytes >= (int64_t{1} << 20)) return absl::StrFormat("%.2f MiB", b / (1 << 20));
  if (bytes >= (int64_t{1} << 10)) return absl::StrFormat("%.2f KiB", b / (1 << 10));
  return absl::StrCat(bytes, " B");
}

HostBudgetMemory::~HostBudgetMemory() {
  for (auto& [p, bytes] : sizes_) std::free(p);
}

absl::StatusOr<void*> HostBudgetMemory::Allocate(size_t bytes) {
  if (bytes > budget_ - used_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host budget: ", FormatBytes(static_cast<int64_t>(budget_ - used_)),
                     " free of ", FormatBytes(static_cast<int64_t>(budget_))));
  }
  void* p = std::aligned_alloc(kHostAlignment,
                               (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment);
  if (p == nullptr) return absl::ResourceExhaustedError("host: aligned_alloc failed");
  used_ += bytes;
  sizes_[p] = bytes;
  return p;
}

void HostBudgetMemory::Free(void* p) {
  auto it = sizes_.find(p);
  if (it == sizes_.end()) return;
  used_ -= it->second;
  sizes_.erase(it);
  std::free(p);
}

std::string HostBudgetMemory::Describe() {
  return absl::StrCat("host test memory: ", FormatBytes(static_cast<int64_t>(budget_ - used_)),
                      " free of ", FormatBytes(static_cast<int64_t>(budget_)));
}

size_t CachingAllocator::SizeClass(size_t bytes) {
  if (bytes <= kSmallLimit)
    return std::max<size_t>(kSmallStep, (bytes + kSmallStep - 1) / kSmallStep * kSmallStep);
  // bytes in (2^p, 2^(p+1)]: steps of 2^(p-3); above kHugeLimit, of kHugeStep.
  const int p = std::bit_width(bytes - 1) - 1;
  const size_t step = bytes > kHugeLimit ? kHugeStep : size_t{1} << (p - 3);
  return (bytes + step - 1) / step * step;
}

CachingAllocator::CachingAllocator(std::unique_ptr<RawMemory> raw) : raw_(std::move(raw)) {}

CachingAllocator::~CachingAllocator() {
  absl::MutexLock lock(&mu_);
  (void)ReleaseCacheLocked();
  for (auto& [p, l] : live_) raw_->Free(p);
  live_.clear();
}

absl::StatusOr<CachingAllocator::Block> CachingAllocator::Allocate(size_t bytes, StreamKey stream,
                                                                   absl::string_view what) {
  const size_t cls = SizeClass(bytes);
  absl::MutexLock lock(&mu_);
  Block b{nullptr, bytes, cls, stream};
  auto it = free_.find({stream, cls});
  if (it != free_.end() && !it->second.empty()) {
    b.ptr = it->second.back();
    it->second.pop_back();
    stats_.cached_bytes -= static_cast<int64_t>(cls);
    ++stats_.cache_hits;
  } else {
    absl::StatusOr<void*> p = raw_->Allocate(cls);
    if (!p.ok() && absl::IsResourceExhausted(p.status()) && stats_.cached_bytes > 0) {
      // Cached blocks of other classes or streams may make room.
      if (absl::Status s = ReleaseCacheLocked(); !s.ok()) return s;
      p = raw_->Allocate(cls);
    }
    if (!p.ok()) {
      if (!absl::IsResourceExhausted(p.status())) {
        return absl::Status(
            p.status().code(),
            absl::StrCat("allocating ", what, " (", FormatBytes(static_cast<int64_t>(bytes)),
                         "): ", p.status().message()));
      }
      std::string largest;
      std::vector<NamedBlock> blocks = LiveBlocksLocked();
      SortLargestFirst(blocks);
      for (size_t i = 0; i < std::min<size_t>(blocks.size(), 3); ++i) {
        absl::StrAppend(&largest, i == 0 ? "; the largest: " : ", ", blocks[i].what, " ",
                        FormatBytes(blocks[i].bytes));
      }
      return absl::ResourceExhaustedError(absl::StrCat(
          "out of device memory allocating ", what, ": asked ",
          FormatBytes(static_cast<int64_t>(bytes)), " (", bytes, " bytes); this allocator holds ",
          FormatBytes(stats_.in_use_bytes), " in ", stats_.live_blocks, " live blocks", largest,
          "; and ", FormatBytes(stats_.cached_bytes), " cached (peak in use ",
          FormatBytes(stats_.peak_in_use_bytes), "); ", raw_->Describe(),
          ". Use a smaller data.batch_size or model, or a GPU with more memory"));
    }
    b.ptr = *p;
    ++stats_.raw_allocations;
    stats_.reserved_bytes += static_cast<int64_t>(cls);
    stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  }
  live_[b.ptr] = Live{b, std::string(what)};
  ++stats_.allocations;
  ++stats_.live_blocks;
  stats_.in_use_bytes += static_cast<int64_t>(cls);
  stats_.requested_bytes += static_cast<int64_t>(bytes);
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  if (stats_.requested_bytes > stats_.peak_requested_bytes) {
    stats_.peak_requested_bytes = stats_.requested_bytes;
    peak_blocks_ = LiveBlocksLocked();
    peak_blocks_sorted_ = false;
  }
  return b;
}

absl::Status CachingAllocator::Free(void* ptr) {
  absl::MutexLock lock(&mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("freeing %p, which this allocator does not hold (freed twice, or "
                        "another allocator's block)",
                        ptr));
  }
  const Block b = it->second.block;
  live_.erase(it);
  free_[{b.stream, b.class_bytes}].push_back(b.ptr);
  --stats_.live_blocks;
  stats_.in_use_bytes -= static_cast<int64_t>(b.class_bytes);
  stats_.requested_bytes -= static_cast<int64_t>(b.bytes);
  stats_.cached_bytes += static_cast<int64_t>(b.class_bytes);
  return absl::OkStatus();
}

absl::Status CachingAllocator::ReleaseCache() {
  absl::MutexLock lock(&mu_);
  return ReleaseCacheLocked();
}

absl::Status CachingAllocator::ReleaseCacheLocked() {
  if (stats_.cached_bytes == 0) return absl::OkStatus();
  if (absl::Status s = raw_->Synchronize(); !s.ok()) return s;
  for (auto& [key, ptrs] : free_) {
    for (void* p : ptrs) {
      raw_->Free(p);
      ++stats_.raw_frees;
      stats_.reserved_bytes -= static_cast<int64_t>(key.second);
    }
  }
  free_.clear();
  stats_.cached_bytes = 0;
  ++stats_.cache_flushes;
  return absl::OkStatus();
}

AllocatorStats CachingAllocator::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void CachingAllocator::ResetPeaks() {
  absl::MutexLock lock(&mu_);
  stats_.peak_in_use_bytes = stats_.in_use_bytes;
  stats_.peak_requested_bytes = stats_.requested_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
  stats_.allocations = stats_.cache_hits = stats_.raw_allocations = stats_.raw_frees = 0;
  stats_.cache_flushes = 0;
  peak_blocks_ = LiveBlocksLocked();
  peak_blocks_sorted_ = false;
}

std::vector<CachingAllocator::NamedBlock> CachingAllocator::PeakBlocks() const {
  absl::MutexLock lock(&mu_);
  if (!peak_blocks_sorted_) {
    SortLargestFirst(peak_blocks_);
    peak_blocks_sorted_ = true;
  }
  return peak_blocks_;
}

std::vector<CachingAllocator::NamedBlock> CachingAllocator::LiveBlocksLocked() const {
  std::vector<NamedBlock> blocks;
  blocks.reserve(live_.size());
  for (const auto& [p, l] : live_) blocks.push_back({l.what, static_cast<int64_t>(l.block.bytes)});
  return blocks;
}

}  // namespace rackrun::runtime::cuda
