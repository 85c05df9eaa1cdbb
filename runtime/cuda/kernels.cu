// Device code of runtime/cuda/kernels.h. Simple, checkable forms first (one block per row
// for row-wise work, grid-stride loops for element-wise work); each kernel's test compares it
// with the CPU function it mirrors (runtime/cuda/kernels_test.cc).
#include <cuda_bf16.h>

#include <cfloat>
#include <cstdint>

#include "runtime/cuda/kernels.h"
#include "runtime/cuda/launch.cuh"
#include "runtime/cuda/reduce.cuh"

namespace rackrun::runtime::cuda::kernels {
namespace {

using detail::BlockMax;
using detail::BlockSum;
using detail::BlockSum1;
using detail::kWarp;
using detail::Sigmoid;

constexpr int kThreads = 256;
constexpr float kRmsEps = 1e-6f;
// Rows per chunk of a column reduction's first pass.
constexpr int64_t kRowChunk = 64;

// ---------------------------------------------------------------- element-wise

__global__ void F32ToBf16Kernel(int64_t n, const float* in, __nv_bfloat16* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __float2bfloat16_rn(in[i]);
  }
}

__global__ void Bf16ToF32Kernel(int64_t n, const __nv_bfloat16* in, float* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __bfloat162float(in[i]);
  }
}

__global__ void CopyKernel(int64_t n16, const uint4* __restrict__ src, uint4* __restrict__ dst) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n16;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = src[i];
  }
}

// ---------------------------------------------------------------- RMSNorm

__global__ void RmsNormForwardKernel(int width, const float* x, const float* gain, float* y,
                                     float* inv_rms) {
  __shared__ float scratch[kWarp];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * width;
  float ss = 0;
  for (int i = threadIdx.x; i < width; i += blockDim.x) ss += xr[i] * xr[i];
  ss = BlockSum1(ss, scratch);
  const float s = 1.0f / sqrtf(ss / static_cast<float>(width) + kRmsEps);
  if (threadIdx.x == 0) inv_rms[r] = s;
  float* yr = y + r * width;
  for (int i = threadIdx.x; i < width; i += blockDim.x) yr[i] = gain[i] * xr[i] * s;
}

__global__ void RmsNormBackwardRowsKernel(int width, const float* x, const float* gain,
                                          const float* inv_rms, const float* dy, float* dx) {
  __shared__ float scratch[kWarp];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * width;
  const float* dyr = dy + r * width;
  const float s = inv_rms[r];
  float dot = 0;
  for (int i = threadIdx.x; i < width; i += blockDim.x) dot += gain[i] * dyr[i] * xr[i];
  dot = BlockSum1(dot, scratch);
  const float k = s * s * s * dot / static_cast<float>(width);
  float* dxr = dx + r * width;
  for (int i = threadIdx.x; i < width; i += blockDim.x) dxr[i] = s * gain[i] * dyr[i] - k * xr[i];
}

// The gain's gradient term of one row and column: dy * x * inv_rms.
struct RmsGainTerm {
  const float* x;
  const float* inv_rms;
  const float* dy;
  int width;
  __device__ float operator()(int64_t r, int c) const {
    return dy[r * width + c] * x[r * width + c] * inv_rms[r];
  }
};

// ---------------------------------------------------------------- SwiGLU

// Element i of act (rows x F) and the offset of its gate in h13 (rows x 2F, [g | up]).
__device__ __forceinline__ int64_t GateOffset(int64_t i, int hidden) {
  const int64_t r = i / hidden;
  return r * 2 * hidden + (i - r * hidden);
}

__global__ void SwigluKernel(int64_t rows, int hidden, const float* h13, float* act) {
  const int64_t n = rows * hidden;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t o = GateOffset(i, hidden);
    const float g = h13[o];
    act[i] = g * Sigmoid(g) * h13[o + hidden];
  }
}

__global__ void SwigluBackwardKernel(int64_t rows, int hidden, const float* h13, const float* dact,
                                     float* dh13) {
  const int64_t n = rows * hidden;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t o = GateOffset(i, hidden);
    const float g = h13[o], up = h13[o + hidden];
    const float s = Sigmoid(g);
    const float da = dact[i];
    dh13[o + hidden] = da * g * s;
    dh13[o] = da * up * (s + g * s * (1.0f - s));
  }
}

// ---------------------------------------------------------------- routing

// One thread per token (E and k are small: the selection is E * k comparisons).
__global__ void RouterForwardKernel(int64_t tokens, int experts, int k, float* scores,
                                    const float* bias, int32_t* selected, float* weights) {
  const int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (t >= tokens) return;
  float* s = scores + t * experts;
  float mx = s[0];
  for (int e = 1; e < experts; ++e) mx = fmaxf(mx, s[e]);
  float sum = 0;
  for (int e = 0; e < experts; ++e) {
    s[e] = expf(s[e] - mx);
    sum += s[e];
  }
  const float inv = 1.0f / sum;
  for (int e = 0; e < experts; ++e) s[e] *= inv;
  int32_t* st = selected + t * k;
  float gate_sum = 0;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    float best_v = 0;
    for (int e = 0; e < experts; ++e) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken |= st[i] == e;
      if (taken) continue;
      const float v = s[e] + (bias != nullptr ? bias[e] : 0.0f);
      if (best < 0 || v > best_v) {
        best = e;
        best_v = v;
      }
    }
    st[j] = best;
    gate_sum += s[best];
  }
  for (int j = 0; j < k; ++j) weights[t * k + j] = s[st[j]] / gate_sum;
}

__global__ void ZeroIntsKernel(int n, int32_t* p) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = 0;
}

__global__ void ExpertCountsKernel(int64_t slots, const int32_t* selected, int32_t* counts) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < slots;
       i += int64_t{gridDim.x} * blockDim.x) {
    atomicAdd(&counts[selected[i]], 1);
  }
}

__global__ void ExpertOffsetsKernel(int experts, const int32_t* counts, int64_t* offsets) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int64_t sum = 0;
  offsets[0] = 0;
  for (int e = 0; e < experts; ++e) {
    sum += counts[e];
    offsets[e + 1] = sum;
  }
}

__global__ void SelectionBiasKernel(int experts, const int32_t* counts, double rate, float* bias) {
  // One thread: E is small, and the total is summed in expert order as on the CPU.
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int64_t total = 0;
  for (int e = 0; e < experts; ++e) total += counts[e];
  const double mean = static_cast<double>(total) / experts;
  for (int e = 0; e < experts; ++e) {
    const double err = mean - static_cast<double>(counts[e]);
    const double sign = err > 0 ? 1.0 : (err < 0 ? -1.0 : 0.0);
    bias[e] += static_cast<float>(rate * sign);
  }
}

__global__ void RouterBackwardKernel(int64_t tokens, int experts, int k, const float* scores,
                                     const int32_t* selected, const float* weights,
                                     const float* dweights, const float* aux, float* dlogits) {
  const int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (t >= tokens) return;
  const float* s = scores + t * experts;
  const int32_t* sel = selected + t * k;
  float* d = dlogits + t * experts;
  float dot = 0, gate_sum = 0;
  for (int j = 0; j < k; ++j) {
    dot += dweights[t * k + j] * weights[t * k + j];
    gate_sum += s[sel[j]];
  }
  for (int e = 0; e < experts; ++e) d[e] = 0;
  for (int j = 0; j < k; ++j) d[sel[j]] = (dweights[t * k + j] - dot) / gate_sum;
  if (aux != nullptr)
    for (int e = 0; e < experts; ++e) d[e] += aux[e];
  float sd = 0;
  for (int e = 0; e < experts; ++e) sd += s[e] * d[e];
  for (int e = 0; e < experts; ++e) d[e] = s[e] * (d[e] - sd);
}

// SlotRows, a stable counting sort without atomics, in three passes over chunks of
// kSlotChunk slots, one thread per (chunk, expert): the chunk's slots of the expert counted;
// per expert, the chunks' first rows (the offset plus the counts of the chunks before); the
// chunk's slots of the expert numbered in order. The same result as one thread per expert
// walking every slot (32768 steps at c1024's 8192 tokens x top-4), in a few hundred.
constexpr int64_t kSlotChunk = 512;

__global__ void SlotChunkCountsKernel(int64_t slots, int experts, const int32_t* selected,
                                      int64_t* first) {
  const int e = blockIdx.y * blockDim.x + threadIdx.x;
  const int64_t chunk = blockIdx.x;
  if (e >= experts) return;
  const int64_t i0 = chunk * kSlotChunk;
  const int64_t i1 = i0 + kSlotChunk < slots ? i0 + kSlotChunk : slots;
  int64_t n = 0;
  for (int64_t i = i0; i < i1; ++i) n += selected[i] == e ? 1 : 0;
  first[chunk * experts + e] = n;
}

__global__ void SlotChunkFirstKernel(int64_t chunks, int experts, const int64_t* offsets,
                                     int64_t* first) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= experts) return;
  int64_t cursor = offsets[e];
  for (int64_t q = 0; q < chunks; ++q) {
    const int64_t n = first[q * experts + e];
    first[q * experts + e] = cursor;
    cursor += n;
  }
}

__global__ void SlotRowsKernel(int64_t slots, int experts, const int32_t* selected,
                               const int64_t* first, int64_t* slot_row) {
  const int e = blockIdx.y * blockDim.x + threadIdx.x;
  const int64_t chunk = blockIdx.x;
  if (e >= experts) return;
  const int64_t i0 = chunk * kSlotChunk;
  const int64_t i1 = i0 + kSlotChunk < slots ? i0 + kSlotChunk : slots;
  int64_t cursor = first[chunk * experts + e];
  for (int64_t i = i0; i < i1; ++i)
    if (selected[i] == e) slot_row[i] = cursor++;
}

__global__ void DispatchRowsKernel(int64_t slots, int k, int width, const int64_t* slot_row,
                                   const float* x, float* dispatched) {
  const int64_t i = blockIdx.x;  // slot
  if (i >= slots) return;
  const float* src = x + (i / k) * width;
  float* dst = dispatched + slot_row[i] * width;
  for (int c = threadIdx.x; c < width; c += blockDim.x) dst[c] = src[c];
}

__global__ void GatherRowsKernel(int64_t divisor, int width, const int64_t* index, const float* src,
                                 float* dst) {
  const int64_t q = blockIdx.x;
  const float* s = src + index[q] / divisor * width;
  float* d = dst + q * width;
  for (int c = threadIdx.x; c < width; c += blockDim.x) d[c] = s[c];
}

__global__ void CombineRowsKernel(int k, int width, const int64_t* slot_row, const float* weights,
                                  const float* src, bool add, float* out) {
  const int64_t t = blockIdx.x;
  float* o = out + t * width;
  for (int c = threadIdx.x; c < width; c += blockDim.x) {
    float acc = add ? o[c] : 0.0f;
    for (int j = 0; j < k; ++j) {
      const float y = src[slot_row[t * k + j] * width + c];
      acc += weights != nullptr ? weights[t * k + j] * y : y;
    }
    o[c] = acc;
  }
}

__global__ void CombineRowsBackwardKernel(int k, int width, const int64_t* slot_row,
                                          const float* weights, const float* src, const float* dout,
                                          float* dsrc, float* dweights) {
  RACKRUN_DYNAMIC_SHARED(float, scratch);  // k * 32
  const int64_t t = blockIdx.x;
  const float* d = dout + t * width;
  // k <= 64 (the spec's limit); dots per slot, reduced k at a time over the block.
  for (int j = 0; j < k; ++j) {
    const int64_t row = slot_row[t * k + j];
    const float g = weights[t * k + j];
    float acc = 0;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
      acc += d[c] * src[row * width + c];
      dsrc[row * width + c] = g * d[c];
    }
    acc = BlockSum1(acc, scratch);
    if (threadIdx.x == 0) dweights[t * k + j] = acc;
  }
}

// ---------------------------------------------------------------- cross-entropy

__global__ void CrossEntropyForwardKernel(int vocab, float* logits, const int32_t* targets,
                                          double* row_loss) {
  __shared__ float scratch[kWarp];
  const int64_t r = blockIdx.x;
  float* l = logits + r * vocab;
  float mx = -FLT_MAX;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) mx = fmaxf(mx, l[j]);
  mx = BlockMax(mx, scratch);
  float sum = 0;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float e = expf(l[j] - mx);
    l[j] = e;
    sum += e;
  }
  sum = BlockSum1(sum, scratch);
  const float inv = 1.0f / sum;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) l[j] *= inv;
  __syncthreads();
  if (threadIdx.x == 0) {
    const int32_t tgt = targets[r];
    row_loss[r] = tgt >= 0 ? -log(static_cast<double>(l[tgt])) : 0.0;
  }
}

__global__ void SumRowsKernel(int64_t rows, const double* v, double* out) {
  __shared__ double scratch[kWarp];
  double acc = 0;
  for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) acc += v[i];
  acc = BlockSum1(acc, scratch);
  if (threadIdx.x == 0) *out = acc;
}

__global__ void CrossEntropyBackwardKernel(int vocab, float* p, const int32_t* targets,
                                           float scale) {
  const int64_t r = blockIdx.x;
  float* pr = p + r * vocab;
  const int32_t tgt = targets[r];
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
    if (tgt < 0) {
      pr[j] = 0;
    } else {
      pr[j] = ((j == tgt ? pr[j] - 1.0f : pr[j])) * scale;
    }
  }
}

// ---------------------------------------------------------------- optimizer

// Products and sums rounded one at a time (no contraction): the CPU's expression.
__global__ void AdamWKernel(const AdamTensor* table, int64_t chunks, const int32_t* chunk_tensor,
                            const int64_t* chunk_start, float beta1, float beta2, float step_size,
                            float inv_sqrt_bias2, float eps, float decay_shrink,
                            const float* scale_ptr) {
  const float scale = scale_ptr != nullptr ? *scale_ptr : 1.0f;
  for (int64_t q = blockIdx.x; q < chunks; q += gridDim.x) {
    const AdamTensor t = table[chunk_tensor[q]];
    const float shrink = t.decay != 0 ? decay_shrink : 1.0f;
    const int64_t start = chunk_start[q];
    const int64_t end = start + kChunk < t.size ? start + kChunk : t.size;
    for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
      const float g = __fmul_rn(t.grad[i], scale);
      const float m = __fadd_rn(__fmul_rn(beta1, t.m[i]), __fmul_rn(1.0f - beta1, g));
      const float v = __fadd_rn(__fmul_rn(beta2, t.v[i]), __fmul_rn(__fmul_rn(1.0f - beta2, g), g));
      t.m[i] = m;
      t.v[i] = v;
      const float denom = __fadd_rn(__fmul_rn(sqrtf(v), inv_sqrt_bias2), eps);
      t.value[i] =
          __fsub_rn(__fmul_rn(t.value[i], shrink), __fdiv_rn(__fmul_rn(step_size, m), denom));
    }
  }
}

__global__ void CopySpansKernel(const CopySpan* spans, int64_t chunks, const int32_t* chunk_span,
                                const int64_t* chunk_start) {
  for (int64_t q = blockIdx.x; q < chunks; q += gridDim.x) {
    const CopySpan s = spans[chunk_span[q]];
    const int64_t start = chunk_start[q];
    const int64_t end = start + kChunk < s.size ? start + kChunk : s.size;
    for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) s.to[i] = s.from[i];
  }
}

__global__ void SquaresKernel(const AdamTensor* table, int64_t chunks, const int32_t* chunk_tensor,
                              const int64_t* chunk_start, double* partial) {
  __shared__ double scratch[kWarp];
  for (int64_t q = blockIdx.x; q < chunks; q += gridDim.x) {
    const AdamTensor t = table[chunk_tensor[q]];
    const int64_t start = chunk_start[q];
    const int64_t end = start + kChunk < t.size ? start + kChunk : t.size;
    double acc = 0;
    for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
      const double g = t.grad[i];
      acc += g * g;
    }
    acc = BlockSum1(acc, scratch);
    if (threadIdx.x == 0) partial[q] = acc;
  }
}

__global__ void NormAndClipKernel(int64_t chunks, const double* partial, double clip, double* norm,
                                  float* scale) {
  __shared__ double scratch[kWarp];
  double acc = 0;
  // Each thread sums a contiguous range of chunks in order, then the block tree.
  const int64_t per = (chunks + blockDim.x - 1) / blockDim.x;
  const int64_t q0 = threadIdx.x * per;
  for (int64_t q = q0; q < q0 + per && q < chunks; ++q) acc += partial[q];
  acc = BlockSum1(acc, scratch);
  if (threadIdx.x == 0) {
    const double n = sqrt(acc);
    *norm = n;
    *scale = static_cast<float>((clip > 0 && n > clip) ? clip / n : 1.0);
  }
}

}  // namespace

cudaError_t F32ToBf16(int64_t n, const float* in, __nv_bfloat16* out, cudaStream_t stream) {
  Launch(F32ToBf16Kernel, GridStrideBlocks(n, kThreads), kThreads, 0, stream)(n, in, out);
  return cudaGetLastError();
}

cudaError_t Bf16ToF32(int64_t n, const __nv_bfloat16* in, float* out, cudaStream_t stream) {
  Launch(Bf16ToF32Kernel, GridStrideBlocks(n, kThreads), kThreads, 0, stream)(n, in, out);
  return cudaGetLastError();
}

cudaError_t CopyBytes(int64_t bytes, const void* src, void* dst, cudaStream_t stream) {
  const int64_t n16 = bytes / 16;
  // About 4 blocks per multiprocessor stream the whole array (grid-stride).
  Launch(CopyKernel, GridStrideBlocks(n16, kThreads * 8), kThreads, 0, stream)(
      n16, static_cast<const uint4*>(src), static_cast<uint4*>(dst));
  return cudaGetLastError();
}

int64_t RmsNormPartialFloats(int64_t rows, int width) {
  return detail::ChunkCount(rows, kRowChunk) * width;
}

cudaError_t RmsNormForward(int64_t rows, int width, const float* x, const float* gain, float* y,
                           float* inv_rms, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  Launch(RmsNormForwardKernel, static_cast<unsigned>(rows), kThreads, 0, stream)(width, x, gain, y,
                                                                                 inv_rms);
  return cudaGetLastError();
}

cudaError_t RmsNormBackward(int64_t rows, int width, const float* x, const float* gain,
                            const float* inv_rms, const float* dy, float* dx, float* dgain,
                            float* partial, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  Launch(RmsNormBackwardRowsKernel, static_cast<unsigned>(rows), kThreads, 0, stream)(
      width, x, gain, inv_rms, dy, dx);
  detail::ColumnSums(rows, width, kRowChunk, RmsGainTerm{x, inv_rms, dy, width}, partial,
                     /*add=*/true, dgain, stream, kThreads);
  return cudaGetLastError();
}

cudaError_t SwigluActivation(int64_t rows, int hidden, const float* h13, float* act,
                             cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  Launch(SwigluKernel, GridStrideBlocks(rows * hidden, kThreads), kThreads, 0, stream)(rows, hidden,
                                                                                       h13, act);
  return cudaGetLastError();
}

cudaError_t SwigluActivationBackward(int64_t rows, int hidden, const float* h13, const float* dact,
                                     float* dh13, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  Launch(SwigluBackwardKernel, GridStrideBlocks(rows * hidden, kThreads), kThreads, 0, stream)(
      rows, hidden, h13, dact, dh13);
  return cudaGetLastError();
}

cudaError_t RouterForward(int64_t tokens, int experts, int k, float* scores, const float* bias,
                          int32_t* selected, float* weights, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  Launch(RouterForwardKernel, BlocksFor(tokens, 128), 128, 0, stream)(tokens, experts, k, scores,
                                                                      bias, selected, weights);
  return cudaGetLastError();
}

cudaError_t ExpertCounts(int64_t slots, int experts, const int32_t* selected, int32_t* counts,
                         cudaStream_t stream) {
  Launch(ZeroIntsKernel, (experts + kThreads - 1) / kThreads, kThreads, 0, stream)(experts, counts);
  if (slots > 0)
    Launch(ExpertCountsKernel, GridStrideBlocks(slots, kThreads), kThreads, 0, stream)(
        slots, selected, counts);
  return cudaGetLastError();
}

cudaError_t ExpertOffsets(int experts, const int32_t* counts, int64_t* offsets,
                          cudaStream_t stream) {
  Launch(ExpertOffsetsKernel, 1, 1, 0, stream)(experts, counts, offsets);
  return cudaGetLastError();
}

cudaError_t SelectionBiasUpdate(int experts, const int32_t* counts, double rate, float* bias,
                                cudaStream_t stream) {
  Launch(SelectionBiasKernel, 1, kWarp, 0, stream)(experts, counts, rate, bias);
  return cudaGetLastError();
}

cudaError_t RouterBackward(int64_t tokens, int experts, int k, const float* scores,
                           const int32_t* selected, const float* weights, const float* dweights,
                           const float* aux, float* dlogits, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  Launch(RouterBackwardKernel, BlocksFor(tokens, 128), 128, 0, stream)(
      tokens, experts, k, scores, selected, weights, dweights, aux, dlogits);
  return cudaGetLastError();
}

int64_t SlotRowsScratch(int64_t tokens, int experts, int k) {
  return detail::ChunkCount(tokens * k, kSlotChunk) * experts;
}

cudaError_t SlotRows(int64_t tokens, int experts, int k, const int32_t* selected,
                     const int64_t* offsets, int64_t* scratch, int64_t* slot_row,
                     cudaStream_t stream) {
  const int64_t slots = tokens * k;
  if (slots == 0 || experts == 0) return cudaSuccess;
  const int64_t chunks = detail::ChunkCount(slots, kSlotChunk);
  const unsigned eb = static_cast<unsigned>((experts + 63) / 64);
  const dim3 grid(static_cast<unsigned>(chunks), eb);  // chunks in x: up to 2^31 - 1
  Launch(SlotChunkCountsKernel, grid, 64, 0, stream)(slots, experts, selected, scratch);
  Launch(SlotChunkFirstKernel, eb, 64, 0, stream)(chunks, experts, offsets, scratch);
  Launch(SlotRowsKernel, grid, 64, 0, stream)(slots, experts, selected, scratch, slot_row);
  return cudaGetLastError();
}

cudaError_t DispatchRows(int64_t tokens, int k, int width, const int64_t* slot_row, const float* x,
                         float* dispatched, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  Launch(DispatchRowsKernel, static_cast<unsigned>(tokens * k), kThreads, 0, stream)(
      tokens * k, k, width, slot_row, x, dispatched);
  return cudaGetLastError();
}

cudaError_t GatherRows(int64_t rows, int64_t divisor, int width, const int64_t* index,
                       const float* src, float* dst, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  Launch(GatherRowsKernel, static_cast<unsigned>(rows), kThreads, 0, stream)(divisor, width, index,
                                                                             src, dst);
  return cudaGetLastError();
}

cudaError_t CombineRows(int64_t tokens, int k, int width, const int64_t* slot_row,
                        const float* weights, const float* src, bool add, float* out,
                        cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  Launch(CombineRowsKernel, static_cast<unsigned>(tokens), kThreads, 0, stream)(
      k, width, slot_row, weights, src, add, out);
  return cudaGetLastError();
}

cudaError_t CombineRowsBackward(int64_t tokens, int k, int width, const int64_t* slot_row,
                                const float* weights, const float* src, const float* dout,
                                float* dsrc, float* dweights, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  Launch(CombineRowsBackwardKernel, static_cast<unsigned>(tokens), kThreads, kWarp * sizeof(float),
         stream)(k, width, slot_row, weights, src, dout, dsrc, dweights);
  return cudaGetLastError();
}

cudaError_t CrossEntropyForward(int64_t rows, int vocab, float* logits, const int32_t* targets,
                                double* row_loss, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  Launch(CrossEntropyForwardKernel, static_cast<unsigned>(rows), kThreads * 2, 0, stream)(
      vocab, logits, targets, row_loss);
  return cudaGetLastError();
}

cudaError_t SumRows(int64_t rows, const double* row_loss, double* loss_sum, cudaStream_t stream) {
  Launch(SumRowsKernel, 1, 1024, 0, stream)(rows, row_loss, loss_sum);
  return cudaGetLastError();
}

cudaError_t CrossEntropyBackward(int64_t rows, int vocab, float* probs, const int32_t* targets,
                                 float scale, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  Launch(CrossEntropyBackwardKernel, static_cast<unsigned>(rows), kThreads * 2, 0, stream)(
      vocab, probs, targets, scale);
  return cudaGetLastError();
}

cudaError_t AdamWStep(int /*tensors*/, const AdamTensor* table, int64_t chunks,
                      const int32_t* chunk_tensor, const int64_t* chunk_start, float beta1,
                      float beta2, float step_size, float inv_sqrt_bias2, float eps, float shrink,
                      const float* scale, cudaStream_t stream) {
  if (chunks == 0) return cudaSuccess;
  Launch(AdamWKernel, GridStrideBlocks(chunks, 1), kThreads, 0, stream)(
      table, chunks, chunk_tensor, chunk_start, beta1, beta2, step_size, inv_sqrt_bias2, eps,
      shrink, scale);
  return cudaGetLastError();
}

cudaError_t CopySpans(const CopySpan* spans, int64_t chunks, const int32_t* chunk_span,
                      const int64_t* chunk_start, cudaStream_t stream) {
  if (chunks == 0) return cudaSuccess;
  Launch(CopySpansKernel, GridStrideBlocks(chunks, 1), kThreads, 0, stream)(
      spans, chunks, chunk_span, chunk_start);
  return cudaGetLastError();
}

cudaError_t GradSquares(const AdamTensor* table, int64_t chunks, const int32_t* chunk_tensor,
                        const int64_t* chunk_start, double* partial, cudaStream_t stream) {
  if (chunks == 0) return cudaSuccess;
  Launch(SquaresKernel, GridStrideBlocks(chunks, 1), kThreads, 0, stream)(
      table, chunks, chunk_tensor, chunk_start, partial);
  return cudaGetLastError();
}

cudaError_t GradNormAndClip(int /*tensors*/, const AdamTensor* table, int64_t chunks,
                            const int32_t* chunk_tensor, const int64_t* chunk_start,
                            double* partial, double clip, double* norm, float* scale,
                            cudaStream_t stream) {
  if (cudaError_t e = GradSquares(table, chunks, chunk_tensor, chunk_start, partial, stream);
      e != cudaSuccess) {
    return e;
  }
  Launch(NormAndClipKernel, 1, 1024, 0, stream)(chunks, partial, clip, norm, scale);
  return cudaGetLastError();
}

}  // namespace rackrun::runtime::cuda::kernels
