// Tensor-core attention: attention_kernels.h's Cores::kTensorBf16 (its header says the
// contract). Checked against runtime/layers/attention.cc by runtime/cuda/attention_test.cc.
//
// Work split: a block of 4 warps owns 64 rows (queries; keys in the dK/dV kernel), 16 per
// warp; the other side streams through shared memory in tiles of 64 rows, converted to
// bf16 as they are loaded. Each product (S = Q K^T, O += P V, dP = dO V^T, dQ += dS K,
// dV += P^T dO, dK += dS^T Q) is a run of 16 x 16 x 16 warp matrix operations (wmma, fp32
// accumulation). The softmax and its gradient run in fp32 on the scores staged in shared
// memory, two lanes per row (a fragment's element layout is unspecified, so row-wise work
// goes through memory); the output accumulators are rescaled through the same staging. As
// in attention_kernels.cu, no atomics: one kernel owns each query row's dQ, another each key
// row's dK and dV, so every sum has a fixed order.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <utility>

#ifdef RACKRUN_CUDA_SIM
#include "runtime/cuda/sim/wmma.h"
#else
#include <mma.h>
#endif

#include "runtime/cuda/attention_kernels.h"
#include "runtime/cuda/launch.cuh"

namespace rackrun::runtime::cuda::attention {
namespace {

namespace wmma = nvcuda::wmma;
using bf16 = __nv_bfloat16;

constexpr int kWarp = 32;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarp;
constexpr int kRows = 16 * kWarps;  // rows a block owns, and rows per streamed tile
constexpr unsigned kAll = 0xffffffffu;

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Shared memory for head dim D: bf16 row tiles [kRows x D], and per warp an fp32 staging
// area [16 x max(kRows, D)] and bf16 tiles [16 x kRows]; rows padded against bank
// conflicts, every array 128-byte aligned (wmma needs 256-bit aligned tiles).
template <int D>
struct Smem {
  static constexpr int kLd = D + 8;                        // bf16 row tiles
  static constexpr int kLs = (kRows > D ? kRows : D) + 4;  // fp32 staging
  static constexpr int kLp = kRows + 8;                    // bf16 per-warp tiles
  static constexpr size_t Align(size_t b) { return (b + 127) / 128 * 128; }
  static constexpr size_t kTile = Align(size_t{kRows} * kLd * sizeof(bf16));
  static constexpr size_t kStage = Align(size_t{16} * kLs * sizeof(float));
  static constexpr size_t kWarpTile = Align(size_t{16} * kLp * sizeof(bf16));
  static constexpr size_t kRowFloats = Align(size_t{kRows} * sizeof(float));
};

// Rows [first, first + kRows) of a [.. x stride] fp32 matrix's columns [0, D) as bf16 (rows
// past `last` zero). Every thread of the block takes part.
template <int D>
__device__ __forceinline__ void LoadRows(const float* base, int64_t stride, int first, int last,
                                         bf16* tile) {
  for (int x = threadIdx.x; x < kRows * D; x += kThreads) {
    const int r = x / D, d = x % D;
    const int row = first + r;
    tile[r * Smem<D>::kLd + d] =
        __float2bfloat16(row <= last ? base[static_cast<int64_t>(row) * stride + d] : 0.0f);
  }
}

// A warp's 16 rows of a bf16 row tile as matrix_a fragments (16 x D).
template <int D>
__device__ __forceinline__ void LoadWarpRows(const bf16* tile, int warp, FragA (&a)[D / 16]) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    wmma::load_matrix_sync(a[kk], tile + warp * 16 * Smem<D>::kLd + kk * 16, Smem<D>::kLd);
  }
}

// stage [16 x kRows] = A (16 x D) times tile^T (tile: [kRows x D]): S = Q K^T and the like.
template <int D>
__device__ __forceinline__ void TimesTileTransposed(const FragA (&a)[D / 16], const bf16* tile,
                                                    float* stage) {
#pragma unroll
  for (int n = 0; n < kRows / 16; ++n) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      FragBCol b;
      wmma::load_matrix_sync(b, tile + n * 16 * Smem<D>::kLd + kk * 16, Smem<D>::kLd);
      wmma::mma_sync(acc, a[kk], b, acc);
    }
    wmma::store_matrix_sync(stage + n * 16, acc, Smem<D>::kLs, wmma::mem_row_major);
  }
}

// acc (16 x D) += p (a warp's bf16 [16 x kRows]) times tile ([kRows x D]): O += P V and the like.
template <int D>
__device__ __forceinline__ void AddTimesTile(const bf16* p, const bf16* tile,
                                             FragC (&acc)[D / 16]) {
#pragma unroll
  for (int kk = 0; kk < kRows / 16; ++kk) {
    FragA a;
    wmma::load_matrix_sync(a, p + kk * 16, Smem<D>::kLp);
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      FragBRow b;
      wmma::load_matrix_sync(b, tile + kk * 16 * Smem<D>::kLd + n * 16, Smem<D>::kLd);
      wmma::mma_sync(acc[n], a, b, acc[n]);
    }
  }
}

// acc (16 x D) into the warp's staging area (row-major); the caller syncs the warp first.
template <int D>
__device__ __forceinline__ void Stage(const FragC (&acc)[D / 16], float* stage) {
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wmma::store_matrix_sync(stage + n * 16, acc[n], Smem<D>::kLs, wmma::mem_row_major);
  }
}

// The forward: per key tile S = Q K^T, the online softmax (running max m and sum l per row,
// two lanes per row), O rescaled and O += P V.
template <int D>
__global__ void __launch_bounds__(kThreads)
    ForwardTensorCoreKernel(int seq, int heads, int width, float scale,
                            const float* __restrict__ qkv, const int32_t* __restrict__ doc_start,
                            float* __restrict__ attn, float* __restrict__ lse) {
  using L = Smem<D>;
  RACKRUN_DYNAMIC_SHARED_ALIGNED(unsigned char, smem, 128);
  const int warp = static_cast<int>(threadIdx.x) / kWarp,
            lane = static_cast<int>(threadIdx.x) % kWarp;
  bf16* qs = reinterpret_cast<bf16*>(smem);
  bf16* ks = reinterpret_cast<bf16*>(smem + L::kTile);
  bf16* vs = reinterpret_cast<bf16*>(smem + 2 * L::kTile);
  float* stage = reinterpret_cast<float*>(smem + 3 * L::kTile + warp * L::kStage);
  bf16* ps =
      reinterpret_cast<bf16*>(smem + 3 * L::kTile + kWarps * L::kStage + warp * L::kWarpTile);
  const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
  const int i0 = blockIdx.x * kRows;
  const int64_t c3 = 3 * static_cast<int64_t>(width);
  const int64_t row0 = static_cast<int64_t>(b) * seq;
  const int32_t* ds = doc_start + row0;
  const float* head = qkv + row0 * c3 + h * D;  // q of row 0; k at + width, v at + 2 width
  const int last = (i0 + kRows < seq ? i0 + kRows : seq) - 1;
  LoadRows<D>(head, c3, i0, last, qs);
  __syncthreads();
  FragA q[D / 16];
  LoadWarpRows<D>(qs, warp, q);
  FragC o[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(o[n], 0.0f);
  const int r = lane / 2, half = lane % 2;  // this lane's row and half of the columns
  const int i = i0 + warp * 16 + r;
  const bool valid = i <= last;
  const int first_key = ds[valid ? i : last];
  const int warp_last = i0 + warp * 16 + 15 < last ? i0 + warp * 16 + 15 : last;
  float m = -INFINITY, l = 0.0f;
  // doc_start is nondecreasing: the block's first row has the smallest.
  for (int kt = ds[i0]; kt <= last; kt += kRows) {
    __syncthreads();  // the last tile's readers are done
    LoadRows<D>(head + width, c3, kt, last, ks);
    LoadRows<D>(head + 2 * width, c3, kt, last, vs);
    __syncthreads();
    if (kt > warp_last) continue;  // every key after the warp's rows (warp-uniform)
    TimesTileTransposed<D>(q, ks, stage);
    __syncwarp();
    float s[kRows / 2];
    float tile_max = -INFINITY;
#pragma unroll
    for (int c = 0; c < kRows / 2; ++c) {
      const int col = half * (kRows / 2) + c, j = kt + col;
      s[c] = valid && j >= first_key && j <= i ? stage[r * L::kLs + col] * scale : -INFINITY;
      tile_max = fmaxf(tile_max, s[c]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kAll, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    // A row with nothing to attend yet keeps m = -inf: its p are 0, its O stays 0.
    const bool none = m_new == -INFINITY;
    const float corr = none ? 1.0f : expf(m - m_new);
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kRows / 2; ++c) {
      const float p = none ? 0.0f : expf(s[c] - m_new);
      sum += p;
      ps[r * L::kLp + half * (kRows / 2) + c] = __float2bfloat16(p);
    }
    l = l * corr + sum + __shfl_xor_sync(kAll, sum, 1);
    m = m_new;
    __syncwarp();  // S read by every lane before O is staged over it
    Stage<D>(o, stage);
    __syncwarp();
#pragma unroll
    for (int d = 0; d < D / 2; ++d) stage[r * L::kLs + half * (D / 2) + d] *= corr;
    __syncwarp();
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      wmma::load_matrix_sync(o[n], stage + n * 16, L::kLs, wmma::mem_row_major);
    }
    AddTimesTile<D>(ps, vs, o);
  }
  __syncwarp();
  Stage<D>(o, stage);
  __syncwarp();
  if (!valid) return;
  const float inv = 1.0f / l;
  float* out = attn + (row0 + i) * width + h * D + half * (D / 2);
#pragma unroll
  for (int d = 0; d < D / 2; ++d) out[d] = stage[r * L::kLs + half * (D / 2) + d] * inv;
  if (half == 0) lse[static_cast<int64_t>(bh) * seq + i] = m + logf(l);
}

// dQ: per key tile S = Q K^T, dP = dO V^T, p = exp(scale S - lse), dS = p (dP - delta),
// dQ += dS K; written times scale.
template <int D>
__global__ void __launch_bounds__(kThreads)
    QueryGradTensorCoreKernel(int seq, int heads, int width, float scale,
                              const float* __restrict__ qkv, const int32_t* __restrict__ doc_start,
                              const float* __restrict__ lse, const float* __restrict__ dattn,
                              const float* __restrict__ delta, float* __restrict__ dqkv) {
  using L = Smem<D>;
  RACKRUN_DYNAMIC_SHARED_ALIGNED(unsigned char, smem, 128);
  const int warp = static_cast<int>(threadIdx.x) / kWarp,
            lane = static_cast<int>(threadIdx.x) % kWarp;
  bf16* qs = reinterpret_cast<bf16*>(smem);
  bf16* dos = reinterpret_cast<bf16*>(smem + L::kTile);
  bf16* ks = reinterpret_cast<bf16*>(smem + 2 * L::kTile);
  bf16* vs = reinterpret_cast<bf16*>(smem + 3 * L::kTile);
  unsigned char* mine = smem + 4 * L::kTile + warp * (2 * L::kStage + L::kWarpTile);
  float* s_stage = reinterpret_cast<float*>(mine);
  float* dp_stage = reinterpret_cast<float*>(mine + L::kStage);
  bf16* dss = reinterpret_cast<bf16*>(mine + 2 * L::kStage);
  const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
  const int i0 = blockIdx.x * kRows;
  const int64_t c3 = 3 * static_cast<int64_t>(width);
  const int64_t row0 = static_cast<int64_t>(b) * seq;
  const int32_t* ds = doc_start + row0;
  const float* head = qkv + row0 * c3 + h * D;
  const int last = (i0 + kRows < seq ? i0 + kRows : seq) - 1;
  LoadRows<D>(head, c3, i0, last, qs);
  LoadRows<D>(dattn + row0 * width + h * D, width, i0, last, dos);
  __syncthreads();
  FragA q[D / 16], d_o[D / 16];
  LoadWarpRows<D>(qs, warp, q);
  LoadWarpRows<D>(dos, warp, d_o);
  FragC dq[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(dq[n], 0.0f);
  const int r = lane / 2, half = lane % 2;
  const int i = i0 + warp * 16 + r;
  const bool valid = i <= last;
  const int ii = valid ? i : last;
  const float row_lse = lse[static_cast<int64_t>(bh) * seq + ii];
  const float row_delta = delta[static_cast<int64_t>(bh) * seq + ii];
  const int first_key = ds[ii];
  const int warp_last = i0 + warp * 16 + 15 < last ? i0 + warp * 16 + 15 : last;
  for (int kt = ds[i0]; kt <= last; kt += kRows) {
    __syncthreads();
    LoadRows<D>(head + width, c3, kt, last, ks);
    LoadRows<D>(head + 2 * width, c3, kt, last, vs);
    __syncthreads();
    if (kt > warp_last) continue;
    TimesTileTransposed<D>(q, ks, s_stage);
    TimesTileTransposed<D>(d_o, vs, dp_stage);
    __syncwarp();
#pragma unroll
    for (int c = 0; c < kRows / 2; ++c) {
      const int col = half * (kRows / 2) + c, j = kt + col;
      const float p = valid && j >= first_key && j <= i
                          ? expf(s_stage[r * L::kLs + col] * scale - row_lse)
                          : 0.0f;
      dss[r * L::kLp + col] = __float2bfloat16(p * (dp_stage[r * L::kLs + col] - row_delta));
    }
    __syncwarp();
    AddTimesTile<D>(dss, ks, dq);
  }
  __syncwarp();
  Stage<D>(dq, s_stage);
  __syncwarp();
  if (!valid) return;
  float* out = dqkv + (row0 + i) * c3 + h * D + half * (D / 2);
#pragma unroll
  for (int d = 0; d < D / 2; ++d) out[d] = s_stage[r * L::kLs + half * (D / 2) + d] * scale;
}

// dK, dV: a block owns 64 keys; the queries that attend them (doc_start[i] <= j <= i)
// stream through with their dO, lse and delta. S^T = K Q^T, dP^T = V dO^T, P^T and dS^T per
// (key, query), dV += P^T dO, dK += dS^T Q (written times scale).
template <int D>
__global__ void __launch_bounds__(kThreads)
    KeyValueGradTensorCoreKernel(int seq, int heads, int width, float scale,
                                 const float* __restrict__ qkv,
                                 const int32_t* __restrict__ doc_start,
                                 const float* __restrict__ lse, const float* __restrict__ dattn,
                                 const float* __restrict__ delta, float* __restrict__ dqkv) {
  using L = Smem<D>;
  RACKRUN_DYNAMIC_SHARED_ALIGNED(unsigned char, smem, 128);
  const int warp = static_cast<int>(threadIdx.x) / kWarp,
            lane = static_cast<int>(threadIdx.x) % kWarp;
  bf16* kown = reinterpret_cast<bf16*>(smem);
  bf16* vown = reinterpret_cast<bf16*>(smem + L::kTile);
  bf16* qs = reinterpret_cast<bf16*>(smem + 2 * L::kTile);
  bf16* dos = reinterpret_cast<bf16*>(smem + 3 * L::kTile);
  unsigned char* rows = smem + 4 * L::kTile;
  float* lse_s = reinterpret_cast<float*>(rows);
  float* delta_s = reinterpret_cast<float*>(rows + L::kRowFloats);
  int32_t* ds_s = reinterpret_cast<int32_t*>(rows + 2 * L::kRowFloats);
  unsigned char* mine = rows + 3 * L::kRowFloats + warp * (2 * L::kStage + 2 * L::kWarpTile);
  float* s_stage = reinterpret_cast<float*>(mine);
  float* dp_stage = reinterpret_cast<float*>(mine + L::kStage);
  bf16* pts = reinterpret_cast<bf16*>(mine + 2 * L::kStage);
  bf16* dsts = reinterpret_cast<bf16*>(mine + 2 * L::kStage + L::kWarpTile);
  const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
  const int j0 = blockIdx.x * kRows;
  const int64_t c3 = 3 * static_cast<int64_t>(width);
  const int64_t row0 = static_cast<int64_t>(b) * seq;
  const int32_t* ds = doc_start + row0;
  const float* head = qkv + row0 * c3 + h * D;
  const int last_key = (j0 + kRows < seq ? j0 + kRows : seq) - 1;
  LoadRows<D>(head + width, c3, j0, last_key, kown);
  LoadRows<D>(head + 2 * width, c3, j0, last_key, vown);
  __syncthreads();
  FragA k[D / 16], v[D / 16];
  LoadWarpRows<D>(kown, warp, k);
  LoadWarpRows<D>(vown, warp, v);
  FragC dk[D / 16], dv[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wmma::fill_fragment(dk[n], 0.0f);
    wmma::fill_fragment(dv[n], 0.0f);
  }
  const int r = lane / 2, half = lane % 2;
  const int j = j0 + warp * 16 + r;
  const bool valid = j <= last_key;
  const float* lse_row = lse + static_cast<int64_t>(bh) * seq;
  const float* delta_row = delta + static_cast<int64_t>(bh) * seq;
  // Queries before j0 attend no key of this block; a tile whose first query starts its
  // document after the block's last key ends the loop (doc_start is nondecreasing).
  for (int qt = j0; qt < seq && ds[qt] <= last_key; qt += kRows) {
    const int last = (qt + kRows < seq ? qt + kRows : seq) - 1;
    __syncthreads();
    LoadRows<D>(head, c3, qt, last, qs);
    LoadRows<D>(dattn + row0 * width + h * D, width, qt, last, dos);
    for (int x = threadIdx.x; x < kRows; x += kThreads) {
      const int row = qt + x;
      lse_s[x] = row <= last ? lse_row[row] : 0.0f;
      delta_s[x] = row <= last ? delta_row[row] : 0.0f;
      ds_s[x] = row <= last ? ds[row] : seq;
    }
    __syncthreads();
    if (j0 + warp * 16 > last) continue;  // the warp's keys come after every query here
    TimesTileTransposed<D>(k, qs, s_stage);
    TimesTileTransposed<D>(v, dos, dp_stage);
    __syncwarp();
#pragma unroll
    for (int c = 0; c < kRows / 2; ++c) {
      const int col = half * (kRows / 2) + c, iq = qt + col;
      const float p = valid && iq <= last && iq >= j && ds_s[col] <= j
                          ? expf(s_stage[r * L::kLs + col] * scale - lse_s[col])
                          : 0.0f;
      pts[r * L::kLp + col] = __float2bfloat16(p);
      dsts[r * L::kLp + col] = __float2bfloat16(p * (dp_stage[r * L::kLs + col] - delta_s[col]));
    }
    __syncwarp();
    AddTimesTile<D>(pts, dos, dv);
    AddTimesTile<D>(dsts, qs, dk);
  }
  __syncwarp();
  Stage<D>(dk, s_stage);
  Stage<D>(dv, dp_stage);
  __syncwarp();
  if (!valid) return;
  float* out = dqkv + (row0 + j) * c3 + h * D + half * (D / 2);
#pragma unroll
  for (int d = 0; d < D / 2; ++d) {
    out[width + d] = s_stage[r * L::kLs + half * (D / 2) + d] * scale;
    out[2 * width + d] = dp_stage[r * L::kLs + half * (D / 2) + d];
  }
}

// Opts the kernel in to `bytes` of dynamic shared memory (above 48 KiB needs it) and
// launches it over (seq / 64, batch * heads) blocks.
template <typename... P, typename... A>
cudaError_t LaunchTensorCore(void (*kernel)(P...), size_t bytes, int batch, int seq, int heads,
                             cudaStream_t stream, A&&... args) {
  if (cudaError_t e = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(bytes));
      e != cudaSuccess) {
    return e;
  }
  const dim3 grid((seq + kRows - 1) / kRows, static_cast<unsigned>(batch * heads));
  Launch(kernel, grid, kThreads, bytes, stream)(std::forward<A>(args)...);
  return cudaGetLastError();
}

template <int D>
cudaError_t ForwardTensorCore(int batch, int seq, int heads, float scale, const float* qkv,
                              const int32_t* doc_start, float* attn, float* lse,
                              cudaStream_t stream) {
  using L = Smem<D>;
  const size_t bytes = 3 * L::kTile + kWarps * (L::kStage + L::kWarpTile);
  return LaunchTensorCore(ForwardTensorCoreKernel<D>, bytes, batch, seq, heads, stream, seq, heads,
                          heads * D, scale, qkv, doc_start, attn, lse);
}

template <int D>
cudaError_t BackwardTensorCore(int batch, int seq, int heads, float scale, const float* qkv,
                               const int32_t* doc_start, const float* lse, const float* dattn,
                               const float* delta, float* dqkv, cudaStream_t stream) {
  using L = Smem<D>;
  const size_t dq_bytes = 4 * L::kTile + kWarps * (2 * L::kStage + L::kWarpTile);
  if (cudaError_t e =
          LaunchTensorCore(QueryGradTensorCoreKernel<D>, dq_bytes, batch, seq, heads, stream, seq,
                           heads, heads * D, scale, qkv, doc_start, lse, dattn, delta, dqkv);
      e != cudaSuccess) {
    return e;
  }
  const size_t dkv_bytes =
      4 * L::kTile + 3 * L::kRowFloats + kWarps * (2 * L::kStage + 2 * L::kWarpTile);
  return LaunchTensorCore(KeyValueGradTensorCoreKernel<D>, dkv_bytes, batch, seq, heads, stream,
                          seq, heads, heads * D, scale, qkv, doc_start, lse, dattn, delta, dqkv);
}

}  // namespace

cudaError_t TensorCoreForward(int batch, int seq, int heads, int head_dim, float scale,
                              const float* qkv, const int32_t* doc_start, float* attn, float* lse,
                              cudaStream_t stream) {
  switch (head_dim) {
    case 16:
      return ForwardTensorCore<16>(batch, seq, heads, scale, qkv, doc_start, attn, lse, stream);
    case 32:
      return ForwardTensorCore<32>(batch, seq, heads, scale, qkv, doc_start, attn, lse, stream);
    case 64:
      return ForwardTensorCore<64>(batch, seq, heads, scale, qkv, doc_start, attn, lse, stream);
    case 128:
      return ForwardTensorCore<128>(batch, seq, heads, scale, qkv, doc_start, attn, lse, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t TensorCoreBackward(int batch, int seq, int heads, int head_dim, float scale,
                               const float* qkv, const int32_t* doc_start, const float* lse,
                               const float* dattn, const float* delta, float* dqkv,
                               cudaStream_t stream) {
  switch (head_dim) {
    case 16:
      return BackwardTensorCore<16>(batch, seq, heads, scale, qkv, doc_start, lse, dattn, delta,
                                    dqkv, stream);
    case 32:
      return BackwardTensorCore<32>(batch, seq, heads, scale, qkv, doc_start, lse, dattn, delta,
                                    dqkv, stream);
    case 64:
      return BackwardTensorCore<64>(batch, seq, heads, scale, qkv, doc_start, lse, dattn, delta,
                                    dqkv, stream);
    case 128:
      return BackwardTensorCore<128>(batch, seq, heads, scale, qkv, doc_start, lse, dattn, delta,
                                     dqkv, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace rackrun::runtime::cuda::attention
