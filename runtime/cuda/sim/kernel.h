// The CUDA simulator's device side (tests only; README.md here): what a .cu file of the
// engine needs to compile as plain C++ and run on the CPU. Included through
// runtime/cuda/launch.cuh when RACKRUN_CUDA_SIM is defined, after the CUDA headers.
//
// Contract:
// - A launch (`Launch(kernel, grid, block, shared, stream)(args...)`) is checked as the GPU
//   checks it (block size, grid size, dynamic shared memory) and queued on the stream
//   (runtime.h); when it runs, the blocks run one after another and the threads of a block
//   as fibers on one host thread, each until it reaches a barrier, in thread order (or all
//   in reverse: ScheduleOrder below).
// - __syncthreads waits for every thread of the block that has not returned; a warp
//   operation (__syncwarp, __shfl_*_sync) for every lane of the warp that has not
//   returned. A lane of the mask that has returned, or a barrier no thread can pass
//   (threads waiting at a block barrier while others of a warp wait at a warp operation),
//   stops the program with the launch site, the block and the threads' states: on a GPU
//   that is a hang or undefined behaviour.
// - __shared__ variables are per host thread (one block runs at a time there); dynamic
//   shared memory is filled with all-ones bytes (NaN) at each block's start, and a write
//   outside it (guard bytes around it, checked after each block) stops the program.
// - A pointer argument must point to device or pinned memory (or be null): a host pointer
//   stops the program at the launch, naming its site and the argument.
// - No timing, no memory model beyond sequential consistency: what runs here checks a
//   kernel's arithmetic, indexing and barriers, not its speed or its races between blocks.
#ifndef RACKRUN_RUNTIME_CUDA_SIM_KERNEL_H_
#define RACKRUN_RUNTIME_CUDA_SIM_KERNEL_H_

#include <cuda_runtime_api.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <source_location>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "runtime/cuda/sim/runtime.h"

namespace rackrun::runtime::cuda::sim {

struct ThreadPlace {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

// The order a grid's blocks and a block's threads run in. kForward: blocks by linear index,
// threads in thread order, each until it reaches a barrier (then the next runnable one).
// kReverse: both descending. A kernel whose result depends on the order races: on a GPU one
// block (or thread, between barriers) may read what another wrote, or not yet. The default
// comes from RACKRUN_CUDASIM_ORDER (forward or reverse; anything else stops the program).
enum class ScheduleOrder { kForward, kReverse };
void SetScheduleOrder(ScheduleOrder order);
ScheduleOrder GetScheduleOrder();

// The running thread's place (valid inside a kernel only).
const ThreadPlace& Place();
void SyncThreads();
// Exchanges one 64-bit value per lane among the lanes of `mask`; returns the lanes' values
// (indexed by lane). Valid until the lane's next warp operation.
const uint64_t* WarpExchange(unsigned mask, uint64_t mine);
void SyncWarp(unsigned mask);
void* DynamicShared();

// Checks a launch of `kernel` (its dynamic shared memory against 48 KiB, or what
// cudaFuncSetAttribute opted it in to); false (and the thread's last error set) if the GPU
// would refuse it.
bool CheckLaunch(const void* kernel, dim3 grid, dim3 block, size_t shared);
// Stops the program, naming the launch site and the argument, when a kernel's pointer
// argument `p` (argument `index`) points to neither device memory (cudaMalloc's range) nor
// pinned memory: on a GPU without host memory mapping the kernel faults on it.
// Returns whether it points to pinned memory (the kernel may write there).
bool CheckPointerArgument(const void* p, int index, const std::source_location& where);
// Runs every block of a grid, each thread calling `body`. `where` names the launch site.
void RunGrid(dim3 grid, dim3 block, size_t shared, const std::source_location& where,
             const std::function<void()>& body);

template <typename T>
T Shuffle(unsigned mask, T v, int lane_of) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  const uint64_t* all = WarpExchange(mask, bits);
  T out;
  std::memcpy(&out, &all[lane_of], sizeof(T));
  SyncWarp(mask);  // nobody overwrites the exchange before every lane has read it
  return out;
}

}  // namespace rackrun::runtime::cuda::sim

namespace rackrun::runtime::cuda {

// `Launch(kernel, grid, block, shared, stream)(args...)`: kernel<<<grid, block, shared,
// stream>>>(args...) on the simulator (runtime/cuda/launch.cuh has nvcc's).
template <typename... P>
class Launch {
 public:
  Launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t shared, cudaStream_t stream,
         std::source_location where = std::source_location::current())
      : kernel_(kernel),
        grid_(grid),
        block_(block),
        shared_(shared),
        stream_(stream),
        where_(where) {}

  template <typename... A>
  void operator()(A&&... args) const {
    if (!sim::CheckLaunch(reinterpret_cast<const void*>(kernel_), grid_, block_, shared_)) return;
    std::tuple<std::decay_t<P>...> bound(std::forward<A>(args)...);
    std::vector<const void*> pinned;  // pointer arguments into pinned memory
    std::apply(
        [&](const auto&... a) {
          int index = 0;
          (CheckIfPointer(a, index++, &pinned), ...);
        },
        bound);
    sim::Enqueue(stream_, sim::Work::kKernel,
                 [kernel = kernel_, bound, grid = grid_, block = block_, shared = shared_,
                  where = where_, pinned] {
                   sim::RunGrid(grid, block, shared, where, [&] { std::apply(kernel, bound); });
                   for (const void* p : pinned) sim::DeviceWrotePinned(p);
                 });
  }

 private:
  template <typename T>
  void CheckIfPointer(const T& a, int index, std::vector<const void*>* pinned) const {
    if constexpr (std::is_pointer_v<T>) {
      const void* p = static_cast<const void*>(a);
      if (p != nullptr && sim::CheckPointerArgument(p, index, where_)) pinned->push_back(p);
    }
  }

  void (*kernel_)(P...);
  dim3 grid_, block_;
  size_t shared_;
  cudaStream_t stream_;
  std::source_location where_;
};

}  // namespace rackrun::runtime::cuda

// ---- CUDA C++'s device-side vocabulary -------------------------------------------------

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

#define threadIdx (::rackrun::runtime::cuda::sim::Place().thread_idx)
#define blockIdx (::rackrun::runtime::cuda::sim::Place().block_idx)
#define blockDim (::rackrun::runtime::cuda::sim::Place().block_dim)
#define gridDim (::rackrun::runtime::cuda::sim::Place().grid_dim)
#define RACKRUN_DYNAMIC_SHARED(T, name) \
  T* name = static_cast<T*>(::rackrun::runtime::cuda::sim::DynamicShared())
// Dynamic shared memory is 128-byte aligned here (scheduler.cc), as on a GPU.
#define RACKRUN_DYNAMIC_SHARED_ALIGNED(T, name, A) \
  static_assert((A) <= 128);                       \
  RACKRUN_DYNAMIC_SHARED(T, name)

inline void __syncthreads() { ::rackrun::runtime::cuda::sim::SyncThreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::rackrun::runtime::cuda::sim::SyncWarp(mask);
}

template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  return ::rackrun::runtime::cuda::sim::Shuffle(mask, v, (lane / width) * width + src % width);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int to = lane ^ lane_mask;
  return ::rackrun::runtime::cuda::sim::Shuffle(mask, v, to / width == lane / width ? to : lane);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int to = lane + static_cast<int>(delta);
  return ::rackrun::runtime::cuda::sim::Shuffle(mask, v, to / width == lane / width ? to : lane);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int to = lane - static_cast<int>(delta);
  return ::rackrun::runtime::cuda::sim::Shuffle(mask, v,
                                                to >= 0 && to / width == lane / width ? to : lane);
}

template <typename T>
T atomicAdd(T* address, T v) {
  return std::atomic_ref<T>(*address).fetch_add(v);
}

// Rounding-mode intrinsics: the host's IEEE operations round to nearest (the project
// compiles without floating-point contraction).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float rsqrtf(float a) { return 1.0f / std::sqrt(a); }
inline double rsqrt(double a) { return 1.0 / std::sqrt(a); }
inline float __expf(float a) { return std::exp(a); }
inline float __logf(float a) { return std::log(a); }
inline float __fdividef(float a, float b) { return a / b; }

#endif  // RACKRUN_RUNTIME_CUDA_SIM_KERNEL_H_
