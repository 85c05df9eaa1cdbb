// Grid sizes for the kernels' launches (launch.cuh includes it; plain C++, so host tests can
// check it): one thread per item, or a grid-stride loop's capped count.
#ifndef RACKRUN_RUNTIME_CUDA_GRID_H_
#define RACKRUN_RUNTIME_CUDA_GRID_H_

#include <cstdint>

namespace rackrun::runtime::cuda {

// Blocks of `threads` for one thread per item of `n` (at least one block): for kernels that
// return past the last item. Not capped: above the grid's x limit (2^31 - 1 blocks) the
// launch fails, it never leaves items out.
inline unsigned BlocksFor(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

// The same for kernels that loop over their items with a grid stride
// (`for (i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)`):
// at most kGridStrideBlocks, the loop takes the rest. Never for a kernel without the loop:
// items past the cap would be left out.
inline constexpr int64_t kGridStrideBlocks = int64_t{65535} * 16;
inline unsigned GridStrideBlocks(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > kGridStrideBlocks ? kGridStrideBlocks : b));
}

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_GRID_H_
