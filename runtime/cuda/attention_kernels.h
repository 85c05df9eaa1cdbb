// Causal multi-head attention with rotary position embedding on the GPU: the device twin of
// runtime/layers/attention.cc's core (between the QKV and the output projections), forward
// and backward, flash-style: scores and probabilities are never stored; the forward keeps
// one log-sum-exp per query row, the backward recomputes the probabilities from it.
//
// Layout as on the CPU: qkv is [tokens x 3C] (q | k | v, heads contiguous within each part),
// tokens = batch * seq, row b of the batch is tokens [b * seq, (b + 1) * seq). doc_start[t]
// is the index within its row of the first token of t's document (nondecreasing within a
// row); query t attends keys j with doc_start[t] <= j <= t. Rotary positions are the index
// within the row.
//
// Work split: a group of G = head_dim / 16 threads owns one row (16 head elements each,
// interleaved so that a tile in shared memory is read without bank conflicts); 64 rows per
// block; keys (forward, dQ) or queries (dK, dV) stream through shared memory in tiles of
// 32. The backward needs no atomics: one kernel owns each query row's dQ, another each key
// row's dK and dV, so every sum has a fixed order and the result is the same run to run.
//
// Tensor cores (Cores::kTensorBf16 / kTensorTf32, attention_tensor_core.cu; sm_80+): the
// same contract and work split in 64-row tiles (4 warps x 16 rows), each product a run of
// warp matrix operations (16 x 16 x 16 bf16, or 16 x 16 x 8 TF32) with fp32 accumulation:
// q, k, v, the probabilities, dO and dS are rounded to the operand type before each
// product; the softmax, lse, delta and its gradient stay fp32 (as PyTorch's flash attention
// in bf16). Shared memory above 48 KiB (at head dim 128: 137 KiB bf16, 205 KiB TF32) is
// opted in per kernel.
//
// Launches are asynchronous on `stream`; the returned cudaError_t is the launch's.
#ifndef RACKRUN_RUNTIME_CUDA_ATTENTION_KERNELS_H_
#define RACKRUN_RUNTIME_CUDA_ATTENTION_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace rackrun::runtime::cuda::attention {

// Head dimensions the kernels are built for: 16, 32, 64 and 128.
bool SupportedHeadDim(int head_dim);

// Rotates the q and k parts of qkv in place (inverse: by the negative angle, the transpose
// of the rotation: the backward's). cos/sin are [max_seq x head_dim / 2], position t % seq.
cudaError_t Rope(int64_t tokens, int seq, int width, int heads, const float* cos, const float* sin,
                 bool inverse, float* qkv, cudaStream_t stream);

// Which units compute the products: CUDA cores in fp32, or tensor cores in bf16 or TF32
// (above).
enum class Cores { kFp32, kTensorBf16, kTensorTf32 };

// attn [tokens x C] = softmax(scale q k^T, masked) v per head, heads concatenated;
// lse [batch * heads x seq] = the log-sum-exp of each query row's scaled scores.
cudaError_t Forward(int batch, int seq, int heads, int head_dim, float scale, const float* qkv,
                    const int32_t* doc_start, float* attn, float* lse, Cores cores,
                    cudaStream_t stream);

// From dattn (the gradient of attn), writes every element of dqkv ([tokens x 3C]: dq, dk, dv
// in rotated coordinates, as the CPU before its inverse rotation). delta [batch * heads x seq]
// is scratch (rowsum(dattn * attn) per head).
cudaError_t Backward(int batch, int seq, int heads, int head_dim, float scale, const float* qkv,
                     const int32_t* doc_start, const float* attn, const float* lse,
                     const float* dattn, float* delta, float* dqkv, Cores cores,
                     cudaStream_t stream);

// The tensor-core kernels (attention_tensor_core.cu), which Forward and Backward call for
// the tensor-core `cores`; TensorCoreBackward takes delta computed.
cudaError_t TensorCoreForward(Cores cores, int batch, int seq, int heads, int head_dim, float scale,
                              const float* qkv, const int32_t* doc_start, float* attn, float* lse,
                              cudaStream_t stream);
cudaError_t TensorCoreBackward(Cores cores, int batch, int seq, int heads, int head_dim,
                               float scale, const float* qkv, const int32_t* doc_start,
                               const float* lse, const float* dattn, const float* delta,
                               float* dqkv, cudaStream_t stream);

}  // namespace rackrun::runtime::cuda::attention

#endif  // RACKRUN_RUNTIME_CUDA_ATTENTION_KERNELS_H_
