#include "runtime/cuda/caching_allocator.h"

#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::runtime::cuda {
namespace {

using ::testing::HasSubstr;

constexpr size_t kMiB = size_t{1} << 20;

// Stream keys for the tests: any distinct addresses.
const int kStreamA = 1, kStreamB = 2;
StreamKey A() { return &kStreamA; }
StreamKey B() { return &kStreamB; }

struct Fixture {
  explicit Fixture(size_t budget) {
    auto raw = std::make_unique<HostBudgetMemory>(budget);
    host = raw.get();
    alloc = std::make_unique<CachingAllocator>(std::move(raw));
  }
  HostBudgetMemory* host;
  std::unique_ptr<CachingAllocator> alloc;
};

TEST(CachingAllocatorTest, SizeClassesWasteLittle) {
  EXPECT_EQ(CachingAllocator::SizeClass(0), 512u);
  EXPECT_EQ(CachingAllocator::SizeClass(1), 512u);
  EXPECT_EQ(CachingAllocator::SizeClass(512), 512u);
  EXPECT_EQ(CachingAllocator::SizeClass(513), 1024u);
  EXPECT_EQ(CachingAllocator::SizeClass(kMiB), kMiB);
  EXPECT_EQ(CachingAllocator::SizeClass(kMiB + 1), kMiB + kMiB / 8);
  EXPECT_EQ(CachingAllocator::SizeClass(2 * kMiB), 2 * kMiB);
  EXPECT_EQ(CachingAllocator::SizeClass(3 * kMiB), 3 * kMiB);
  // Above 1 GiB, 2 MiB steps: c1024's parameters (823M floats) in 3.07 GiB, not 3.25.
  EXPECT_EQ(CachingAllocator::SizeClass(1024 * kMiB), 1024 * kMiB);
  EXPECT_EQ(CachingAllocator::SizeClass(1024 * kMiB + 1), 1026 * kMiB);
  EXPECT_EQ(CachingAllocator::SizeClass(size_t{823} * 1000 * 1000 * 4), 3140 * kMiB);
  // Every size from 1 byte to 16 GiB (sampled): the class holds it, wastes < 2 MiB above
  // 1 GiB, < 12.5% above 1 MiB and < 512 bytes below, and classes are monotonic.
  size_t last = 0;
  for (size_t b = 1; b <= 16384 * kMiB; b = b * 9 / 8 + 1) {
    const size_t c = CachingAllocator::SizeClass(b);
    EXPECT_GE(c, b);
    EXPECT_GE(c, last);
    if (b > 1024 * kMiB) {
      EXPECT_LT(c - b, 2 * kMiB) << b;
    } else if (b > kMiB) {
      EXPECT_LT(static_cast<double>(c - b), 0.125 * static_cast<double>(b)) << b;
    } else {
      EXPECT_LT(c - b, 512u) << b;
    }
    last = c;
  }
}

TEST(CachingAllocatorTest, ReusesFreedBlocksOfTheSameClassAndStream) {
  Fixture f(64 * kMiB);
  absl::StatusOr<CachingAllocator::Block> a = f.alloc->Allocate(3000, A(), "a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->class_bytes, 3072u);
  std::memset(a->ptr, 1, a->bytes);  // the memory is real
  void* first = a->ptr;
  ASSERT_TRUE(f.alloc->Free(first).ok());
  AllocatorStats s = f.alloc->stats();
  EXPECT_EQ(s.in_use_bytes, 0);
  EXPECT_EQ(s.cached_bytes, 3072);
  EXPECT_EQ(s.reserved_bytes, 3072);

  // Same class (3000 and 2600 both round to 3072), same stream: the same block.
  absl::StatusOr<CachingAllocator::Block> b = f.alloc->Allocate(2600, A(), "b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->ptr, first);
  // Another stream does not get a block that stream A's queued work may still use.
  ASSERT_TRUE(f.alloc->Free(b->ptr).ok());
  absl::StatusOr<CachingAllocator::Block> c = f.alloc->Allocate(3000, B(), "c");
  ASSERT_TRUE(c.ok());
  EXPECT_NE(c->ptr, first);
  // Another class does not get it either.
  absl::StatusOr<CachingAllocator::Block> d = f.alloc->Allocate(4000, A(), "d");
  ASSERT_TRUE(d.ok());
  EXPECT_NE(d->ptr, first);

  s = f.alloc->stats();
  EXPECT_EQ(s.allocations, 4);
  EXPECT_EQ(s.cache_hits, 1);
  EXPECT_EQ(s.raw_allocations, 3);
  EXPECT_EQ(s.live_blocks, 2);
  EXPECT_EQ(s.in_use_bytes, 3072 + 4096);
  EXPECT_EQ(s.requested_bytes, 3000 + 4000);
  EXPECT_EQ(s.cached_bytes, 3072);
  EXPECT_EQ(s.reserved_bytes, 3 * 3072 + 4096 - 3072);
  EXPECT_EQ(f.host->used(), static_cast<size_t>(s.reserved_bytes));
}

TEST(CachingAllocatorTest, TracksPeaksAndResetsThem) {
  Fixture f(64 * kMiB);
  std::vector<void*> ptrs;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<CachingAllocator::Block> b = f.alloc->Allocate(kMiB - 100, A(), "x");
    ASSERT_TRUE(b.ok());
    ptrs.push_back(b->ptr);
  }
  for (void* p : ptrs) ASSERT_TRUE(f.alloc->Free(p).ok());
  AllocatorStats s = f.alloc->stats();
  EXPECT_EQ(s.peak_in_use_bytes, static_cast<int64_t>(4 * kMiB));  // the size classes
  EXPECT_EQ(s.peak_requested_bytes, static_cast<int64_t>(4 * (kMiB - 100)));
  EXPECT_EQ(s.peak_reserved_bytes, static_cast<int64_t>(4 * kMiB));
  EXPECT_EQ(s.in_use_bytes, 0);
  f.alloc->ResetPeaks();
  s = f.alloc->stats();
  EXPECT_EQ(s.peak_in_use_bytes, 0);
  EXPECT_EQ(s.peak_requested_bytes, 0);
  EXPECT_EQ(s.peak_reserved_bytes, static_cast<int64_t>(4 * kMiB));  // still cached
  EXPECT_EQ(s.allocations, 0);
  // The steady state: the same four allocations again come from the cache.
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(f.alloc->Allocate(kMiB, A(), "x").ok());
  s = f.alloc->stats();
  EXPECT_EQ(s.cache_hits, 4);
  EXPECT_EQ(s.raw_allocations, 0);
}

TEST(CachingAllocatorTest, RecordsTheBlocksLiveAtTheRequestedPeak) {
  Fixture f(64 * kMiB);
  absl::StatusOr<CachingAllocator::Block> w = f.alloc->Allocate(3 * kMiB, A(), "weights");
  absl::StatusOr<CachingAllocator::Block> a = f.alloc->Allocate(kMiB, A(), "layer 0 activations");
  absl::StatusOr<CachingAllocator::Block> g = f.alloc->Allocate(2 * kMiB, A(), "gradient scratch");
  ASSERT_TRUE(w.ok() && a.ok() && g.ok());
  // Below the peak (6 MiB): the recorded blocks stay those of the peak.
  ASSERT_TRUE(f.alloc->Free(g->ptr).ok());
  absl::StatusOr<CachingAllocator::Block> small = f.alloc->Allocate(512, B(), "small");
  ASSERT_TRUE(small.ok());
  std::vector<CachingAllocator::NamedBlock> peak = f.alloc->PeakBlocks();
  ASSERT_EQ(peak.size(), 3u);
  EXPECT_EQ(peak[0].what, "weights");
  EXPECT_EQ(peak[0].bytes, static_cast<int64_t>(3 * kMiB));
  EXPECT_EQ(peak[1].what, "gradient scratch");
  EXPECT_EQ(peak[2].what, "layer 0 activations");
  int64_t sum = 0;
  for (const CachingAllocator::NamedBlock& b : peak) sum += b.bytes;
  EXPECT_EQ(sum, f.alloc->stats().peak_requested_bytes);
  // A new peak replaces them; ResetPeaks starts from the live blocks.
  absl::StatusOr<CachingAllocator::Block> big = f.alloc->Allocate(4 * kMiB, A(), "logits");
  ASSERT_TRUE(big.ok());
  peak = f.alloc->PeakBlocks();
  ASSERT_EQ(peak.size(), 4u);
  EXPECT_EQ(peak[0].what, "logits");
  EXPECT_EQ(peak[3].what, "small");
  ASSERT_TRUE(f.alloc->Free(big->ptr).ok());
  f.alloc->ResetPeaks();
  peak = f.alloc->PeakBlocks();
  ASSERT_EQ(peak.size(), 3u);
  EXPECT_EQ(peak[0].what, "weights");
}

TEST(CachingAllocatorTest, OutOfMemoryFlushesTheCacheThenRetries) {
  Fixture f(10 * kMiB);
  // 8 MiB cached on stream B, then 6 MiB asked on stream A: only room after the flush.
  absl::StatusOr<CachingAllocator::Block> big = f.alloc->Allocate(8 * kMiB, B(), "cached");
  ASSERT_TRUE(big.ok());
  ASSERT_TRUE(f.alloc->Free(big->ptr).ok());
  const int syncs = f.host->synchronizations();
  absl::StatusOr<CachingAllocator::Block> b = f.alloc->Allocate(6 * kMiB, A(), "activations");
  ASSERT_TRUE(b.ok()) << b.status();
  AllocatorStats s = f.alloc->stats();
  EXPECT_EQ(s.cache_flushes, 1);
  EXPECT_EQ(s.raw_frees, 1);
  EXPECT_EQ(s.cached_bytes, 0);
  EXPECT_EQ(s.reserved_bytes, static_cast<int64_t>(6 * kMiB));
  // The device was waited for before the cached block went back.
  EXPECT_EQ(f.host->synchronizations(), syncs + 1);
}

TEST(CachingAllocatorTest, OutOfMemoryNamesTheTensorAndTheBytes) {
  Fixture f(10 * kMiB);
  absl::StatusOr<CachingAllocator::Block> held = f.alloc->Allocate(4 * kMiB, A(), "weights");
  ASSERT_TRUE(held.ok());
  absl::StatusOr<CachingAllocator::Block> b =
      f.alloc->Allocate(7 * kMiB, A(), "blocks.3.moe.dispatched");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string m(b.status().message());
  EXPECT_THAT(m, HasSubstr("out of device memory allocating blocks.3.moe.dispatched"));
  EXPECT_THAT(m, HasSubstr("asked 7.00 MiB (7340032 bytes)"));
  EXPECT_THAT(m, HasSubstr("holds 4.00 MiB in 1 live blocks; the largest: weights 4.00 MiB; "
                           "and 0 B cached"));
  EXPECT_THAT(m, HasSubstr("host test memory: 6.00 MiB free of 10.00 MiB"));
  // Nothing changed: the held block is intact and still counted.
  EXPECT_EQ(f.alloc->stats().in_use_bytes, static_cast<int64_t>(4 * kMiB));
}

TEST(CachingAllocatorTest, BadFreesAreErrors) {
  Fixture f(kMiB);
  absl::StatusOr<CachingAllocator::Block> b = f.alloc->Allocate(100, A(), "x");
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(f.alloc->Free(b->ptr).ok());
  absl::Status again = f.alloc->Free(b->ptr);
  EXPECT_EQ(again.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(again.message()), HasSubstr("does not hold"));
  int local = 0;
  EXPECT_FALSE(f.alloc->Free(&local).ok());
}

TEST(CachingAllocatorTest, ReleaseCacheReturnsEverythingCached) {
  Fixture f(16 * kMiB);
  std::vector<void*> ptrs;
  for (size_t bytes : {size_t{100}, size_t{5000}, 2 * kMiB, 3 * kMiB}) {
    absl::StatusOr<CachingAllocator::Block> b = f.alloc->Allocate(bytes, A(), "x");
    ASSERT_TRUE(b.ok());
    ptrs.push_back(b->ptr);
  }
  ASSERT_TRUE(f.alloc->Free(ptrs[0]).ok());
  ASSERT_TRUE(f.alloc->Free(ptrs[2]).ok());
  ASSERT_TRUE(f.alloc->ReleaseCache().ok());
  AllocatorStats s = f.alloc->stats();
  EXPECT_EQ(s.cached_bytes, 0);
  EXPECT_EQ(s.reserved_bytes, s.in_use_bytes);
  EXPECT_EQ(f.host->used(), static_cast<size_t>(s.in_use_bytes));
}

TEST(CachingAllocatorTest, ThreadsShareOneAllocator) {
  Fixture f(256 * kMiB);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&f, t] {
      std::set<void*> mine;
      for (int i = 0; i < 200; ++i) {
        absl::StatusOr<CachingAllocator::Block> b =
            f.alloc->Allocate(static_cast<size_t>(1000 * (i % 7 + 1)), t % 2 ? A() : B(), "x");
        ASSERT_TRUE(b.ok());
        ASSERT_TRUE(mine.insert(b->ptr).second);
        if (i % 3 == 0) {
          ASSERT_TRUE(f.alloc->Free(b->ptr).ok());
          mine.erase(b->ptr);
        }
      }
      for (void* p : mine) ASSERT_TRUE(f.alloc->Free(p).ok());
    });
  }
  for (std::thread& th : threads) th.join();
  AllocatorStats s = f.alloc->stats();
  EXPECT_EQ(s.live_blocks, 0);
  EXPECT_EQ(s.in_use_bytes, 0);
  EXPECT_EQ(s.allocations, 800);
  EXPECT_EQ(s.reserved_bytes, s.cached_bytes);
}

TEST(CachingAllocatorTest, FormatsBytes) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(int64_t{3} << 30), "3.00 GiB");
}

}  // namespace
}  // namespace rackrun::runtime::cuda
