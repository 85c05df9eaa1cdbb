// The MoE transformer trained by the runtime:
//   token embedding -> residual streams (Expand) -> L blocks of [attention sublayer, MoE
//   sublayer], each body read from and written into the ResidualStreams (every mode) ->
//   Collapse -> final RMSNorm -> LM head -> next-token cross-entropy.
//
// Bodies include their own pre-norm (RMSNorm with gain). Initialisation: every matrix
// N(0, init_std); the output projections of the bodies (attention W_o, expert and
// shared-expert W_2) N(0, init_std / sqrt(N)) when the residual mode has N > 1 streams;
// norm gains 1. The body weights are drawn from one generator seeded with `seed`, in
// Parameters() order; the residual component initialises its own mappings (its router
// from seed ^ a fixed salt), so a (config, seed) pair gives the same weights everywhere.
//
// Determinism: same config, seed, inputs and OpenMP thread count give bit-identical
// losses and gradients (static schedules, fixed reduction orders, GEMM split fixed by
// the thread count). Workspaces are sized on the first microbatch of a shape; later
// microbatches of the same shape allocate nothing.
#ifndef RACKRUN_RUNTIME_MODEL_H_
#define RACKRUN_RUNTIME_MODEL_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/layers/attention.h"
#include "runtime/layers/embedding.h"
#include "runtime/layers/lm_head.h"
#include "runtime/layers/moe.h"
#include "runtime/layers/parameter.h"
#include "runtime/layers/rmsnorm.h"
#include "runtime/residual/residual_streams.h"
#include "runtime/tensor.h"

namespace rackrun::runtime {

struct MoeConfig {
  int experts = 16;
  int top_k = 2;
  int expert_hidden = 256;
  bool shared_expert = false;
  int shared_hidden = 0;
  double aux_loss_coef = 0;     // 0 = off
  double bias_update_rate = 0;  // DeepSeek-V3 aux-loss-free balancing, 0 = off
};

struct ModelConfig {
  int vocab = 256;
  int width = 128;
  int blocks = 4;
  int heads = 4;
  int seq_len = 256;             // longest sequence (rotary table size)
  std::string residual = "xhc";  // vanilla | hc | mhc | xhc | xhc_flash | xhc_flash4
  int streams = 0;               // N; 0 = the mode's default
  int active = 0;                // k (xhc modes); 0 = default
  int fixed = 0;                 // m (xhc modes); 0 = default
  MoeConfig moe;
  double rope_theta = 10000;
  double init_std = 0.02;
  // Expert parallelism: this process holds the experts of rank `expert_rank` of
  // `expert_ranks` (experts / expert_ranks consecutive logical experts per MoE layer); the
  // caller installs an expert-parallel executor in every MoE layer. Initial weights equal
  // the unsharded model's. 1 = all experts here.
  int expert_rank = 0;
  int expert_ranks = 1;

  // OK, or InvalidArgument naming the field and the fix.
  absl::Status Validate() const;
  // The residual component's config for this model (mode defaults filled in).
  absl::StatusOr<ResidualConfig> ToResidualConfig() const;
};

// Every MoE layer's configuration in a model of `config` (this rank's experts when
// expert-parallel); the CPU model and the GPU engine build their layers from it.
MoeLayerConfig MoeLayerConfigOf(const ModelConfig& config);

// A microbatch's token layout, checked against the model: the packed batch's shape, the
// merged, sorted segment starts (row starts and document starts: the residual streams'
// boundaries) and, per token, the index within its row of its document's first token (the
// attention mask). The CPU model and the GPU engine (runtime/cuda/model.h) both use it.
struct BatchLayout {
  int batch = 0;
  int seq = 0;
  int64_t tokens = 0;
  std::vector<int32_t> starts;
  std::vector<int32_t> doc_start;
  std::vector<uint8_t> is_start;  // scratch, per token
};

// Fills `layout` from a microbatch as Model::ForwardBackward takes it (its buffers are reused,
// so the same shape allocates nothing); InvalidArgument naming the argument (inputs, targets,
// batch, segment_starts) and the fix otherwise.
absl::Status LayOutBatch(const ModelConfig& config, std::span<const int32_t> inputs,
                         std::span<const int32_t> targets, int batch,
                         std::span<const int32_t> segment_starts, BatchLayout* layout);

template <typename T>
class Model {
 public:
  // Seconds of the last ForwardBackward/Evaluate by kind. gemm: the dense projections and
  // LM-head GEMMs, and the expert FFNs whole (GEMMs + SwiGLU activation); attention: the attention
  // core (scores, softmax, weighted sum, rotary; includes its per-head GEMMs); residual: the
  // ResidualStreams calls; routing: router softmax/top-k, dispatch and combine; other: the rest
  // (norms, embedding, SwiGLU activations, cross-entropy). total is the whole call.
  struct Timing {
    double gemm = 0, attention = 0, residual = 0, routing = 0, other = 0, total = 0;
  };

  static absl::StatusOr<std::unique_ptr<Model>> Create(const ModelConfig& config, uint64_t seed);

  const ModelConfig& config() const { return config_; }
  // Every trainable parameter, in a stable order with stable names (checkpoints rely on
  // it): embed, blocks.i.attn.*, blocks.i.moe.*, residual.*, final_norm, lm_head.
  std::vector<ParamRef<T>> Parameters();
  // Non-trainable state that a checkpoint must keep (grad == nullptr): the MoE
  // selection biases blocks.i.moe.router_bias (zero unless bias_update_rate > 0).
  std::vector<ParamRef<T>> Buffers();
  int64_t ParameterCount();
  void ZeroGrad();

  // One microbatch. inputs/targets: [batch x seq] token ids (seq = size / batch <=
  // seq_len); a negative target is not counted. segment_starts: token indices into the
  // flattened batch*seq where a document begins (row starts are implied; any order).
  // Runs forward + backward, ACCUMULATES grad_scale * d(mean CE + aux loss)/d params, and
  // returns the mean cross-entropy. With bias_update_rate > 0 the selection biases step
  // once per call, after the backward.
  absl::StatusOr<double> ForwardBackward(std::span<const int32_t> inputs,
                                         std::span<const int32_t> targets, int batch,
                                         std::span<const int32_t> segment_starts, T grad_scale);
  // Forward only; no gradients, no bias update. Returns the mean cross-entropy.
  absl::StatusOr<double> Evaluate(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                                  int batch, std::span<const int32_t> segment_starts);

  // Exact per-expert token counts of the last microbatch, one vector per MoE layer (over
  // every rank when the experts are sharded).
  const std::vector<std::vector<int64_t>>& expert_counts() const { return expert_counts_; }
  // Sum over MoE layers of the auxiliary loss of the last microbatch (0 when off).
  double aux_loss() const { return aux_loss_; }
  const Timing& timing() const { return timing_; }
  ResidualStreams<T>& residual() { return *residual_; }
  MoeLayer<T>& moe(int block) { return *moe_[static_cast<size_t>(block)]; }

 private:
  Model(const ModelConfig& config, ResidualStreams<T> residual);
  absl::Status Prepare(std::span<const int32_t> inputs, std::span<const int32_t> targets, int batch,
                       std::span<const int32_t> segment_starts, bool train);
  absl::StatusOr<double> Forward(std::span<const int32_t> targets);

  ModelConfig config_;
  std::unique_ptr<ResidualStreams<T>> residual_;
  Embedding<T> embedding_;
  std::vector<std::unique_ptr<Attention<T>>> attention_;
  std::vector<std::unique_ptr<MoeLayer<T>>> moe_;
  RmsNorm<T> final_norm_;
  LmHead<T> head_;

  // Microbatch shape and workspaces.
  int batch_ = 0;
  int seq_ = 0;
  int64_t tokens_ = 0;
  const int32_t* inputs_ = nullptr;
  BatchLayout layout_;               // segment starts and per-token document starts
  Tensor<T> embedded_;               // [tokens x C]
  std::vector<Tensor<T>> body_in_;   // per sublayer [tokens x C]
  std::vector<Tensor<T>> body_out_;  // per sublayer [tokens x C]
  Tensor<T> collapsed_, final_;      // [tokens x C]
  Tensor<T> dfinal_, dcollapsed_, dbody_, dbody_out_, dembedded_;

  std::vector<std::vector<int64_t>> expert_counts_;
  double aux_loss_ = 0;
  Timing timing_;
};

extern template class Model<float>;
extern template class Model<double>;

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_MODEL_H_
