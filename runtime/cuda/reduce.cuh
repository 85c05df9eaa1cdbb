// Private to runtime/cuda/*.cu: block-wide sums in a fixed order (the same tree for a
// given block size, so results are reproducible run to run), column sums over many rows in
// chunks (a fixed order too), and bf16/fp32 loads.
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

// ---- Column sums over many rows, in a fixed order: partial[chunk][c] = the sum of
// value(r, c) over the chunk's rows r in order (chunks of `chunk_rows` rows), then out[c] =
// (or +=) the sum of the chunks' partials in chunk order. The same order on every GPU and
// every run, so results repeat bit for bit, and thousands of threads instead of one per
// column walking every row: a per-column serial loop over 8192 tokens waits on one load
// latency per few rows (hundreds of microseconds a call). `Value` is a functor with
// `__device__ Acc operator()(int64_t row, int col) const`, passed by value.
template <typename Acc, typename Value>
__global__ void ChunkColumnPartialsKernel(int64_t rows, int cols, int64_t chunk_rows, Value value,
                                          Acc* partial) {
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  const int64_t chunk = blockIdx.x;  // x: up to 2^31 - 1 chunks (y stops at 65535)
  if (c >= cols) return;
  const int64_t r0 = chunk * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
  Acc acc = 0;
  for (int64_t r = r0; r < r1; ++r) acc += value(r, c);
  partial[chunk * cols + c] = acc;
}

template <typename Acc, typename Out>
__global__ void SumChunkPartialsKernel(int64_t chunks, int cols, const Acc* partial, bool add,
                                       Out* out) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  Acc acc = 0;
  for (int64_t q = 0; q < chunks; ++q) acc += partial[q * cols + c];
  out[c] = add ? static_cast<Out>(out[c] + acc) : static_cast<Out>(acc);
}

inline int64_t ChunkCount(int64_t rows, int64_t chunk_rows) {
  return (rows + chunk_rows - 1) / chunk_rows;
}

// Launches both passes on `stream`; `partial` holds ChunkCount(rows, chunk_rows) * cols
// values. With no rows, out is set to 0 (or left as it is when adding).
template <typename Acc, typename Out, typename Value>
void ColumnSums(int64_t rows, int cols, int64_t chunk_rows, Value value, Acc* partial, bool add,
                Out* out, cudaStream_t stream, int threads = 64) {
  if (cols <= 0) return;
  const int64_t chunks = ChunkCount(rows, chunk_rows);
  const unsigned col_blocks = static_cast<unsigned>((cols + threads - 1) / threads);
  if (chunks > 0) {
    Launch(ChunkColumnPartialsKernel<Acc, Value>, dim3(static_cast<unsigned>(chunks), col_blocks),
           threads, 0, stream)(rows, cols, chunk_rows, value, partial);
  }
  Launch(SumChunkPartialsKernel<Acc, Out>, col_blocks, threads, 0, stream)(chunks, cols, partial,
                                                                           add, out);
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
