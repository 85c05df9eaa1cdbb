#include "runtime/cuda/model.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "runtime/cuda/kernels.h"
#include "runtime/cuda/model_kernels.h"
#include "runtime/cuda/xhc.h"

namespace rackrun::runtime::cuda {
namespace {

// Parameters start on 256-byte boundaries: cuBLASLt's tensor-core kernels want 16-byte
// aligned operands, and an expert's matrices are slices of its layer's tensor.
constexpr int64_t kAlignFloats = 64;

}  // namespace

// The residual streams as the model drives them, whatever the mode.
class GpuModel::Residual {
 public:
  virtual ~Residual() = default;
  // The CPU component's parameter names (without the model's "residual." prefix).
  virtual std::vector<ParamRef<float>> Parameters() = 0;
  virtual absl::Status ZeroGrad() = 0;
  virtual absl::Status BeginBatch(int tokens, std::span<const int32_t> starts) = 0;
  virtual absl::Status Expand(const float* embedded) = 0;
  virtual absl::Status ReadInput(int l, float* u) = 0;
  virtual absl::Status WriteOutput(int l, const float* out) = 0;
  virtual absl::Status Collapse(float* y) = 0;
  virtual absl::Status CollapseBackward(const float* dy) = 0;
  virtual absl::Status WriteOutputBackward(int l, float* d_out) = 0;
  virtual absl::Status ReadInputBackward(int l, const float* d_u) = 0;
  virtual absl::Status ExpandBackward(float* d_embedded) = 0;
};

namespace {

// vanilla: x' = x + F(x), one stream (runtime/residual's VanillaImpl).
class VanillaResidual final : public GpuModel::Residual {
 public:
  VanillaResidual(Device* device, int width)
      : device_(device),
        width_(width),
        x_(device, "vanilla state"),
        dx_(device, "vanilla state gradient") {}
  std::vector<ParamRef<float>> Parameters() override { return {}; }
  absl::Status ZeroGrad() override { return absl::OkStatus(); }
  absl::Status BeginBatch(int tokens, std::span<const int32_t>) override {
    for (absl::Status s : {x_.Resize({tokens, width_}), dx_.Resize({tokens, width_})}) {
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  absl::Status Expand(const float* embedded) override { return Copy(embedded, x_.data()); }
  absl::Status ReadInput(int, float* u) override { return Copy(x_.data(), u); }
  absl::Status WriteOutput(int, const float* out) override {
    return CudaCheck(kernels::AddInPlace(x_.size(), out, x_.data(), device_->stream()),
                     "vanilla residual merge");
  }
  absl::Status Collapse(float* y) override { return Copy(x_.data(), y); }
  absl::Status CollapseBackward(const float* dy) override { return Copy(dy, dx_.data()); }
  absl::Status WriteOutputBackward(int, float* d_out) override { return Copy(dx_.data(), d_out); }
  absl::Status ReadInputBackward(int, const float* d_u) override {
    return CudaCheck(kernels::AddInPlace(dx_.size(), d_u, dx_.data(), device_->stream()),
                     "vanilla residual backward");
  }
  absl::Status ExpandBackward(float* d_embedded) override { return Copy(dx_.data(), d_embedded); }

 private:
  absl::Status Copy(const float* from, float* to) {
    return CudaCheck(cudaMemcpyAsync(to, from, sizeof(float) * static_cast<size_t>(x_.size()),
                                     cudaMemcpyDeviceToDevice, device_->stream()),
                     "vanilla residual copy");
  }
  Device* device_;
  int width_;
  DeviceTensor<float> x_, dx_;
};

// mhc, xhc, xhc_flash, xhc_flash4: runtime/cuda/xhc.h's streams, the state in S (float or
// bf16).
template <typename S>
class XhcResidual final : public GpuModel::Residual {
 public:
  explicit XhcResidual(std::unique_ptr<XhcStreams<S>> x) : x_(std::move(x)) {}
  std::vector<ParamRef<float>> Parameters() override { return x_->Parameters(); }
  absl::Status ZeroGrad() override { return x_->ZeroGrad(); }
  absl::Status BeginBatch(int tokens, std::span<const int32_t> starts) override {
    return x_->BeginBatch(tokens, starts);
  }
  absl::Status Expand(const float* embedded) override { return x_->Expand(embedded); }
  absl::Status ReadInput(int l, float* u) override { return x_->ReadInput(l, u); }
  absl::Status WriteOutput(int l, const float* out) override { return x_->WriteOutput(l, out); }
  absl::Status Collapse(float* y) override { return x_->Collapse(y); }
  absl::Status CollapseBackward(const float* dy) override { return x_->CollapseBackward(dy); }
  absl::Status WriteOutputBackward(int l, float* d_out) override {
    return x_->WriteOutputBackward(l, d_out);
  }
  absl::Status ReadInputBackward(int l, const float* d_u) override {
    return x_->ReadInputBackward(l, d_u);
  }
  absl::Status ExpandBackward(float* d_embedded) override { return x_->ExpandBackward(d_embedded); }

 private:
  std::unique_ptr<XhcStreams<S>> x_;
};

template <typename S>
absl::StatusOr<std::unique_ptr<GpuModel::Residual>> MakeXhc(Device* device,
                                                            ResidualStreams<float>& host,
                                                            GemmPrecision gemm) {
  absl::StatusOr<std::unique_ptr<XhcStreams<S>>> x =
      XhcStreams<S>::Create(device, host.config(), /*seed=*/0, gemm);
  if (!x.ok()) return x.status();
  if (absl::Status s = (*x)->CopyParametersFrom(host); !s.ok()) return s;
  return std::unique_ptr<GpuModel::Residual>(new XhcResidual<S>(*std::move(x)));
}

}  // namespace

GpuModel::GpuModel(Device* device, const ModelConfig& config, GemmPrecision precision)
    : device_(device),
      config_(config),
      matmul_(device, precision),
      clock_(device),
      values_(device, "model parameters"),
      grads_(device, "model gradients"),
      biases_(device, "router selection biases"),
      inputs_(device, "input tokens"),
      targets_(device, "target tokens"),
      doc_start_(device, "document starts"),
      embed_ids_d_(device, "embedding ids"),
      embed_first_d_(device, "embedding id runs"),
      embed_order_d_(device, "embedding token order"),
      embedded_(device, "embedded tokens"),
      collapsed_(device, "collapsed streams"),
      final_(device, "final norm output"),
      final_inv_rms_(device, "final norm inverse rms"),
      logits_(device, "logits"),
      body_out_(device, "sublayer body output"),
      row_loss_(device, "row losses"),
      loss_sum_(device, "loss sum"),
      dfinal_(device, "final norm output gradient"),
      dcollapsed_(device, "collapsed gradient"),
      dbody_(device, "body input gradient"),
      dbody_out_(device, "body output gradient"),
      dembedded_(device, "embedding gradient"),
      partial_(device, "final norm gain partials") {}

GpuModel::~GpuModel() = default;

absl::StatusOr<std::unique_ptr<GpuModel>> GpuModel::Create(Device* device, Model<float>& host,
                                                           GemmPrecision precision) {
  const ModelConfig& config = host.config();
  if (absl::Status s = CheckGpuResidualMode(config.residual); !s.ok()) return s;
  std::unique_ptr<GpuModel> m(new GpuModel(device, config, precision));
  if (absl::Status s = m->Init(host); !s.ok()) return s;
  return m;
}

absl::Status GpuModel::Check(cudaError_t e, const char* what) const {
  return CudaCheck(e, absl::StrCat("GPU model: ", what));
}

float* GpuModel::Value(const std::string& name) {
  for (const Slot& s : slots_) {
    if (s.name == name) return values_.data() + s.offset;
  }
  return nullptr;
}

float* GpuModel::Grad(const std::string& name) {
  for (const Slot& s : slots_) {
    if (s.name == name) return grads_.data() + s.offset;
  }
  return nullptr;
}

absl::Status GpuModel::Init(Model<float>& host) {
  int64_t total = 0;
  for (const ParamRef<float>& p : host.Parameters()) {
    order_.push_back(p.name);
    if (absl::StartsWith(p.name, "residual.")) continue;
    total = (total + kAlignFloats - 1) / kAlignFloats * kAlignFloats;
    slots_.push_back({p.name, total, p.size, p.shape});
    total += p.size;
  }
  for (absl::Status s : {values_.Resize({std::max<int64_t>(total, 1)}),
                         grads_.Resize({std::max<int64_t>(total, 1)}), grads_.Zero()}) {
    if (!s.ok()) return s;
  }
  const int E = config_.moe.experts;
  if (absl::Status s = biases_.Resize({config_.blocks, E}); !s.ok()) return s;
  for (const ParamRef<float>& b : host.Buffers()) bias_names_.push_back(b.name);

  if (config_.residual == "vanilla") {
    residual_ = std::make_unique<VanillaResidual>(device_, config_.width);
  } else {
    // The streams' own projections: fp32 or TF32; a bf16 state projects in bf16 anyway.
    const GemmPrecision p = matmul_.precision();
    absl::StatusOr<std::unique_ptr<Residual>> r =
        p == GemmPrecision::kBf16 ? MakeXhc<bf16>(device_, host.residual(), GemmPrecision::kTf32)
                                  : MakeXhc<float>(device_, host.residual(), p);
    if (!r.ok()) return r.status();
    residual_ = *std::move(r);
  }

  const MoeLayerConfig mc = MoeLayerConfigOf(config_);
  attention_scratch_ = std::make_unique<AttentionScratch>(device_, "blocks.*.attn");
  moe_scratch_ = std::make_unique<MoeScratch>(device_, "blocks.*.moe");
  for (int b = 0; b < config_.blocks; ++b) {
    const std::string a = absl::StrCat("blocks.", b, ".attn");
    AttentionWeights aw{Value(a + ".norm"), Value(a + ".wqkv"), Value(a + ".wo"),
                        Grad(a + ".norm"),  Grad(a + ".wqkv"),  Grad(a + ".wo")};
    absl::StatusOr<std::unique_ptr<GpuAttention>> att =
        GpuAttention::Create(device_, &matmul_, config_.width, config_.heads, config_.seq_len,
                             config_.rope_theta, a, aw, attention_scratch_.get());
    if (!att.ok()) return att.status();
    (*att)->set_clock(&clock_);
    attention_.push_back(*std::move(att));
    const std::string m = absl::StrCat("blocks.", b, ".moe");
    MoeWeights mw;
    mw.norm = Value(m + ".norm");
    mw.router = Value(m + ".router");
    mw.w13 = Value(m + ".experts.w13");
    mw.w2 = Value(m + ".experts.w2");
    mw.dnorm = Grad(m + ".norm");
    mw.drouter = Grad(m + ".router");
    mw.dw13 = Grad(m + ".experts.w13");
    mw.dw2 = Grad(m + ".experts.w2");
    if (mc.shared_expert) {
      mw.shared_w13 = Value(m + ".shared.w13");
      mw.shared_w2 = Value(m + ".shared.w2");
      mw.dshared_w13 = Grad(m + ".shared.w13");
      mw.dshared_w2 = Grad(m + ".shared.w2");
    }
    mw.bias = biases_.data() + static_cast<int64_t>(b) * E;
    absl::StatusOr<std::unique_ptr<GpuMoe>> moe =
        GpuMoe::Create(device_, &matmul_, mc, m, mw, moe_scratch_.get());
    if (!moe.ok()) return moe.status();
    (*moe)->set_clock(&clock_);
    moe_.push_back(*std::move(moe));
  }
  for (int l = 0; l < 2 * config_.blocks; ++l) {
    body_in_.emplace_back(device_, absl::StrCat("sublayer ", l, " body input"));
  }
  expert_counts_.assign(static_cast<size_t>(config_.blocks),
                        std::vector<int64_t>(static_cast<size_t>(E), 0));
  if (absl::Status s = CopyFromHost(host); !s.ok()) return s;
  return device_->Synchronize();
}

std::vector<ParamRef<float>> GpuModel::Parameters() {
  std::vector<ParamRef<float>> residual = residual_->Parameters();
  std::vector<ParamRef<float>> out;
  size_t slot = 0;
  for (const std::string& name : order_) {
    if (absl::StartsWith(name, "residual.")) {
      const std::string own = name.substr(std::string("residual.").size());
      for (ParamRef<float>& r : residual) {
        if (r.name == own) out.push_back({name, r.value, r.grad, r.size, r.shape});
      }
      continue;
    }
    const Slot& s = slots_[slot++];
    out.push_back({s.name, values_.data() + s.offset, grads_.data() + s.offset, s.size, s.shape});
  }
  return out;
}

absl::Status GpuModel::CopyParameters(Model<float>& host, bool grads, cudaMemcpyKind kind) {
  std::vector<ParamRef<float>> mine = Parameters();
  std::vector<ParamRef<float>> theirs = host.Parameters();
  if (mine.size() != theirs.size()) {
    return absl::InternalError("GPU model: parameter lists of the host and device models differ");
  }
  const bool up = kind == cudaMemcpyHostToDevice;
  const char* what = grads ? (up ? "gradients to the device" : "gradients to the host")
                           : (up ? "parameters to the device" : "parameters to the host");
  for (size_t i = 0; i < mine.size(); ++i) {
    if (mine[i].name != theirs[i].name || mine[i].size != theirs[i].size) {
      return absl::InternalError(absl::StrCat("GPU model: parameter ", i, " is ", mine[i].name,
                                              " on the device but ", theirs[i].name,
                                              " on the host"));
    }
    float* device = grads ? mine[i].grad : mine[i].value;
    float* on_host = grads ? theirs[i].grad : theirs[i].value;
    if (absl::Status s = Check(cudaMemcpyAsync(up ? device : on_host, up ? on_host : device,
                                               sizeof(float) * static_cast<size_t>(mine[i].size),
                                               kind, device_->stream()),
                               what);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status GpuModel::CopyBuffers(Model<float>& host, cudaMemcpyKind kind) {
  const bool up = kind == cudaMemcpyHostToDevice;
  std::vector<ParamRef<float>> buffers = host.Buffers();
  for (size_t b = 0; b < buffers.size(); ++b) {
    float* device = biases_.data() + static_cast<int64_t>(b) * config_.moe.experts;
    if (absl::Status s =
            Check(cudaMemcpyAsync(up ? device : buffers[b].value, up ? buffers[b].value : device,
                                  sizeof(float) * static_cast<size_t>(buffers[b].size), kind,
                                  device_->stream()),
                  up ? "buffers to the device" : "buffers to the host");
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status GpuModel::CopyFromHost(Model<float>& host) {
  if (absl::Status s = CopyParameters(host, /*grads=*/false, cudaMemcpyHostToDevice); !s.ok())
    return s;
  if (absl::Status s = CopyBuffers(host, cudaMemcpyHostToDevice); !s.ok()) return s;
  return device_->Synchronize();
}

absl::Status GpuModel::CopyToHost(Model<float>& host) {
  if (absl::Status s = CopyParameters(host, /*grads=*/false, cudaMemcpyDeviceToHost); !s.ok())
    return s;
  if (absl::Status s = CopyBuffers(host, cudaMemcpyDeviceToHost); !s.ok()) return s;
  return device_->Synchronize();
}

absl::Status GpuModel::GradientsToHost(Model<float>& host) {
  if (absl::Status s = CopyParameters(host, /*grads=*/true, cudaMemcpyDeviceToHost); !s.ok()) {
    return s;
  }
  return device_->Synchronize();
}

absl::Status GpuModel::GradientsFromHost(Model<float>& host) {
  if (absl::Status s = CopyParameters(host, /*grads=*/true, cudaMemcpyHostToDevice); !s.ok()) {
    return s;
  }
  return device_->Synchronize();
}

std::vector<ExpertParallelGroup::Layer> GpuModel::ExpertParallelLayers(bool shared_slots) {
  std::vector<ExpertParallelGroup::Layer> layers;
  const std::shared_ptr<DeviceSlots> shared =
      shared_slots ? std::make_shared<DeviceSlots>(device_, "MoE layers'") : nullptr;
  for (size_t b = 0; b < moe_.size(); ++b) {
    GpuMoe* moe = moe_[b].get();
    layers.push_back(
        {moe->config(),
         std::make_unique<DeviceExpertInstances>(device_, &matmul_, moe->shard(),
                                                 absl::StrCat("blocks.", b, ".moe"), shared),
         [moe](std::unique_ptr<ExpertExecutor<float>> executor) {
           moe->SetExecutor(std::move(executor));
         }});
  }
  return layers;
}

absl::Status GpuModel::ZeroGrad() {
  if (absl::Status s = grads_.Zero(); !s.ok()) return s;
  return residual_->ZeroGrad();
}

absl::Status GpuModel::Prepare(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                               int batch, std::span<const int32_t> segment_starts) {
  if (absl::Status s = LayOutBatch(config_, inputs, targets, batch, segment_starts, &layout_);
      !s.ok()) {
    return s;
  }
  const int64_t tokens = layout_.tokens;
  const int c = config_.width;
  counted_ = 0;
  for (int32_t t : targets) counted_ += t >= 0 ? 1 : 0;
  for (absl::Status s :
       {inputs_.Resize({tokens}), targets_.Resize({tokens}), doc_start_.Resize({tokens}),
        inputs_.CopyFrom(inputs), targets_.CopyFrom(targets),
        doc_start_.CopyFrom(layout_.doc_start), embedded_.Resize({tokens, c}),
        collapsed_.Resize({tokens, c}), final_.Resize({tokens, c}), final_inv_rms_.Resize({tokens}),
        logits_.Resize({tokens, config_.vocab}), row_loss_.Resize({tokens}),
        loss_sum_.Resize({1})}) {
    if (!s.ok()) return s;
  }
  for (DeviceTensor<float>& b : body_in_) {
    if (absl::Status s = b.Resize({tokens, c}); !s.ok()) return s;
  }
  if (absl::Status s = body_out_.Resize({tokens, c}); !s.ok()) return s;
  return residual_->BeginBatch(static_cast<int>(tokens), layout_.starts);
}

absl::StatusOr<double> GpuModel::Forward() {
  const int64_t tokens = layout_.tokens;
  const int t = static_cast<int>(tokens);
  const int c = config_.width, v = config_.vocab;
  cudaStream_t st = device_->stream();
  clock_.Mark(Phase::kOther);
  if (absl::Status s = Check(kernels::EmbeddingForward(tokens, c, inputs_.data(), Value("embed"),
                                                       embedded_.data(), st),
                             "embedding");
      !s.ok()) {
    return s;
  }
  clock_.Mark(Phase::kStreams);
  if (absl::Status s = residual_->Expand(embedded_.data()); !s.ok()) return s;
  aux_loss_ = 0;
  for (int b = 0; b < config_.blocks; ++b) {
    for (int part = 0; part < 2; ++part) {
      const int l = 2 * b + part;
      DeviceTensor<float>& in = body_in_[static_cast<size_t>(l)];
      DeviceTensor<float>& out = body_out_;
      clock_.Mark(Phase::kStreams);
      if (absl::Status s = residual_->ReadInput(l, in.data()); !s.ok()) return s;
      if (part == 0) {
        if (absl::Status s = attention_[static_cast<size_t>(b)]->Forward(
                in.data(), layout_.batch, layout_.seq, doc_start_.data(), out.data());
            !s.ok()) {
          return s;
        }
      } else {
        GpuMoe& moe = *moe_[static_cast<size_t>(b)];
        if (absl::Status s = moe.Forward(in.data(), tokens, out.data()); !s.ok()) return s;
        aux_loss_ += moe.aux_loss();
        expert_counts_[static_cast<size_t>(b)] = moe.counts();
      }
      clock_.Mark(Phase::kStreams);
      if (absl::Status s = residual_->WriteOutput(l, out.data()); !s.ok()) return s;
    }
  }
  if (absl::Status s = residual_->Collapse(collapsed_.data()); !s.ok()) return s;
  clock_.Mark(Phase::kOther);
  if (absl::Status s =
          Check(kernels::RmsNormForward(tokens, c, collapsed_.data(), Value("final_norm"),
                                        final_.data(), final_inv_rms_.data(), st),
                "final norm");
      !s.ok()) {
    return s;
  }
  clock_.Mark(Phase::kGemm);
  if (absl::Status s = matmul_.Run({.m = t, .n = v, .k = c, .lda = c, .ldb = v, .ldc = v}, 1.0f,
                                   final_.data(), Value("lm_head"), 0.0f, logits_.data());
      !s.ok()) {
    return s;
  }
  clock_.Mark(Phase::kOther);
  if (absl::Status s = Check(kernels::CrossEntropyForward(tokens, v, logits_.data(),
                                                          targets_.data(), row_loss_.data(), st),
                             "cross-entropy");
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          Check(kernels::SumRows(tokens, row_loss_.data(), loss_sum_.data(), st), "loss sum");
      !s.ok()) {
    return s;
  }
  std::vector<double> sum;
  if (absl::Status s = loss_sum_.CopyTo(&sum); !s.ok()) return s;
  return counted_ > 0 ? sum[0] / static_cast<double>(counted_) : 0.0;
}

absl::Status GpuModel::Backward(float grad_scale) {
  const int64_t tokens = layout_.tokens;
  const int t = static_cast<int>(tokens);
  const int c = config_.width, v = config_.vocab;
  cudaStream_t st = device_->stream();
  for (absl::Status s :
       {dfinal_.Resize({tokens, c}), dcollapsed_.Resize({tokens, c}), dbody_.Resize({tokens, c}),
        dbody_out_.Resize({tokens, c}), dembedded_.Resize({tokens, c}),
        partial_.Resize({kernels::RmsNormPartialFloats(tokens, c)})}) {
    if (!s.ok()) return s;
  }
  clock_.Mark(Phase::kOther);
  const float scale = counted_ > 0 ? grad_scale / static_cast<float>(counted_) : 0.0f;
  if (absl::Status s = Check(
          kernels::CrossEntropyBackward(tokens, v, logits_.data(), targets_.data(), scale, st),
          "cross-entropy backward");
      !s.ok()) {
    return s;
  }
  clock_.Mark(Phase::kGemm);
  // dW += final^T dlogits; dfinal = dlogits W^T.
  if (absl::Status s = matmul_.LinearBackward(t, c, v, final_.data(), logits_.data(),
                                              Value("lm_head"), Grad("lm_head"), dfinal_.data());
      !s.ok()) {
    return s;
  }
  clock_.Mark(Phase::kOther);
  if (absl::Status s =
          Check(kernels::RmsNormBackward(tokens, c, collapsed_.data(), Value("final_norm"),
                                         final_inv_rms_.data(), dfinal_.data(), dcollapsed_.data(),
                                         Grad("final_norm"), partial_.data(), st),
                "final norm backward");
      !s.ok()) {
    return s;
  }
  clock_.Mark(Phase::kStreams);
  if (absl::Status s = residual_->CollapseBackward(dcollapsed_.data()); !s.ok()) return s;
  for (int b = config_.blocks - 1; b >= 0; --b) {
    for (int part = 1; part >= 0; --part) {
      const int l = 2 * b + part;
      clock_.Mark(Phase::kStreams);
      if (absl::Status s = residual_->WriteOutputBackward(l, dbody_out_.data()); !s.ok()) return s;
      if (part == 0) {
        if (absl::Status s =
                attention_[static_cast<size_t>(b)]->Backward(dbody_out_.data(), dbody_.data());
            !s.ok()) {
          return s;
        }
      } else {
        if (absl::Status s = moe_[static_cast<size_t>(b)]->Backward(dbody_out_.data(), grad_scale,
                                                                    dbody_.data());
            !s.ok()) {
          return s;
        }
      }
      clock_.Mark(Phase::kStreams);
      if (absl::Status s = residual_->ReadInputBackward(l, dbody_.data()); !s.ok()) return s;
    }
  }
  if (absl::Status s = residual_->ExpandBackward(dembedded_.data()); !s.ok()) return s;
  clock_.Mark(Phase::kOther);
  // The embedding's gradient: token positions grouped by id on the host (ids ascending,
  // positions ascending within an id), one block per id on the device.
  const std::vector<int32_t>& ids = host_inputs_;
  std::vector<int64_t> count(static_cast<size_t>(config_.vocab) + 1, 0);
  for (int32_t id : ids) ++count[static_cast<size_t>(id) + 1];
  embed_ids_.clear();
  embed_first_.assign(1, 0);
  for (int id = 0; id < config_.vocab; ++id) {
    if (count[static_cast<size_t>(id) + 1] == 0) continue;
    embed_ids_.push_back(id);
    embed_first_.push_back(embed_first_.back() + count[static_cast<size_t>(id) + 1]);
  }
  for (int id = 0; id < config_.vocab; ++id) count[static_cast<size_t>(id) + 1] += count[id];
  embed_order_.resize(ids.size());
  for (size_t p = 0; p < ids.size(); ++p) {
    embed_order_[static_cast<size_t>(count[static_cast<size_t>(ids[p])]++)] =
        static_cast<int64_t>(p);
  }
  const int64_t distinct = static_cast<int64_t>(embed_ids_.size());
  for (absl::Status s :
       {embed_ids_d_.Resize({distinct}), embed_first_d_.Resize({distinct + 1}),
        embed_order_d_.Resize({tokens}), embed_ids_d_.CopyFrom(embed_ids_),
        embed_first_d_.CopyFrom(embed_first_), embed_order_d_.CopyFrom(embed_order_)}) {
    if (!s.ok()) return s;
  }
  if (absl::Status s = Check(
          kernels::EmbeddingBackward(distinct, c, embed_ids_d_.data(), embed_first_d_.data(),
                                     embed_order_d_.data(), dembedded_.data(), Grad("embed"), st),
          "embedding backward");
      !s.ok()) {
    return s;
  }
  for (auto& m : moe_) {
    if (absl::Status s = m->UpdateSelectionBias(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<double> GpuModel::ForwardBackward(std::span<const int32_t> inputs,
                                                 std::span<const int32_t> targets, int batch,
                                                 std::span<const int32_t> segment_starts,
                                                 float grad_scale) {
  if (absl::Status s = Prepare(inputs, targets, batch, segment_starts); !s.ok()) return s;
  host_inputs_.assign(inputs.begin(), inputs.end());
  absl::StatusOr<double> loss = Forward();
  if (!loss.ok()) return loss;
  if (absl::Status s = Backward(grad_scale); !s.ok()) return s;
  return loss;
}

absl::StatusOr<double> GpuModel::Evaluate(std::span<const int32_t> inputs,
                                          std::span<const int32_t> targets, int batch,
                                          std::span<const int32_t> segment_starts) {
  if (absl::Status s = Prepare(inputs, targets, batch, segment_starts); !s.ok()) return s;
  return Forward();
}

}  // namespace rackrun::runtime::cuda
