// The GPU engine's layer kernels, each the device twin of a CPU function in runtime/ (named
// beside it), forward and backward. Launches are asynchronous on `stream`; the returned
// cudaError_t is the launch's (cudaGetLastError), so a bad configuration is reported at
// once and an execution error at the stream's next synchronisation. Wrap with CudaCheck.
//
// Precision: activations and coefficients fp32; reductions in fp32 except where the CPU
// reduces in double (cross-entropy losses, gradient norm), which these do in double too.
// Every sum runs in a fixed order (fixed block size and tree), so results are reproducible
// run to run; they differ from the CPU's order by rounding only.
//
// Nothing here includes device code: runtime/cuda/kernels.cu holds the kernels.
#ifndef RACKRUN_RUNTIME_CUDA_KERNELS_H_
#define RACKRUN_RUNTIME_CUDA_KERNELS_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace rackrun::runtime::cuda::kernels {

// ---- element-wise utilities
cudaError_t F32ToBf16(int64_t n, const float* in, __nv_bfloat16* out, cudaStream_t stream);
cudaError_t Bf16ToF32(int64_t n, const __nv_bfloat16* in, float* out, cudaStream_t stream);
// dst = src, `bytes` a multiple of 16 and both 16-byte aligned: the reference rate the
// stream kernels are measured against (bench_gpu_residual).
cudaError_t CopyBytes(int64_t bytes, const void* src, void* dst, cudaStream_t stream);

// ---- RMSNorm with gain (runtime/layers/rmsnorm.h), eps 1e-6, rows x width.
// y = g * x * inv_rms; inv_rms[r] kept for the backward.
cudaError_t RmsNormForward(int64_t rows, int width, const float* x, const float* gain, float* y,
                           float* inv_rms, cudaStream_t stream);
// dx overwritten; dgain += sum over rows of dy * x * inv_rms (two passes: per-chunk partials
// in `partial` (RmsNormPartialFloats(rows, width) floats), then summed in chunk order).
int64_t RmsNormPartialFloats(int64_t rows, int width);
cudaError_t RmsNormBackward(int64_t rows, int width, const float* x, const float* gain,
                            const float* inv_rms, const float* dy, float* dx, float* dgain,
                            float* partial, cudaStream_t stream);

// ---- SwiGLU activation (runtime/layers/moe.h's SwigluForward between its GEMMs):
// h13 = [g | up] rows x 2F; act = silu(g) * up; backward dh13 from dact.
cudaError_t SwigluActivation(int64_t rows, int hidden, const float* h13, float* act,
                             cudaStream_t stream);
cudaError_t SwigluActivationBackward(int64_t rows, int hidden, const float* h13, const float* dact,
                                     float* dh13, cudaStream_t stream);

// ---- MoE routing (runtime/layers/moe.cc, MoeLayer::Forward/Backward).
// scores (tokens x E) hold the router logits and become the softmax probabilities; top-k
// of (score + bias) per token, ties to the lower expert, best first, into selected (tokens
// x k); weights = the selected raw scores renormalised. bias may be null (zeros).
cudaError_t RouterForward(int64_t tokens, int experts, int k, float* scores, const float* bias,
                          int32_t* selected, float* weights, cudaStream_t stream);
// counts[e] = number of slots routed to e (zeroed first).
cudaError_t ExpertCounts(int64_t slots, int experts, const int32_t* selected, int32_t* counts,
                         cudaStream_t stream);
// DeepSeek-V3's aux-loss-free step: bias[e] += rate * sign(mean load - counts[e]).
cudaError_t SelectionBiasUpdate(int experts, const int32_t* counts, double rate, float* bias,
                                cudaStream_t stream);
// Gate gradients -> router logit gradients. dweights (tokens x k) = dL/d weights; aux
// (E floats or null): the aux-loss gradient per expert added to every token's score
// gradient (grad_scale * coef * E * f_e / tokens). dlogits (tokens x E) overwritten.
cudaError_t RouterBackward(int64_t tokens, int experts, int k, const float* scores,
                           const int32_t* selected, const float* weights, const float* dweights,
                           const float* aux, float* dlogits, cudaStream_t stream);
// offsets[0] = 0, offsets[e + 1] = offsets[e] + counts[e] (E + 1 entries): the exclusive
// prefix sum of the counts, on the device (one thread; E is small), so that SlotRows need not
// wait for the counts' copy to the host.
cudaError_t ExpertOffsets(int experts, const int32_t* counts, int64_t* offsets,
                          cudaStream_t stream);
// Slot rows of the dispatched buffer: a stable counting sort of the slots by expert
// (experts in order, tokens in order inside an expert), from selected and the exclusive
// prefix sum of counts (offsets, E + 1 entries: ExpertOffsets). `scratch` holds
// SlotRowsScratch(tokens, experts, k) values (the slots in chunks, per chunk and expert).
int64_t SlotRowsScratch(int64_t tokens, int experts, int k);
cudaError_t SlotRows(int64_t tokens, int experts, int k, const int32_t* selected,
                     const int64_t* offsets, int64_t* scratch, int64_t* slot_row,
                     cudaStream_t stream);
// dispatched[slot_row[t*k+j]] = x[t] (width C).
cudaError_t DispatchRows(int64_t tokens, int k, int width, const int64_t* slot_row, const float* x,
                         float* dispatched, cudaStream_t stream);
// dst[q] = src[index[q] / divisor] (width C) for q < rows, bytes as they are: the token
// dispatch's packing of rows on the device (device_rows.h; its unpacking is DispatchRows, k 1).
cudaError_t GatherRows(int64_t rows, int64_t divisor, int width, const int64_t* index,
                       const float* src, float* dst, cudaStream_t stream);
// out[t] (+)= sum_j w[t,j] * src[slot_row[t*k+j]] (w = 1 when weights is null).
cudaError_t CombineRows(int64_t tokens, int k, int width, const int64_t* slot_row,
                        const float* weights, const float* src, bool add, float* out,
                        cudaStream_t stream);
// The combine's backward: dsrc[slot_row[t,j]] = w[t,j] * dout[t], dweights[t,j] =
// <dout[t], src[slot_row[t,j]]>.
cudaError_t CombineRowsBackward(int64_t tokens, int k, int width, const int64_t* slot_row,
                                const float* weights, const float* src, const float* dout,
                                float* dsrc, float* dweights, cudaStream_t stream);

// ---- Cross-entropy over logits (runtime/layers/lm_head.cc). logits (rows x V) become
// the softmax probabilities; row_loss[r] = -log p[target] (0 where target < 0).
cudaError_t CrossEntropyForward(int64_t rows, int vocab, float* logits, const int32_t* targets,
                                double* row_loss, cudaStream_t stream);
// loss_sum = sum of row_loss in row order (one block, fixed tree).
cudaError_t SumRows(int64_t rows, const double* row_loss, double* loss_sum, cudaStream_t stream);
// probs -> dlogits in place: scale * (p - onehot(target)), zero rows for target < 0.
cudaError_t CrossEntropyBackward(int64_t rows, int vocab, float* probs, const int32_t* targets,
                                 float scale, cudaStream_t stream);

// ---- Optimizer (runtime/optimizer.h): all tensors in one launch.
struct AdamTensor {
  float* value;
  const float* grad;
  float* m;
  float* v;
  int64_t size;
  int32_t decay;  // 1: the step shrinks the value by `shrink` (weight decay); 0: not
};
// Elements per chunk of the multi-tensor launches (one block each).
inline constexpr int64_t kChunk = 4096;
// Chunks of `count` tensors (the table `chunk_tensor`/`chunk_start` the launches take, built
// on the host once per tensor list: see MultiTensorTable in optimizer.h).
// One AdamW step over every tensor. `scale` points to the gradient scale on the device (the
// clipping factor), or is null for 1. `shrink` is 1 - lr * weight_decay, applied to the
// tensors that decay (the table stays the same from step to step).
cudaError_t AdamWStep(int tensors, const AdamTensor* table, int64_t chunks,
                      const int32_t* chunk_tensor, const int64_t* chunk_start, float beta1,
                      float beta2, float step_size, float inv_sqrt_bias2, float eps, float shrink,
                      const float* scale, cudaStream_t stream);
// Several copies in one launch: span s's `size` floats from `from` to `to`, over the chunks
// of the spans (the table `chunk_span`/`chunk_start`, kChunk floats each, as AdamWStep's).
// Spans must not overlap. The GPU engine packs a job's gradients for the all-reduce with it.
struct CopySpan {
  const float* from;
  float* to;
  int64_t size;
};
cudaError_t CopySpans(const CopySpan* spans, int64_t chunks, const int32_t* chunk_span,
                      const int64_t* chunk_start, cudaStream_t stream);
// Sum of squares of every gradient in double, chunk by chunk, into partial[q] (`chunks`
// doubles; a tensor's chunks are consecutive).
cudaError_t GradSquares(const AdamTensor* table, int64_t chunks, const int32_t* chunk_tensor,
                        const int64_t* chunk_start, double* partial, cudaStream_t stream);
// GradSquares, then the partials summed in chunk order into norm[0] = sqrt(sum) and scale[0]
// = clip / norm when clip > 0 and norm > clip, else 1 (the trainer's rule).
cudaError_t GradNormAndClip(int tensors, const AdamTensor* table, int64_t chunks,
                            const int32_t* chunk_tensor, const int64_t* chunk_start,
                            double* partial, double clip, double* norm, float* scale,
                            cudaStream_t stream);

}  // namespace rackrun::runtime::cuda::kernels

#endif  // RACKRUN_RUNTIME_CUDA_KERNELS_H_
