#include "runtime/cuda/attention.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/cuda/attention_kernels.h"
#include "runtime/cuda/kernels.h"

namespace rackrun::runtime::cuda {

AttentionScratch::AttentionScratch(Device* device, const std::string& name)
    : xn(device, name + " normed input"),
      dattn(device, name + " attention output gradient"),
      dqkv(device, name + " qkv gradient"),
      dxn(device, name + " normed input gradient") {}

GpuAttention::GpuAttention(Device* device, MatMul* matmul, int width, int heads, int max_seq,
                           const std::string& name, AttentionWeights weights,
                           AttentionScratch* scratch)
    : device_(device),
      matmul_(matmul),
      width_(width),
      heads_(heads),
      head_dim_(width / heads),
      max_seq_(max_seq),
      name_(name),
      w_(weights),
      rope_cos_(device, name + " rotary cos"),
      rope_sin_(device, name + " rotary sin"),
      inv_rms_(device, name + " inverse rms"),
      qkv_(device, name + " qkv"),
      attn_(device, name + " attention output"),
      lse_(device, name + " log-sum-exp"),
      own_scratch_(scratch == nullptr ? std::make_unique<AttentionScratch>(device, name) : nullptr),
      scratch_(scratch == nullptr ? own_scratch_.get() : scratch),
      xn_(scratch_->xn),
      dattn_(scratch_->dattn),
      dqkv_(scratch_->dqkv),
      dxn_(scratch_->dxn),
      delta_(device, name + " softmax delta"),
      partial_(device, name + " norm gain partials") {}

absl::StatusOr<std::unique_ptr<GpuAttention>> GpuAttention::Create(
    Device* device, MatMul* matmul, int width, int heads, int max_seq, double rope_theta,
    const std::string& name, AttentionWeights weights, AttentionScratch* scratch) {
  if (heads <= 0 || width % heads != 0 || !attention::SupportedHeadDim(width / heads)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPU attention (", name, "): head dim model.width / model.heads = ", width, " / ", heads,
        " is not one the GPU kernels are built for (16, 32, 64 or 128); change model.heads"));
  }
  std::unique_ptr<GpuAttention> a(
      new GpuAttention(device, matmul, width, heads, max_seq, name, weights, scratch));
  // The CPU layer's table, value for value (double angles rounded to float).
  const int half = a->head_dim_ / 2;
  std::vector<float> cs(static_cast<size_t>(max_seq) * half), sn(cs.size());
  for (int p = 0; p < max_seq; ++p) {
    for (int i = 0; i < half; ++i) {
      const double freq = std::pow(rope_theta, -2.0 * i / a->head_dim_);
      cs[static_cast<size_t>(p) * half + i] = static_cast<float>(std::cos(p * freq));
      sn[static_cast<size_t>(p) * half + i] = static_cast<float>(std::sin(p * freq));
    }
  }
  for (absl::Status s : {a->rope_cos_.Resize({max_seq, half}), a->rope_sin_.Resize({max_seq, half}),
                         a->rope_cos_.CopyFrom(cs), a->rope_sin_.CopyFrom(sn)}) {
    if (!s.ok()) return s;
  }
  // The tables are pageable: CopyFrom has copied them before returning.
  return a;
}

absl::Status GpuAttention::Check(cudaError_t e, const char* what) const {
  return CudaCheck(e, absl::StrCat(name_, " (GPU attention): ", what));
}

absl::Status GpuAttention::Forward(const float* u, int batch, int seq, const int32_t* doc_start,
                                   float* out) {
  if (batch <= 0 || seq <= 0 || seq > max_seq_) {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": batch ", batch, " x seq ", seq,
                                                   " outside the layer's sequence length ",
                                                   max_seq_));
  }
  u_ = u;
  doc_start_ = doc_start;
  batch_ = batch;
  seq_ = seq;
  const int64_t tokens = static_cast<int64_t>(batch) * seq;
  const int t = static_cast<int>(tokens);
  const int c = width_, c3 = 3 * width_;
  for (absl::Status s :
       {xn_.Resize({tokens, c}), inv_rms_.Resize({tokens}), qkv_.Resize({tokens, c3}),
        attn_.Resize({tokens, c}), lse_.Resize({static_cast<int64_t>(batch) * heads_, seq})}) {
    if (!s.ok()) return s;
  }
  cudaStream_t st = device_->stream();
  if (absl::Status s =
          NormThenLinear(*matmul_, clock_, tokens, c, c3, u, w_.norm, xn_.data(), inv_rms_.data(),
                         w_.wqkv, qkv_.data(), absl::StrCat(name_, " (GPU attention)"));
      !s.ok()) {
    return s;
  }
  MarkPhase(clock_, Phase::kAttention);
  if (absl::Status s = Check(attention::Rope(tokens, seq, c, heads_, rope_cos_.data(),
                                             rope_sin_.data(), /*inverse=*/false, qkv_.data(), st),
                             "rotary");
      !s.ok()) {
    return s;
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
  if (absl::Status s = Check(attention::Forward(batch, seq, heads_, head_dim_, scale, qkv_.data(),
                                                doc_start, attn_.data(), lse_.data(), Cores(), st),
                             "attention");
      !s.ok()) {
    return s;
  }
  MarkPhase(clock_, Phase::kGemm);
  return matmul_->Run({.m = t, .n = c, .k = c, .lda = c, .ldb = c, .ldc = c}, 1.0f, attn_.data(),
                      w_.wo, 0.0f, out);
}

attention::Cores GpuAttention::Cores() const {
  switch (matmul_->precision()) {
    case GemmPrecision::kBf16:
      return attention::Cores::kTensorBf16;
    case GemmPrecision::kTf32:
      return attention::Cores::kTensorTf32;
    default:
      return attention::Cores::kFp32;
  }
}

absl::Status GpuAttention::Backward(const float* dout, float* du) {
  if (u_ == nullptr) return absl::FailedPreconditionError(name_ + ": Backward without a Forward");
  const int64_t tokens = static_cast<int64_t>(batch_) * seq_;
  const int t = static_cast<int>(tokens);
  const int c = width_, c3 = 3 * width_;
  for (absl::Status s :
       {dattn_.Resize({tokens, c}), dqkv_.Resize({tokens, c3}), dxn_.Resize({tokens, c}),
        delta_.Resize({static_cast<int64_t>(batch_) * heads_, seq_}),
        partial_.Resize({kernels::RmsNormPartialFloats(tokens, c)})}) {
    if (!s.ok()) return s;
  }
  cudaStream_t st = device_->stream();
  MarkPhase(clock_, Phase::kGemm);
  // Output projection: dWo += attn^T dout; dattn = dout Wo^T.
  if (absl::Status s =
          matmul_->LinearBackward(t, c, c, attn_.data(), dout, w_.wo, w_.dwo, dattn_.data());
      !s.ok()) {
    return s;
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
  MarkPhase(clock_, Phase::kAttention);
  if (absl::Status s =
          Check(attention::Backward(batch_, seq_, heads_, head_dim_, scale, qkv_.data(), doc_start_,
                                    attn_.data(), lse_.data(), dattn_.data(), delta_.data(),
                                    dqkv_.data(), Cores(), st),
                "attention backward");
      !s.ok()) {
    return s;
  }
  // Rotary is orthogonal: its transpose is the inverse rotation.
  if (absl::Status s = Check(attention::Rope(tokens, seq_, c, heads_, rope_cos_.data(),
                                             rope_sin_.data(), /*inverse=*/true, dqkv_.data(), st),
                             "rotary backward");
      !s.ok()) {
    return s;
  }
  MarkPhase(clock_, Phase::kOther);
  // The normed input again (the forward's kernel: the same numbers); dWqkv += xn^T dqkv;
  // dxn = dqkv Wqkv^T.
  if (absl::Status s = xn_.Resize({tokens, c}); !s.ok()) return s;
  if (absl::Status s =
          Check(kernels::RmsNormForward(tokens, c, u_, w_.norm, xn_.data(), inv_rms_.data(), st),
                "norm again");
      !s.ok()) {
    return s;
  }
  MarkPhase(clock_, Phase::kGemm);
  if (absl::Status s = matmul_->LinearBackward(t, c, c3, xn_.data(), dqkv_.data(), w_.wqkv,
                                               w_.dwqkv, dxn_.data());
      !s.ok()) {
    return s;
  }
  MarkPhase(clock_, Phase::kOther);
  return Check(kernels::RmsNormBackward(tokens, c, u_, w_.norm, inv_rms_.data(), dxn_.data(), du,
                                        w_.dnorm, partial_.data(), st),
               "norm backward");
}

}  // namespace rackrun::runtime::cuda
