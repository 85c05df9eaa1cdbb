// The GPU model's small kernels beside the layers' (runtime/cuda/kernels.h): the embedding,
// the vanilla residual's merge, the xhc state's expansion into N streams, and the router's
// mean scores for the auxiliary loss; each the device twin of a CPU function named beside it.
// Launches are asynchronous on `stream`; the returned cudaError_t is the launch's. Every sum
// runs in a fixed order (no atomics), so results repeat bit for bit.
#ifndef RACKRUN_RUNTIME_CUDA_MODEL_KERNELS_H_
#define RACKRUN_RUNTIME_CUDA_MODEL_KERNELS_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace rackrun::runtime::cuda::kernels {

// ---- Embedding (runtime/layers/embedding.h): out[t] = table[tokens[t]].
cudaError_t EmbeddingForward(int64_t count, int width, const int32_t* tokens, const float* table,
                             float* out, cudaStream_t stream);
// table_grad[ids[u]] += sum over q in [first[u], first[u+1]) of dout[order[q]]: the token
// positions grouped by id (order, ascending positions within an id), built on the host from
// the microbatch's token ids; one block per distinct id.
cudaError_t EmbeddingBackward(int64_t distinct, int width, const int32_t* ids, const int64_t* first,
                              const int64_t* order, const float* dout, float* table_grad,
                              cudaStream_t stream);

// ---- y += x over n floats (the vanilla residual's merge and its backward).
cudaError_t AddInPlace(int64_t n, const float* x, float* y, cudaStream_t stream);

// ---- The multi-stream state (residual/residual_streams.h's Expand): x[t][i] = e[t] for
// every stream i < N, in the state's type S (float or bf16); backward: de[t] = sum over i of
// dx[t][i] (streams in order).
template <typename S>
cudaError_t ExpandStreams(int64_t tokens, int streams, int width, const float* e, S* x,
                          cudaStream_t stream);
cudaError_t ExpandStreamsBackward(int64_t tokens, int streams, int width, const float* dx,
                                  float* de, cudaStream_t stream);

// ---- The router's score sums per expert (runtime/layers/moe.cc's aux loss: P_e * tokens):
// sums[e] = sum over tokens of scores[t][e] in double, in chunks of tokens (partial:
// ScoreColumnPartials(tokens, experts) doubles) then the chunks in order.
int64_t ScoreColumnPartials(int64_t tokens, int experts);
cudaError_t ScoreColumnSums(int64_t tokens, int experts, const float* scores, double* partial,
                            double* sums, cudaStream_t stream);

}  // namespace rackrun::runtime::cuda::kernels

#endif  // RACKRUN_RUNTIME_CUDA_MODEL_KERNELS_H_
