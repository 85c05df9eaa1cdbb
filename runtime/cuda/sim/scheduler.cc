// The CUDA simulator's block scheduler (kernel.h): the threads of a block as fibers on the
// host thread that runs the grid, switched at barriers. The switch is a few instructions of
// x86-64 (callee-saved registers, the stack pointer, MXCSR): ucontext's swapcontext also
// saves the signal mask, a system call per switch that took two thirds of the simulated
// tests' time. The x87 control word is not switched (saving it serializes the pipeline, and
// no kernel changes it).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/cuda/sim/kernel.h"

#if !defined(__x86_64__)
#error "the CUDA simulator's fiber switch is written for x86-64"
#endif

// Saves the callee-saved state on the current stack and its pointer in *save, then resumes
// the state saved at `load` (a fiber prepared by Prepare, or one that switched away).
extern "C" void rackrun_cudasim_switch(void** save, void* load);
asm(R"(
  .text
  .p2align 4
  .globl rackrun_cudasim_switch
  .hidden rackrun_cudasim_switch
  .type rackrun_cudasim_switch, @function
rackrun_cudasim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size rackrun_cudasim_switch, .-rackrun_cudasim_switch
)");

namespace rackrun::runtime::cuda::sim {
namespace {

constexpr int kWarp = 32;
constexpr size_t kStackBytes = size_t{256} << 10;  // per simulated thread
constexpr size_t kSharedLimit = size_t{48} << 10;  // dynamic shared memory without opt-in
constexpr size_t kSharedAlign = 128;               // dynamic shared memory's alignment
constexpr size_t kSharedGuard = 256;               // guard bytes after it, checked after each block
constexpr unsigned char kGuardByte = 0xa5;
constexpr size_t kSharedOptInLimit = size_t{227} << 10;  // sm_90's most, with opt-in

// cudaFuncSetAttribute's cudaFuncAttributeMaxDynamicSharedMemorySize, per kernel.
std::mutex opt_in_mu;
std::map<const void*, size_t>& OptIns() {
  static std::map<const void*, size_t> m;
  return m;
}

enum class State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kReturned };

// The order blocks and threads run in: RACKRUN_CUDASIM_ORDER at the first grid, or what
// SetScheduleOrder set.
std::atomic<int> order_setting{-1};  // -1: not read yet

ScheduleOrder CurrentOrder() {
  int o = order_setting.load(std::memory_order_relaxed);
  if (o < 0) {
    const char* env = std::getenv("RACKRUN_CUDASIM_ORDER");
    const std::string v = env == nullptr ? "" : env;
    if (v.empty() || v == "forward") {
      o = static_cast<int>(ScheduleOrder::kForward);
    } else if (v == "reverse") {
      o = static_cast<int>(ScheduleOrder::kReverse);
    } else {
      std::fprintf(stderr, "cuda sim: RACKRUN_CUDASIM_ORDER=%s: use forward or reverse\n",
                   v.c_str());
      std::abort();
    }
    int expected = -1;
    if (!order_setting.compare_exchange_strong(expected, o)) o = expected;
  }
  return static_cast<ScheduleOrder>(o);
}

const char* Name(State s) {
  switch (s) {
    case State::kRunnable:
      return "runnable";
    case State::kAtBlockBarrier:
      return "at __syncthreads";
    case State::kAtWarpBarrier:
      return "at a warp operation";
    case State::kReturned:
      return "returned";
  }
  return "?";
}

// A fiber's stack with a guard page below it, so that an overflow faults.
class Stack {
 public:
  Stack() {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    base_ = static_cast<char*>(mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (base_ == MAP_FAILED) {
      std::fprintf(stderr, "cuda sim: cannot map a fiber stack\n");
      std::abort();
    }
    mprotect(base_, page, PROT_NONE);  // the guard page, below the stack
    bytes_ = kStackBytes + page;
  }
  ~Stack() { munmap(base_, bytes_); }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  char* top() const { return base_ + bytes_; }  // stacks grow down from here

 private:
  char* base_;
  size_t bytes_;
};

struct Fiber {
  void* sp = nullptr;  // its saved stack pointer while it does not run
  ThreadPlace place;
  State state = State::kRunnable;
  unsigned warp_mask = 0;  // the mask of the warp operation it waits at
};

struct Block {
  bool reverse = false;  // threads in descending order (ScheduleOrder::kReverse)
  const std::function<void()>* body = nullptr;
  const std::source_location* where = nullptr;
  std::vector<Fiber> fibers;
  void* scheduler = nullptr;  // the grid's host stack while fibers run
  int current = 0;
  std::vector<uint64_t> exchange;  // kWarp values per warp
  // The dynamic shared memory asked for, from SharedBegin (aligned), with guard bytes
  // around it.
  std::vector<unsigned char> shared;
  // What the barriers wait for: threads not returned, those at __syncthreads; per warp, the
  // lanes not returned, those at a warp operation, the lanes that returned (bits).
  int live = 0, at_block = 0;
  std::vector<int> warp_live, at_warp;
  std::vector<unsigned> warp_returned;
};

thread_local Block* running = nullptr;
thread_local std::vector<std::unique_ptr<Stack>> stacks;  // reused by every grid

[[noreturn]] void Stop(const Block& b, const char* what) {
  const Fiber& f = b.fibers[static_cast<size_t>(b.current)];
  std::fprintf(stderr, "cuda sim: %s\n  kernel launched at %s:%u, block (%u,%u,%u) of (%u,%u,%u)\n",
               what, b.where->file_name(), static_cast<unsigned>(b.where->line()),
               f.place.block_idx.x, f.place.block_idx.y, f.place.block_idx.z, f.place.grid_dim.x,
               f.place.grid_dim.y, f.place.grid_dim.z);
  int shown = 0;
  for (const Fiber& t : b.fibers) {
    if (shown++ == 40) {
      std::fprintf(stderr, "  ...\n");
      break;
    }
    std::fprintf(stderr, "  thread (%u,%u,%u): %s\n", t.place.thread_idx.x, t.place.thread_idx.y,
                 t.place.thread_idx.z, Name(t.state));
  }
  std::abort();
}

// Releases warp `w` if every lane that has not returned waits at a warp operation (none of
// whose masks may name a returned lane), then the block if every thread that has not
// returned waits at __syncthreads.
void Release(Block& b, size_t w) {
  if (b.at_warp[w] > 0 && b.at_warp[w] == b.warp_live[w]) {
    const size_t end = std::min(b.fibers.size(), (w + 1) * kWarp);
    for (size_t i = w * kWarp; i < end; ++i) {
      Fiber& f = b.fibers[i];
      if (f.state != State::kAtWarpBarrier) continue;
      if ((f.warp_mask & b.warp_returned[w]) != 0) {
        b.current = static_cast<int>(i);
        Stop(b, "a warp operation's mask names a lane that has returned");
      }
      f.state = State::kRunnable;
    }
    b.at_warp[w] = 0;
  }
  if (b.at_block > 0 && b.at_block == b.live) {
    for (Fiber& f : b.fibers) {
      if (f.state == State::kAtBlockBarrier) f.state = State::kRunnable;
    }
    b.at_block = 0;
  }
}

// Hands the host thread from the current fiber (which has just stopped running) to the
// next runnable one in thread order (descending in reverse order), or back to the grid when
// none is left.
void Next(Block& b) {
  const size_t n = b.fibers.size();
  const size_t me = static_cast<size_t>(b.current);
  Fiber& f = b.fibers[me];
  for (size_t step = 1; step <= n; ++step) {
    const size_t i = b.reverse ? (me + n - step) % n : (me + step) % n;
    if (b.fibers[i].state != State::kRunnable) continue;
    if (i == me) return;  // released by its own arrival: it goes on
    b.current = static_cast<int>(i);
    rackrun_cudasim_switch(&f.sp, b.fibers[i].sp);
    return;
  }
  rackrun_cudasim_switch(&f.sp, b.scheduler);
}

[[noreturn]] void FiberMain() {
  Block& b = *running;
  (*b.body)();
  const size_t me = static_cast<size_t>(b.current);
  b.fibers[me].state = State::kReturned;
  --b.live;
  --b.warp_live[me / kWarp];
  b.warp_returned[me / kWarp] |= 1u << (me % kWarp);
  Release(b, me / kWarp);  // its return may complete a barrier
  Next(b);                 // never resumed
  __builtin_unreachable();
}

void Wait(State s, unsigned mask) {
  Block& b = *running;
  const size_t me = static_cast<size_t>(b.current);
  Fiber& f = b.fibers[me];
  f.state = s;
  f.warp_mask = mask;
  if (s == State::kAtBlockBarrier) {
    ++b.at_block;
  } else {
    ++b.at_warp[me / kWarp];
  }
  Release(b, me / kWarp);
  Next(b);
}

// A fresh fiber's stack, as rackrun_cudasim_switch leaves one: MXCSR, six
// registers, then FiberMain as the return address (16-byte aligned, so FiberMain starts as
// if called).
void Prepare(Fiber& f, char* top) {
  auto* p = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(top) & ~uintptr_t{15});
  *--p = 0;
  *--p = reinterpret_cast<uint64_t>(&FiberMain);
  for (int r = 0; r < 6; ++r) *--p = 0;  // rbp, rbx, r12 .. r15
  uint32_t mxcsr = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  *--p = mxcsr;
  f.sp = p;
}

// Runs the block's fibers from thread 0 (the last thread in reverse order); they hand the
// host thread to each other and back here when none can run.
void RunBlock(Block& b) {
  b.current = b.reverse ? static_cast<int>(b.fibers.size()) - 1 : 0;
  rackrun_cudasim_switch(&b.scheduler, b.fibers[static_cast<size_t>(b.current)].sp);
  if (b.live > 0) Stop(b, "no thread of the block can go on (a barrier some threads never reach)");
}

// Where the aligned dynamic shared memory starts in b.shared.
size_t SharedBegin(const Block& b) {
  const auto at = reinterpret_cast<uintptr_t>(b.shared.data());
  return (kSharedAlign - at % kSharedAlign) % kSharedAlign;
}

}  // namespace

const ThreadPlace& Place() { return running->fibers[static_cast<size_t>(running->current)].place; }

void SetScheduleOrder(ScheduleOrder order) {
  order_setting.store(static_cast<int>(order), std::memory_order_relaxed);
}

ScheduleOrder GetScheduleOrder() { return CurrentOrder(); }

void SyncThreads() { Wait(State::kAtBlockBarrier, 0); }

void SyncWarp(unsigned mask) { Wait(State::kAtWarpBarrier, mask); }

const uint64_t* WarpExchange(unsigned mask, uint64_t mine) {
  Block& b = *running;
  const size_t warp = static_cast<size_t>(b.current) / kWarp;
  b.exchange[static_cast<size_t>(b.current)] = mine;
  SyncWarp(mask);
  return &b.exchange[warp * kWarp];
}

// Aligned as a GPU aligns it (wmma needs 256-bit aligned tiles; malloc gives 16 bytes).
void* DynamicShared() { return running->shared.data() + SharedBegin(*running); }

bool SetMaxDynamicShared(const void* kernel, int bytes) {
  if (kernel == nullptr || bytes < 0 || static_cast<size_t>(bytes) > kSharedOptInLimit) {
    return false;
  }
  std::lock_guard<std::mutex> lock(opt_in_mu);
  OptIns()[kernel] = static_cast<size_t>(bytes);
  return true;
}

bool CheckLaunch(const void* kernel, dim3 grid, dim3 block, size_t shared) {
  size_t limit = kSharedLimit;
  {
    std::lock_guard<std::mutex> lock(opt_in_mu);
    auto it = OptIns().find(kernel);
    if (it != OptIns().end()) limit = std::max(limit, it->second);
  }
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.y > 65535 || grid.z > 65535 || shared > limit) {
    SetLastError(cudaErrorInvalidConfiguration);
    return false;
  }
  return true;
}

bool CheckPointerArgument(const void* p, int index, const std::source_location& where) {
  const Memory kind = ClassifyArgument(p);
  if (kind != Memory::kPageable) return kind == Memory::kPinned;
  std::fprintf(stderr,
               "CUDA simulator: %s:%u (%s): kernel argument %d is a host pointer (%p), neither "
               "device memory (cudaMalloc) nor pinned memory (cudaHostAlloc); on a GPU the "
               "kernel faults on it\n",
               where.file_name(), static_cast<unsigned>(where.line()), where.function_name(), index,
               p);
  std::abort();
}

void RunGrid(dim3 grid, dim3 block, size_t shared, const std::source_location& where,
             const std::function<void()>& body) {
  const size_t threads = size_t{block.x} * block.y * block.z;
  while (stacks.size() < threads) stacks.push_back(std::make_unique<Stack>());
  Block b;
  b.body = &body;
  b.where = &where;
  b.fibers.resize(threads);
  b.exchange.assign((threads + kWarp - 1) / kWarp * kWarp, 0);
  b.reverse = CurrentOrder() == ScheduleOrder::kReverse;
  Block* outer = running;
  running = &b;
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  for (uint64_t n = 0; n < blocks; ++n) {
    const uint64_t linear = b.reverse ? blocks - 1 - n : n;
    const auto bx = static_cast<unsigned>(linear % grid.x);
    const auto by = static_cast<unsigned>(linear / grid.x % grid.y);
    const auto bz = static_cast<unsigned>(linear / (uint64_t{grid.x} * grid.y));
    b.shared.assign(shared + kSharedAlign + kSharedGuard, 0xff);
    const size_t begin = SharedBegin(b), end = begin + shared;
    std::fill(b.shared.begin(), b.shared.begin() + static_cast<std::ptrdiff_t>(begin), kGuardByte);
    std::fill(b.shared.begin() + static_cast<std::ptrdiff_t>(end), b.shared.end(), kGuardByte);
    b.live = static_cast<int>(threads);
    b.at_block = 0;
    b.at_warp.assign(b.exchange.size() / kWarp, 0);
    b.warp_returned.assign(b.exchange.size() / kWarp, 0);
    b.warp_live.assign(b.exchange.size() / kWarp, kWarp);
    if (threads % kWarp != 0) b.warp_live.back() = static_cast<int>(threads % kWarp);
    for (size_t t = 0; t < threads; ++t) {
      Fiber& f = b.fibers[t];
      f.state = State::kRunnable;
      f.place.thread_idx =
          uint3{static_cast<unsigned>(t % block.x), static_cast<unsigned>(t / block.x % block.y),
                static_cast<unsigned>(t / (size_t{block.x} * block.y))};
      f.place.block_idx = uint3{bx, by, bz};
      f.place.block_dim = block;
      f.place.grid_dim = grid;
      // Tops staggered by a few cache lines: at equal strides every fiber's live stack
      // lines would fall into the same cache sets.
      Prepare(f, stacks[t]->top() - (t % 64) * 192);
    }
    RunBlock(b);
    const auto intact = [](auto first, auto last) {
      return std::all_of(first, last, [](unsigned char x) { return x == kGuardByte; });
    };
    const auto at = [&](size_t i) { return b.shared.begin() + static_cast<std::ptrdiff_t>(i); };
    if (!intact(b.shared.begin(), at(begin))) {
      Stop(b, "a thread wrote before the launch's dynamic shared memory");
    }
    if (!intact(at(end), b.shared.end())) {
      Stop(b, "a thread wrote past the launch's dynamic shared memory");
    }
  }
  running = outer;
  CheckRedzones(&where);
}

}  // namespace rackrun::runtime::cuda::sim
