// Private to runtime/cuda/*.cu: block-wide sums in a fixed order (the same tree for a
// given block size, so results are reproducible run to run), and bf16/fp32 loads.
#ifndef RACKRUN_RUNTIME_CUDA_REDUCE_CUH_
#define RACKRUN_RUNTIME_CUDA_REDUCE_CUH_

#include <cuda_bf16.h>

#include "runtime/cuda/launch.cuh"

namespace rackrun::runtime::cuda::detail {

inline constexpr int kWarp = 32;

template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sums the first `n` (at most R, the same in every thread) of `R` values per thread over
// the block; every thread gets the totals (values from n on are left as they were).
// `scratch` holds R * 32 values of T (shared). blockDim.x a multiple of 32, at most 1024.
// Ends with a barrier, so the scratch may be reused at once.
template <typename T, int R>
__device__ __forceinline__ void BlockSum(T (&v)[R], T* scratch, int n = R) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (r < n) v[r] = WarpSum(v[r]);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (r < n) scratch[r * kWarp + warp] = v[r];
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= n) continue;
    T s = lane < warps ? scratch[r * kWarp + lane] : T(0);
    v[r] = WarpSum(s);
  }
  __syncthreads();
}

template <typename T>
__device__ __forceinline__ T BlockSum1(T v, T* scratch) {
  T a[1] = {v};
  BlockSum<T, 1>(a, scratch);
  return a[0];
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  v = WarpMax(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float s = lane < warps ? scratch[lane] : -INFINITY;
  v = WarpMax(s);
  __syncthreads();
  return v;
}

__device__ __forceinline__ float ToF(float v) { return v; }
__device__ __forceinline__ float ToF(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename S>
__device__ __forceinline__ S FromF(float v);
template <>
__device__ __forceinline__ float FromF<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

}  // namespace rackrun::runtime::cuda::detail

#endif  // RACKRUN_RUNTIME_CUDA_REDUCE_CUH_
