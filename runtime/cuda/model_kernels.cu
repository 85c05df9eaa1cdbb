// Device code of runtime/cuda/model_kernels.h. Checked against the CPU functions by
// runtime/cuda/model_test.cc (embedding, streams) and runtime/cuda/moe_test.cc (scores).
#include <cuda_bf16.h>

#include <cstdint>

#include "runtime/cuda/launch.cuh"
#include "runtime/cuda/model_kernels.h"
#include "runtime/cuda/reduce.cuh"

namespace rackrun::runtime::cuda::kernels {
namespace {

using detail::FromF;

constexpr int kThreads = 256;
constexpr int64_t kTokenChunk = 256;

__global__ void EmbeddingForwardKernel(int width, const int32_t* __restrict__ tokens,
                                       const float* __restrict__ table, float* __restrict__ out) {
  const int64_t t = blockIdx.x;
  const float* src = table + static_cast<int64_t>(tokens[t]) * width;
  float* dst = out + t * width;
  for (int c = threadIdx.x; c < width; c += blockDim.x) dst[c] = src[c];
}

__global__ void EmbeddingBackwardKernel(int width, const int32_t* __restrict__ ids,
                                        const int64_t* __restrict__ first,
                                        const int64_t* __restrict__ order,
                                        const float* __restrict__ dout, float* __restrict__ grad) {
  const int64_t u = blockIdx.x;
  float* g = grad + static_cast<int64_t>(ids[u]) * width;
  for (int c = threadIdx.x; c < width; c += blockDim.x) {
    float acc = 0.0f;
    for (int64_t q = first[u]; q < first[u + 1]; ++q) acc += dout[order[q] * width + c];
    g[c] += acc;
  }
}

__global__ void AddKernel(int64_t n, const float* __restrict__ x, float* __restrict__ y) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    y[i] += x[i];
  }
}

template <typename S>
__global__ void ExpandKernel(int64_t tokens, int streams, int width, const float* __restrict__ e,
                             S* __restrict__ x) {
  const int64_t n = tokens * streams * width;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / (static_cast<int64_t>(streams) * width);
    const int c = static_cast<int>(i % width);
    x[i] = FromF<S>(e[t * width + c]);
  }
}

__global__ void ExpandBackwardKernel(int64_t tokens, int streams, int width,
                                     const float* __restrict__ dx, float* __restrict__ de) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < tokens * width;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / width;
    const int c = static_cast<int>(i % width);
    const float* row = dx + t * streams * width + c;
    float acc = 0.0f;
    for (int s = 0; s < streams; ++s) acc += row[static_cast<int64_t>(s) * width];
    de[i] = acc;
  }
}

// One token's score of one expert, widened to double.
struct ScoreTerm {
  const float* scores;
  int experts;
  __device__ double operator()(int64_t t, int e) const {
    return static_cast<double>(scores[t * experts + e]);
  }
};

}  // namespace

cudaError_t EmbeddingForward(int64_t count, int width, const int32_t* tokens, const float* table,
                             float* out, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  Launch(EmbeddingForwardKernel, static_cast<unsigned>(count), 128, 0, stream)(width, tokens, table,
                                                                               out);
  return cudaGetLastError();
}

cudaError_t EmbeddingBackward(int64_t distinct, int width, const int32_t* ids, const int64_t* first,
                              const int64_t* order, const float* dout, float* table_grad,
                              cudaStream_t stream) {
  if (distinct == 0) return cudaSuccess;
  Launch(EmbeddingBackwardKernel, static_cast<unsigned>(distinct), 128, 0, stream)(
      width, ids, first, order, dout, table_grad);
  return cudaGetLastError();
}

cudaError_t AddInPlace(int64_t n, const float* x, float* y, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  Launch(AddKernel, GridStrideBlocks(n, kThreads), kThreads, 0, stream)(n, x, y);
  return cudaGetLastError();
}

template <typename S>
cudaError_t ExpandStreams(int64_t tokens, int streams, int width, const float* e, S* x,
                          cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  Launch(ExpandKernel<S>, GridStrideBlocks(tokens * streams * width, kThreads), kThreads, 0,
         stream)(tokens, streams, width, e, x);
  return cudaGetLastError();
}
template cudaError_t ExpandStreams<float>(int64_t, int, int, const float*, float*, cudaStream_t);
template cudaError_t ExpandStreams<__nv_bfloat16>(int64_t, int, int, const float*, __nv_bfloat16*,
                                                  cudaStream_t);

cudaError_t ExpandStreamsBackward(int64_t tokens, int streams, int width, const float* dx,
                                  float* de, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  Launch(ExpandBackwardKernel, GridStrideBlocks(tokens * width, kThreads), kThreads, 0, stream)(
      tokens, streams, width, dx, de);
  return cudaGetLastError();
}

int64_t ScoreColumnPartials(int64_t tokens, int experts) {
  return detail::ChunkCount(tokens, kTokenChunk) * experts;
}

cudaError_t ScoreColumnSums(int64_t tokens, int experts, const float* scores, double* partial,
                            double* sums, cudaStream_t stream) {
  detail::ColumnSums(tokens, experts, kTokenChunk, ScoreTerm{scores, experts}, partial,
                     /*add=*/false, sums, stream);
  return cudaGetLastError();
}

}  // namespace rackrun::runtime::cuda::kernels
