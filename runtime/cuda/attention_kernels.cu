// Device code of runtime/cuda/attention_kernels.h (its header says the work split). Checked
// against runtime/layers/attention.cc by runtime/cuda/attention_test.cc.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "runtime/cuda/attention_grid.cuh"
#include "runtime/cuda/attention_kernels.h"
#include "runtime/cuda/launch.cuh"

namespace rackrun::runtime::cuda::attention {
namespace {

constexpr int kE = 16;     // head elements per thread
constexpr int kRows = 64;  // rows (queries, or keys in the dK/dV kernel) per block
constexpr int kTile = 32;  // rows per shared-memory tile

// Sum over the G lanes of a row's group (aligned groups of G lanes). Every lane of the group
// ends with the same bits (a butterfly adds the same pairs in every lane), so the masks and
// exponentials computed from it agree across the group.
template <int G>
__device__ __forceinline__ float GroupSum(float v) {
#pragma unroll
  for (int o = G / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Loads rows [first, first + kTile) of a [.. x stride] matrix's columns [col, col + D) into
// tile (rows past `last` as zeros). Every thread of the block takes part.
template <int D>
__device__ __forceinline__ void LoadTile(const float* base, int64_t stride, int first, int last,
                                         float (*tile)[D]) {
  for (int x = threadIdx.x; x < kTile * D; x += blockDim.x) {
    const int r = x / D, d = x % D;
    const int row = first + r;
    tile[r][d] = row <= last ? base[static_cast<int64_t>(row) * stride + d] : 0.0f;
  }
}

// Where a thread of the kernels below works: its block's (batch, head), its row (a query
// row, or a key row in the dK/dV kernel: kRows per tile of the grid (attention_grid.cuh),
// one per group of G threads) and its
// part of the head's D = kE * G columns (e * G + part).
template <int G>
struct RowPlace {
  int bh, h;  // blockIdx.x = batch * heads + head
  int part;   // threadIdx.x % G
  int first;  // the block's first row
  int row;    // this thread's; valid when below seq
  bool valid;
  int row_read;       // row, or seq - 1 for the threads past the end (they read, never write)
  int64_t c3;         // the qkv rows' stride, 3 x width
  int64_t row0;       // the batch's first token
  const int32_t* ds;  // the batch's doc_start
  const float* head;  // q of the batch's row 0 and head h; k at + width, v at + 2 width
};

template <int G>
__device__ __forceinline__ RowPlace<G> PlaceRow(int seq, int heads, int width, const float* qkv,
                                                const int32_t* doc_start, int tile) {
  RowPlace<G> p;
  p.bh = blockIdx.x;
  p.h = p.bh % heads;
  p.part = threadIdx.x % G;
  p.first = tile * kRows;
  p.row = p.first + static_cast<int>(threadIdx.x) / G;
  p.valid = p.row < seq;
  p.row_read = p.valid ? p.row : seq - 1;
  p.c3 = 3 * static_cast<int64_t>(width);
  p.row0 = static_cast<int64_t>(p.bh / heads) * seq;
  p.ds = doc_start + p.row0;
  p.head = qkv + p.row0 * p.c3 + p.h * kE * G;
  return p;
}

// One query row per group of G threads; keys stream through shared memory. Online softmax
// (running max m and sum l, the output rescaled when the max grows).
template <int G>
__global__ void __launch_bounds__(kRows* G)
    ForwardKernel(int seq, int heads, int width, float scale, const float* __restrict__ qkv,
                  const int32_t* __restrict__ doc_start, float* __restrict__ attn,
                  float* __restrict__ lse) {
  constexpr int D = kE * G;
  __shared__ float ks[kTile][D];
  __shared__ float vs[kTile][D];
  const auto [bh, h, part, i0, i, valid, ii, c3, row0, ds, head] =
      PlaceRow<G>(seq, heads, width, qkv, doc_start, QueryTile());
  float q[kE], o[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    q[e] = head[ii * c3 + e * G + part];
    o[e] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const int first_key = ds[ii];
  const int last = (i0 + kRows < seq ? i0 + kRows : seq) - 1;
  // doc_start is nondecreasing: the block's first row has the smallest.
  for (int kt = ds[i0]; kt <= last; kt += kTile) {
    LoadTile<D>(head + width, c3, kt, last, ks);
    LoadTile<D>(head + 2 * width, c3, kt, last, vs);
    __syncthreads();
    float s[kTile];
    float tile_max = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < kTile; ++jj) {
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < kE; ++e) dot += q[e] * ks[jj][e * G + part];
      dot = GroupSum<G>(dot);
      const int j = kt + jj;
      s[jj] = valid && j >= first_key && j <= i ? dot * scale : -INFINITY;
      tile_max = fmaxf(tile_max, s[jj]);
    }
    if (tile_max > -INFINITY) {
      const float m_new = fmaxf(m, tile_max);
      const float corr = expf(m - m_new);
      l *= corr;
#pragma unroll
      for (int e = 0; e < kE; ++e) o[e] *= corr;
#pragma unroll
      for (int jj = 0; jj < kTile; ++jj) {
        const float p = expf(s[jj] - m_new);
        l += p;
#pragma unroll
        for (int e = 0; e < kE; ++e) o[e] += p * vs[jj][e * G + part];
      }
      m = m_new;
    }
    __syncthreads();
  }
  if (!valid) return;
  const float inv = 1.0f / l;
  float* out = attn + (row0 + i) * width + h * D;
#pragma unroll
  for (int e = 0; e < kE; ++e) out[e * G + part] = o[e] * inv;
  if (part == 0) lse[static_cast<int64_t>(bh) * seq + i] = m + logf(l);
}

// delta[bh, i] = <dattn row i head h, attn row i head h>: one thread per (token, head).
__global__ void DeltaKernel(int64_t tokens, int seq, int heads, int head_dim, int width,
                            const float* __restrict__ attn, const float* __restrict__ dattn,
                            float* __restrict__ delta) {
  for (int64_t x = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; x < tokens * heads;
       x += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = x / heads;
    const int h = static_cast<int>(x % heads);
    const float* o = attn + t * width + h * head_dim;
    const float* d = dattn + t * width + h * head_dim;
    float acc = 0.0f;
    for (int e = 0; e < head_dim; ++e) acc += d[e] * o[e];
    const int64_t b = t / seq, i = t % seq;
    delta[(b * heads + h) * seq + i] = acc;
  }
}

// dQ: one query row per group. p = exp(scale q.k - lse), dp = dO.v, dS = p (dp - delta),
// dq = scale sum_j dS k_j.
template <int G>
__global__ void __launch_bounds__(kRows* G)
    QueryGradKernel(int seq, int heads, int width, float scale, const float* __restrict__ qkv,
                    const int32_t* __restrict__ doc_start, const float* __restrict__ lse,
                    const float* __restrict__ dattn, const float* __restrict__ delta,
                    float* __restrict__ dqkv) {
  constexpr int D = kE * G;
  __shared__ float ks[kTile][D];
  __shared__ float vs[kTile][D];
  const auto [bh, h, part, i0, i, valid, ii, c3, row0, ds, head] =
      PlaceRow<G>(seq, heads, width, qkv, doc_start, QueryTile());
  const float* dout = dattn + (row0 + ii) * width + h * D;
  float q[kE], d_o[kE], dq[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    q[e] = head[ii * c3 + e * G + part];
    d_o[e] = dout[e * G + part];
    dq[e] = 0.0f;
  }
  const float row_lse = lse[static_cast<int64_t>(bh) * seq + ii];
  const float row_delta = delta[static_cast<int64_t>(bh) * seq + ii];
  const int first_key = ds[ii];
  const int last = (i0 + kRows < seq ? i0 + kRows : seq) - 1;
  for (int kt = ds[i0]; kt <= last; kt += kTile) {
    LoadTile<D>(head + width, c3, kt, last, ks);
    LoadTile<D>(head + 2 * width, c3, kt, last, vs);
    __syncthreads();
#pragma unroll 4
    for (int jj = 0; jj < kTile; ++jj) {
      float dot = 0.0f, dp = 0.0f;
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        dot += q[e] * ks[jj][e * G + part];
        dp += d_o[e] * vs[jj][e * G + part];
      }
      dot = GroupSum<G>(dot);
      dp = GroupSum<G>(dp);
      const int j = kt + jj;
      const float p = valid && j >= first_key && j <= i ? expf(dot * scale - row_lse) : 0.0f;
      const float dsc = p * (dp - row_delta);
#pragma unroll
      for (int e = 0; e < kE; ++e) dq[e] += dsc * ks[jj][e * G + part];
    }
    __syncthreads();
  }
  if (!valid) return;
  float* out = dqkv + (row0 + i) * c3 + h * D;
#pragma unroll
  for (int e = 0; e < kE; ++e) out[e * G + part] = dq[e] * scale;
}

// dK, dV: one key row per group; the queries that attend it (doc_start[i] <= j <= i) stream
// through shared memory with their dO, lse and delta.
template <int G>
__global__ void __launch_bounds__(kRows* G)
    KeyValueGradKernel(int seq, int heads, int width, float scale, const float* __restrict__ qkv,
                       const int32_t* __restrict__ doc_start, const float* __restrict__ lse,
                       const float* __restrict__ dattn, const float* __restrict__ delta,
                       float* __restrict__ dqkv) {
  constexpr int D = kE * G;
  __shared__ float qs[kTile][D];
  __shared__ float dos[kTile][D];
  __shared__ float lse_s[kTile], delta_s[kTile];
  __shared__ int32_t ds_s[kTile];
  const auto [bh, h, part, j0, j, valid, jj_row, c3, row0, ds, head] =
      PlaceRow<G>(seq, heads, width, qkv, doc_start, KeyTile());
  float k[kE], v[kE], dk[kE], dv[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    k[e] = head[jj_row * c3 + width + e * G + part];
    v[e] = head[jj_row * c3 + 2 * width + e * G + part];
    dk[e] = 0.0f;
    dv[e] = 0.0f;
  }
  const int last_key = (j0 + kRows < seq ? j0 + kRows : seq) - 1;
  const float* lse_row = lse + static_cast<int64_t>(bh) * seq;
  const float* delta_row = delta + static_cast<int64_t>(bh) * seq;
  // Queries before j0 attend no key of this block; a tile whose first query starts its
  // document after the block's last key ends the loop (doc_start is nondecreasing).
  for (int qt = j0; qt < seq && ds[qt] <= last_key; qt += kTile) {
    const int last = (qt + kTile < seq ? qt + kTile : seq) - 1;
    LoadTile<D>(head, c3, qt, last, qs);
    LoadTile<D>(dattn + row0 * width + h * D, width, qt, last, dos);
    for (int x = threadIdx.x; x < kTile; x += blockDim.x) {
      const int row = qt + x;
      lse_s[x] = row <= last ? lse_row[row] : 0.0f;
      delta_s[x] = row <= last ? delta_row[row] : 0.0f;
      ds_s[x] = row <= last ? ds[row] : seq;
    }
    __syncthreads();
#pragma unroll 4
    for (int r = 0; r < kTile; ++r) {
      float dot = 0.0f, dp = 0.0f;
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        dot += qs[r][e * G + part] * k[e];
        dp += dos[r][e * G + part] * v[e];
      }
      dot = GroupSum<G>(dot);
      dp = GroupSum<G>(dp);
      const int i = qt + r;
      const float p =
          valid && i <= last && i >= j && ds_s[r] <= j ? expf(dot * scale - lse_s[r]) : 0.0f;
      const float dsc = p * (dp - delta_s[r]);
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        dv[e] += p * dos[r][e * G + part];
        dk[e] += dsc * qs[r][e * G + part];
      }
    }
    __syncthreads();
  }
  if (!valid) return;
  float* out = dqkv + (row0 + j) * c3 + h * D;
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    out[width + e * G + part] = dk[e] * scale;
    out[2 * width + e * G + part] = dv[e];
  }
}

// One thread per (token, q or k, head, rotary pair).
__global__ void RopeKernel(int64_t tokens, int seq, int width, int heads, int half,
                           const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                           float sign, float* __restrict__ qkv) {
  const int64_t per_token = 2 * static_cast<int64_t>(heads) * half;
  for (int64_t x = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; x < tokens * per_token;
       x += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = x / per_token;
    const int rem = static_cast<int>(x % per_token);
    const int part = rem / (heads * half);
    const int h = (rem / half) % heads;
    const int i = rem % half;
    const int64_t pos = t % seq;
    float* p = qkv + t * 3 * width + part * width + h * 2 * half + 2 * i;
    const float c = cos_table[pos * half + i], s = sign * sin_table[pos * half + i];
    const float x0 = p[0], x1 = p[1];
    p[0] = x0 * c - x1 * s;
    p[1] = x0 * s + x1 * c;
  }
}

template <int G>
cudaError_t LaunchForward(int batch, int seq, int heads, int width, float scale, const float* qkv,
                          const int32_t* doc_start, float* attn, float* lse, cudaStream_t stream) {
  const dim3 grid = AttentionGrid(batch, heads, seq, kRows);
  Launch(ForwardKernel<G>, grid, kRows * G, 0, stream)(seq, heads, width, scale, qkv, doc_start,
                                                       attn, lse);
  return cudaGetLastError();
}

template <int G>
cudaError_t LaunchBackward(int batch, int seq, int heads, int width, float scale, const float* qkv,
                           const int32_t* doc_start, const float* lse, const float* dattn,
                           const float* delta, float* dqkv, cudaStream_t stream) {
  const dim3 grid = AttentionGrid(batch, heads, seq, kRows);
  Launch(QueryGradKernel<G>, grid, kRows * G, 0, stream)(seq, heads, width, scale, qkv, doc_start,
                                                         lse, dattn, delta, dqkv);
  Launch(KeyValueGradKernel<G>, grid, kRows * G, 0, stream)(seq, heads, width, scale, qkv,
                                                            doc_start, lse, dattn, delta, dqkv);
  return cudaGetLastError();
}

}  // namespace

bool SupportedHeadDim(int head_dim) {
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128;
}

cudaError_t Rope(int64_t tokens, int seq, int width, int heads, const float* cos, const float* sin,
                 bool inverse, float* qkv, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  const int half = width / heads / 2;
  Launch(RopeKernel, GridStrideBlocks(tokens * 2 * heads * half, 256), 256, 0, stream)(
      tokens, seq, width, heads, half, cos, sin, inverse ? -1.0f : 1.0f, qkv);
  return cudaGetLastError();
}

cudaError_t Forward(int batch, int seq, int heads, int head_dim, float scale, const float* qkv,
                    const int32_t* doc_start, float* attn, float* lse, Cores cores,
                    cudaStream_t stream) {
  if (batch == 0 || seq == 0) return cudaSuccess;
  if (cores != Cores::kFp32) {
    return TensorCoreForward(cores, batch, seq, heads, head_dim, scale, qkv, doc_start, attn, lse,
                             stream);
  }
  const int width = heads * head_dim;
  switch (head_dim) {
    case 16:
      return LaunchForward<1>(batch, seq, heads, width, scale, qkv, doc_start, attn, lse, stream);
    case 32:
      return LaunchForward<2>(batch, seq, heads, width, scale, qkv, doc_start, attn, lse, stream);
    case 64:
      return LaunchForward<4>(batch, seq, heads, width, scale, qkv, doc_start, attn, lse, stream);
    case 128:
      return LaunchForward<8>(batch, seq, heads, width, scale, qkv, doc_start, attn, lse, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t Backward(int batch, int seq, int heads, int head_dim, float scale, const float* qkv,
                     const int32_t* doc_start, const float* attn, const float* lse,
                     const float* dattn, float* delta, float* dqkv, Cores cores,
                     cudaStream_t stream) {
  if (batch == 0 || seq == 0) return cudaSuccess;
  const int width = heads * head_dim;
  const int64_t tokens = static_cast<int64_t>(batch) * seq;
  Launch(DeltaKernel, GridStrideBlocks(tokens * heads, 256), 256, 0, stream)(
      tokens, seq, heads, head_dim, width, attn, dattn, delta);
  if (cores != Cores::kFp32) {
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    return TensorCoreBackward(cores, batch, seq, heads, head_dim, scale, qkv, doc_start, lse, dattn,
                              delta, dqkv, stream);
  }
  switch (head_dim) {
    case 16:
      return LaunchBackward<1>(batch, seq, heads, width, scale, qkv, doc_start, lse, dattn, delta,
                               dqkv, stream);
    case 32:
      return LaunchBackward<2>(batch, seq, heads, width, scale, qkv, doc_start, lse, dattn, delta,
                               dqkv, stream);
    case 64:
      return LaunchBackward<4>(batch, seq, heads, width, scale, qkv, doc_start, lse, dattn, delta,
                               dqkv, stream);
    case 128:
      return LaunchBackward<8>(batch, seq, heads, width, scale, qkv, doc_start, lse, dattn, delta,
                               dqkv, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace rackrun::runtime::cuda::attention
