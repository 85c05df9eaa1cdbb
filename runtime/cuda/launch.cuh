// Private to runtime/cuda/*.cu: how a kernel is launched, one spelling for nvcc and for the
// CUDA simulator (runtime/cuda/sim, RACKRUN_CUDA_SIM), which compiles the same .cu files as
// plain C++ for the tests on machines without a GPU:
//
//   Launch(kernel, grid, block, shared_bytes, stream)(args...);  // kernel<<<...>>>(args...)
//   RACKRUN_DYNAMIC_SHARED(float, scratch);                       // extern __shared__ float[]
//   RACKRUN_DYNAMIC_SHARED_ALIGNED(unsigned char, smem, 128);     // the same, __align__(128)
#ifndef RACKRUN_RUNTIME_CUDA_LAUNCH_CUH_
#define RACKRUN_RUNTIME_CUDA_LAUNCH_CUH_

#include <cuda_runtime.h>

#include "runtime/cuda/grid.h"

#ifdef RACKRUN_CUDA_SIM
#include "runtime/cuda/sim/kernel.h"
#else

#include <utility>

namespace rackrun::runtime::cuda {

template <typename... P>
class Launch {
 public:
  Launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t shared, cudaStream_t stream)
      : kernel_(kernel), grid_(grid), block_(block), shared_(shared), stream_(stream) {}

  template <typename... A>
  void operator()(A&&... args) const {
    // clang-format off
    kernel_<<<grid_, block_, shared_, stream_>>>(std::forward<A>(args)...);
    // clang-format on
  }

 private:
  void (*kernel_)(P...);
  dim3 grid_, block_;
  size_t shared_;
  cudaStream_t stream_;
};

}  // namespace rackrun::runtime::cuda

#define RACKRUN_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#define RACKRUN_DYNAMIC_SHARED_ALIGNED(T, name, A) \
  extern __shared__ __align__(A)                   \
  T name[]

#endif  // RACKRUN_CUDA_SIM

#endif  // RACKRUN_RUNTIME_CUDA_LAUNCH_CUH_
