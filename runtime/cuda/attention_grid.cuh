// Private to the attention kernels (attention_kernels.cu, attention_tensor_core.cu): the
// grid they launch over and the row tile each block takes, kept together because the two
// must agree. x = batch * heads (no 65535 limit on x), y = tiles of `rows` rows. Blocks start
// in x-fastest order, so a tile's blocks of every head start together; the query kernels
// take their tiles from the last (the most keys under the causal mask) to the first, the
// dK/dV kernels in order (the first key tile has the most queries): the lightest tiles are
// left for the last wave.
#ifndef RACKRUN_RUNTIME_CUDA_ATTENTION_GRID_CUH_
#define RACKRUN_RUNTIME_CUDA_ATTENTION_GRID_CUH_

#include "runtime/cuda/launch.cuh"

namespace rackrun::runtime::cuda::attention {

inline dim3 AttentionGrid(int batch, int heads, int seq, int rows) {
  return dim3(static_cast<unsigned>(batch * heads), static_cast<unsigned>((seq + rows - 1) / rows));
}

__device__ __forceinline__ int QueryTile() { return static_cast<int>(gridDim.y - 1 - blockIdx.y); }
__device__ __forceinline__ int KeyTile() { return static_cast<int>(blockIdx.y); }

}  // namespace rackrun::runtime::cuda::attention

#endif  // RACKRUN_RUNTIME_CUDA_ATTENTION_GRID_CUH_
