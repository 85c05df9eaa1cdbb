// Device code of the xhc stream kernels (runtime/cuda/xhc_kernels.h). One block per token
// for the per-token stages: the block's threads split the width C (or N x C) and meet in
// block-wide sums; every thread works only on its own elements between those sums, so the
// per-element arithmetic is the CPU's sequential form (runtime/residual/xhc.cc), in the
// same order of terms; dot products are summed in another order (a fixed tree).
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "runtime/cuda/launch.cuh"
#include "runtime/cuda/reduce.cuh"
#include "runtime/cuda/xhc_kernels.h"

namespace rackrun::runtime::cuda::xhc {
namespace {

using detail::BlockSum;
using detail::FromF;
using detail::kWarp;
using detail::Sigmoid;
using detail::ToF;

constexpr int kRowThreads = 256;                       // per-token kernels over N x C
constexpr int kMaxR = kMaxK * kMaxK + kMaxK * kMaxKr;  // dot products of the write's backward
constexpr int kLevels = kMaxJ * (kMaxJ + 1) / 2;       // Gram-Schmidt levels W(m, i), i < m
// Tokens per chunk of the convolution weights' first reduction pass.
constexpr int64_t kTokenChunk = 256;

// ---------------------------------------------------------------- Sinkhorn

// runtime/residual/sinkhorn.cc, one matrix on one thread. tape (nullable): M0 (nn), then per
// iteration B (nn, after the column step), column sums (n), row sums (n).
__device__ void SinkhornForward(int n, int iters, const float* z, float* h, float* tape) {
  float m[kMaxSinkhornN * kMaxSinkhornN];
  const int nn = n * n;
  for (int a = 0; a < n; ++a) {
    float mx = z[a * n];
    for (int b = 1; b < n; ++b) mx = mx < z[a * n + b] ? z[a * n + b] : mx;
    for (int b = 0; b < n; ++b) m[a * n + b] = expf(z[a * n + b] - mx);
  }
  float* step = tape;
  if (step != nullptr) {
    for (int e = 0; e < nn; ++e) step[e] = m[e];
    step += nn;
  }
  for (int it = 0; it < iters; ++it) {
    for (int b = 0; b < n; ++b) {
      float c = 0;
      for (int a = 0; a < n; ++a) c += m[a * n + b];
      if (step != nullptr) step[nn + b] = c;
      const float d = c + kSinkhornEps;
      for (int a = 0; a < n; ++a) m[a * n + b] /= d;
    }
    if (step != nullptr)
      for (int e = 0; e < nn; ++e) step[e] = m[e];
    for (int a = 0; a < n; ++a) {
      float s = 0;
      for (int b = 0; b < n; ++b) s += m[a * n + b];
      if (step != nullptr) step[nn + n + a] = s;
      const float d = s + kSinkhornEps;
      for (int b = 0; b < n; ++b) m[a * n + b] /= d;
    }
    if (step != nullptr) step += nn + 2 * n;
  }
  for (int e = 0; e < nn; ++e) h[e] = m[e];
}

__device__ void SinkhornBackward(int n, int iters, const float* z, const float* tape,
                                 const float* dh, float* dz) {
  float g[kMaxSinkhornN * kMaxSinkhornN];
  const int nn = n * n;
  for (int e = 0; e < nn; ++e) g[e] = dh[e];
  for (int it = iters - 1; it >= 0; --it) {
    const float* b_mat = tape + nn + static_cast<int64_t>(it) * (nn + 2 * n);
    const float* c = b_mat + nn;
    const float* r = b_mat + nn + n;
    for (int a = 0; a < n; ++a) {
      const float inv = 1.0f / (r[a] + kSinkhornEps);
      float gy = 0;
      for (int b = 0; b < n; ++b) gy += g[a * n + b] * (b_mat[a * n + b] * inv);
      for (int b = 0; b < n; ++b) g[a * n + b] = (g[a * n + b] - gy) * inv;
    }
    for (int b = 0; b < n; ++b) {
      const float inv = 1.0f / (c[b] + kSinkhornEps);
      float gy = 0;
      for (int a = 0; a < n; ++a) gy += g[a * n + b] * b_mat[a * n + b];
      for (int a = 0; a < n; ++a) g[a * n + b] = (g[a * n + b] - gy) * inv;
    }
  }
  for (int e = 0; e < nn; ++e) g[e] *= tape[e];
  for (int a = 0; a < n; ++a) {
    int arg = 0;
    for (int b = 1; b < n; ++b)
      if (z[a * n + b] > z[a * n + arg]) arg = b;
    float total = 0;
    for (int b = 0; b < n; ++b) {
      dz[a * n + b] = g[a * n + b];
      total += g[a * n + b];
    }
    dz[a * n + arg] -= total;
  }
}

__global__ void SinkhornBatchKernel(int count, int n, int iters, const float* z, float* h,
                                    const float* dh, float* dz, float* tape, int64_t tape_floats) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const int nn = n * n;
  float* tp = tape + i * tape_floats;
  SinkhornForward(n, iters, z + i * nn, h + i * nn, tp);
  if (dh != nullptr) SinkhornBackward(n, iters, z + i * nn, tp, dh + i * nn, dz + i * nn);
}

// The same projection with a warp per matrix, for n up to kDenseMaxN (the thread-per-matrix form
// above keeps n x n values in one thread: 64 at n = 8, and its tape holds every iteration's
// matrix). Lane a < n holds row a in `row` (lanes from n on hold zeros); column sums are
// warp sums, row sums the lane's own. Every lane of the warp must call.
template <int NM>
__device__ __forceinline__ void WarpSinkhornStart(int n, float (&row)[NM]) {
  const int lane = threadIdx.x % kWarp;
  float mx = row[0];
#pragma unroll
  for (int b = 1; b < NM; ++b)
    if (b < n) mx = mx < row[b] ? row[b] : mx;
#pragma unroll
  for (int b = 0; b < NM; ++b) row[b] = lane < n && b < n ? expf(row[b] - mx) : 0.0f;
}

// One iteration's column step on `row`; lane b < n stores the column sum at cs[b] when cs is
// not null.
template <int NM>
__device__ __forceinline__ void WarpColumnStep(int n, float (&row)[NM], float* cs) {
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int b = 0; b < NM; ++b) {
    if (b >= n) break;
    const float c = detail::WarpSum(row[b]);
    if (cs != nullptr && lane == b) cs[b] = c;
    row[b] /= c + kSinkhornEps;
  }
}

// The row step; lane a < n stores its row sum at rs[a] when rs is not null.
template <int NM>
__device__ __forceinline__ void WarpRowStep(int n, float (&row)[NM], float* rs) {
  const int lane = threadIdx.x % kWarp;
  float s = 0;
#pragma unroll
  for (int b = 0; b < NM; ++b)
    if (b < n) s += row[b];
  if (rs != nullptr && lane < n) rs[lane] = s;
  if (lane >= n) return;
#pragma unroll
  for (int b = 0; b < NM; ++b)
    if (b < n) row[b] /= s + kSinkhornEps;
}

// row: the lane's logits in, its row of h = Sinkhorn(z) out.
template <int NM>
__device__ void WarpSinkhornForward(int n, int iters, float (&row)[NM]) {
  WarpSinkhornStart(n, row);
  for (int it = 0; it < iters; ++it) {
    WarpColumnStep(n, row, nullptr);
    WarpRowStep(n, row, nullptr);
  }
}

// g: the lane's row of dh in, of dz out; z: its logits. The forward is recomputed, keeping
// each iteration's column and row sums in `sums` (iters x 2n floats of scratch, each written
// and read back by the lane that owns it: no warp barrier needed) and the last column step's
// matrix B; the backward walks the iterations back, recovering the earlier B from the later
// one and the sums (B_{i-1} = B_i (c_i + eps) (r_{i-1} + eps), exact but for rounding).
template <int NM>
__device__ void WarpSinkhornBackward(int n, int iters, const float (&z)[NM], float (&g)[NM],
                                     float* sums) {
  const int lane = threadIdx.x % kWarp;
  float m[NM], b_mat[NM];
#pragma unroll
  for (int b = 0; b < NM; ++b) {
    m[b] = z[b];
    b_mat[b] = 0;
  }
  WarpSinkhornStart(n, m);
  for (int it = 0; it < iters; ++it) {
    float* cs = sums + static_cast<int64_t>(it) * 2 * n;
    WarpColumnStep(n, m, cs);
    if (it == iters - 1) {
#pragma unroll
      for (int b = 0; b < NM; ++b) b_mat[b] = m[b];
    }
    WarpRowStep(n, m, cs + n);
  }
  for (int it = iters - 1; it >= 0; --it) {
    const float* cs = sums + static_cast<int64_t>(it) * 2 * n;
    const float c_own = lane < n ? cs[lane] : 0.0f;
    // The row step's backward, in the lane.
    if (lane < n) {
      const float inv = 1.0f / (cs[n + lane] + kSinkhornEps);
      float gy = 0;
#pragma unroll
      for (int b = 0; b < NM; ++b)
        if (b < n) gy += g[b] * (b_mat[b] * inv);
#pragma unroll
      for (int b = 0; b < NM; ++b)
        if (b < n) g[b] = (g[b] - gy) * inv;
    }
    // The column step's backward: column dots over the warp; then B of the iteration before.
    const float r_prev = it > 0 && lane < n ? (cs - 2 * n)[n + lane] + kSinkhornEps : 0.0f;
#pragma unroll
    for (int b = 0; b < NM; ++b) {
      if (b >= n) break;
      const float gy = detail::WarpSum(g[b] * b_mat[b]);
      const float c = __shfl_sync(0xffffffffu, c_own, b) + kSinkhornEps;
      const float inv = 1.0f / c;
      if (lane < n) g[b] = (g[b] - gy) * inv;
      b_mat[b] = b_mat[b] * c * r_prev;
    }
  }
  // Through M0 = exp(z - max) (recomputed) to the logits.
#pragma unroll
  for (int b = 0; b < NM; ++b) m[b] = z[b];
  WarpSinkhornStart(n, m);
  int arg = 0;
  float best = z[0];
#pragma unroll
  for (int b = 1; b < NM; ++b) {
    if (b < n && z[b] > best) {
      best = z[b];
      arg = b;
    }
  }
  float total = 0;
#pragma unroll
  for (int b = 0; b < NM; ++b) {
    g[b] = b < n ? g[b] * m[b] : 0.0f;
    total += g[b];
  }
#pragma unroll
  for (int b = 0; b < NM; ++b)
    if (b == arg) g[b] -= total;
}

// SinkhornBatch above 8: a warp per matrix.
__global__ void WarpSinkhornBatchKernel(int count, int n, int iters, const float* z, float* h,
                                        const float* dh, float* dz, float* tape,
                                        int64_t tape_floats) {
  const int i = blockIdx.x * (blockDim.x / kWarp) + static_cast<int>(threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (i >= count) return;  // whole warps
  const int64_t nn = static_cast<int64_t>(n) * n;
  float row[kDenseMaxN], zr[kDenseMaxN], g[kDenseMaxN];
#pragma unroll
  for (int b = 0; b < kDenseMaxN; ++b) {
    zr[b] = lane < n && b < n ? z[i * nn + lane * n + b] : 0.0f;
    row[b] = zr[b];
    g[b] = dh != nullptr && lane < n && b < n ? dh[i * nn + lane * n + b] : 0.0f;
  }
  WarpSinkhornForward(n, iters, row);
  if (lane < n)
    for (int b = 0; b < n; ++b) h[i * nn + lane * n + b] = row[b];
  if (dh == nullptr) return;
  WarpSinkhornBackward(n, iters, zr, g, tape + i * tape_floats);
  if (lane < n)
    for (int b = 0; b < n; ++b) dz[i * nn + lane * n + b] = g[b];
}

// ---------------------------------------------------------------- read

__global__ void RouterColumnSumsKernel(int64_t nc, const float* w, float* colsum) {
  __shared__ float scratch[kWarp];
  const float* row = w + blockIdx.x * nc;
  float s = 0;
  for (int64_t e = threadIdx.x; e < nc; e += blockDim.x) s += row[e];
  s = detail::BlockSum1(s, scratch);
  if (threadIdx.x == 0) colsum[blockIdx.x] = s;
}

// XhcImpl::TopK: the routed streams by descending score, ties to the lower index, then
// ascending; the m fixed streams first.
__device__ void TopK(const Layout& l, const float* score, int32_t* idx) {
  const int want = l.k - l.m;
  int sel[kMaxK];
  int count = 0;
  for (int i = l.m; i < l.N; ++i) {
    int pos = count;
    while (pos > 0 && score[i] > score[sel[pos - 1]]) --pos;
    if (pos >= want) continue;
    const int end = count < want - 1 ? count : want - 1;
    for (int q = end; q > pos; --q) sel[q] = sel[q - 1];
    sel[pos] = i;
    count = count + 1 < want ? count + 1 : want;
  }
  for (int a = 1; a < count; ++a)  // insertion sort, ascending
    for (int b = a; b > 0 && sel[b - 1] > sel[b]; --b) {
      const int s = sel[b];
      sel[b] = sel[b - 1];
      sel[b - 1] = s;
    }
  for (int j = 0; j < l.m; ++j) idx[j] = j;
  for (int j = 0; j < count; ++j) idx[l.m + j] = sel[j];
}

template <typename S>
__global__ void __launch_bounds__(kRowThreads)
    ReadEntryKernel(Layout l, const S* x, const float* z, const float* colsum, MapParams p,
                    float* rec, int32_t* idx, float* u, float* base, S* saved, float* coef) {
  __shared__ float scratch[2 * kWarp];
  // hpre[s * kMaxN + i]: H_pre of sublayer s of the group; for s > 0 zero on the active
  // streams (the coefficients of the non-active bases).
  __shared__ float hpre[kMaxG * kMaxN];
  __shared__ int sidx[kMaxK];
  const int64_t t = blockIdx.x;
  const int N = l.N, C = l.C, k = l.k;
  const int64_t nc = static_cast<int64_t>(N) * C;
  const S* xt = x + t * nc;
  float mom[2] = {0, 0};
  for (int64_t e = threadIdx.x; e < nc; e += blockDim.x) {
    const float v = ToF(xt[e]);
    mom[0] += v;
    mom[1] += v * v;
  }
  BlockSum<float, 2>(mom, scratch);
  if (threadIdx.x == 0) {
    float* r = rec + t * l.RecStride();
    const float D = static_cast<float>(nc);
    const float mu = mom[0] / D;
    const float var = fmaxf(mom[1] / D - mu * mu, 0.0f);
    const float sd = sqrtf(var + kNormEps);
    const float rms = sqrtf(mom[1] / D + kNormEps);
    r[Layout::kMu] = mu;
    r[Layout::kSd] = sd;
    r[Layout::kRms] = rms;
    const float* zt = z + t * l.P1();
    float score[kMaxN];
    for (int q = 0; q < N; ++q) {
      const float yr = (zt[q] - mu * colsum[q]) / sd;
      r[l.YrOff() + q] = yr;
      score[q] = Sigmoid(yr);
    }
    for (int s = 0; s < l.g; ++s) {
      const float a = *p.group_a_pre[s];
      const float* b = p.group_b_pre[s];
      for (int q = 0; q < N; ++q) {
        const float y = zt[N + s * N + q] / rms;
        r[l.YpreOff(s) + q] = y;
        const float h = Sigmoid(a * y + b[q]);
        r[l.HpreOff(s) + q] = h;
        hpre[s * kMaxN + q] = h;
      }
    }
    int32_t* it = idx + t * k;
    TopK(l, score, it);
    for (int j = 0; j < k; ++j) {
      sidx[j] = it[j];
      r[Layout::kGate + j] = j < l.m ? 1.0f : score[it[j]];
      for (int s = 1; s < l.g; ++s) hpre[s * kMaxN + it[j]] = 0.0f;
    }
  }
  __syncthreads();
  // The dense read, the later sublayers' bases and the gather, from the rows just read (in
  // L1/L2).
  S* at = saved + t * l.SavedStride();
  float asq = 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float acc[kMaxG] = {};
    for (int i = 0; i < N; ++i) {
      const float v = ToF(xt[static_cast<int64_t>(i) * C + c]);
#pragma unroll
      for (int s = 0; s < kMaxG; ++s)
        if (s < l.g) acc[s] += hpre[s * kMaxN + i] * v;
    }
    u[t * C + c] = acc[0];
#pragma unroll
    for (int s = 1; s < kMaxG; ++s)
      if (s < l.g) base[(t * (l.g - 1) + s - 1) * C + c] = acc[s];
    for (int j = 0; j < k; ++j) {
      const S v = xt[static_cast<int64_t>(sidx[j]) * C + c];
      at[static_cast<int64_t>(j) * C + c] = v;
      const float f = ToF(v);
      asq += f * f;
    }
  }
  asq = detail::BlockSum1(asq, scratch);
  if (threadIdx.x == 0) {
    coef[t * l.CoefStride() + Layout::kRa] =
        sqrtf(asq / static_cast<float>(static_cast<int64_t>(k) * C) + kNormEps);
  }
}

// XhcImpl::BaseToken + GatherActive: u = base_s + sum_j H_pre^s_(I_j) a_j, a_j the current
// active rows (A_(s-1)), gathered into the saved rows in the same pass.
template <typename S>
__global__ void __launch_bounds__(kRowThreads)
    ReadBaseKernel(Layout l, const S* x, const float* base, const float* rec, const int32_t* idx,
                   float* u, S* saved, float* coef) {
  __shared__ float scratch[kWarp];
  __shared__ float h[kMaxK];
  __shared__ int sidx[kMaxK];
  const int64_t t = blockIdx.x;
  const int C = l.C, k = l.k;
  if (static_cast<int>(threadIdx.x) < k) {
    const int i = idx[t * k + threadIdx.x];
    sidx[threadIdx.x] = i;
    h[threadIdx.x] = rec[t * l.RecStride() + l.HpreOff() + i];
  }
  __syncthreads();
  const S* xt = x + t * static_cast<int64_t>(l.N) * C;
  const float* bt = base + (t * (l.g - 1) + l.s - 1) * C;
  S* at = saved + t * l.SavedStride();
  float asq = 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = bt[c];
    for (int j = 0; j < k; ++j) {
      const S v = xt[static_cast<int64_t>(sidx[j]) * C + c];
      at[static_cast<int64_t>(j) * C + c] = v;
      const float f = ToF(v);
      acc += h[j] * f;
      asq += f * f;
    }
    u[t * C + c] = acc;
  }
  asq = detail::BlockSum1(asq, scratch);
  if (threadIdx.x == 0) {
    coef[t * l.CoefStride() + Layout::kRa] =
        sqrtf(asq / static_cast<float>(static_cast<int64_t>(k) * C) + kNormEps);
  }
}

__global__ void ActiveMapsKernel(Layout l, int64_t tokens, const float* q, MapParams p,
                                 float* coef) {
  const int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (t >= tokens) return;
  const int k = l.k, kk = k * k, P2 = l.P2();
  float* cf = coef + t * l.CoefStride();
  const float ra = cf[Layout::kRa];
  for (int i = 0; i < P2; ++i) cf[Layout::kQ + i] = q[t * P2 + i] / ra;
  if (l.mix) {
    float logits[kMaxK * kMaxK];
    const float a_res = *p.a_res;
    for (int i = 0; i < kk; ++i) logits[i] = a_res * cf[Layout::kQ + i] + p.b_res[i];
    float* h = cf + l.HresOff();
    SinkhornForward(k, l.iters, logits, h, nullptr);
    for (int j = 0; j < k; ++j) {
      float s = 0;
      for (int i = 0; i < k; ++i) s += h[j * k + i];
      if (s > 1.0f)
        for (int i = 0; i < k; ++i) h[j * k + i] /= s;
    }
  }
  const float a_post = *p.a_post;
  for (int i = 0; i < k * l.Kr; ++i) {
    cf[l.HpostOff() + i] = 2.0f * Sigmoid(a_post * cf[Layout::kQ + l.PostQ() + i] + p.b_post[i]);
  }
}

// ---------------------------------------------------------------- write

// One element of a causal depthwise convolution (the CPU's ConvRow): sum over the taps in
// order of w[i][c] * x[c - i * ldx]. The forward reads `out`, the backward's recomputation the
// saved v1 rows; both go through here, so they agree.
template <typename X>
__device__ __forceinline__ float ConvElement(const float* w, int C, int c, int taps, const X* x,
                                             int64_t ldx) {
  float acc = 0;
  for (int i = 0; i < taps; ++i) acc += w[i * C + c] * ToF(x[c - i * ldx]);
  return acc;
}

// Valid taps of convolution j at token t (XhcImpl::CausalTaps).
__device__ __forceinline__ int Taps(const MapParams& p, int j, int64_t t, int32_t seg) {
  const int64_t room = t - seg + 1;
  return p.conv_taps[j] < room ? p.conv_taps[j] : static_cast<int>(room);
}

// Thread 0 of a block stages token t's active stream indices, H_res (the identity in a
// sublayer that does not mix) and the gated H_post in shared memory for the write-back
// (forward and backward).
__device__ __forceinline__ void StageWriteMaps(const Layout& l, const float* r, const float* cf,
                                               const int32_t* idx, int64_t t, int* sidx,
                                               float* smix, float* spost) {
  const int k = l.k, Kr = l.Kr;
  for (int j = 0; j < k; ++j) {
    sidx[j] = idx[t * k + j];
    for (int i = 0; i < k; ++i)
      smix[j * k + i] = l.mix ? cf[l.HresOff() + j * k + i] : (i == j ? 1.0f : 0.0f);
    for (int q = 0; q < Kr; ++q)
      spost[j * Kr + q] = r[Layout::kGate + j] * cf[l.HpostOff() + j * Kr + q];
  }
}

// FusedWriteBack's MLP basis in registers: rows 1..J of o become the raw convolutions of
// out_t (earlier tokens' rows `ld` elements apart), each orthogonalized against the rows before
// it (one block-wide sum per pass); row 0 holds out_t already. The forward's Write runs it on
// the body output, the backward on the saved out rows (the same values for an fp32 state).
template <typename X, int EPT>
__device__ __forceinline__ void MlpBasis(const Layout& l, const MapParams& p,
                                         const int32_t* segment, int64_t t, const X* out_t,
                                         int64_t ld, float (&o)[kMaxKr][EPT], float* red) {
  const int C = l.C, J = l.J;
  const int B = blockDim.x;
  const int32_t seg = segment[t];
  // The raw convolutions v_m (taps in order, as ConvRow).
#pragma unroll
  for (int m = 1; m <= kMaxJ; ++m) {
    if (m > J) break;
    const int taps = Taps(p, m - 1, t, seg);
    const float* w = p.conv[m - 1];
#pragma unroll
    for (int e = 0; e < EPT; ++e) {
      const int c = threadIdx.x + e * B;
      o[m][e] = c < C ? ConvElement(w, C, c, taps, out_t, ld) : 0.0f;
    }
  }
  float cc[kMaxKr][kMaxKr] = {};
  // Pass 0: |o_0|^2 and <v_m, o_0>.
  {
    float v[kMaxKr] = {};
#pragma unroll
    for (int e = 0; e < EPT; ++e) {
      v[0] += o[0][e] * o[0][e];
#pragma unroll
      for (int m = 1; m <= kMaxJ; ++m) v[m] += o[m][e] * o[0][e];
    }
    BlockSum<float, kMaxKr>(v, red);
    const float norm0 = v[0] + kGramSchmidtEps;
#pragma unroll
    for (int m = 1; m <= kMaxJ; ++m) cc[m][0] = v[m] / norm0;
  }
  // Pass i: rows m > i lose c[m][i] o_i; row i+1 is then final.
#pragma unroll
  for (int i = 0; i + 1 < kMaxJ; ++i) {
    if (i + 1 >= J) break;
    float v[kMaxKr] = {};
#pragma unroll
    for (int e = 0; e < EPT; ++e) {
      o[i + 1][e] = o[i + 1][e] + (-cc[i + 1][i]) * o[i][e];
      v[0] += o[i + 1][e] * o[i + 1][e];
#pragma unroll
      for (int m = i + 2; m <= kMaxJ; ++m) {
        if (m > J) break;
        o[m][e] = o[m][e] + (-cc[m][i]) * o[i][e];
        v[m] += o[m][e] * o[i + 1][e];
      }
    }
    BlockSum<float, kMaxKr>(v, red);
    const float norm = v[0] + kGramSchmidtEps;
#pragma unroll
    for (int m = i + 2; m <= kMaxJ; ++m) cc[m][i + 1] = v[m] / norm;
  }
  // Last: row J.
#pragma unroll
  for (int jj = 1; jj <= kMaxJ; ++jj) {
    if (jj != J) continue;
#pragma unroll
    for (int e = 0; e < EPT; ++e) o[jj][e] = o[jj][e] + (-cc[jj][jj - 1]) * o[jj - 1][e];
  }
}

template <typename S, int EPT>
__global__ void __launch_bounds__(512)
    WriteKernel(Layout l, const float* out, const int32_t* segment, MapParams p, const float* rec,
                const int32_t* idx, const float* coef, S* x, S* saved) {
  __shared__ float red[kMaxKr * kWarp];
  __shared__ int sidx[kMaxK];
  __shared__ float smix[kMaxK * kMaxK];
  __shared__ float spost[kMaxK * kMaxKr];
  const int64_t t = blockIdx.x;
  const int C = l.C, k = l.k, Kr = l.Kr, J = l.J;
  const int B = blockDim.x;
  if (threadIdx.x == 0) {
    StageWriteMaps(l, rec + t * l.RecStride(), coef + t * l.CoefStride(), idx, t, sidx, smix,
                   spost);
  }
  __syncthreads();
  const float* out_t = out + t * C;
  float o[kMaxKr][EPT] = {};
#pragma unroll
  for (int e = 0; e < EPT; ++e) {
    const int c = threadIdx.x + e * B;
    o[0][e] = c < C ? out_t[c] : 0.0f;
  }
  if (J > 0) MlpBasis<float, EPT>(l, p, segment, t, out_t, C, o, red);
  // Save out (O's first row) after A, then the write-back of the k stream rows in place.
  S* st = saved + t * l.SavedStride();
  S* xt = x + t * static_cast<int64_t>(l.N) * C;
#pragma unroll
  for (int e = 0; e < EPT; ++e) {
    const int c = threadIdx.x + e * B;
    if (c >= C) continue;
    st[static_cast<int64_t>(k) * C + c] = FromF<S>(o[0][e]);
    float xv[kMaxK] = {};
#pragma unroll
    for (int i = 0; i < kMaxK; ++i)
      if (i < k) xv[i] = ToF(xt[static_cast<int64_t>(sidx[i]) * C + c]);
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
      if (j >= k) break;
      float y = 0;
      if (l.mix) {
#pragma unroll
        for (int i = 0; i < kMaxK; ++i)
          if (i < k) y += smix[j * k + i] * xv[i];
      } else {
        y = xv[j];
      }
#pragma unroll
      for (int r = 0; r < kMaxKr; ++r)
        if (r < Kr) y += spost[j * Kr + r] * o[r][e];
      xt[static_cast<int64_t>(sidx[j]) * C + c] = FromF<S>(y);
    }
  }
}

// RebuildBasis: token t's basis rows 1..J from the saved out rows, as WriteKernel computed
// them from the body output (MlpBasis, on the same values for an fp32 state), into basis
// (tokens x J x C, S).
template <typename S, int EPT>
__global__ void __launch_bounds__(512)
    RebuildBasisKernel(Layout l, const S* saved, const int32_t* segment, MapParams p, S* basis) {
  __shared__ float red[kMaxKr * kWarp];
  const int64_t t = blockIdx.x;
  const int C = l.C, J = l.J;
  const int B = blockDim.x;
  const S* v1_t = saved + t * l.SavedStride() + static_cast<int64_t>(l.k) * C;
  float o[kMaxKr][EPT] = {};
#pragma unroll
  for (int e = 0; e < EPT; ++e) {
    const int c = threadIdx.x + e * B;
    o[0][e] = c < C ? ToF(v1_t[c]) : 0.0f;
  }
  MlpBasis<S, EPT>(l, p, segment, t, v1_t, l.SavedStride(), o, red);
  S* bt = basis + t * static_cast<int64_t>(J) * C;
#pragma unroll
  for (int e = 0; e < EPT; ++e) {
    const int c = threadIdx.x + e * B;
    if (c >= C) continue;
#pragma unroll
    for (int r = 1; r <= kMaxJ; ++r)
      if (r <= J) bt[static_cast<int64_t>(r - 1) * C + c] = FromF<S>(o[r][e]);
  }
}

// ---------------------------------------------------------------- write backward

// FusedWriteBackBackward on this thread's elements: the rows A and out (O's first row) from
// the saved rows, O's others from `bt` (the token's rebuilt basis rows, RebuildBasis),
// dA_i = sum_j H_res[j][i] G_j, dO_r = sum_j post[j][r] G_j and this thread's terms of the
// dots <G_j, A_i>, <G_j, O_r>.
template <typename S, int EPT>
__device__ __forceinline__ void WriteBackGrads(const Layout& l, const float* dxt, const S* st,
                                               const S* bt, const int* sidx, const float* smix,
                                               const float* spost, float (&a)[kMaxK][EPT],
                                               float (&dA)[kMaxK][EPT], float (&o)[kMaxKr][EPT],
                                               float (&dO)[kMaxKr][EPT], float (&dots)[kMaxR]) {
  const int C = l.C, k = l.k, Kr = l.Kr;
  const int B = blockDim.x;
#pragma unroll
  for (int e = 0; e < EPT; ++e) {
    const int c = threadIdx.x + e * B;
    const bool in = c < C;
    float g[kMaxK];
#pragma unroll
    for (int j = 0; j < kMaxK; ++j)
      g[j] = (in && j < k) ? dxt[static_cast<int64_t>(sidx[j]) * C + c] : 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxK; ++i)
      a[i][e] = (in && i < k) ? ToF(st[static_cast<int64_t>(i) * C + c]) : 0.0f;
    o[0][e] = in ? ToF(st[static_cast<int64_t>(k) * C + c]) : 0.0f;
#pragma unroll
    for (int q = 1; q < kMaxKr; ++q)
      o[q][e] = (in && q < Kr) ? ToF(bt[static_cast<int64_t>(q - 1) * C + c]) : 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxK; ++i) {
      float d = 0;
#pragma unroll
      for (int j = 0; j < kMaxK; ++j)
        if (i < k && j < k) d += smix[j * k + i] * g[j];
      dA[i][e] = d;
    }
#pragma unroll
    for (int q = 0; q < kMaxKr; ++q) {
      float d = 0;
#pragma unroll
      for (int j = 0; j < kMaxK; ++j)
        if (q < Kr && j < k) d += spost[j * Kr + q] * g[j];
      dO[q][e] = d;
    }
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
#pragma unroll
      for (int i = 0; i < kMaxK; ++i) dots[j * kMaxK + i] += g[j] * a[i][e];
#pragma unroll
      for (int q = 0; q < kMaxKr; ++q) dots[kMaxK * kMaxK + j * kMaxKr + q] += g[j] * o[q][e];
    }
  }
}

// Gram-Schmidt backward, its first J passes: the levels W(m, i) (W(m, 0) the raw
// convolutions of the saved v1 rows), norms = |o_r|^2 + eps, c(m, i) and dc(J, J-1).
template <typename S, int EPT>
__device__ __forceinline__ void BasisLevels(const Layout& l, const MapParams& p, const S* saved,
                                            int32_t seg, int64_t t, const float (&o)[kMaxKr][EPT],
                                            const float (&dO)[kMaxKr][EPT],
                                            float (&lev)[kLevels][EPT], float (&norms)[kMaxKr],
                                            float (&cc)[kMaxKr][kMaxKr],
                                            float (&dc)[kMaxKr][kMaxKr], float* red) {
  const int C = l.C, k = l.k, J = l.J;
  const int B = blockDim.x;
  {
    // W(m, 0): the raw convolutions, from the saved v1 (= out) rows of earlier tokens.
    const S* v1 = saved + t * l.SavedStride() + static_cast<int64_t>(k) * C;
#pragma unroll
    for (int m = 1; m <= kMaxJ; ++m) {
      if (m > J) break;
      const int taps = Taps(p, m - 1, t, seg);
      const float* w = p.conv[m - 1];
#pragma unroll
      for (int e = 0; e < EPT; ++e) {
        const int c = threadIdx.x + e * B;
        lev[m * (m - 1) / 2][e] = c < C ? ConvElement(w, C, c, taps, v1, l.SavedStride()) : 0.0f;
      }
    }
    // |o_r|^2, <W(m, 0), o_0>, <dO_J, o_(J-1)>.
    float v[2 * kMaxKr] = {};
#pragma unroll
    for (int e = 0; e < EPT; ++e) {
#pragma unroll
      for (int q = 0; q < kMaxKr; ++q) v[q] += o[q][e] * o[q][e];
#pragma unroll
      for (int m = 1; m <= kMaxJ; ++m)
        if (m <= J) v[kMaxKr + m - 1] += lev[m * (m - 1) / 2][e] * o[0][e];
#pragma unroll
      for (int jj = 1; jj <= kMaxJ; ++jj)
        if (jj == J) v[2 * kMaxKr - 1] += dO[jj][e] * o[jj - 1][e];
    }
    BlockSum<float, 2 * kMaxKr>(v, red);
#pragma unroll
    for (int q = 0; q < kMaxKr; ++q) norms[q] = v[q] + kGramSchmidtEps;
#pragma unroll
    for (int m = 1; m <= kMaxJ; ++m) cc[m][0] = v[kMaxKr + m - 1] / norms[0];
#pragma unroll
    for (int jj = 1; jj <= kMaxJ; ++jj)
      if (jj == J) dc[jj][jj - 1] = -v[2 * kMaxKr - 1];
  }
// W(m, i) = W(m, i-1) - c(m, i-1) o_(i-1) for m > i; c(m, i) = <W(m, i), o_i> / |o_i|^2.
#pragma unroll
  for (int i = 1; i < kMaxJ; ++i) {
    if (i >= J) break;
    float v[kMaxKr] = {};
#pragma unroll
    for (int e = 0; e < EPT; ++e) {
#pragma unroll
      for (int m = i + 1; m <= kMaxJ; ++m) {
        if (m > J) break;
        const float w = lev[m * (m - 1) / 2 + i - 1][e] + (-cc[m][i - 1]) * o[i - 1][e];
        lev[m * (m - 1) / 2 + i][e] = w;
        v[m] += w * o[i][e];
      }
    }
    BlockSum<float, kMaxKr>(v, red);
#pragma unroll
    for (int m = i + 1; m <= kMaxJ; ++m) cc[m][i] = v[m] / norms[i];
  }
}

// Gram-Schmidt backward, its last J passes: undo step i of every row m > i, i = J-1 .. 0;
// dO -> dg_t (the raw convolutions' gradients, J x C) and dout_t (= dv1).
template <int EPT>
__device__ __forceinline__ void UndoBasis(const Layout& l, const float (&o)[kMaxKr][EPT],
                                          const float (&lev)[kLevels][EPT],
                                          const float (&norms)[kMaxKr],
                                          const float (&cc)[kMaxKr][kMaxKr],
                                          float (&dc)[kMaxKr][kMaxKr], float (&dO)[kMaxKr][EPT],
                                          float* dg_t, float* dout_t, float* red) {
  const int C = l.C, J = l.J;
  const int B = blockDim.x;
#pragma unroll
  for (int i = kMaxJ - 1; i >= 0; --i) {
    if (i > J - 1) continue;
    float s1[kMaxKr] = {}, s2[kMaxKr] = {}, s3[kMaxKr] = {};
#pragma unroll
    for (int m = i + 1; m <= kMaxJ; ++m) {
      s1[m] = -cc[m][i];
      s2[m] = dc[m][i] / norms[i];
      s3[m] = -2.0f * cc[m][i] * dc[m][i] / norms[i];
    }
    float v[kMaxKr] = {};
#pragma unroll
    for (int e = 0; e < EPT; ++e) {
      const float vi = o[i][e];
      float di = dO[i][e];
      float dm[kMaxKr] = {};
#pragma unroll
      for (int m = kMaxJ; m > i; --m) {
        if (m > J) continue;
        const float d = dO[m][e];
        di = di + s1[m] * d;
        di = di + s2[m] * lev[m * (m - 1) / 2 + i][e];
        di = di + s3[m] * vi;
        dm[m] = d + s2[m] * vi;
      }
      const int c = threadIdx.x + e * B;
      if (i > 0) {
        const float vp = o[i - 1][e];
        dm[i] = di;
#pragma unroll
        for (int m = i; m <= kMaxJ; ++m) {
          if (m > J) break;
          dO[m][e] = dm[m];
          v[m] += dm[m] * vp;
        }
      } else if (c < C) {
#pragma unroll
        for (int m = 1; m <= kMaxJ; ++m)
          if (m <= J) dg_t[static_cast<int64_t>(m - 1) * C + c] = dm[m];
        dout_t[c] = di;
      }
    }
    if (i > 0) {
      BlockSum<float, kMaxKr>(v, red);
#pragma unroll
      for (int m = i; m <= kMaxJ; ++m) dc[m][i - 1] = -v[m];
    }
  }
}

// The write-back's scalar gradients on one thread: the gates' (added to dp_out), H_post's
// and, in a sublayer that mixes, H_res's (Sinkhorn recomputed with its tape), the active
// mappings' logits (c2_out, wscal). Returns the factor of A in dA (the norm's term).
__device__ __forceinline__ float MappingGrads(const Layout& l, const MapParams& p, const float* r,
                                              const float* cf, const float (&dots)[kMaxR],
                                              int64_t t, float* dp_out, float* wscal, float* c2_out,
                                              float* tape, int64_t tape_floats) {
  const int C = l.C, k = l.k, Kr = l.Kr, kk = k * k;
  const float* q = cf + Layout::kQ;
  const float* hpost = cf + l.HpostOff();
  const float* hres = cf + l.HresOff();
  float dhpost[kMaxK * kMaxKr];
  for (int j = 0; j < k; ++j) {
    const float pj = r[Layout::kGate + j];
    float acc = 0;
    for (int c2 = 0; c2 < Kr; ++c2) {
      const float go = dots[kMaxK * kMaxK + j * kMaxKr + c2];
      acc += hpost[j * Kr + c2] * go;
      dhpost[j * Kr + c2] = pj * go;
    }
    dp_out[t * k + j] += acc;
  }
  float* scal = wscal + t * l.WriteScalStride();
  for (int i = 0; i < l.WriteScalStride(); ++i) scal[i] = 0;
  float* c2 = c2_out + t * l.C2Stride();
  float sum_dq_q = 0;
  if (l.mix) {
    // MixingBackward: Sinkhorn recomputed with its tape, the row-sum clamp, its backward.
    float logits[kMaxK * kMaxK], hraw[kMaxK * kMaxK], dh[kMaxK * kMaxK], dz[kMaxK * kMaxK];
    const float a_res = *p.a_res;
    for (int i = 0; i < kk; ++i) logits[i] = a_res * q[i] + p.b_res[i];
    float* tp = tape + t * tape_floats;
    SinkhornForward(k, l.iters, logits, hraw, tp);
    for (int j = 0; j < k; ++j)
      for (int i = 0; i < k; ++i) dh[j * k + i] = dots[j * kMaxK + i];
    for (int j = 0; j < k; ++j) {
      float s = 0;
      for (int i = 0; i < k; ++i) s += hraw[j * k + i];
      if (s > 1.0f) {
        float gy = 0;
        for (int i = 0; i < k; ++i) gy += dh[j * k + i] * hres[j * k + i];
        for (int i = 0; i < k; ++i) dh[j * k + i] = (dh[j * k + i] - gy) / s;
      }
    }
    SinkhornBackward(k, l.iters, logits, tp, dh, dz);
    // ActiveMapsBackward.
    for (int i = 0; i < kk; ++i) {
      scal[0] += dz[i] * q[i];
      scal[1 + i] += dz[i];
      const float dq = a_res * dz[i];
      c2[i] = dq;
      sum_dq_q += dq * q[i];
    }
  }
  const float a_post = *p.a_post;
  const int off = l.PostQ();
  for (int i = 0; i < k * Kr; ++i) {
    const float h = hpost[i] / 2.0f;
    const float dlogit = dhpost[i] * 2.0f * h * (1.0f - h);
    scal[1 + kk] += dlogit * q[off + i];
    scal[2 + kk + i] += dlogit;
    const float dq = a_post * dlogit;
    c2[off + i] = dq;
    sum_dq_q += dq * q[off + i];
  }
  const float ra = cf[Layout::kRa];
  for (int i = 0; i < l.P2(); ++i) c2[i] /= ra;
  return -sum_dq_q / (static_cast<float>(static_cast<int64_t>(k) * C) * ra * ra);
}

template <typename S, int EPT>
__global__ void __launch_bounds__(512)
    WriteBackwardKernel(Layout l, const float* dx, const S* saved, const S* basis,
                        const int32_t* segment, MapParams p, const float* rec, const int32_t* idx,
                        const float* coef, float* da_out, float* d_out, float* dg_out,
                        float* dp_out, float* c2_out, float* wscal, float* tape,
                        int64_t tape_floats) {
  __shared__ float red[kMaxR * kWarp];
  __shared__ int sidx[kMaxK];
  __shared__ float smix[kMaxK * kMaxK];
  __shared__ float spost[kMaxK * kMaxKr];
  __shared__ float sfactor;
  const int64_t t = blockIdx.x;
  const int N = l.N, C = l.C, k = l.k, J = l.J;
  const int B = blockDim.x;
  const float* r = rec + t * l.RecStride();
  const float* cf = coef + t * l.CoefStride();
  if (threadIdx.x == 0) StageWriteMaps(l, r, cf, idx, t, sidx, smix, spost);
  __syncthreads();
  const S* st = saved + t * l.SavedStride();
  const float* dxt = dx + t * static_cast<int64_t>(N) * C;
  float a[kMaxK][EPT], dA[kMaxK][EPT], o[kMaxKr][EPT], dO[kMaxKr][EPT];
  float dots[kMaxR] = {};
  const S* bt = basis == nullptr ? nullptr : basis + t * static_cast<int64_t>(J) * C;
  WriteBackGrads<S, EPT>(l, dxt, st, bt, sidx, smix, spost, a, dA, o, dO, dots);
  BlockSum<float, kMaxR>(dots, red);

  // Gram-Schmidt backward (MLP): dO -> d_out (= dv1) and dg (the raw convolutions').
  float* dout_t = d_out + t * C;
  if (J == 0) {
#pragma unroll
    for (int e = 0; e < EPT; ++e) {
      const int c = threadIdx.x + e * B;
      if (c < C) dout_t[c] = dO[0][e];
    }
  } else {
    const int32_t seg = segment[t];
    float lev[kLevels][EPT] = {};  // W(m, i) at m (m - 1) / 2 + i
    float norms[kMaxKr] = {}, cc[kMaxKr][kMaxKr] = {}, dc[kMaxKr][kMaxKr] = {};
    BasisLevels<S, EPT>(l, p, saved, seg, t, o, dO, lev, norms, cc, dc, red);
    // Undo step i of every row m > i, i = J-1 .. 0.
    float* dg_t = dg_out + t * static_cast<int64_t>(J) * C;
    UndoBasis<EPT>(l, o, lev, norms, cc, dc, dO, dg_t, dout_t, red);
  }

  // Gates, H_post and H_res gradients, the active mappings' logits (one thread).
  if (threadIdx.x == 0) {
    sfactor = MappingGrads(l, p, r, cf, dots, t, dp_out, wscal, c2_out, tape, tape_floats);
  }
  __syncthreads();
  const float f = sfactor;
  float* dat = da_out + t * static_cast<int64_t>(k) * C;
#pragma unroll
  for (int e = 0; e < EPT; ++e) {
    const int c = threadIdx.x + e * B;
    if (c >= C) continue;
#pragma unroll
    for (int i = 0; i < kMaxK; ++i)
      if (i < k) dat[static_cast<int64_t>(i) * C + c] = dA[i][e] + f * a[i][e];
  }
}

template <typename S>
__global__ void ScatterActiveKernel(Layout l, int64_t tokens, const float* da, const S* saved,
                                    const int32_t* idx, float* dx, S* x) {
  const int C = l.C, k = l.k;
  const int64_t total = tokens * k * C;
  for (int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; n < total;
       n += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = n / (static_cast<int64_t>(k) * C);
    const int64_t rest = n - t * k * C;
    const int j = static_cast<int>(rest / C);
    const int c = static_cast<int>(rest - static_cast<int64_t>(j) * C);
    const int64_t row = (t * l.N + idx[t * k + j]) * C + c;
    dx[row] = da[n];
    x[row] = saved[t * l.SavedStride() + static_cast<int64_t>(j) * C + c];
  }
}

// d_out[t] += sum_j sum_i w_j[i] dg_j[t + i] over the taps that stay in t's segment.
__global__ void ConvInputGradKernel(Layout l, int64_t tokens, const float* dg,
                                    const int32_t* segment, MapParams p, float* d_out) {
  const int C = l.C, J = l.J;
  const int64_t total = tokens * C;
  for (int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; n < total;
       n += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = n / C;
    const int c = static_cast<int>(n - t * C);
    float acc = d_out[n];
    for (int j = 0; j < J; ++j) {
      const float* w = p.conv[j];
      for (int i = 0; i < p.conv_taps[j]; ++i) {
        if (t + i >= tokens || segment[t + i] > t) break;
        acc += w[i * C + c] * dg[((t + i) * J + j) * C + c];
      }
    }
    d_out[n] = acc;
  }
}

// partial[chunk][tap row][c]: sum over the chunk's tokens of dg_j[t][c] * v1[t - i][c].
template <typename S>
__global__ void ConvWeightPartialKernel(Layout l, int64_t tokens, const float* dg, const S* saved,
                                        const int32_t* segment, MapParams p, int total_taps,
                                        float* partial) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int tap_row = blockIdx.y;
  const int64_t chunk = blockIdx.z;
  if (c >= l.C) return;
  int j = 0, i = tap_row;
  while (j < l.J && i >= p.conv_taps[j]) {
    i -= p.conv_taps[j];
    ++j;
  }
  const int64_t t0 = chunk * kTokenChunk;
  const int64_t t1 = t0 + kTokenChunk < tokens ? t0 + kTokenChunk : tokens;
  float acc = 0;
  for (int64_t t = t0; t < t1; ++t) {
    if (t - i < segment[t]) continue;
    acc += dg[(t * l.J + j) * l.C + c] *
           ToF(saved[(t - i) * l.SavedStride() + static_cast<int64_t>(l.k) * l.C + c]);
  }
  partial[(chunk * total_taps + tap_row) * l.C + c] = acc;
}

// ---------------------------------------------------------------- read backward

// dots[i] = <du, x_i> over the block for the N <= R streams of a token's state xt (the dense
// read's backward, xhc and hc / mhc alike); `red`: R * 32 floats of shared scratch.
template <typename S, int R>
__device__ __forceinline__ void StreamDots(int N, int C, const S* xt, const float* du,
                                           float (&dots)[R], float* red) {
#pragma unroll
  for (int i = 0; i < R; ++i) dots[i] = 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float d = du[c];
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (i < N) dots[i] += d * ToF(xt[static_cast<int64_t>(i) * C + c]);
  }
  BlockSum<float, R>(dots, red, N);  // the N streams' dots, not all R
}

template <typename S>
__global__ void __launch_bounds__(kRowThreads)
    ReadBackwardKernel(Layout l, const S* x, const float* du, const float* dp, const float* colsum,
                       MapParams p, const float* rec, const int32_t* idx, float* dx,
                       float* dypre_out, float* c1_out, float* rscal) {
  __shared__ float red[kMaxN * kWarp];
  __shared__ float hpre[kMaxN];
  __shared__ float coefs[2];
  const int64_t t = blockIdx.x;
  const int N = l.N, C = l.C, k = l.k;
  const int64_t nc = static_cast<int64_t>(N) * C;
  const S* xt = x + t * nc;
  const float* dut = du + t * C;
  const float* r = rec + t * l.RecStride();
  if (static_cast<int>(threadIdx.x) < N) hpre[threadIdx.x] = r[l.HpreOff() + threadIdx.x];
  // DenseReadBackward: dH_pre_r = <du, x_r>.
  float dh[kMaxN];
  StreamDots<S, kMaxN>(N, C, xt, dut, dh, red);
  if (threadIdx.x == 0) {
    float* scal = rscal + t * l.ReadScalStride();
    const float a_pre = *p.a_pre;
    float* dypre = dypre_out + (t * l.g + l.s) * N;
    scal[0] = 0;
    for (int q = 0; q < N; ++q) {
      const float h = hpre[q];
      const float dlogit = dh[q] * h * (1.0f - h);
      scal[0] += dlogit * r[l.YpreOff() + q];
      scal[1 + q] = dlogit;
      dypre[q] = a_pre * dlogit;
    }
    coefs[0] = 0;
    coefs[1] = 0;
  }
  // EntryTokenBackward (the group's first sublayer): the router's and every pre-mapping's
  // logit gradients (dypre of the later sublayers written by their ReadBackward).
  if (threadIdx.x == 0 && l.s == 0) {
    float* c1 = c1_out + t * l.P1();
    const float mu = r[Layout::kMu], sd = r[Layout::kSd], rms = r[Layout::kRms];
    const float D = static_cast<float>(nc);
    for (int q = 0; q < N; ++q) c1[q] = 0;
    float sum_dy_y_r = 0, sum_dy_cs = 0;
    for (int j = l.m; j < k; ++j) {
      const int q = idx[t * k + j];
      const float y = r[l.YrOff() + q];
      const float sg = Sigmoid(y);
      const float dy = dp[t * k + j] * sg * (1.0f - sg);
      c1[q] = dy / sd;
      sum_dy_y_r += dy * y;
      sum_dy_cs += dy * colsum[q];
    }
    float sum_dy_y_pre = 0;
    for (int s = 0; s < l.g; ++s) {
      const float* dyp = dypre_out + (t * l.g + s) * N;
      for (int q = 0; q < N; ++q) {
        c1[N + s * N + q] = dyp[q] / rms;
        sum_dy_y_pre += dyp[q] * r[l.YpreOff(s) + q];
      }
    }
    coefs[0] = -sum_dy_y_pre / (D * rms * rms) - sum_dy_y_r / (D * sd * sd);
    coefs[1] = -sum_dy_cs / (D * sd) + sum_dy_y_r * mu / (D * sd * sd);
  }
  __syncthreads();
  const float alpha = coefs[0], beta = coefs[1];
  float* dxt = dx + t * nc;
  const bool entry = l.s == 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float d = dut[c];
    for (int i = 0; i < N; ++i) {
      const int64_t e = static_cast<int64_t>(i) * C + c;
      float v = dxt[e] + hpre[i] * d;
      if (entry) {
        v = v + alpha * ToF(xt[e]);
        if (beta != 0.0f) v = v + beta;
      }
      dxt[e] = v;
    }
  }
}

// The router centring's term of one token: c1[t][q] mu_t.
struct CentringTerm {
  const float* c1;
  const float* rec;
  int c1_stride, rec_stride;
  __device__ float operator()(int64_t t, int q) const {
    return c1[t * c1_stride + q] * rec[t * rec_stride + Layout::kMu];
  }
};

__global__ void RouterCentringApplyKernel(int64_t rows_nc, int64_t nc, const float* corr,
                                          float* dw) {
  for (int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; n < rows_nc;
       n += int64_t{gridDim.x} * blockDim.x) {
    dw[n] -= corr[n / nc];
  }
}

// One token's record value s of rows `stride` apart.
struct StridedColumn {
  const float* values;
  int stride;
  __device__ float operator()(int64_t t, int s) const { return values[t * stride + s]; }
};

// ---------------------------------------------------------------- hc and mhc

// The kernels below hold a token's N streams in arrays of NM, the smallest of 4, 8 and 16
// that holds N (the launchers pick it). Up to kThreadMapsMaxN streams one thread of the
// block turns the sums into the maps (N x N values at most 64); above it a warp does, a lane
// per stream (mhc's Sinkhorn a lane per row), and the write's backward, whose N + N^2 dot
// products per token no longer fit a thread's registers, goes through shared-memory tiles.
constexpr int kThreadMapsMaxN = 8;
static_assert(kThreadMapsMaxN <= kMaxSinkhornN && kDenseMaxN <= kWarp);

// v[i] for a run-time i, without indexing a register array at run time.
template <int NM>
__device__ __forceinline__ float Pick(const float (&v)[NM], int i) {
  float r = 0;
#pragma unroll
  for (int j = 0; j < NM; ++j)
    if (j == i) r = v[j];
  return r;
}

// hc's maps of stream s (HcImpl::Read's step per stream) from its sum of squares: its
// record (r_s, y_s), A_m[s], row s of A_r, B[s]. A_m = s_a tanh(y_m) + A_m0, A_r = s_a
// tanh(y_r) + A_r0, B = s_b tanh(y_b) + B0.
__device__ void HcStreamMaps(const DenseLayout& l, const MapParams& p, int s, float sq,
                             const float* zt, float* cf) {
  const int N = l.N, P = l.P();
  const float s_a = *p.a_pre, s_b = *p.a_post;
  float* am = cf + l.Pre();
  float* ar = am + N;
  float* bb = ar + N * N;
  const float r = sqrtf(sq / static_cast<float>(l.C) + kNormEps);
  float* rec = cf + s * (1 + P);
  rec[0] = r;
  for (int q = 0; q < P; ++q) rec[1 + q] = zt[s * P + q] / r;
  am[s] = s_a * tanhf(rec[1]) + p.b_pre[s];
  for (int j = 0; j < N; ++j) ar[s * N + j] = s_a * tanhf(rec[2 + j]) + p.b_res[s * N + j];
  bb[s] = s_b * tanhf(rec[2 + N]) + p.b_post[s];
}

// mhc's RMS (of vec X) from the streams' sums of squares, summed in stream order.
template <int NM>
__device__ float MhcRms(const DenseLayout& l, const float (&sq)[NM]) {
  float total = 0;
#pragma unroll
  for (int s = 0; s < NM; ++s)
    if (s < l.N) total += sq[s];
  return sqrtf(total / static_cast<float>(static_cast<int64_t>(l.N) * l.C) + kNormEps);
}

// Thread 0 of DenseRead (N <= kThreadMapsMaxN): the coefficient record from the streams'
// sums of squares `sq` (hc: each stream's RMS; mhc: their total, the RMS of vec X) and the
// projections zt (Rows() x P).
template <int NM>
__device__ void DenseMaps(const DenseLayout& l, const MapParams& p, const float (&sq)[NM],
                          const float* zt, float* cf) {
  const int N = l.N, P = l.P();
  if (l.hc) {
    for (int s = 0; s < N; ++s) HcStreamMaps(l, p, s, sq[s], zt, cf);
    return;
  }
  // MhcImpl::Read.
  const float r = MhcRms(l, sq);
  cf[0] = r;
  float* y = cf + 1;
  for (int q = 0; q < P; ++q) y[q] = zt[q] / r;
  float* hp = cf + l.Pre();
  float* hq = cf + l.Post();
  const float a_pre = *p.a_pre, a_post = *p.a_post, a_res = *p.a_res;
  for (int j = 0; j < N; ++j) {
    hp[j] = Sigmoid(a_pre * y[j] + p.b_pre[j]);
    hq[j] = 2.0f * Sigmoid(a_post * y[N + j] + p.b_post[j]);
  }
  float logits[NM * NM];
  for (int j = 0; j < N * N; ++j) logits[j] = a_res * y[2 * N + j] + p.b_res[j];
  SinkhornForward(N, l.iters, logits, cf + l.Res(), nullptr);
}

// Warp 0 of DenseRead above kThreadMapsMaxN streams: DenseMaps with lane s on stream s (mhc's
// H_res by the warp's Sinkhorn, lane a on row a); each lane stages its H_pre entry in hpre.
template <int NM>
__device__ void WarpDenseMaps(const DenseLayout& l, const MapParams& p, const float (&sq)[NM],
                              const float* zt, float* cf, float* hpre) {
  const int N = l.N, P = l.P(), lane = threadIdx.x % kWarp;
  if (l.hc) {
    if (lane < N) {
      HcStreamMaps(l, p, lane, Pick(sq, lane), zt, cf);
      hpre[lane] = cf[l.Pre() + lane];
    }
    return;
  }
  const float r = MhcRms(l, sq);
  if (lane == 0) cf[0] = r;
  for (int q = lane; q < P; q += kWarp) cf[1 + q] = zt[q] / r;
  const float a_pre = *p.a_pre, a_post = *p.a_post, a_res = *p.a_res;
  if (lane < N) {
    const float hp = Sigmoid(a_pre * (zt[lane] / r) + p.b_pre[lane]);
    cf[l.Pre() + lane] = hp;
    hpre[lane] = hp;
    cf[l.Post() + lane] = 2.0f * Sigmoid(a_post * (zt[N + lane] / r) + p.b_post[lane]);
  }
  float row[NM];
#pragma unroll
  for (int b = 0; b < NM; ++b) {
    const int e = lane * N + b;
    row[b] = lane < N && b < N ? a_res * (zt[2 * N + e] / r) + p.b_res[e] : 0.0f;
  }
  WarpSinkhornForward(N, l.iters, row);
  if (lane < N) {
#pragma unroll
    for (int b = 0; b < NM; ++b)
      if (b < N) cf[l.Res() + lane * N + b] = row[b];
  }
}

template <typename S, int NM>
__global__ void __launch_bounds__(kRowThreads)
    DenseReadKernel(DenseLayout l, const S* x, const float* z, MapParams p, float* coef, float* u,
                    S* saved) {
  __shared__ float red[NM * kWarp];
  __shared__ float hpre[NM];
  const int64_t t = blockIdx.x;
  const int N = l.N, C = l.C;
  const int64_t nc = static_cast<int64_t>(N) * C;
  const S* xt = x + t * nc;
  float sq[NM] = {};
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
#pragma unroll
    for (int j = 0; j < NM; ++j) {
      if (j >= N) break;
      const float v = ToF(xt[static_cast<int64_t>(j) * C + c]);
      sq[j] += v * v;
    }
  }
  BlockSum<float, NM>(sq, red, N);
  float* cf = coef + t * l.CoefStride();
  const float* zt = z + t * l.Rows() * l.P();
  if constexpr (NM > kThreadMapsMaxN) {
    if (threadIdx.x < kWarp) WarpDenseMaps(l, p, sq, zt, cf, hpre);
  } else if (threadIdx.x == 0) {
    DenseMaps(l, p, sq, zt, cf);
    for (int j = 0; j < N; ++j) hpre[j] = cf[l.Pre() + j];
  }
  __syncthreads();
  // The dense read and the saved copy, from the rows just read (in L1/L2).
  S* st = saved + t * nc;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = 0;
    for (int j = 0; j < N; ++j) {
      const S v = xt[static_cast<int64_t>(j) * C + c];
      st[static_cast<int64_t>(j) * C + c] = v;
      acc += hpre[j] * ToF(v);
    }
    u[t * C + c] = acc;
  }
}

template <typename S, int NM>
__global__ void DenseWriteKernel(DenseLayout l, int64_t tokens, const float* out, const float* coef,
                                 S* x, float* out_saved) {
  const int N = l.N, C = l.C;
  const int64_t total = tokens * C;
  for (int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; n < total;
       n += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = n / C;
    const int c = static_cast<int>(n - t * C);
    const float* cf = coef + t * l.CoefStride();
    const float* hpost = cf + l.Post();
    const float* hres = cf + l.Res();
    S* xt = x + t * N * C + c;
    float xv[NM] = {};
#pragma unroll
    for (int j = 0; j < NM; ++j)
      if (j < N) xv[j] = ToF(xt[static_cast<int64_t>(j) * C]);
    const float o = out[n];
    out_saved[n] = o;
    const auto write = [&](int i) {
      float y = 0;
#pragma unroll
      for (int j = 0; j < NM; ++j)
        if (j < N) y += hres[i * l.ResRow() + j * l.ResCol()] * xv[j];
      y += hpost[i] * o;
      xt[static_cast<int64_t>(i) * C] = FromF<S>(y);
    };
    if constexpr (NM > kThreadMapsMaxN) {
      // Unrolled over both loops, 16 x 16 coefficient loads took 255 registers and spilled.
#pragma unroll 1
      for (int i = 0; i < N; ++i) write(i);
    } else {
#pragma unroll
      for (int i = 0; i < NM; ++i) {
        if (i >= N) break;
        write(i);
      }
    }
  }
}

template <typename S, int NM>
__global__ void __launch_bounds__(kRowThreads)
    DenseWriteBackwardKernel(DenseLayout l, const S* saved, const float* out_saved,
                             const float* coef, float* dx, float* d_out, float* dcoef) {
  constexpr int R = NM + NM * NM;  // the dots
  __shared__ float red[R * kWarp];
  const int64_t t = blockIdx.x;
  const int N = l.N, C = l.C;
  const int64_t nc = static_cast<int64_t>(N) * C;
  const float* cf = coef + t * l.CoefStride();
  const float* hpost = cf + l.Post();
  const float* hres = cf + l.Res();
  const S* xt = saved + t * nc;
  float* dxt = dx + t * nc;
  float dots[R] = {};
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float g[NM], xp[NM];
#pragma unroll
    for (int j = 0; j < NM; ++j) {
      g[j] = j < N ? dxt[static_cast<int64_t>(j) * C + c] : 0.0f;
      xp[j] = j < N ? ToF(xt[static_cast<int64_t>(j) * C + c]) : 0.0f;
    }
    const float o = out_saved[t * C + c];
    float d = 0;
#pragma unroll
    for (int i = 0; i < NM; ++i) {
      if (i >= N) break;
      d += hpost[i] * g[i];
      dots[i] += g[i] * o;
#pragma unroll
      for (int j = 0; j < NM; ++j) dots[NM + i * NM + j] += g[i] * xp[j];
    }
    d_out[t * C + c] = d;
#pragma unroll
    for (int j = 0; j < NM; ++j) {
      if (j >= N) break;
      float v = 0;
#pragma unroll
      for (int i = 0; i < NM; ++i)
        if (i < N) v += hres[i * l.ResRow() + j * l.ResCol()] * g[i];
      dxt[static_cast<int64_t>(j) * C + c] = v;
    }
  }
  BlockSum<float, R>(dots, red);
  if (threadIdx.x == 0) {
    float* dc = dcoef + t * l.DcoefStride();
    for (int i = 0; i < N; ++i) {
      dc[i] = dots[i];
      for (int j = 0; j < N; ++j) dc[N + i * l.ResRow() + j * l.ResCol()] = dots[NM + i * NM + j];
    }
  }
}

// DenseWriteBackward above kThreadMapsMaxN streams: the token's G and saved X pass through
// shared memory in tiles of kDenseTile columns; thread q owns dot products q, q + 256, ...
// (q < N: <G_q, out>; then <G_i, x_j> at N + i N + j), summed over the columns in order; the
// tile's d_out and dx := H_res^T G are written from the same tile (dx's rows were read into
// it first, so the in-place write is safe).
constexpr int kDenseTile = 32;
template <typename S>
__global__ void __launch_bounds__(kRowThreads)
    DenseWriteBackwardTiledKernel(DenseLayout l, const S* saved, const float* out_saved,
                                  const float* coef, float* dx, float* d_out, float* dcoef) {
  constexpr int kOwned = (kDenseMaxN + kDenseMaxN * kDenseMaxN + kRowThreads - 1) / kRowThreads;
  // Rows padded by one column: a warp's dots read column cc of 32 different rows.
  __shared__ float gs[kDenseMaxN][kDenseTile + 1];
  __shared__ float xs[kDenseMaxN][kDenseTile + 1];
  __shared__ float os[kDenseTile];
  __shared__ float hres[kDenseMaxN * kDenseMaxN];  // hres[i * N + j] = H_res[i][j]
  __shared__ float hpost[kDenseMaxN];
  const int64_t t = blockIdx.x;
  const int N = l.N, C = l.C, dots = N + N * N;
  const int64_t nc = static_cast<int64_t>(N) * C;
  const float* cf = coef + t * l.CoefStride();
  for (int e = threadIdx.x; e < N * N; e += blockDim.x)
    hres[e] = cf[l.Res() + (e / N) * l.ResRow() + (e % N) * l.ResCol()];
  if (static_cast<int>(threadIdx.x) < N) hpost[threadIdx.x] = cf[l.Post() + threadIdx.x];
  const S* xt = saved + t * nc;
  float* dxt = dx + t * nc;
  float acc[kOwned] = {};
  for (int c0 = 0; c0 < C; c0 += kDenseTile) {
    const int w = C - c0 < kDenseTile ? C - c0 : kDenseTile;
    __syncthreads();  // the maps are staged; the previous tile's readers are done
    for (int e = threadIdx.x; e < N * kDenseTile; e += blockDim.x) {
      const int i = e / kDenseTile, cc = e % kDenseTile;
      const int64_t at = static_cast<int64_t>(i) * C + c0 + cc;
      gs[i][cc] = cc < w ? dxt[at] : 0.0f;
      xs[i][cc] = cc < w ? ToF(xt[at]) : 0.0f;
    }
    if (static_cast<int>(threadIdx.x) < kDenseTile)
      os[threadIdx.x] =
          static_cast<int>(threadIdx.x) < w ? out_saved[t * C + c0 + threadIdx.x] : 0.0f;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kOwned; ++k) {
      const int q = static_cast<int>(threadIdx.x) + k * kRowThreads;
      if (q >= dots) continue;
      const float* a = gs[q < N ? q : (q - N) / N];
      const float* b = q < N ? os : xs[(q - N) % N];
      for (int cc = 0; cc < w; ++cc) acc[k] += a[cc] * b[cc];
    }
    for (int cc = threadIdx.x; cc < w; cc += blockDim.x) {
      float d = 0;
      for (int i = 0; i < N; ++i) d += hpost[i] * gs[i][cc];
      d_out[t * C + c0 + cc] = d;
    }
    for (int e = threadIdx.x; e < N * kDenseTile; e += blockDim.x) {
      const int j = e / kDenseTile, cc = e % kDenseTile;
      if (cc >= w) continue;
      float v = 0;
      for (int i = 0; i < N; ++i) v += hres[i * N + j] * gs[i][cc];
      dxt[static_cast<int64_t>(j) * C + c0 + cc] = v;
    }
  }
  float* dc = dcoef + t * l.DcoefStride();
#pragma unroll
  for (int k = 0; k < kOwned; ++k) {
    const int q = static_cast<int>(threadIdx.x) + k * kRowThreads;
    if (q >= dots) continue;
    dc[q < N ? q : N + ((q - N) / N) * l.ResRow() + ((q - N) % N) * l.ResCol()] = acc[k];
  }
}

// hc's map gradients of stream s (HcImpl::ReadBackward's token_grad, one stream): the tanh
// maps' gradients, its row of c and its entries of scal; its terms of s_a's and s_b's
// gradients in sa and sb; returns alpha_s, the factor of x_s in dx_s.
__device__ float HcStreamGrads(const DenseLayout& l, const MapParams& p, int s, const float* cf,
                               const float* dc, float dam, float* ct, float* sc, float& sa,
                               float& sb) {
  const int N = l.N, P = l.P();
  const float s_a = *p.a_pre, s_b = *p.a_post;
  const float* rec = cf + s * (1 + P);
  const float r = rec[0];
  float* row = ct + s * P;
  float th = tanhf(rec[1]);
  sa = dam * th;
  sc[2 + s] = dam;
  row[0] = s_a * dam * (1.0f - th * th);
  for (int j = 0; j < N; ++j) {
    const float dar = dc[N + s * N + j];
    th = tanhf(rec[2 + j]);
    sa += dar * th;
    sc[2 + 2 * N + s * N + j] = dar;
    row[1 + j] = s_a * dar * (1.0f - th * th);
  }
  const float db = dc[s];
  th = tanhf(rec[2 + N]);
  sb = db * th;
  sc[2 + N + s] = db;
  row[1 + N] = s_b * db * (1.0f - th * th);
  float sum_dy_y = 0;
  for (int q = 0; q < P; ++q) {
    sum_dy_y += row[q] * rec[1 + q];
    row[q] /= r;
  }
  return -sum_dy_y / (static_cast<float>(l.C) * r * r);
}

// Thread 0 of DenseReadBackward for hc (N <= kThreadMapsMaxN): every stream in turn.
template <int NM>
__device__ void HcMapGrads(const DenseLayout& l, const MapParams& p, const float* cf,
                           const float* dc, const float (&dpre)[NM], float* ct, float* sc,
                           float (&alpha)[NM]) {
  float sa_total = 0, sb_total = 0;
  for (int s = 0; s < l.N; ++s) {
    float sa = 0, sb = 0;
    alpha[s] = HcStreamGrads(l, p, s, cf, dc, dpre[s], ct, sc, sa, sb);
    sa_total += sa;
    sb_total += sb;
  }
  sc[0] = sa_total;
  sc[1] = sb_total;
}

// Thread 0 of DenseReadBackward for mhc (MhcImpl::ReadBackward's token_grad): the logit
// gradients of H_pre, H_post and (through the recomputed Sinkhorn) H_res; c and scal; every
// alpha[s] the RMS norm's factor.
template <int NM>
__device__ void MhcMapGrads(const DenseLayout& l, const MapParams& p, const float* cf,
                            const float* dc, const float (&dpre)[NM], float* ct, float* sc,
                            float* tp, float (&alpha)[NM]) {
  const int N = l.N, P = l.P();
  const float r = cf[0];
  const float* y = cf + 1;
  const float* hp = cf + l.Pre();
  const float* hq = cf + l.Post();
  const float a_pre = *p.a_pre, a_post = *p.a_post, a_res = *p.a_res;
  for (int i = 0; i < l.ScalStride(); ++i) sc[i] = 0;
  for (int j = 0; j < N; ++j) {
    const float dl = dpre[j] * hp[j] * (1.0f - hp[j]);
    sc[0] += dl * y[j];
    sc[3 + j] = dl;
    ct[j] = a_pre * dl;
    const float h = hq[j] / 2.0f;
    const float dlp = dc[j] * 2.0f * h * (1.0f - h);
    sc[1] += dlp * y[N + j];
    sc[3 + N + j] = dlp;
    ct[N + j] = a_post * dlp;
  }
  float logits[NM * NM] = {}, hraw[NM * NM] = {}, dz[NM * NM] = {};
  for (int j = 0; j < N * N; ++j) logits[j] = a_res * y[2 * N + j] + p.b_res[j];
  SinkhornForward(N, l.iters, logits, hraw, tp);
  SinkhornBackward(N, l.iters, logits, tp, dc + N, dz);
  for (int j = 0; j < N * N; ++j) {
    sc[2] += dz[j] * y[2 * N + j];
    sc[3 + 2 * N + j] = dz[j];
    ct[2 * N + j] = a_res * dz[j];
  }
  float sum_dy_y = 0;
  for (int q = 0; q < P; ++q) {
    sum_dy_y += ct[q] * y[q];
    ct[q] /= r;
  }
  const float a = -sum_dy_y / (static_cast<float>(static_cast<int64_t>(N) * l.C) * r * r);
  for (int s = 0; s < N; ++s) alpha[s] = a;
}

// Warp 0 of DenseReadBackward above kThreadMapsMaxN streams: HcMapGrads or MhcMapGrads with
// lane s on stream s (mhc's Sinkhorn backward a lane per row, `sums` its scratch, tokens x
// DenseTapeFloats); each lane stages alpha_s in salpha.
template <int NM>
__device__ void WarpMapGrads(const DenseLayout& l, const MapParams& p, const float* cf,
                             const float* dc, const float (&dpre)[NM], float* ct, float* sc,
                             float* sums, float* salpha) {
  const int N = l.N, lane = threadIdx.x % kWarp;
  if (l.hc) {
    float sa = 0, sb = 0;
    if (lane < N)
      salpha[lane] = HcStreamGrads(l, p, lane, cf, dc, Pick(dpre, lane), ct, sc, sa, sb);
    sa = detail::WarpSum(sa);
    sb = detail::WarpSum(sb);
    if (lane == 0) {
      sc[0] = sa;
      sc[1] = sb;
    }
    return;
  }
  const float r = cf[0];
  const float* y = cf + 1;
  const float a_pre = *p.a_pre, a_post = *p.a_post, a_res = *p.a_res;
  // Partial sums of the three gains' gradients and of sum_q c_q y_q (before the 1/r).
  float s_pre = 0, s_post = 0, s_res = 0, dyy = 0;
  if (lane < N) {
    const float hp = cf[l.Pre() + lane];
    const float dl = Pick(dpre, lane) * hp * (1.0f - hp);
    s_pre = dl * y[lane];
    sc[3 + lane] = dl;
    const float cp = a_pre * dl;
    dyy += cp * y[lane];
    ct[lane] = cp / r;
    const float h = cf[l.Post() + lane] / 2.0f;
    const float dlp = dc[lane] * 2.0f * h * (1.0f - h);
    s_post = dlp * y[N + lane];
    sc[3 + N + lane] = dlp;
    const float cq = a_post * dlp;
    dyy += cq * y[N + lane];
    ct[N + lane] = cq / r;
  }
  float z[NM], g[NM];
#pragma unroll
  for (int b = 0; b < NM; ++b) {
    const int e = lane * N + b;
    const bool in = lane < N && b < N;
    z[b] = in ? a_res * y[2 * N + e] + p.b_res[e] : 0.0f;
    g[b] = in ? dc[N + e] : 0.0f;
  }
  WarpSinkhornBackward(N, l.iters, z, g, sums);
  if (lane < N) {
#pragma unroll
    for (int b = 0; b < NM; ++b) {
      if (b >= N) break;
      const int e = lane * N + b;
      s_res += g[b] * y[2 * N + e];
      sc[3 + 2 * N + e] = g[b];
      const float cz = a_res * g[b];
      dyy += cz * y[2 * N + e];
      ct[2 * N + e] = cz / r;
    }
  }
  s_pre = detail::WarpSum(s_pre);
  s_post = detail::WarpSum(s_post);
  s_res = detail::WarpSum(s_res);
  dyy = detail::WarpSum(dyy);
  if (lane == 0) {
    sc[0] = s_pre;
    sc[1] = s_post;
    sc[2] = s_res;
  }
  const float a = -dyy / (static_cast<float>(static_cast<int64_t>(N) * l.C) * r * r);
  if (lane < N) salpha[lane] = a;
}

template <typename S, int NM>
__global__ void __launch_bounds__(kRowThreads)
    DenseReadBackwardKernel(DenseLayout l, const S* saved, const float* du, const float* coef,
                            const float* dcoef, MapParams p, float* dx, float* c, float* scal,
                            float* tape, int64_t tape_floats) {
  __shared__ float red[NM * kWarp];
  __shared__ float hpre[NM];
  __shared__ float salpha[NM];
  const int64_t t = blockIdx.x;
  const int N = l.N, C = l.C;
  const int64_t nc = static_cast<int64_t>(N) * C;
  const float* cf = coef + t * l.CoefStride();
  const S* xt = saved + t * nc;
  const float* dut = du + t * C;
  if (static_cast<int>(threadIdx.x) < N) hpre[threadIdx.x] = cf[l.Pre() + threadIdx.x];
  float dpre[NM];
  StreamDots<S, NM>(N, C, xt, dut, dpre, red);
  const float* dc = dcoef + t * l.DcoefStride();
  float* ct = c + t * l.Rows() * l.P();
  float* sc = scal + t * l.ScalStride();
  if constexpr (NM > kThreadMapsMaxN) {
    if (threadIdx.x < kWarp)
      WarpMapGrads(l, p, cf, dc, dpre, ct, sc, tape + t * tape_floats, salpha);
  } else if (threadIdx.x == 0) {
    float alpha[NM] = {};
    if (l.hc) {
      HcMapGrads(l, p, cf, dc, dpre, ct, sc, alpha);
    } else {
      MhcMapGrads(l, p, cf, dc, dpre, ct, sc, tape + t * tape_floats, alpha);
    }
    for (int s = 0; s < N; ++s) salpha[s] = alpha[s];
  }
  __syncthreads();
  float* dxt = dx + t * nc;
  for (int c2 = threadIdx.x; c2 < C; c2 += blockDim.x) {
    const float d = dut[c2];
    for (int j = 0; j < N; ++j) {
      const int64_t e = static_cast<int64_t>(j) * C + c2;
      float v = dxt[e] + hpre[j] * d;
      v = v + salpha[j] * ToF(xt[e]);
      dxt[e] = v;
    }
  }
}

template <typename S>
__global__ void CollapseKernel(Layout l, int64_t tokens, const S* x, float* y) {
  const int64_t total = tokens * l.C;
  for (int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; n < total;
       n += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = n / l.C;
    const int c = static_cast<int>(n - t * l.C);
    float s = 0;
    for (int i = 0; i < l.N; ++i) s += ToF(x[(t * l.N + i) * l.C + c]);
    y[n] = s;
  }
}

__global__ void CollapseBackwardKernel(Layout l, int64_t tokens, const float* dy, float* dx) {
  const int64_t total = tokens * l.N * l.C;
  for (int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; n < total;
       n += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = n / (static_cast<int64_t>(l.N) * l.C);
    const int c = static_cast<int>(n % l.C);
    dx[n] = dy[t * l.C + c];
  }
}

// Per-token kernels: 4 elements per thread up to C = 1024 (at most 256 threads), 8 above (at
// most 512 threads up to C = 4096). Sixteen per thread compiled to 255 registers and spilled
// in the write's backward, and took three times as long to compile.

// Threads per block for a per-token kernel with EPT elements per thread.
int ThreadsFor(int C, int ept) {
  const int t = (C + ept - 1) / ept;
  return (t + kWarp - 1) / kWarp * kWarp;
}

}  // namespace

int64_t SinkhornTapeFloats(int n, int iters) {
  return static_cast<int64_t>(n) * n + static_cast<int64_t>(iters) * (n * n + 2 * n);
}

cudaError_t RouterColumnSums(const Layout& l, const float* w_router, float* colsum,
                             cudaStream_t stream) {
  Launch(RouterColumnSumsKernel, l.N, 256, 0, stream)(static_cast<int64_t>(l.N) * l.C, w_router,
                                                      colsum);
  return cudaGetLastError();
}

template <typename S>
cudaError_t ReadEntry(const Layout& l, int64_t tokens, const S* x, const float* z,
                      const float* colsum, const MapParams& p, float* rec, int32_t* idx, float* u,
                      float* base, S* saved, float* coef, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  if (l.g < 1 || l.g > kMaxG || (l.g > 1 && base == nullptr)) return cudaErrorInvalidValue;
  Launch(ReadEntryKernel<S>, static_cast<unsigned>(tokens), kRowThreads, 0, stream)(
      l, x, z, colsum, p, rec, idx, u, base, saved, coef);
  return cudaGetLastError();
}

template <typename S>
cudaError_t ReadBase(const Layout& l, int64_t tokens, const S* x, const float* base,
                     const float* rec, const int32_t* idx, float* u, S* saved, float* coef,
                     cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  if (l.s < 1 || l.s >= l.g) return cudaErrorInvalidValue;
  Launch(ReadBaseKernel<S>, static_cast<unsigned>(tokens), kRowThreads, 0, stream)(
      l, x, base, rec, idx, u, saved, coef);
  return cudaGetLastError();
}

cudaError_t ActiveMaps(const Layout& l, int64_t tokens, const float* q, const MapParams& p,
                       float* coef, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  Launch(ActiveMapsKernel, BlocksFor(tokens, 64), 64, 0, stream)(l, tokens, q, p, coef);
  return cudaGetLastError();
}

template <typename S>
cudaError_t Write(const Layout& l, int64_t tokens, const float* out, const int32_t* segment,
                  const MapParams& p, const float* rec, const int32_t* idx, const float* coef, S* x,
                  S* saved, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(tokens);
  if (l.C <= 1024) {
    Launch(WriteKernel<S, 4>, blocks, ThreadsFor(l.C, 4), 0, stream)(l, out, segment, p, rec, idx,
                                                                     coef, x, saved);
  } else {
    Launch(WriteKernel<S, 8>, blocks, ThreadsFor(l.C, 8), 0, stream)(l, out, segment, p, rec, idx,
                                                                     coef, x, saved);
  }
  return cudaGetLastError();
}

template <typename S>
cudaError_t RebuildBasis(const Layout& l, int64_t tokens, const S* saved, const int32_t* segment,
                         const MapParams& p, S* basis, cudaStream_t stream) {
  if (tokens == 0 || l.J == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(tokens);
  if (l.C <= 1024) {
    Launch(RebuildBasisKernel<S, 4>, blocks, ThreadsFor(l.C, 4), 0, stream)(l, saved, segment, p,
                                                                            basis);
  } else {
    Launch(RebuildBasisKernel<S, 8>, blocks, ThreadsFor(l.C, 8), 0, stream)(l, saved, segment, p,
                                                                            basis);
  }
  return cudaGetLastError();
}

template <typename S>
cudaError_t WriteBackward(const Layout& l, int64_t tokens, const float* dx, const S* saved,
                          const S* basis, const int32_t* segment, const MapParams& p,
                          const float* rec, const int32_t* idx, const float* coef, float* da,
                          float* d_out, float* dg, float* dp, float* c2, float* wscal, float* tape,
                          cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(tokens);
  const int64_t tf = SinkhornTapeFloats(l.k, l.iters);
  if (l.C <= 1024) {
    Launch(WriteBackwardKernel<S, 4>, blocks, ThreadsFor(l.C, 4), 0, stream)(
        l, dx, saved, basis, segment, p, rec, idx, coef, da, d_out, dg, dp, c2, wscal, tape, tf);
  } else {
    Launch(WriteBackwardKernel<S, 8>, blocks, ThreadsFor(l.C, 8), 0, stream)(
        l, dx, saved, basis, segment, p, rec, idx, coef, da, d_out, dg, dp, c2, wscal, tape, tf);
  }
  return cudaGetLastError();
}

template <typename S>
cudaError_t ScatterActive(const Layout& l, int64_t tokens, const float* da, const S* saved,
                          const int32_t* idx, float* dx, S* x, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  Launch(ScatterActiveKernel<S>, GridStrideBlocks(tokens * l.k * l.C, 256), 256, 0, stream)(
      l, tokens, da, saved, idx, dx, x);
  return cudaGetLastError();
}

int64_t ConvPartialFloats(const Layout& l, int64_t tokens, const int* taps) {
  int total = 0;
  for (int j = 0; j < l.J; ++j) total += taps[j];
  const int64_t chunks = (tokens + kTokenChunk - 1) / kTokenChunk;
  return chunks * total * l.C;
}

template <typename S>
cudaError_t ConvolutionsBackward(const Layout& l, int64_t tokens, const float* dg, const S* saved,
                                 const int32_t* segment, const MapParams& p, float* d_out,
                                 float* dconv, float* partial, cudaStream_t stream) {
  if (tokens == 0 || l.J == 0) return cudaSuccess;
  Launch(ConvInputGradKernel, GridStrideBlocks(tokens * l.C, 256), 256, 0, stream)(
      l, tokens, dg, segment, p, d_out);
  int total = 0;
  for (int j = 0; j < l.J; ++j) total += p.conv_taps[j];
  const int64_t chunks = (tokens + kTokenChunk - 1) / kTokenChunk;
  const dim3 grid((l.C + 127) / 128, total, static_cast<unsigned>(chunks));
  Launch(ConvWeightPartialKernel<S>, grid, 128, 0, stream)(l, tokens, dg, saved, segment, p, total,
                                                           partial);
  // The convolutions' gradients are adjacent, taps in order: tap row r of them all is row r,
  // so the partials' columns are dconv's.
  Launch(detail::SumChunkPartialsKernel<float, float>, (total * l.C + 127) / 128, 128, 0, stream)(
      chunks, total * l.C, partial, /*add=*/true, dconv);
  return cudaGetLastError();
}

template <typename S>
cudaError_t ReadBackward(const Layout& l, int64_t tokens, const S* x, const float* du,
                         const float* dp, const float* colsum, const MapParams& p, const float* rec,
                         const int32_t* idx, float* dx, float* dypre, float* c1, float* rscal,
                         cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  Launch(ReadBackwardKernel<S>, static_cast<unsigned>(tokens), kRowThreads, 0, stream)(
      l, x, du, dp, colsum, p, rec, idx, dx, dypre, c1, rscal);
  return cudaGetLastError();
}

cudaError_t RouterCentring(const Layout& l, int64_t tokens, const float* c1, const float* rec,
                           float* dw_router, float* corr, float* partial, cudaStream_t stream) {
  detail::ColumnSums(tokens, l.N, kTokenChunk, CentringTerm{c1, rec, l.P1(), l.RecStride()},
                     partial,
                     /*add=*/false, corr, stream);
  const int64_t nc = static_cast<int64_t>(l.N) * l.C;
  Launch(RouterCentringApplyKernel, GridStrideBlocks(l.N * nc, 256), 256, 0, stream)(
      l.N * nc, nc, corr, dw_router);
  return cudaGetLastError();
}

int64_t ColumnSumPartialFloats(int64_t tokens, int count) {
  return detail::ChunkCount(tokens, kTokenChunk) * count;
}

cudaError_t SumScalars(int64_t tokens, int stride, int count, const float* scal, float* grads,
                       float* partial, cudaStream_t stream) {
  detail::ColumnSums(tokens, count, kTokenChunk, StridedColumn{scal, stride}, partial,
                     /*add=*/true, grads, stream);
  return cudaGetLastError();
}

template <typename S>
cudaError_t Collapse(const Layout& l, int64_t tokens, const S* x, float* y, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  Launch(CollapseKernel<S>, GridStrideBlocks(tokens * l.C, 256), 256, 0, stream)(l, tokens, x, y);
  return cudaGetLastError();
}

cudaError_t CollapseBackward(const Layout& l, int64_t tokens, const float* dy, float* dx,
                             cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  Launch(CollapseBackwardKernel, GridStrideBlocks(tokens * l.N * l.C, 256), 256, 0, stream)(
      l, tokens, dy, dx);
  return cudaGetLastError();
}

int64_t DenseTapeFloats(const DenseLayout& l) {
  return l.N <= kThreadMapsMaxN ? SinkhornTapeFloats(l.N, l.iters) : int64_t{2} * l.N * l.iters;
}

namespace {

// Calls launch(std::integral_constant<int, NM>) with NM the smallest of the dense kernels'
// stream-array sizes (4, 8, 16) that holds n streams (n <= kDenseMaxN).
template <typename F>
void ByStreamArray(int n, F&& launch) {
  if (n <= 4) {
    launch(std::integral_constant<int, 4>{});
  } else if (n <= 8) {
    launch(std::integral_constant<int, 8>{});
  } else {
    static_assert(kDenseMaxN == 16);
    launch(std::integral_constant<int, 16>{});
  }
}

}  // namespace

template <typename S>
cudaError_t DenseRead(const DenseLayout& l, int64_t tokens, const S* x, const float* z,
                      const MapParams& p, float* coef, float* u, S* saved, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  if (l.N > kDenseMaxN) return cudaErrorInvalidValue;
  ByStreamArray(l.N, [&](auto nm) {
    Launch(DenseReadKernel<S, decltype(nm)::value>, static_cast<unsigned>(tokens), kRowThreads, 0,
           stream)(l, x, z, p, coef, u, saved);
  });
  return cudaGetLastError();
}

template <typename S>
cudaError_t DenseWrite(const DenseLayout& l, int64_t tokens, const float* out, const float* coef,
                       S* x, float* out_saved, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  if (l.N > kDenseMaxN) return cudaErrorInvalidValue;
  ByStreamArray(l.N, [&](auto nm) {
    Launch(DenseWriteKernel<S, decltype(nm)::value>, GridStrideBlocks(tokens * l.C, 256), 256, 0,
           stream)(l, tokens, out, coef, x, out_saved);
  });
  return cudaGetLastError();
}

template <typename S>
cudaError_t DenseWriteBackward(const DenseLayout& l, int64_t tokens, const S* saved,
                               const float* out_saved, const float* coef, float* dx, float* d_out,
                               float* dcoef, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  if (l.N > kDenseMaxN) return cudaErrorInvalidValue;
  if (l.N > kThreadMapsMaxN) {
    Launch(DenseWriteBackwardTiledKernel<S>, static_cast<unsigned>(tokens), kRowThreads, 0, stream)(
        l, saved, out_saved, coef, dx, d_out, dcoef);
    return cudaGetLastError();
  }
  ByStreamArray(l.N, [&](auto nm) {
    if constexpr (decltype(nm)::value <= kThreadMapsMaxN) {
      Launch(DenseWriteBackwardKernel<S, decltype(nm)::value>, static_cast<unsigned>(tokens),
             kRowThreads, 0, stream)(l, saved, out_saved, coef, dx, d_out, dcoef);
    }
  });
  return cudaGetLastError();
}

template <typename S>
cudaError_t DenseReadBackward(const DenseLayout& l, int64_t tokens, const S* saved, const float* du,
                              const float* coef, const float* dcoef, const MapParams& p, float* dx,
                              float* c, float* scal, float* tape, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  if (l.N > kDenseMaxN) return cudaErrorInvalidValue;
  const int64_t tape_floats = DenseTapeFloats(l);
  ByStreamArray(l.N, [&](auto nm) {
    Launch(DenseReadBackwardKernel<S, decltype(nm)::value>, static_cast<unsigned>(tokens),
           kRowThreads, 0, stream)(l, saved, du, coef, dcoef, p, dx, c, scal, tape, tape_floats);
  });
  return cudaGetLastError();
}

cudaError_t SinkhornBatch(int count, int n, int iters, const float* z, float* h, const float* dh,
                          float* dz, float* tape, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  if (n > kDenseMaxN) return cudaErrorInvalidValue;
  if (n <= kMaxSinkhornN) {
    Launch(SinkhornBatchKernel, (count + 63) / 64, 64, 0, stream)(
        count, n, iters, z, h, dh, dz, tape, SinkhornTapeFloats(n, iters));
  } else {
    constexpr int kWarpsPerBlock = 4;
    Launch(WarpSinkhornBatchKernel, (count + kWarpsPerBlock - 1) / kWarpsPerBlock,
           kWarpsPerBlock * kWarp, 0,
           stream)(count, n, iters, z, h, dh, dz, tape, SinkhornTapeFloats(n, iters));
  }
  return cudaGetLastError();
}

#define RACKRUN_XHC_INSTANTIATE(S)                                                                 \
  template cudaError_t ReadEntry<S>(const Layout&, int64_t, const S*, const float*, const float*,  \
                                    const MapParams&, float*, int32_t*, float*, float*, S*,        \
                                    float*, cudaStream_t);                                         \
  template cudaError_t ReadBase<S>(const Layout&, int64_t, const S*, const float*, const float*,   \
                                   const int32_t*, float*, S*, float*, cudaStream_t);              \
  template cudaError_t Write<S>(const Layout&, int64_t, const float*, const int32_t*,              \
                                const MapParams&, const float*, const int32_t*, const float*, S*,  \
                                S*, cudaStream_t);                                                 \
  template cudaError_t RebuildBasis<S>(const Layout&, int64_t, const S*, const int32_t*,           \
                                       const MapParams&, S*, cudaStream_t);                        \
  template cudaError_t WriteBackward<S>(const Layout&, int64_t, const float*, const S*, const S*,  \
                                        const int32_t*, const MapParams&, const float*,            \
                                        const int32_t*, const float*, float*, float*, float*,      \
                                        float*, float*, float*, float*, cudaStream_t);             \
  template cudaError_t ScatterActive<S>(const Layout&, int64_t, const float*, const S*,            \
                                        const int32_t*, float*, S*, cudaStream_t);                 \
  template cudaError_t ConvolutionsBackward<S>(const Layout&, int64_t, const float*, const S*,     \
                                               const int32_t*, const MapParams&, float*, float*,   \
                                               float*, cudaStream_t);                              \
  template cudaError_t ReadBackward<S>(const Layout&, int64_t, const S*, const float*,             \
                                       const float*, const float*, const MapParams&, const float*, \
                                       const int32_t*, float*, float*, float*, float*,             \
                                       cudaStream_t);                                              \
  template cudaError_t Collapse<S>(const Layout&, int64_t, const S*, float*, cudaStream_t);        \
  template cudaError_t DenseRead<S>(const DenseLayout&, int64_t, const S*, const float*,           \
                                    const MapParams&, float*, float*, S*, cudaStream_t);           \
  template cudaError_t DenseWrite<S>(const DenseLayout&, int64_t, const float*, const float*, S*,  \
                                     float*, cudaStream_t);                                        \
  template cudaError_t DenseWriteBackward<S>(const DenseLayout&, int64_t, const S*, const float*,  \
                                             const float*, float*, float*, float*, cudaStream_t);  \
  template cudaError_t DenseReadBackward<S>(const DenseLayout&, int64_t, const S*, const float*,   \
                                            const float*, const float*, const MapParams&, float*,  \
                                            float*, float*, float*, cudaStream_t);

RACKRUN_XHC_INSTANTIATE(float)
RACKRUN_XHC_INSTANTIATE(__nv_bfloat16)
#undef RACKRUN_XHC_INSTANTIATE

}  // namespace rackrun::runtime::cuda::xhc
