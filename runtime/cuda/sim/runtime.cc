// The CUDA simulator's runtime (runtime.h): the CUDA runtime API functions the GPU engine,
// its tests and the simulated cuBLAS call, defined here with the real header's signatures.
// Linked into a test program as object code, these definitions take the place of
// libcudart's. Work queued on a stream runs when the host waits for it (runtime.h).
#include "runtime/cuda/sim/runtime.h"

#include <cuda_runtime_api.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

// The runtime's opaque handle types, completed here.
struct CUstream_st {
  std::deque<std::function<void()>> queue;
  uint64_t queued = 0;  // items ever queued
  uint64_t done = 0;    // items run
  bool blocking = true;
};

struct CUevent_st {
  CUstream_st* stream = nullptr;  // where it was last recorded; null: never
  uint64_t seq = 0;               // done when stream->done >= seq
  bool timing = true;
  double ms = 0;  // host time when its point in the stream ran
};

namespace rackrun::runtime::cuda::sim {
namespace {

constexpr size_t kDeviceBytes = size_t{16} << 30;  // what the simulated device reports
constexpr size_t kAlignment = 256;                 // cudaMalloc's
// Address space reserved for device memory: twice what the device reports, so that
// fragmentation never refuses what cudaMemGetInfo says is free.
constexpr size_t kArenaBytes = 2 * kDeviceBytes;
// Bytes of a known pattern before every allocation and after its end (from the bytes asked
// for, through the rounding, then this many more), checked after every kernel: a write
// outside the allocation there stops the program. The pattern is fresh memory's garbage
// (all-ones bytes: NaN as floats, -1 as integers), so a kernel that reads there carries a NaN
// or a -1 into its results.
constexpr size_t kRedzone = kAlignment;
constexpr unsigned char kRedzoneByte = 0xff;

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

// The arena's range, for the fault handler (set once, before any device memory exists).
std::atomic<uintptr_t> arena_begin{0};
std::atomic<uintptr_t> arena_end{0};
struct sigaction previous_segv;

void WriteAll(const char* text, size_t n) {
  while (n > 0) {
    const ssize_t w = write(STDERR_FILENO, text, n);
    if (w <= 0) return;
    text += w;
    n -= static_cast<size_t>(w);
  }
}

// A host access to device memory: says so with the stack, then lets the fault take its course
// (the previous handler, e.g. AddressSanitizer's report, or the default: the program stops).
void OnSegv(int signal, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  if (addr >= arena_begin.load() && addr < arena_end.load()) {
    char text[256];
    const int n = std::snprintf(
        text, sizeof(text),
        "CUDA simulator: host code touched device memory at %p (cudaMalloc memory is not "
        "host-accessible: on a GPU this access faults; copy it with cudaMemcpy or use it in a "
        "kernel). Stack:\n",
        info->si_addr);
    WriteAll(text, static_cast<size_t>(std::max(n, 0)));
    void* frames[64];
    backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  }
  if ((previous_segv.sa_flags & SA_SIGINFO) != 0 && previous_segv.sa_sigaction != nullptr) {
    previous_segv.sa_sigaction(signal, info, context);
    return;
  }
  if (previous_segv.sa_handler != SIG_DFL && previous_segv.sa_handler != SIG_IGN &&
      previous_segv.sa_handler != nullptr) {
    previous_segv.sa_handler(signal);
    return;
  }
  // Default: uninstall and return; the access faults again and the program stops on it.
  std::signal(SIGSEGV, SIG_DFL);
}

double NowMs() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class Simulator {
 public:
  // One lock for everything: queued work runs under it, so that the host threads of a test
  // (ranks sharing the device) see one device that runs one thing at a time.
  std::recursive_mutex mu;
  CUstream_st legacy;
  std::set<CUstream_st*> streams;      // created, not destroyed
  std::set<CUevent_st*> events;        // created, not destroyed
  std::map<uintptr_t, size_t> device;  // start -> bytes
  std::map<uintptr_t, size_t> pinned;
  size_t device_in_use = 0;
  // Queued work items started so far, and per pinned allocation the last one that wrote into
  // it (a copy to it, a kernel given a pointer into it): a pinned copy source that changed
  // while such an item ran was changed by the device, not by the host.
  uint64_t steps = 0;
  std::map<uintptr_t, uint64_t> pinned_device_writes;
  uint64_t redzones_checked = 0;  // the step whose writes CheckRedzones saw last
  Census census;

  // The pinned allocation `p` points into (or one past the end of); 0 if none.
  uintptr_t PinnedStart(const void* p) const {
    const auto a = reinterpret_cast<uintptr_t>(p);
    auto it = pinned.upper_bound(a);
    if (it == pinned.begin()) return 0;
    --it;
    return a <= it->first + it->second ? it->first : 0;
  }
  void DeviceWrote(const void* p) {
    if (const uintptr_t start = PinnedStart(p); start != 0) pinned_device_writes[start] = steps;
  }

  // Device memory comes from one reserved range of address space that the host cannot touch
  // (PROT_NONE) except while the device works (queued work runs, cudaMalloc fills fresh
  // memory): host code that dereferences a device pointer faults here as on a GPU, instead of
  // reading what a GPU would never let it read. `open` counts the nested openings.
  char* arena = nullptr;
  size_t high_water = 0;                 // end of the highest allocation, bytes from arena
  std::map<size_t, size_t> free_ranges;  // offset -> bytes, coalesced
  int open = 0;

  Simulator() {
    void* p =
        mmap(nullptr, kArenaBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      std::fprintf(stderr,
                   "CUDA simulator: cannot reserve %zu bytes of address space for device "
                   "memory\n",
                   kArenaBytes);
      std::abort();
    }
    arena = static_cast<char*>(p);
    // Huge pages where the kernel allows them: fewer page-table entries for every opening
    // and closing to change.
    (void)madvise(p, kArenaBytes, MADV_HUGEPAGE);
    free_ranges[0] = kArenaBytes;
    arena_begin = reinterpret_cast<uintptr_t>(arena);
    arena_end = reinterpret_cast<uintptr_t>(arena) + kArenaBytes;
    void* warm[1];
    backtrace(warm, 1);  // loads the unwinder now, not first in the fault handler
    struct sigaction action = {};
    action.sa_sigaction = OnSegv;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    sigaction(SIGSEGV, &action, &previous_segv);
  }

  // The device's memory readable and writable (prot) up to the high-water mark.
  void Protect(int prot) {
    const size_t bytes = RoundUp(high_water, static_cast<size_t>(getpagesize()));
    if (bytes > 0 && mprotect(arena, bytes, prot) != 0) {
      std::perror("CUDA simulator: mprotect of device memory");
      std::abort();
    }
  }
  void Open() {
    if (open++ == 0) Protect(PROT_READ | PROT_WRITE);
  }
  void Close() {
    if (--open == 0) Protect(PROT_NONE);
  }
  // Device work runs between them (nested calls allowed).
  struct Opened {
    explicit Opened(Simulator& s) : sim(s) { sim.Open(); }
    ~Opened() { sim.Close(); }
    Simulator& sim;
  };

  // First fit in the arena; null when no range is large enough.
  char* Allocate(size_t rounded) {
    for (auto it = free_ranges.begin(); it != free_ranges.end(); ++it) {
      if (it->second < rounded) continue;
      const size_t offset = it->first;
      const size_t left = it->second - rounded;
      free_ranges.erase(it);
      if (left > 0) free_ranges[offset + rounded] = left;
      if (offset + rounded > high_water) {
        high_water = offset + rounded;
        if (open > 0) Protect(PROT_READ | PROT_WRITE);
      }
      return arena + offset;
    }
    return nullptr;
  }
  void Release(char* p, size_t rounded) {
    size_t offset = static_cast<size_t>(p - arena);
    size_t bytes = rounded;
    auto next = free_ranges.lower_bound(offset);
    if (next != free_ranges.end() && next->first == offset + bytes) {
      bytes += next->second;
      next = free_ranges.erase(next);
    }
    if (next != free_ranges.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        offset = prev->first;
        bytes += prev->second;
        free_ranges.erase(prev);
      }
    }
    free_ranges[offset] = bytes;
  }

  CUstream_st* Resolve(cudaStream_t s) {
    if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return &legacy;
    return s;
  }

  // Runs `s`'s queue until `seq` items have run.
  void RunUntil(CUstream_st* s, uint64_t seq) {
    if (s->done >= seq || s->queue.empty()) return;
    Opened device_works(*this);
    while (s->done < seq && !s->queue.empty()) {
      std::function<void()> work = std::move(s->queue.front());
      s->queue.pop_front();
      ++steps;
      work();
      // A kernel checked after its grid, naming its launch; this catches the rest (the
      // simulated cuBLAS's writes).
      if (redzones_checked != steps) CheckRedzones(nullptr);
      ++s->done;
    }
  }
  void RunAll(CUstream_st* s) { RunUntil(s, s->queued); }
  void RunEverything() {
    RunAll(&legacy);
    for (CUstream_st* s : streams) RunAll(s);
  }

  void Push(CUstream_st* s, std::function<void()> work) {
    // A blocking stream's work waits for the legacy stream's earlier work (and the legacy
    // stream's for the blocking streams', in cudaMemcpy).
    if (s != &legacy && s->blocking && legacy.done < legacy.queued) {
      const uint64_t seq = legacy.queued;
      s->queue.push_back([this, seq] { RunUntil(&legacy, seq); });
      ++s->queued;
    }
    s->queue.push_back(std::move(work));
    ++s->queued;
  }

  static bool Inside(const std::map<uintptr_t, size_t>& m, const void* p, size_t bytes) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    auto it = m.upper_bound(a);
    if (it == m.begin()) return false;
    --it;
    return a >= it->first && a + bytes <= it->first + std::max<size_t>(it->second, 1);
  }
  Memory Where(const void* p) {
    if (Inside(device, p, 1)) return Memory::kDevice;
    if (Inside(pinned, p, 1)) return Memory::kPinned;
    return Memory::kPageable;
  }
};

Simulator& Sim() {
  static Simulator* sim = new Simulator;  // never destroyed: queued work may outlive main
  return *sim;
}

thread_local cudaError_t last_error = cudaSuccess;

cudaError_t Fail(cudaError_t e) {
  last_error = e;
  return e;
}

// Is a copy of `bytes` from `src` to `dst` of `kind` consistent with where they point?
bool KindMatches(Simulator& sim, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  const bool dst_dev = sim.Where(dst) == Memory::kDevice;
  const bool src_dev = sim.Where(src) == Memory::kDevice;
  if (dst_dev && !Simulator::Inside(sim.device, dst, bytes)) return false;
  if (src_dev && !Simulator::Inside(sim.device, src, bytes)) return false;
  switch (kind) {
    case cudaMemcpyHostToDevice:
      return dst_dev && !src_dev;
    case cudaMemcpyDeviceToHost:
      return !dst_dev && src_dev;
    case cudaMemcpyDeviceToDevice:
      return dst_dev && src_dev;
    case cudaMemcpyHostToHost:
      return !dst_dev && !src_dev;
    case cudaMemcpyDefault:
      return true;
  }
  return false;
}

}  // namespace

void Enqueue(cudaStream_t stream, Work what, std::function<void()> work) {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  ++(what == Work::kKernel ? sim.census.kernels : sim.census.blas);
  sim.Push(sim.Resolve(stream), std::move(work));
}

Census TakeCensus() {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  return std::exchange(sim.census, Census{});
}

Memory Classify(const void* p) {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  return sim.Where(p);
}

void CheckRedzones(const std::source_location* kernel) {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  sim.redzones_checked = sim.steps;
  Simulator::Opened device_works(sim);
  for (const auto& [start, bytes] : sim.device) {
    static const std::vector<unsigned char> pattern(2 * kRedzone, kRedzoneByte);
    const auto* p = reinterpret_cast<const unsigned char*>(start);
    const size_t end = RoundUp(std::max<size_t>(bytes, 1), kAlignment) + kRedzone;
    if (std::memcmp(p - kRedzone, pattern.data(), kRedzone) == 0 &&
        std::memcmp(p + bytes, pattern.data(), end - bytes) == 0) {
      continue;
    }
    // Before the allocation, then after the bytes asked for.
    ptrdiff_t bad = -static_cast<ptrdiff_t>(kRedzone);
    while (bad < 0 && p[bad] == kRedzoneByte) ++bad;
    if (bad == 0) {
      bad = static_cast<ptrdiff_t>(bytes);
      while (p[bad] == kRedzoneByte) ++bad;  // memcmp found a changed byte before `end`
    }
    if (kernel != nullptr) {
      std::fprintf(stderr, "CUDA simulator: the kernel launched at %s:%u (%s)", kernel->file_name(),
                   static_cast<unsigned>(kernel->line()), kernel->function_name());
    } else {
      std::fprintf(stderr, "CUDA simulator: queued work (a cuBLAS call, copy or memset)");
    }
    std::fprintf(stderr,
                 " wrote outside a cudaMalloc allocation: byte %td of the %zu-byte allocation "
                 "at %p (%s its %s); on a GPU that write lands in another allocation or faults\n",
                 bad, bytes, static_cast<const void*>(p), bad < 0 ? "before" : "past",
                 bad < 0 ? "start" : "end");
    std::abort();
  }
}

void DeviceWrotePinned(const void* p) {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  sim.DeviceWrote(p);
}

Memory ClassifyArgument(const void* p) {
  Simulator& sim = Sim();  // reserves the device memory's range first
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a >= arena_begin.load() && a < arena_end.load()) return Memory::kDevice;
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  return sim.PinnedStart(p) != 0 ? Memory::kPinned : Memory::kPageable;
}

void SetLastError(cudaError_t error) { last_error = error; }

}  // namespace rackrun::runtime::cuda::sim

namespace sim = rackrun::runtime::cuda::sim;
using sim::Fail;
using sim::Memory;
using sim::Sim;
using sim::Simulator;

// ---- devices and errors ----------------------------------------------------------------

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return Fail(cudaErrorInvalidValue);
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : Fail(cudaErrorInvalidDevice);
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return Fail(cudaErrorInvalidValue);
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr) return Fail(cudaErrorInvalidValue);
  if (device != 0) return Fail(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof(prop->name), "rackrun CUDA simulator (CPU)");
  prop->major = 9;
  prop->minor = 0;
  prop->totalGlobalMem = sim::kDeviceBytes;
  prop->multiProcessorCount = 1;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->sharedMemPerBlock = 48 << 10;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* version) {
  if (version == nullptr) return Fail(cudaErrorInvalidValue);
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* version) { return cudaDriverGetVersion(version); }

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  // The one attribute the engine sets; the others are refused, so using one is noticed.
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return Fail(cudaErrorInvalidValue);
  return sim::SetMaxDynamicShared(func, value) ? cudaSuccess : Fail(cudaErrorInvalidValue);
}

cudaError_t cudaGetLastError() {
  const cudaError_t e = sim::last_error;
  sim::last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError() { return sim::last_error; }

namespace {

struct ErrorText {
  cudaError_t error;
  const char* name;
  const char* text;
};
constexpr ErrorText kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration",
     "invalid configuration argument"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
};

const ErrorText* Find(cudaError_t e) {
  for (const ErrorText& t : kErrors) {
    if (t.error == e) return &t;
  }
  return nullptr;
}

}  // namespace

const char* cudaGetErrorName(cudaError_t error) {
  const ErrorText* t = Find(error);
  return t != nullptr ? t->name : "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t error) {
  const ErrorText* t = Find(error);
  return t != nullptr ? t->text : "unknown error";
}

// ---- memory ------------------------------------------------------------------------------

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  if (ptr == nullptr) return Fail(cudaErrorInvalidValue);
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  if (bytes > sim::kDeviceBytes - sim.device_in_use) {
    *ptr = nullptr;
    return Fail(cudaErrorMemoryAllocation);
  }
  const size_t rounded = sim::RoundUp(std::max<size_t>(bytes, 1), sim::kAlignment);
  char* block = sim.Allocate(rounded + 2 * sim::kRedzone);
  if (block == nullptr) return Fail(cudaErrorMemoryAllocation);
  char* p = block + sim::kRedzone;
  // Device memory starts as garbage: all-ones bytes (NaN as floats, -1 as integers), so that
  // a kernel reading what nobody wrote shows it; the redzones around it hold their pattern.
  {
    Simulator::Opened device_works(sim);
    static_assert(sim::kRedzoneByte == 0xff);  // the garbage and the redzones are one fill
    std::memset(block, 0xff, rounded + 2 * sim::kRedzone);
  }
  sim.device[reinterpret_cast<uintptr_t>(p)] = bytes;
  sim.device_in_use += bytes;
  ++sim.census.allocations;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  auto it = sim.device.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == sim.device.end()) return Fail(cudaErrorInvalidValue);
  sim.RunEverything();  // cudaFree synchronizes the device
  ++sim.census.frees;
  ++sim.census.host_waits;
  sim.device_in_use -= it->second;
  sim.Release(static_cast<char*>(ptr) - sim::kRedzone,
              sim::RoundUp(std::max<size_t>(it->second, 1), sim::kAlignment) + 2 * sim::kRedzone);
  sim.device.erase(it);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  if (free_bytes == nullptr || total == nullptr) return Fail(cudaErrorInvalidValue);
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  *total = sim::kDeviceBytes;
  *free_bytes = *total - sim.device_in_use;
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int /*flags*/) {
  if (ptr == nullptr) return Fail(cudaErrorInvalidValue);
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  void* p = std::malloc(std::max<size_t>(bytes, 1));
  if (p == nullptr) return Fail(cudaErrorMemoryAllocation);
  sim.pinned[reinterpret_cast<uintptr_t>(p)] = bytes;
  ++sim.census.allocations;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t bytes) { return cudaHostAlloc(ptr, bytes, 0); }

cudaError_t cudaFreeHost(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  auto it = sim.pinned.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == sim.pinned.end()) return Fail(cudaErrorInvalidValue);
  sim.RunEverything();
  ++sim.census.frees;
  ++sim.census.host_waits;
  sim.pinned.erase(it);
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) {
  if (attributes == nullptr) return Fail(cudaErrorInvalidValue);
  *attributes = cudaPointerAttributes{};
  switch (sim::Classify(ptr)) {
    case Memory::kDevice:
      attributes->type = cudaMemoryTypeDevice;
      attributes->devicePointer = const_cast<void*>(ptr);
      break;
    case Memory::kPinned:
      attributes->type = cudaMemoryTypeHost;
      attributes->hostPointer = const_cast<void*>(ptr);
      attributes->devicePointer = const_cast<void*>(ptr);
      break;
    case Memory::kPageable:
      attributes->type = cudaMemoryTypeUnregistered;
      attributes->device = -2;  // no device's memory
      attributes->hostPointer = const_cast<void*>(ptr);
      return cudaSuccess;
  }
  attributes->device = 0;
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr || !KindMatches(sim, dst, src, bytes, kind)) {
    return Fail(cudaErrorInvalidValue);
  }
  CUstream_st* s = sim.Resolve(stream);
  const Memory from = sim.Where(src);
  const Memory to = sim.Where(dst);
  if (to == Memory::kDevice) {
    ++(from == Memory::kDevice ? sim.census.copies_on_device : sim.census.copies_to_device);
  } else if (from == Memory::kDevice) {
    ++sim.census.copies_to_host;
  }
  if (from == Memory::kPageable || to == Memory::kPageable) ++sim.census.pageable_copies;
  if (from == Memory::kPageable) {
    // Pageable source: CUDA stages it before returning, so the caller may reuse it at once.
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                      static_cast<const char*>(src) + bytes);
    sim.Push(s, [&sim, dst, staged] {
      std::memcpy(dst, staged->data(), staged->size());
      sim.DeviceWrote(dst);
    });
  } else if (from == Memory::kPinned) {
    // Pinned source: the copy reads it when it runs, as a GPU's DMA does. The host must not
    // write it before then (it cannot know when that is without waiting): a copy that finds
    // its source changed since it was issued, with no device work writing there meanwhile,
    // stops the program, where a GPU would have sent either bytes.
    auto issued = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                      static_cast<const char*>(src) + bytes);
    const uint64_t issued_at = sim.steps;
    sim.Push(s, [&sim, dst, src, bytes, issued, issued_at] {
      const auto by_device = sim.pinned_device_writes.find(sim.PinnedStart(src));
      const bool device_wrote =
          by_device != sim.pinned_device_writes.end() && by_device->second > issued_at;
      if (!device_wrote && std::memcmp(src, issued->data(), bytes) != 0) {
        std::fprintf(stderr,
                     "CUDA simulator: host code wrote the pinned memory at %p (%zu bytes) after "
                     "a cudaMemcpyAsync from it was issued and before it ran; on a GPU the copy "
                     "may read either bytes: wait for the copy (an event) before writing its "
                     "source\n",
                     src, bytes);
        std::abort();
      }
      std::memmove(dst, src, bytes);
      sim.DeviceWrote(dst);
    });
  } else {
    sim.Push(s, [&sim, dst, src, bytes] {
      std::memmove(dst, src, bytes);
      sim.DeviceWrote(dst);
    });
  }
  // Pageable destination: the call returns once the copy is done.
  if (to == Memory::kPageable) {
    sim.RunAll(s);
    ++sim.census.host_waits;
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  // The legacy default stream waits for the blocking streams (not the non-blocking ones).
  for (CUstream_st* s : sim.streams) {
    if (s->blocking) sim.RunAll(s);
  }
  if (cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, nullptr); e != cudaSuccess) return e;
  sim.RunAll(&sim.legacy);
  if (sim.Where(dst) != Memory::kPageable) ++sim.census.host_waits;  // else counted there
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  if (bytes == 0) return cudaSuccess;
  if (!Simulator::Inside(sim.device, ptr, bytes)) return Fail(cudaErrorInvalidValue);
  ++sim.census.memsets;
  sim.Push(sim.Resolve(stream), [ptr, value, bytes] { std::memset(ptr, value, bytes); });
  return cudaSuccess;
}

cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
  if (cudaError_t e = cudaMemsetAsync(ptr, value, bytes, nullptr); e != cudaSuccess) return e;
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  sim.RunAll(&sim.legacy);
  ++sim.census.host_waits;
  return cudaSuccess;
}

// ---- streams and events ------------------------------------------------------------------

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (stream == nullptr) return Fail(cudaErrorInvalidValue);
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  auto* s = new CUstream_st;
  s->blocking = (flags & cudaStreamNonBlocking) == 0;
  sim.streams.insert(s);
  *stream = s;
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  if (sim.streams.erase(stream) == 0) return Fail(cudaErrorInvalidResourceHandle);
  sim.RunAll(stream);  // its work still completes
  for (CUevent_st* e : sim.events) {
    if (e->stream == stream) e->stream = nullptr;  // recorded there: done now
  }
  delete stream;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  sim.RunAll(sim.Resolve(stream));
  ++sim.census.host_waits;
  return cudaSuccess;
}

// Not done: runs one queued item (the device makes progress while the host polls).
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  CUstream_st* s = sim.Resolve(stream);
  if (s->done >= s->queued) return cudaSuccess;
  sim.RunUntil(s, s->done + 1);
  return cudaErrorNotReady;
}

cudaError_t cudaDeviceSynchronize() {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  sim.RunEverything();
  ++sim.census.host_waits;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (event == nullptr) return Fail(cudaErrorInvalidValue);
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  auto* e = new CUevent_st;
  e->timing = (flags & cudaEventDisableTiming) == 0;
  sim.events.insert(e);
  *event = e;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  if (sim.events.erase(event) == 0) return Fail(cudaErrorInvalidResourceHandle);
  // A record still queued writes the event's time: keep the object (a few bytes per
  // destroyed event that was recorded and never waited for) rather than free it under it.
  if (event->stream == nullptr || event->stream->done >= event->seq) delete event;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  if (sim.events.count(event) == 0) return Fail(cudaErrorInvalidResourceHandle);
  CUstream_st* s = sim.Resolve(stream);
  sim.Push(s, [event] { event->ms = sim::NowMs(); });
  event->stream = s;
  event->seq = s->queued;
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  if (sim.events.count(event) == 0) return Fail(cudaErrorInvalidResourceHandle);
  CUstream_st* s = event->stream;
  if (s == nullptr || s->done >= event->seq) return cudaSuccess;
  sim.RunUntil(s, s->done + 1);
  return cudaErrorNotReady;  // not a sticky error: cudaGetLastError does not report it
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  if (sim.events.count(event) == 0) return Fail(cudaErrorInvalidResourceHandle);
  if (event->stream != nullptr) sim.RunUntil(event->stream, event->seq);
  ++sim.census.host_waits;
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  if (ms == nullptr) return Fail(cudaErrorInvalidValue);
  if (sim.events.count(start) == 0 || sim.events.count(end) == 0 || !start->timing ||
      !end->timing) {
    return Fail(cudaErrorInvalidResourceHandle);
  }
  for (CUevent_st* e : {start, end}) {
    if (e->stream != nullptr && e->stream->done < e->seq) return Fail(cudaErrorNotReady);
  }
  *ms = static_cast<float>(end->ms - start->ms);
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int /*flags*/) {
  Simulator& sim = Sim();
  std::lock_guard<std::recursive_mutex> lock(sim.mu);
  if (sim.events.count(event) == 0) return Fail(cudaErrorInvalidResourceHandle);
  CUstream_st* waited = event->stream;
  if (waited == nullptr) return cudaSuccess;
  const uint64_t seq = event->seq;
  sim.Push(sim.Resolve(stream), [&sim, waited, seq] {
    if (sim.streams.count(waited) != 0 || waited == &sim.legacy) sim.RunUntil(waited, seq);
  });
  return cudaSuccess;
}
