#include "runtime/model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "runtime/cpu/gemm.h"

namespace rackrun::runtime {
namespace {

absl::Status Invalid(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("model.", field, ": ", what));
}

// The residual component's router draws from its own stream so that changing the residual
// mode does not reshuffle the body weights.
constexpr uint64_t kResidualSeedSalt = 0x9e3779b97f4a7c15ULL;
// Top-k gates are handled in a fixed-size per-token scratch.
constexpr int kMaxTopK = 64;

}  // namespace

absl::Status ModelConfig::Validate() const {
  if (vocab <= 0) return Invalid("vocab", absl::StrCat(vocab, " must be positive (256 for bytes)"));
  if (width <= 0) return Invalid("width", absl::StrCat(width, " must be positive"));
  if (blocks <= 0) return Invalid("blocks", absl::StrCat(blocks, " must be positive"));
  if (heads <= 0) return Invalid("heads", absl::StrCat(heads, " must be positive"));
  if (expert_ranks < 1 || expert_rank < 0 || expert_rank >= expert_ranks) {
    return Invalid("expert_rank", absl::StrCat("rank ", expert_rank, " of ", expert_ranks,
                                               " is not a rank of the expert-parallel group"));
  }
  if (moe.experts % expert_ranks != 0) {
    return Invalid("moe.experts",
                   absl::StrCat(moe.experts, " experts cannot be split evenly over ", expert_ranks,
                                " ranks; use a multiple of the ranks"));
  }
  if (width % heads != 0) {
    return Invalid("heads", absl::StrCat("width ", width, " is not divisible by heads ", heads,
                                         "; choose heads dividing width"));
  }
  if ((width / heads) % 2 != 0) {
    return Invalid("heads", absl::StrCat("head dim width/heads = ", width / heads,
                                         " must be even for rotary embedding; change heads"));
  }
  if (seq_len <= 0) return Invalid("seq_len", absl::StrCat(seq_len, " must be positive"));
  if (!(rope_theta > 1)) return Invalid("rope_theta", "must be > 1 (10000 is usual)");
  if (!(init_std > 0)) return Invalid("init_std", "must be > 0 (0.02 is usual)");
  if (moe.experts <= 0)
    return Invalid("moe.experts", absl::StrCat(moe.experts, " must be positive"));
  if (moe.top_k <= 0 || moe.top_k > moe.experts) {
    return Invalid("moe.top_k", absl::StrCat(moe.top_k, " must be in [1, moe.experts = ",
                                             moe.experts, "]; lower top_k or add experts"));
  }
  if (moe.top_k > kMaxTopK) return Invalid("moe.top_k", absl::StrCat("at most ", kMaxTopK));
  if (moe.expert_hidden <= 0) {
    return Invalid("moe.expert_hidden", absl::StrCat(moe.expert_hidden, " must be positive"));
  }
  if (moe.shared_expert && moe.shared_hidden <= 0) {
    return Invalid(
        "moe.shared_hidden",
        "must be positive when moe.shared_expert is true (or turn the shared expert off)");
  }
  if (moe.aux_loss_coef < 0) return Invalid("moe.aux_loss_coef", "must be >= 0 (0 = off)");
  if (moe.bias_update_rate < 0) return Invalid("moe.bias_update_rate", "must be >= 0 (0 = off)");
  if (streams < 0) return Invalid("streams", "must be >= 0 (0 = the mode's default)");
  if (active < 0) return Invalid("active", "must be >= 0 (0 = the mode's default)");
  if (fixed < 0) return Invalid("fixed", "must be >= 0 (0 = the mode's default)");
  absl::StatusOr<ResidualConfig> rc = ToResidualConfig();
  if (!rc.ok()) return rc.status();
  return absl::OkStatus();
}

absl::StatusOr<ResidualConfig> ModelConfig::ToResidualConfig() const {
  absl::StatusOr<ResidualMode> mode = ParseResidualMode(residual);
  if (!mode.ok()) {
    return Invalid("residual", absl::StrCat("'", residual,
                                            "' is not a residual mode; use vanilla, "
                                            "hc, mhc, xhc, xhc_flash or xhc_flash4"));
  }
  ResidualConfig rc = ResidualConfig::ForMode(*mode, width, ResidualConfig::Transformer(blocks));
  if (streams > 0) rc.streams = streams;
  if (active > 0) rc.active = active;
  if (fixed > 0) rc.fixed = fixed;
  absl::Status status = rc.Validate();
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("model (residual): ", status.message()));
  }
  return rc;
}

template <typename T>
Model<T>::Model(const ModelConfig& config, ResidualStreams<T> residual)
    : config_(config),
      residual_(std::make_unique<ResidualStreams<T>>(std::move(residual))),
      embedding_(config.vocab, config.width, "embed"),
      final_norm_(config.width, "final_norm"),
      head_(config.width, config.vocab, "lm_head") {
  const MoeLayerConfig mc = MoeLayerConfigOf(config);
  for (int b = 0; b < config.blocks; ++b) {
    const std::string prefix = absl::StrCat("blocks.", b);
    attention_.push_back(std::make_unique<Attention<T>>(config.width, config.heads, config.seq_len,
                                                        config.rope_theta, prefix + ".attn"));
    moe_.push_back(std::make_unique<MoeLayer<T>>(mc, prefix + ".moe"));
  }
  body_in_.resize(static_cast<size_t>(2 * config.blocks));
  body_out_.resize(static_cast<size_t>(2 * config.blocks));
  expert_counts_.assign(static_cast<size_t>(config.blocks),
                        std::vector<int64_t>(static_cast<size_t>(config.moe.experts), 0));
}

template <typename T>
absl::StatusOr<std::unique_ptr<Model<T>>> Model<T>::Create(const ModelConfig& config,
                                                           uint64_t seed) {
  absl::Status status = config.Validate();
  if (!status.ok()) return status;
  absl::StatusOr<ResidualConfig> rc = config.ToResidualConfig();
  if (!rc.ok()) return rc.status();
  absl::StatusOr<ResidualStreams<T>> residual =
      ResidualStreams<T>::Create(*rc, seed ^ kResidualSeedSalt);
  if (!residual.ok()) return residual.status();
  const int streams = residual->streams();
  std::unique_ptr<Model<T>> model(new Model<T>(config, std::move(*residual)));
  const double std = config.init_std;
  const double out_std = streams > 1 ? std / std::sqrt(static_cast<double>(streams)) : std;
  NormalInit rng(seed);
  rng.Fill(model->embedding_.table().value, std);
  for (int b = 0; b < config.blocks; ++b) {
    model->attention_[static_cast<size_t>(b)]->Init(rng, std, out_std);
    model->moe_[static_cast<size_t>(b)]->Init(rng, std, out_std);
  }
  rng.Fill(model->head_.weight().value, std);
  return model;
}

template <typename T>
std::vector<ParamRef<T>> Model<T>::Parameters() {
  std::vector<ParamRef<T>> params = {embedding_.table().Ref()};
  for (int b = 0; b < config_.blocks; ++b) {
    for (auto& p : attention_[static_cast<size_t>(b)]->Parameters()) params.push_back(p);
    for (auto& p : moe_[static_cast<size_t>(b)]->Parameters()) params.push_back(p);
  }
  for (auto& p : residual_->Parameters()) {
    p.name = "residual." + p.name;
    params.push_back(p);
  }
  params.push_back(final_norm_.gain().Ref());
  params.push_back(head_.weight().Ref());
  return params;
}

template <typename T>
std::vector<ParamRef<T>> Model<T>::Buffers() {
  std::vector<ParamRef<T>> buffers;
  for (auto& m : moe_) {
    for (auto& p : m->Buffers()) buffers.push_back(p);
  }
  return buffers;
}

template <typename T>
int64_t Model<T>::ParameterCount() {
  int64_t n = 0;
  for (const auto& p : Parameters()) n += p.size;
  return n;
}

template <typename T>
void Model<T>::ZeroGrad() {
  for (auto& p : Parameters()) std::fill(p.grad, p.grad + p.size, T(0));
}

MoeLayerConfig MoeLayerConfigOf(const ModelConfig& config) {
  MoeLayerConfig mc;
  mc.width = config.width;
  mc.experts = config.moe.experts;
  mc.top_k = config.moe.top_k;
  mc.expert_hidden = config.moe.expert_hidden;
  mc.shared_expert = config.moe.shared_expert;
  mc.shared_hidden = config.moe.shared_hidden;
  mc.aux_loss_coef = config.moe.aux_loss_coef;
  mc.bias_update_rate = config.moe.bias_update_rate;
  mc.local_experts = config.moe.experts / config.expert_ranks;
  mc.expert_first = config.expert_rank * mc.local_experts;
  return mc;
}

absl::Status LayOutBatch(const ModelConfig& config, std::span<const int32_t> inputs,
                         std::span<const int32_t> targets, int batch,
                         std::span<const int32_t> segment_starts, BatchLayout* layout) {
  if (batch <= 0) return Invalid("batch", absl::StrCat(batch, " must be positive"));
  if (inputs.empty() || inputs.size() % static_cast<size_t>(batch) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("inputs: size ", inputs.size(),
                                                   " is not a positive multiple of batch ", batch,
                                                   "; pass batch x seq token ids"));
  }
  if (targets.size() != inputs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("targets: size ", targets.size(),
                                                   " differs from inputs size ", inputs.size()));
  }
  const int64_t tokens = static_cast<int64_t>(inputs.size());
  const int seq = static_cast<int>(tokens / batch);
  if (seq > config.seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("inputs: sequence length ", seq,
                                                   " exceeds model.seq_len ", config.seq_len,
                                                   "; raise seq_len or shorten the batch rows"));
  }
  for (int64_t t = 0; t < tokens; ++t) {
    if (inputs[t] < 0 || inputs[t] >= config.vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          "inputs[", t, "] = ", inputs[t], " is outside the vocabulary [0, ", config.vocab, ")"));
    }
    if (targets[t] >= config.vocab) {
      return absl::InvalidArgumentError(absl::StrCat("targets[", t, "] = ", targets[t],
                                                     " is outside the vocabulary [0, ",
                                                     config.vocab, ") (negative = ignored)"));
    }
  }
  std::vector<uint8_t>& is_start = layout->is_start;
  is_start.assign(static_cast<size_t>(tokens), 0);
  for (int32_t s : segment_starts) {
    if (s < 0 || s >= tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("segment_starts: ", s, " is outside [0, ", tokens, ")"));
    }
    is_start[static_cast<size_t>(s)] = 1;
  }
  for (int b = 0; b < batch; ++b) is_start[static_cast<size_t>(b) * seq] = 1;
  layout->starts.clear();
  layout->doc_start.resize(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) {
    if (is_start[static_cast<size_t>(t)]) layout->starts.push_back(static_cast<int32_t>(t));
    layout->doc_start[static_cast<size_t>(t)] = is_start[static_cast<size_t>(t)]
                                                    ? static_cast<int32_t>(t % seq)
                                                    : layout->doc_start[static_cast<size_t>(t) - 1];
  }
  layout->batch = batch;
  layout->seq = seq;
  layout->tokens = tokens;
  return absl::OkStatus();
}

template <typename T>
absl::Status Model<T>::Prepare(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                               int batch, std::span<const int32_t> segment_starts, bool train) {
  if (absl::Status s = LayOutBatch(config_, inputs, targets, batch, segment_starts, &layout_);
      !s.ok()) {
    return s;
  }
  const int64_t tokens = layout_.tokens;
  const int seq = layout_.seq;
  batch_ = batch;
  seq_ = seq;
  tokens_ = tokens;
  inputs_ = inputs.data();
  const int c = config_.width;
  embedded_.Resize({tokens, c});
  for (auto& b : body_in_) b.Resize({tokens, c});
  for (auto& b : body_out_) b.Resize({tokens, c});
  collapsed_.Resize({tokens, c});
  final_.Resize({tokens, c});
  return residual_->BeginBatch(static_cast<int>(tokens), layout_.starts, train);
}

template <typename T>
absl::StatusOr<double> Model<T>::Forward(std::span<const int32_t> targets) {
  const double t_start = base::NowSeconds();
  const double g_start = cpu::GemmSeconds();
  timing_ = Timing{};
  const int64_t tokens = tokens_;
  const int c = config_.width;
  const auto span_of = [c, tokens](Tensor<T>& t) {
    return std::span<T>(t.data(), static_cast<size_t>(tokens * c));
  };
  embedding_.Forward(inputs_, tokens, embedded_.data());
  double t0 = base::NowSeconds();
  absl::Status status = residual_->Expand(span_of(embedded_));
  timing_.residual += base::NowSeconds() - t0;
  if (!status.ok()) return status;
  aux_loss_ = 0;
  double expert_seconds = 0;
  for (int b = 0; b < config_.blocks; ++b) {
    for (int part = 0; part < 2; ++part) {
      const int l = 2 * b + part;
      Tensor<T>& in = body_in_[static_cast<size_t>(l)];
      t0 = base::NowSeconds();
      status = residual_->ReadInput(l, span_of(in));
      timing_.residual += base::NowSeconds() - t0;
      if (!status.ok()) return status;
      t0 = base::NowSeconds();
      const double g0 = cpu::GemmSeconds();
      Tensor<T>& out = body_out_[static_cast<size_t>(l)];
      if (part == 0) {
        attention_[static_cast<size_t>(b)]->Forward(in.data(), batch_, seq_,
                                                    layout_.doc_start.data(), out.data());
        timing_.attention += base::NowSeconds() - t0 - (cpu::GemmSeconds() - g0);
      } else {
        MoeLayer<T>& moe = *moe_[static_cast<size_t>(b)];
        status = moe.Forward(in.data(), tokens, out.data());
        if (!status.ok()) return status;
        timing_.routing += moe.routing_seconds();
        expert_seconds += moe.expert_seconds();
        aux_loss_ += moe.aux_loss();
        expert_counts_[static_cast<size_t>(b)] = moe.global_counts();
      }
      t0 = base::NowSeconds();
      status = residual_->WriteOutput(l, span_of(out));
      timing_.residual += base::NowSeconds() - t0;
      if (!status.ok()) return status;
    }
  }
  t0 = base::NowSeconds();
  status = residual_->Collapse(span_of(collapsed_));
  timing_.residual += base::NowSeconds() - t0;
  if (!status.ok()) return status;
  final_norm_.Forward(collapsed_.data(), tokens, final_.data());
  const double loss = head_.Forward(final_.data(), targets.data(), tokens, nullptr);
  timing_.gemm = cpu::GemmSeconds() - g_start + expert_seconds;
  timing_.total = base::NowSeconds() - t_start;
  return loss;
}

template <typename T>
absl::StatusOr<double> Model<T>::Evaluate(std::span<const int32_t> inputs,
                                          std::span<const int32_t> targets, int batch,
                                          std::span<const int32_t> segment_starts) {
  absl::Status status = Prepare(inputs, targets, batch, segment_starts, /*train=*/false);
  if (!status.ok()) return status;
  absl::StatusOr<double> loss = Forward(targets);
  if (loss.ok()) {
    timing_.other = std::max(
        0.0, timing_.total - timing_.gemm - timing_.attention - timing_.residual - timing_.routing);
  }
  return loss;
}

template <typename T>
absl::StatusOr<double> Model<T>::ForwardBackward(std::span<const int32_t> inputs,
                                                 std::span<const int32_t> targets, int batch,
                                                 std::span<const int32_t> segment_starts,
                                                 T grad_scale) {
  absl::Status status = Prepare(inputs, targets, batch, segment_starts, /*train=*/true);
  if (!status.ok()) return status;
  absl::StatusOr<double> loss = Forward(targets);
  if (!loss.ok()) return loss;
  Timing forward = timing_;
  const double t_start = base::NowSeconds();
  const double g_start = cpu::GemmSeconds();
  const int64_t tokens = tokens_;
  const int c = config_.width;
  const auto span_of = [c, tokens](Tensor<T>& t) {
    return std::span<T>(t.data(), static_cast<size_t>(tokens * c));
  };
  dfinal_.Resize({tokens, c});
  dcollapsed_.Resize({tokens, c});
  dbody_.Resize({tokens, c});
  dbody_out_.Resize({tokens, c});
  dembedded_.Resize({tokens, c});

  head_.Backward(final_.data(), grad_scale, dfinal_.data());
  final_norm_.Backward(collapsed_.data(), dfinal_.data(), tokens, dcollapsed_.data());
  double t0 = base::NowSeconds();
  status = residual_->CollapseBackward(span_of(dcollapsed_));
  forward.residual += base::NowSeconds() - t0;
  if (!status.ok()) return status;
  for (int b = config_.blocks - 1; b >= 0; --b) {
    for (int part = 1; part >= 0; --part) {
      const int l = 2 * b + part;
      t0 = base::NowSeconds();
      status = residual_->WriteOutputBackward(l, span_of(dbody_out_));
      forward.residual += base::NowSeconds() - t0;
      if (!status.ok()) return status;
      t0 = base::NowSeconds();
      const double g0 = cpu::GemmSeconds();
      if (part == 0) {
        attention_[static_cast<size_t>(b)]->Backward(dbody_out_.data(), dbody_.data());
        forward.attention += base::NowSeconds() - t0 - (cpu::GemmSeconds() - g0);
      } else {
        MoeLayer<T>& moe = *moe_[static_cast<size_t>(b)];
        const double before = moe.routing_seconds();
        const double expert_before = moe.expert_seconds();
        status = moe.Backward(dbody_out_.data(), grad_scale, dbody_.data());
        if (!status.ok()) return status;
        forward.routing += moe.routing_seconds() - before;
        forward.gemm += moe.expert_seconds() - expert_before;
      }
      t0 = base::NowSeconds();
      status = residual_->ReadInputBackward(l, span_of(dbody_));
      forward.residual += base::NowSeconds() - t0;
      if (!status.ok()) return status;
    }
  }
  t0 = base::NowSeconds();
  status = residual_->ExpandBackward(span_of(dembedded_));
  forward.residual += base::NowSeconds() - t0;
  if (!status.ok()) return status;
  embedding_.Backward(inputs_, tokens, dembedded_.data());
  for (auto& m : moe_) m->UpdateSelectionBias();

  forward.gemm += cpu::GemmSeconds() - g_start;
  forward.total += base::NowSeconds() - t_start;
  forward.other = std::max(
      0.0, forward.total - forward.gemm - forward.attention - forward.residual - forward.routing);
  timing_ = forward;
  return loss;
}

template class Model<float>;
template class Model<double>;

}  // namespace rackrun::runtime
