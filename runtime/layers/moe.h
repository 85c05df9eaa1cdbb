// Mixture-of-Experts sublayer body: pre-norm RMSNorm -> router (softmax scores, top-k,
// renormalised top-k weights) -> dispatch -> SwiGLU experts -> combine, plus an optional
// always-on shared SwiGLU expert.
//
// The dispatch -> expert compute -> combine seam is explicit: MoeLayer routes and
// gathers each expert's tokens into one contiguous block (experts in index order, tokens
// in token order inside a block), hands the blocks to an ExpertExecutor, and combines
// the executor's outputs. LocalExpertExecutor runs every expert in this process; an
// expert-parallel executor (later issue) sends the blocks to other ranks and back.
//
// Balancing pressure (both off by default):
// - auxiliary loss (aux_loss_coef > 0): Switch-style coef * E * sum_e f_e * P_e, with f_e
//   the fraction of the T*k routed slots that went to e and P_e the mean router score;
//   equals coef under perfectly uniform routing. Gradient flows through P_e only. Under
//   expert parallelism f_e counts every rank's slots (the executor's global counts) and
//   P_e this rank's tokens, so share-weighted ranks add up to the whole batch's loss.
// - aux-loss-free bias (bias_update_rate > 0, DeepSeek-V3): a per-expert bias is added to
//   the scores for top-k *selection only* (the gate weights use the raw scores); after
//   each training microbatch b_e += rate * sign(mean load - load_e).
#ifndef RACKRUN_RUNTIME_LAYERS_MOE_H_
#define RACKRUN_RUNTIME_LAYERS_MOE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "runtime/layers/parameter.h"
#include "runtime/layers/rmsnorm.h"
#include "runtime/tensor.h"

namespace rackrun::runtime {

// One SwiGLU expert with explicit weights: y = (silu(x W1) * (x W3)) W2 with W1 | W3 side
// by side as w13 [C x 2F] and w2 [F x C]. h13 [rows x 2F] and act [rows x F] keep what
// SwigluBackward needs. Used for masters (weights in SwigluExperts) and for replicas
// (weights in a fan-out slot) alike.
template <typename T>
void SwigluForward(int width, int hidden, const T* w13, const T* w2, int64_t rows, const T* x,
                   T* h13, T* act, T* y);
// dx overwritten; dw13 / dw2 accumulated. dh13 [rows x 2F] and dact [rows x F] are scratch.
template <typename T>
void SwigluBackward(int width, int hidden, const T* w13, const T* w2, T* dw13, T* dw2, int64_t rows,
                    const T* x, const T* h13, const T* act, const T* dy, T* dh13, T* dact, T* dx);

// The router after its GEMM (MoeLayer's Forward; the GPU engine's twin is
// runtime/cuda/kernels.h's RouterForward): `scores` (tokens x E) hold the logits and become
// the softmax probabilities; top-k of score + bias (bias null: zeros) per token, ties to the
// lower expert, best first, into selected (tokens x k); weights = the selected scores
// renormalised to sum 1.
template <typename T>
void RouteTopK(int64_t tokens, int experts, int k, const T* bias, T* scores, int32_t* selected,
               T* weights);
// Its backward: from dweights = dL/d weights (tokens x k) and the aux-loss gradient per
// expert (aux, E values added to every token's score gradient, or null), the logit
// gradients dlogits (tokens x E, overwritten) through the renormalisation and the softmax.
template <typename T>
void RouterBackward(int64_t tokens, int experts, int k, const T* scores, const int32_t* selected,
                    const T* weights, const T* dweights, const T* aux, T* dlogits);

// SwiGLU feed-forward weights for `count` experts of width C and hidden F (see
// SwigluForward). An expert-parallel rank holds a shard: experts [first, first + count) of
// the layer's logical experts, local index e = logical - first.
template <typename T>
class SwigluExperts {
 public:
  SwigluExperts(int count, int width, int hidden, const std::string& prefix, int first = 0);

  // Draws the weights of `total` experts (0 = count) in logical order from `rng` and keeps
  // this shard's, so every sharding of a layer gets the weights of the unsharded one.
  void Init(NormalInit& rng, double std, double out_std, int total = 0);
  std::vector<ParamRef<T>> Parameters() { return {w13_.Ref(), w2_.Ref()}; }
  int count() const { return count_; }
  int first() const { return first_; }
  int width() const { return width_; }
  int hidden() const { return hidden_; }
  // Floats of one expert's weights (w13 then w2).
  int64_t expert_floats() const { return 3 * static_cast<int64_t>(width_) * hidden_; }
  // Weights and gradients of local expert e.
  const T* w13(int e) const {
    return w13_.value.data() + static_cast<int64_t>(e) * width_ * 2 * hidden_;
  }
  const T* w2(int e) const { return w2_.value.data() + static_cast<int64_t>(e) * hidden_ * width_; }
  T* dw13(int e) { return w13_.grad.data() + static_cast<int64_t>(e) * width_ * 2 * hidden_; }
  T* dw2(int e) { return w2_.grad.data() + static_cast<int64_t>(e) * hidden_ * width_; }

  // Expert e on `rows` rows of x. h13 [rows x 2F] and act [rows x F] are kept for
  // Backward by the caller.
  void Forward(int e, int64_t rows, const T* x, T* h13, T* act, T* y) const;
  // dx overwritten; weight gradients of expert e accumulated. dh13 [rows x 2F] and
  // dact [rows x F] are scratch.
  void Backward(int e, int64_t rows, const T* x, const T* h13, const T* act, const T* dy, T* dh13,
                T* dact, T* dx);

 private:
  int count_, width_, hidden_, first_;
  Parameter<T> w13_;  // [count x C x 2F]
  Parameter<T> w2_;   // [count x F x C]
};

// The seam between routing and expert compute. Rows [offsets[e], offsets[e+1]) of the
// dispatched buffer are expert e's tokens (offsets has experts + 1 entries).
template <typename T>
class ExpertExecutor {
 public:
  virtual ~ExpertExecutor() = default;
  // expert_out[row] = expert(row's expert)(dispatched[row]) for every row. An error (e.g.
  // a peer rank that failed) stops the microbatch.
  virtual absl::Status Forward(std::span<const int64_t> offsets, const T* dispatched,
                               T* expert_out) = 0;
  // Given d expert_out, writes d dispatched and accumulates the experts' weight gradients.
  // Uses the state of the last Forward (same offsets).
  virtual absl::Status Backward(std::span<const int64_t> offsets, const T* dexpert_out,
                                T* ddispatched) = 0;
  // Optional, each right before its pass (Forward with the same offsets; Backward): the part
  // of the pass that needs no rows (an expert-parallel executor's load exchange, plan and
  // weight fan-out; forward or backward). A caller whose rows are still on their way (a GPU
  // copying them to the host) calls it first, so that it runs while they travel; a pass that
  // was not prepared does it itself.
  virtual absl::Status PrepareForward(std::span<const int64_t> /*offsets*/) {
    return absl::OkStatus();
  }
  virtual absl::Status PrepareBackward() { return absl::OkStatus(); }
  // True when Forward's and Backward's buffers are device memory (a GPU engine's, whose
  // expert-parallel executor keeps the rows on the device: runtime/expert_instances.h);
  // false: host memory.
  virtual bool device_rows() const { return false; }
  // Tokens per logical expert over every rank of the last Forward, when the executor
  // spans several ranks (the selection-bias update and load statistics use them); null
  // when the layer's own counts are the whole picture.
  virtual const std::vector<int64_t>* global_counts() const { return nullptr; }
};

// Runs body(i) for every batch i of `offsets` (batch i is rows [offsets[i], offsets[i+1])):
// batches with at least 1/threads of all rows one at a time on every thread, the rest side
// by side, one per thread, each single-threaded. Deterministic when batches write
// disjoint outputs: the split depends only on the rows and the thread count.
// `work_per_row` sizes the serial cut-off; `cold` is scratch.
void RunExpertBatches(std::span<const int64_t> offsets, int64_t work_per_row,
                      std::vector<int>* cold, absl::FunctionRef<void(int)> body);

// Runs every expert in-process: GEMMs per expert over its gathered rows. Hot experts use
// all threads; the others run concurrently, one per thread.
template <typename T>
class LocalExpertExecutor final : public ExpertExecutor<T> {
 public:
  explicit LocalExpertExecutor(SwigluExperts<T>* experts) : experts_(experts) {}
  // FailedPrecondition when the layer's experts are a shard (needs an expert-parallel
  // executor).
  absl::Status Forward(std::span<const int64_t> offsets, const T* dispatched,
                       T* expert_out) override;
  absl::Status Backward(std::span<const int64_t> offsets, const T* dexpert_out,
                        T* ddispatched) override;

 private:
  // FailedPrecondition unless `offsets` covers every expert (this layer is not a shard).
  absl::Status CheckHoldsEveryExpert(std::span<const int64_t> offsets) const;
  SwigluExperts<T>* experts_;
  std::vector<int> small_;  // cold experts of the current call (capacity kept)
  const T* input_ = nullptr;
  Tensor<T> h13_, act_, dh13_, dact_;
};

struct MoeLayerConfig {
  int width = 0;
  int experts = 0;
  int top_k = 0;
  int expert_hidden = 0;
  bool shared_expert = false;
  int shared_hidden = 0;
  double aux_loss_coef = 0;
  double bias_update_rate = 0;
  // Expert shard held by this process: logical experts [expert_first, expert_first +
  // local_experts); local_experts 0 = all of them.
  int expert_first = 0;
  int local_experts = 0;
};

template <typename T>
class MoeLayer {
 public:
  // Parameters: prefix.norm, prefix.router, prefix.experts.{w13,w2},
  // prefix.shared.{w13,w2} (if shared); buffer prefix.router_bias.
  MoeLayer(const MoeLayerConfig& config, const std::string& prefix);

  void Init(NormalInit& rng, double std, double out_std);
  std::vector<ParamRef<T>> Parameters();
  // Non-trainable state (grad == nullptr): the aux-loss-free selection bias.
  std::vector<ParamRef<T>> Buffers();

  // Replaces the executor (default: LocalExpertExecutor over this layer's experts).
  void SetExecutor(std::unique_ptr<ExpertExecutor<T>> executor);
  SwigluExperts<T>& experts() { return experts_; }
  const MoeLayerConfig& config() const { return config_; }

  // out[tokens x width] = body(u). `u` must stay valid until Backward. Errors come from
  // the executor.
  absl::Status Forward(const T* u, int64_t tokens, T* out);
  // du overwritten; gradients of grad_scale * (upstream loss + aux loss) accumulated.
  absl::Status Backward(const T* dout, T grad_scale, T* du);
  // DeepSeek-V3 bias step from the last Forward's counts (no-op when the rate is 0).
  void UpdateSelectionBias();

  // Exact per-expert routed-token counts of this process's tokens in the last Forward
  // (sum = tokens * top_k).
  const std::vector<int64_t>& counts() const { return counts_; }
  // The same over every rank of an expert-parallel layer (= counts() in one process).
  const std::vector<int64_t>& global_counts() const {
    const std::vector<int64_t>* g = executor_->global_counts();
    return g != nullptr ? *g : counts_;
  }
  // Auxiliary loss value of the last Forward (already multiplied by the coefficient).
  double aux_loss() const { return aux_loss_; }
  // Seconds of the last Forward + Backward spent routing, dispatching and combining
  // (excluding the router GEMM).
  double routing_seconds() const { return routing_seconds_; }
  // Seconds of the last Forward + Backward inside the expert executor that cpu::Gemm's
  // clock did not already count (expert GEMMs run inside parallel regions, activations).
  double expert_seconds() const { return expert_seconds_; }

 private:
  MoeLayerConfig config_;
  RmsNorm<T> norm_;
  Parameter<T> router_;  // [C x E]
  Tensor<T> bias_;       // [E]
  SwigluExperts<T> experts_;
  std::unique_ptr<SwigluExperts<T>> shared_;
  std::unique_ptr<ExpertExecutor<T>> executor_;
  std::string bias_name_;

  // State of the last Forward.
  const T* u_ = nullptr;
  int64_t tokens_ = 0;
  std::vector<int64_t> counts_;
  std::vector<int64_t> offsets_;
  std::vector<double> slot_fraction_;  // aux loss f_e of the last Forward
  double aux_loss_ = 0;
  double routing_seconds_ = 0;
  double expert_seconds_ = 0;
  Tensor<T> xn_;
  Tensor<T> scores_;          // [tokens x E] softmax
  Tensor<int32_t> selected_;  // [tokens x k] expert ids, best first
  Tensor<T> weights_;         // [tokens x k] renormalised gates
  Tensor<int64_t> slot_row_;  // [tokens x k] row in the dispatched buffer
  Tensor<T> dispatched_, expert_out_;
  Tensor<T> shared_h13_, shared_act_, shared_out_;
  // Backward scratch.
  Tensor<T> dexpert_out_, ddispatched_, dxn_, dscores_, dshared_h13_, dshared_act_, dshared_x_;
  Tensor<T> dweights_;       // [tokens x k] dL/d gate weights
  std::vector<T> aux_grad_;  // [E] the aux loss's score gradient
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_LAYERS_MOE_H_
