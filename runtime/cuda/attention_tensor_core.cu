// Tensor-core attention: attention_kernels.h's Cores::kTensorBf16 and kTensorTf32 (its header
// says the contract). Checked against runtime/layers/attention.cc and the fp32 kernels by
// runtime/cuda/attention_test.cc.
//
// Work split: a block of 4 warps owns 64 rows (queries; keys in the dK/dV kernel), 16 per
// warp; the other side streams through shared memory in tiles of 64 rows, rounded to the
// operand type (bf16, or TF32 kept in floats) as they are loaded. Each product (S = Q K^T,
// O += P V, dP = dO V^T, dQ += dS K, dV += P^T dO, dK += dS^T Q) is a run of warp matrix
// operations (wmma: 16 x 16 x 16 for bf16, 16 x 16 x 8 for TF32; fp32 accumulation). The
// softmax and its gradient run in fp32 on the scores staged in shared memory, two lanes per
// row (a fragment's element layout is unspecified, so row-wise work goes through memory);
// the output accumulators are rescaled through the same staging. As in
// attention_kernels.cu, no atomics: one kernel owns each query row's dQ, another each key
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

#include "runtime/cuda/attention_grid.cuh"
#include "runtime/cuda/attention_kernels.h"
#include "runtime/cuda/launch.cuh"

namespace rackrun::runtime::cuda::attention {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kWarp = 32;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarp;
constexpr int kRows = 16 * kWarps;  // rows a block owns, and rows per streamed tile
constexpr int kHalf = kRows / 2;    // columns of a staged row per lane
constexpr unsigned kAll = 0xffffffffu;

// The operands: bf16 (m16n16k16, bf16 in shared memory) or TF32 (m16n16k8, floats rounded
// to TF32 in shared memory).
struct Bf16Ops {
  using T = __nv_bfloat16;
  static constexpr int kK = 16;
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
  using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
  using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
  using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  static __device__ __forceinline__ T From(float v) { return __float2bfloat16(v); }
};
struct Tf32Ops {
  using T = float;
  static constexpr int kK = 8;
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
  using FragBRow =
      wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
  using FragBCol =
      wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major>;
  using FragC = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;
  static __device__ __forceinline__ T From(float v) { return wmma::__float_to_tf32(v); }
};

// Head dim D with operands Ops: the loop counts and the shared-memory layout (operand row
// tiles [kRows x D]; per warp fp32 staging areas [16 x max(kRows, D)] and operand tiles [16 x
// kRows]; rows padded against bank conflicts; every array 128-byte aligned, as wmma needs
// 256-bit aligned tiles).
template <int D, typename Ops>
struct Shape {
  using T = typename Ops::T;
  static constexpr int kDK = D / Ops::kK;      // k-steps over the head dim
  static constexpr int kRK = kRows / Ops::kK;  // k-steps over a tile's rows
  static constexpr int kDN = D / 16;           // 16-column blocks of the head dim
  static constexpr int kLd = D + 8;
  static constexpr int kLs = (kRows > D ? kRows : D) + 8;
  static constexpr int kLp = kRows + 8;
  static constexpr size_t Align(size_t b) { return (b + 127) / 128 * 128; }
  static constexpr size_t kTile = Align(size_t{kRows} * kLd * sizeof(T));
  static constexpr size_t kStage = Align(size_t{16} * kLs * sizeof(float));
  static constexpr size_t kWarpTile = Align(size_t{16} * kLp * sizeof(T));
  static constexpr size_t kRowFloats = Align(size_t{kRows} * sizeof(float));
  // The backward writes its per-warp operand tiles (dS, P^T) over the staged scores they
  // come from.
  static_assert(kWarpTile <= kStage);
  static constexpr size_t kForwardBytes = 3 * kTile + kWarps * (kStage + kWarpTile);
  static constexpr size_t kQueryGradBytes = 4 * kTile + kWarps * 2 * kStage;
  static constexpr size_t kKeyValueGradBytes = 4 * kTile + 3 * kRowFloats + kWarps * 2 * kStage;
};

// Rows [first, first + kRows) of a [.. x stride] fp32 matrix's columns [0, D), rounded to the
// operands' type (rows past `last` zero). Every thread of the block takes part.
template <int D, typename Ops>
__device__ __forceinline__ void LoadRows(const float* base, int64_t stride, int first, int last,
                                         typename Ops::T* tile) {
  for (int x = threadIdx.x; x < kRows * D; x += kThreads) {
    const int r = x / D, d = x % D;
    const int row = first + r;
    tile[r * Shape<D, Ops>::kLd + d] =
        Ops::From(row <= last ? base[static_cast<int64_t>(row) * stride + d] : 0.0f);
  }
}

// stage [16 x kRows] = rows (16 x D: a warp's rows of a row tile) times tile^T (tile:
// [kRows x D]): S = Q K^T and the like. The A operand is read from shared memory at each use
// rather than held in registers (which the accumulators need).
template <int D, typename Ops>
__device__ __forceinline__ void TimesTileTransposed(const typename Ops::T* rows,
                                                    const typename Ops::T* tile, float* stage) {
  using S = Shape<D, Ops>;
#pragma unroll 1  // one accumulator live at a time (registers: the caller's accumulators)
  for (int n = 0; n < kRows / 16; ++n) {
    typename Ops::FragC acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int kk = 0; kk < S::kDK; ++kk) {
      typename Ops::FragA a;
      typename Ops::FragBCol b;
      wmma::load_matrix_sync(a, rows + kk * Ops::kK, S::kLd);
      wmma::load_matrix_sync(b, tile + n * 16 * S::kLd + kk * Ops::kK, S::kLd);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(stage + n * 16, acc, S::kLs, wmma::mem_row_major);
  }
}

// acc (16 x D) += p (a warp's operand tile [16 x kRows]) times tile ([kRows x D]): O += P V
// and the like.
template <int D, typename Ops>
__device__ __forceinline__ void AddTimesTile(const typename Ops::T* p, const typename Ops::T* tile,
                                             typename Ops::FragC (&acc)[Shape<D, Ops>::kDN]) {
  using S = Shape<D, Ops>;
#pragma unroll 1
  for (int kk = 0; kk < S::kRK; ++kk) {
    typename Ops::FragA a;
    wmma::load_matrix_sync(a, p + kk * Ops::kK, S::kLp);
#pragma unroll
    for (int n = 0; n < S::kDN; ++n) {
      typename Ops::FragBRow b;
      wmma::load_matrix_sync(b, tile + kk * Ops::kK * S::kLd + n * 16, S::kLd);
      wmma::mma_sync(acc[n], a, b, acc[n]);
    }
  }
}

// acc (16 x D) into the warp's staging area (row-major); the caller syncs the warp first.
template <int D, typename Ops>
__device__ __forceinline__ void Stage(const typename Ops::FragC (&acc)[Shape<D, Ops>::kDN],
                                      float* stage) {
  using S = Shape<D, Ops>;
#pragma unroll
  for (int n = 0; n < S::kDN; ++n) {
    wmma::store_matrix_sync(stage + n * 16, acc[n], S::kLs, wmma::mem_row_major);
  }
}

template <int D, typename Ops>
__device__ __forceinline__ void ZeroAll(typename Ops::FragC (&acc)[Shape<D, Ops>::kDN]) {
#pragma unroll
  for (int n = 0; n < Shape<D, Ops>::kDN; ++n) wmma::fill_fragment(acc[n], 0.0f);
}

// Where a block works: its warp and lane, its (batch row, head) bh (blockIdx.x), and that row's
// offsets: row0 (its first token), c3 (qkv's row stride), ds (its doc starts), head (q of
// its token 0 for head h; k at + width, v at + 2 width).
struct Place {
  int warp, lane, bh, h;
  int64_t c3, row0;
  const int32_t* ds;
  const float* head;
};

template <int D>
__device__ __forceinline__ Place PlaceOf(int seq, int heads, int width, const float* qkv,
                                         const int32_t* doc_start) {
  Place p;
  p.warp = static_cast<int>(threadIdx.x) / kWarp;
  p.lane = static_cast<int>(threadIdx.x) % kWarp;
  p.bh = blockIdx.x;
  p.h = p.bh % heads;
  p.c3 = 3 * static_cast<int64_t>(width);
  p.row0 = static_cast<int64_t>(p.bh / heads) * seq;
  p.ds = doc_start + p.row0;
  p.head = qkv + p.row0 * p.c3 + p.h * D;
  return p;
}

// The forward: per key tile S = Q K^T, the online softmax (running max m and sum l per row,
// two lanes per row), O rescaled and O += P V.
template <int D, typename Ops>
__global__ void __launch_bounds__(kThreads)
    ForwardTensorCoreKernel(int seq, int heads, int width, float scale,
                            const float* __restrict__ qkv, const int32_t* __restrict__ doc_start,
                            float* __restrict__ attn, float* __restrict__ lse) {
  using S = Shape<D, Ops>;
  using T = typename Ops::T;
  RACKRUN_DYNAMIC_SHARED_ALIGNED(unsigned char, smem, 128);
  const auto [warp, lane, bh, h, c3, row0, ds, head] =
      PlaceOf<D>(seq, heads, width, qkv, doc_start);
  T* qs = reinterpret_cast<T*>(smem);
  T* ks = reinterpret_cast<T*>(smem + S::kTile);
  T* vs = reinterpret_cast<T*>(smem + 2 * S::kTile);
  float* stage = reinterpret_cast<float*>(smem + 3 * S::kTile + warp * S::kStage);
  T* ps = reinterpret_cast<T*>(smem + 3 * S::kTile + kWarps * S::kStage + warp * S::kWarpTile);
  const int i0 = QueryTile() * kRows;
  const int last = (i0 + kRows < seq ? i0 + kRows : seq) - 1;
  LoadRows<D, Ops>(head, c3, i0, last, qs);
  __syncthreads();
  const T* q = qs + warp * 16 * S::kLd;  // the warp's query rows
  typename Ops::FragC o[S::kDN];
  ZeroAll<D, Ops>(o);
  const int r = lane / 2, half = lane % 2;  // this lane's row and half of the columns
  const int i = i0 + warp * 16 + r;
  const bool valid = i <= last;
  const int first_key = ds[valid ? i : last];
  const int warp_last = i0 + warp * 16 + 15 < last ? i0 + warp * 16 + 15 : last;
  float m = -INFINITY, l = 0.0f;
  // doc_start is nondecreasing: the block's first row has the smallest.
  for (int kt = ds[i0]; kt <= last; kt += kRows) {
    __syncthreads();  // the last tile's readers are done
    LoadRows<D, Ops>(head + width, c3, kt, last, ks);
    LoadRows<D, Ops>(head + 2 * width, c3, kt, last, vs);
    __syncthreads();
    if (kt > warp_last) continue;  // every key after the warp's rows (warp-uniform)
    TimesTileTransposed<D, Ops>(q, ks, stage);
    __syncwarp();
    float s[kHalf];
    float tile_max = -INFINITY;
#pragma unroll
    for (int c = 0; c < kHalf; ++c) {
      const int col = half * kHalf + c, j = kt + col;
      s[c] = valid && j >= first_key && j <= i ? stage[r * S::kLs + col] * scale : -INFINITY;
      tile_max = fmaxf(tile_max, s[c]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kAll, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    // A row with nothing to attend yet keeps m = -inf: its p are 0, its O stays 0.
    const bool none = m_new == -INFINITY;
    const float corr = none ? 1.0f : expf(m - m_new);
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kHalf; ++c) {
      const float p = none ? 0.0f : expf(s[c] - m_new);
      sum += p;
      ps[r * S::kLp + half * kHalf + c] = Ops::From(p);
    }
    l = l * corr + sum + __shfl_xor_sync(kAll, sum, 1);
    m = m_new;
    __syncwarp();  // S read by every lane before O is staged over it
    Stage<D, Ops>(o, stage);
    __syncwarp();
#pragma unroll
    for (int d = 0; d < D / 2; ++d) stage[r * S::kLs + half * (D / 2) + d] *= corr;
    __syncwarp();
#pragma unroll
    for (int n = 0; n < S::kDN; ++n) {
      wmma::load_matrix_sync(o[n], stage + n * 16, S::kLs, wmma::mem_row_major);
    }
    AddTimesTile<D, Ops>(ps, vs, o);
  }
  __syncwarp();
  Stage<D, Ops>(o, stage);
  __syncwarp();
  if (!valid) return;
  const float inv = 1.0f / l;
  float* out = attn + (row0 + i) * width + h * D + half * (D / 2);
#pragma unroll
  for (int d = 0; d < D / 2; ++d) out[d] = stage[r * S::kLs + half * (D / 2) + d] * inv;
  if (half == 0) lse[static_cast<int64_t>(bh) * seq + i] = m + logf(l);
}

// dQ: per key tile S = Q K^T, dP = dO V^T, p = exp(scale S - lse), dS = p (dP - delta) (over
// the staged S once read), dQ += dS K; written times scale.
template <int D, typename Ops>
__global__ void __launch_bounds__(kThreads)
    QueryGradTensorCoreKernel(int seq, int heads, int width, float scale,
                              const float* __restrict__ qkv, const int32_t* __restrict__ doc_start,
                              const float* __restrict__ lse, const float* __restrict__ dattn,
                              const float* __restrict__ delta, float* __restrict__ dqkv) {
  using S = Shape<D, Ops>;
  using T = typename Ops::T;
  RACKRUN_DYNAMIC_SHARED_ALIGNED(unsigned char, smem, 128);
  const auto [warp, lane, bh, h, c3, row0, ds, head] =
      PlaceOf<D>(seq, heads, width, qkv, doc_start);
  T* qs = reinterpret_cast<T*>(smem);
  T* dos = reinterpret_cast<T*>(smem + S::kTile);
  T* ks = reinterpret_cast<T*>(smem + 2 * S::kTile);
  T* vs = reinterpret_cast<T*>(smem + 3 * S::kTile);
  unsigned char* mine = smem + 4 * S::kTile + warp * 2 * S::kStage;
  float* s_stage = reinterpret_cast<float*>(mine);
  float* dp_stage = reinterpret_cast<float*>(mine + S::kStage);
  T* dss = reinterpret_cast<T*>(mine);  // over s_stage, once read
  const int i0 = QueryTile() * kRows;
  const int last = (i0 + kRows < seq ? i0 + kRows : seq) - 1;
  LoadRows<D, Ops>(head, c3, i0, last, qs);
  LoadRows<D, Ops>(dattn + row0 * width + h * D, width, i0, last, dos);
  __syncthreads();
  const T* q = qs + warp * 16 * S::kLd;  // the warp's query rows and their dO
  const T* d_o = dos + warp * 16 * S::kLd;
  typename Ops::FragC dq[S::kDN];
  ZeroAll<D, Ops>(dq);
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
    LoadRows<D, Ops>(head + width, c3, kt, last, ks);
    LoadRows<D, Ops>(head + 2 * width, c3, kt, last, vs);
    __syncthreads();
    if (kt > warp_last) continue;
    TimesTileTransposed<D, Ops>(q, ks, s_stage);
    TimesTileTransposed<D, Ops>(d_o, vs, dp_stage);
    __syncwarp();
    float dsv[kHalf];
#pragma unroll
    for (int c = 0; c < kHalf; ++c) {
      const int col = half * kHalf + c, j = kt + col;
      const float p = valid && j >= first_key && j <= i
                          ? expf(s_stage[r * S::kLs + col] * scale - row_lse)
                          : 0.0f;
      dsv[c] = p * (dp_stage[r * S::kLs + col] - row_delta);
    }
    __syncwarp();  // every lane has read S before dS goes over it
#pragma unroll
    for (int c = 0; c < kHalf; ++c) dss[r * S::kLp + half * kHalf + c] = Ops::From(dsv[c]);
    __syncwarp();
    AddTimesTile<D, Ops>(dss, ks, dq);
  }
  __syncwarp();
  Stage<D, Ops>(dq, s_stage);
  __syncwarp();
  if (!valid) return;
  float* out = dqkv + (row0 + i) * c3 + h * D + half * (D / 2);
#pragma unroll
  for (int d = 0; d < D / 2; ++d) out[d] = s_stage[r * S::kLs + half * (D / 2) + d] * scale;
}

// dK, dV: a block owns 64 keys; the queries that attend them (doc_start[i] <= j <= i)
// stream through with their dO, lse and delta. S^T = K Q^T, dP^T = V dO^T, P^T and dS^T per
// (key, query) over the staged scores once read, dV += P^T dO, dK += dS^T Q (written times
// scale).
template <int D, typename Ops>
__global__ void __launch_bounds__(kThreads)
    KeyValueGradTensorCoreKernel(int seq, int heads, int width, float scale,
                                 const float* __restrict__ qkv,
                                 const int32_t* __restrict__ doc_start,
                                 const float* __restrict__ lse, const float* __restrict__ dattn,
                                 const float* __restrict__ delta, float* __restrict__ dqkv) {
  using S = Shape<D, Ops>;
  using T = typename Ops::T;
  RACKRUN_DYNAMIC_SHARED_ALIGNED(unsigned char, smem, 128);
  const auto [warp, lane, bh, h, c3, row0, ds, head] =
      PlaceOf<D>(seq, heads, width, qkv, doc_start);
  T* kown = reinterpret_cast<T*>(smem);
  T* vown = reinterpret_cast<T*>(smem + S::kTile);
  T* qs = reinterpret_cast<T*>(smem + 2 * S::kTile);
  T* dos = reinterpret_cast<T*>(smem + 3 * S::kTile);
  unsigned char* rows = smem + 4 * S::kTile;
  float* lse_s = reinterpret_cast<float*>(rows);
  float* delta_s = reinterpret_cast<float*>(rows + S::kRowFloats);
  int32_t* ds_s = reinterpret_cast<int32_t*>(rows + 2 * S::kRowFloats);
  unsigned char* mine = rows + 3 * S::kRowFloats + warp * 2 * S::kStage;
  float* s_stage = reinterpret_cast<float*>(mine);
  float* dp_stage = reinterpret_cast<float*>(mine + S::kStage);
  T* pts = reinterpret_cast<T*>(mine);               // over s_stage, once read
  T* dsts = reinterpret_cast<T*>(mine + S::kStage);  // over dp_stage, once read
  const int j0 = KeyTile() * kRows;
  const int last_key = (j0 + kRows < seq ? j0 + kRows : seq) - 1;
  LoadRows<D, Ops>(head + width, c3, j0, last_key, kown);
  LoadRows<D, Ops>(head + 2 * width, c3, j0, last_key, vown);
  __syncthreads();
  const T* k = kown + warp * 16 * S::kLd;  // the warp's key rows and their values
  const T* v = vown + warp * 16 * S::kLd;
  typename Ops::FragC dk[S::kDN], dv[S::kDN];
  ZeroAll<D, Ops>(dk);
  ZeroAll<D, Ops>(dv);
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
    LoadRows<D, Ops>(head, c3, qt, last, qs);
    LoadRows<D, Ops>(dattn + row0 * width + h * D, width, qt, last, dos);
    for (int x = threadIdx.x; x < kRows; x += kThreads) {
      const int row = qt + x;
      lse_s[x] = row <= last ? lse_row[row] : 0.0f;
      delta_s[x] = row <= last ? delta_row[row] : 0.0f;
      ds_s[x] = row <= last ? ds[row] : seq;
    }
    __syncthreads();
    if (j0 + warp * 16 > last) continue;  // the warp's keys come after every query here
    TimesTileTransposed<D, Ops>(k, qs, s_stage);
    TimesTileTransposed<D, Ops>(v, dos, dp_stage);
    __syncwarp();
    float pv[kHalf], dsv[kHalf];
#pragma unroll
    for (int c = 0; c < kHalf; ++c) {
      const int col = half * kHalf + c, iq = qt + col;
      pv[c] = valid && iq <= last && iq >= j && ds_s[col] <= j
                  ? expf(s_stage[r * S::kLs + col] * scale - lse_s[col])
                  : 0.0f;
      dsv[c] = pv[c] * (dp_stage[r * S::kLs + col] - delta_s[col]);
    }
    __syncwarp();  // every lane has read the stages before P^T and dS^T go over them
#pragma unroll
    for (int c = 0; c < kHalf; ++c) {
      pts[r * S::kLp + half * kHalf + c] = Ops::From(pv[c]);
      dsts[r * S::kLp + half * kHalf + c] = Ops::From(dsv[c]);
    }
    __syncwarp();
    AddTimesTile<D, Ops>(pts, dos, dv);
    AddTimesTile<D, Ops>(dsts, qs, dk);
  }
  __syncwarp();
  Stage<D, Ops>(dk, s_stage);
  Stage<D, Ops>(dv, dp_stage);
  __syncwarp();
  if (!valid) return;
  float* out = dqkv + (row0 + j) * c3 + h * D + half * (D / 2);
#pragma unroll
  for (int d = 0; d < D / 2; ++d) {
    out[width + d] = s_stage[r * S::kLs + half * (D / 2) + d] * scale;
    out[2 * width + d] = dp_stage[r * S::kLs + half * (D / 2) + d];
  }
}

// Opts the kernel in to `bytes` of dynamic shared memory (above 48 KiB needs it) and
// launches it over AttentionGrid (batch * heads, seq / 64 blocks).
template <typename... P, typename... A>
cudaError_t LaunchTensorCore(void (*kernel)(P...), size_t bytes, int batch, int seq, int heads,
                             cudaStream_t stream, A&&... args) {
  if (cudaError_t e = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(bytes));
      e != cudaSuccess) {
    return e;
  }
  Launch(kernel, AttentionGrid(batch, heads, seq, kRows), kThreads, bytes,
         stream)(std::forward<A>(args)...);
  return cudaGetLastError();
}

template <int D, typename Ops>
cudaError_t ForwardFor(int batch, int seq, int heads, float scale, const float* qkv,
                       const int32_t* doc_start, float* attn, float* lse, cudaStream_t stream) {
  return LaunchTensorCore(ForwardTensorCoreKernel<D, Ops>, Shape<D, Ops>::kForwardBytes, batch, seq,
                          heads, stream, seq, heads, heads * D, scale, qkv, doc_start, attn, lse);
}

template <int D, typename Ops>
cudaError_t BackwardFor(int batch, int seq, int heads, float scale, const float* qkv,
                        const int32_t* doc_start, const float* lse, const float* dattn,
                        const float* delta, float* dqkv, cudaStream_t stream) {
  using S = Shape<D, Ops>;
  if (cudaError_t e = LaunchTensorCore(QueryGradTensorCoreKernel<D, Ops>, S::kQueryGradBytes, batch,
                                       seq, heads, stream, seq, heads, heads * D, scale, qkv,
                                       doc_start, lse, dattn, delta, dqkv);
      e != cudaSuccess) {
    return e;
  }
  return LaunchTensorCore(KeyValueGradTensorCoreKernel<D, Ops>, S::kKeyValueGradBytes, batch, seq,
                          heads, stream, seq, heads, heads * D, scale, qkv, doc_start, lse, dattn,
                          delta, dqkv);
}

template <typename Ops>
cudaError_t ForwardOps(int batch, int seq, int heads, int head_dim, float scale, const float* qkv,
                       const int32_t* doc_start, float* attn, float* lse, cudaStream_t stream) {
  switch (head_dim) {
    case 16:
      return ForwardFor<16, Ops>(batch, seq, heads, scale, qkv, doc_start, attn, lse, stream);
    case 32:
      return ForwardFor<32, Ops>(batch, seq, heads, scale, qkv, doc_start, attn, lse, stream);
    case 64:
      return ForwardFor<64, Ops>(batch, seq, heads, scale, qkv, doc_start, attn, lse, stream);
    case 128:
      return ForwardFor<128, Ops>(batch, seq, heads, scale, qkv, doc_start, attn, lse, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename Ops>
cudaError_t BackwardOps(int batch, int seq, int heads, int head_dim, float scale, const float* qkv,
                        const int32_t* doc_start, const float* lse, const float* dattn,
                        const float* delta, float* dqkv, cudaStream_t stream) {
  switch (head_dim) {
    case 16:
      return BackwardFor<16, Ops>(batch, seq, heads, scale, qkv, doc_start, lse, dattn, delta, dqkv,
                                  stream);
    case 32:
      return BackwardFor<32, Ops>(batch, seq, heads, scale, qkv, doc_start, lse, dattn, delta, dqkv,
                                  stream);
    case 64:
      return BackwardFor<64, Ops>(batch, seq, heads, scale, qkv, doc_start, lse, dattn, delta, dqkv,
                                  stream);
    case 128:
      return BackwardFor<128, Ops>(batch, seq, heads, scale, qkv, doc_start, lse, dattn, delta,
                                   dqkv, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t TensorCoreForward(Cores cores, int batch, int seq, int heads, int head_dim, float scale,
                              const float* qkv, const int32_t* doc_start, float* attn, float* lse,
                              cudaStream_t stream) {
  if (cores == Cores::kTensorTf32) {
    return ForwardOps<Tf32Ops>(batch, seq, heads, head_dim, scale, qkv, doc_start, attn, lse,
                               stream);
  }
  return ForwardOps<Bf16Ops>(batch, seq, heads, head_dim, scale, qkv, doc_start, attn, lse, stream);
}

cudaError_t TensorCoreBackward(Cores cores, int batch, int seq, int heads, int head_dim,
                               float scale, const float* qkv, const int32_t* doc_start,
                               const float* lse, const float* dattn, const float* delta,
                               float* dqkv, cudaStream_t stream) {
  if (cores == Cores::kTensorTf32) {
    return BackwardOps<Tf32Ops>(batch, seq, heads, head_dim, scale, qkv, doc_start, lse, dattn,
                                delta, dqkv, stream);
  }
  return BackwardOps<Bf16Ops>(batch, seq, heads, head_dim, scale, qkv, doc_start, lse, dattn, delta,
                              dqkv, stream);
}

}  // namespace rackrun::runtime::cuda::attention
