#include "runtime/cuda/xhc.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/cuda/kernels.h"
#include "runtime/cuda/model_kernels.h"

namespace rackrun::runtime::cuda {

template <typename S>
struct XhcStreams<S>::Sublayer {
  explicit Sublayer(Device* d, int l)
      : rec(d, absl::StrCat("xhc sublayer ", l, " records")),
        idx(d, absl::StrCat("xhc sublayer ", l, " active sets")),
        coef(d, absl::StrCat("xhc sublayer ", l, " coefficients")),
        saved(d, absl::StrCat("xhc sublayer ", l, " saved rows")),
        out(d, absl::StrCat("mhc sublayer ", l, " saved body output")),
        colsum(d, absl::StrCat("xhc sublayer ", l, " router row sums")) {}
  bool mlp = false;
  int Kr = 1;
  int s = 0;        // position in its group
  bool mix = true;  // the group's last sublayer: mixes with H_res
  int64_t w1 = -1;  // the group's router + pre rows (the group's first sublayer only)
  int64_t a_pre = 0, w2 = 0, a_res = -1, a_post = 0, conv = -1;
  std::vector<int> taps;
  // The group's records, active sets and router row sums live in its first sublayer.
  DeviceTensor<float> rec;
  DeviceTensor<int32_t> idx;
  DeviceTensor<float> coef;
  DeviceTensor<S> saved;    // mhc: the sublayer's input state
  DeviceTensor<float> out;  // mhc: the body output
  DeviceTensor<float> colsum;
};

template <typename S>
XhcStreams<S>::XhcStreams(Device* device, const ResidualConfig& config, GemmPrecision gemm)
    : device_(device),
      config_(config),
      gemm_precision_(gemm),
      gemm_(device),
      values_(device, "xhc parameters"),
      grads_(device, "xhc parameter gradients"),
      shadow_(device, "xhc bf16 weights"),
      segment_(device, "xhc segments"),
      x_(device, "xhc state"),
      dx_(device, "xhc state gradient"),
      z_(device, "xhc mapping projections"),
      q_(device, "xhc active projections"),
      da_(device, "xhc active-row gradients"),
      dg_(device, "xhc convolution gradients"),
      dp_(device, "xhc gate gradients"),
      c2_(device, "xhc active logit gradients"),
      wscal_(device, "xhc write scalar gradients"),
      rscal_(device, "xhc read scalar gradients"),
      c1_(device, "xhc mapping logit gradients"),
      base_(device, "xhc flash read bases"),
      dypre_(device, "xhc pre-mapping logit gradients"),
      tape_(device, "xhc Sinkhorn tape"),
      partial_(device, "xhc column-sum partials (convolution weights, scalars, router centring)"),
      corr_(device, "xhc router centring"),
      c_bf16_(device, "xhc bf16 logit gradients"),
      basis_(device, "xhc rebuilt basis rows") {}

template <typename S>
XhcStreams<S>::~XhcStreams() = default;

template <typename S>
absl::StatusOr<std::unique_ptr<XhcStreams<S>>> XhcStreams<S>::Create(Device* device,
                                                                     const ResidualConfig& config,
                                                                     uint64_t seed,
                                                                     GemmPrecision gemm) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  if (config.mode != ResidualMode::kXhc && config.mode != ResidualMode::kXhcFlash &&
      config.mode != ResidualMode::kXhcFlash4 && config.mode != ResidualMode::kMhc &&
      config.mode != ResidualMode::kHc) {
    return absl::UnimplementedError(absl::StrCat(
        "GPU residual streams: mode ", std::string(ResidualModeName(config.mode)),
        " is not XhcStreams' (it runs hc, mhc, xhc, xhc_flash and xhc_flash4; vanilla is "
        "GpuModel's own stream)"));
  }
  if (gemm == GemmPrecision::kBf16) {
    return absl::InvalidArgumentError(
        "GPU residual streams: the fp32 GEMMs' precision is fp32 or tf32 (a bf16 state's "
        "projections run in bf16 anyway)");
  }
  if (config.mode == ResidualMode::kMhc || config.mode == ResidualMode::kHc) {
    if (config.streams > xhc::kDenseMaxN || config.width > xhc::kMaxWidth) {
      return absl::InvalidArgumentError(absl::StrCat(
          "GPU residual streams: ", std::string(ResidualModeName(config.mode)),
          " supports model.streams <= ", xhc::kDenseMaxN, " and model.width <= ", xhc::kMaxWidth,
          "; got ", config.streams, " streams, width ", config.width,
          " (use resources.device: cpu for larger ones)"));
    }
    std::unique_ptr<XhcStreams> x(new XhcStreams(device, config, gemm));
    if (absl::Status s = x->Init(seed); !s.ok()) return s;
    return x;
  }
  if (config.streams > xhc::kMaxN || config.active > xhc::kMaxK ||
      static_cast<int>(config.conv_widths.size()) > xhc::kMaxJ || config.width > xhc::kMaxWidth ||
      config.active * config.active > xhc::kMaxSinkhornN * xhc::kMaxSinkhornN) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPU residual streams: ", std::string(ResidualModeName(config.mode)),
        " supports model.streams <= ", xhc::kMaxN, ", model.active <= ", xhc::kMaxK,
        ", model.width <= ", xhc::kMaxWidth, " and at most ", xhc::kMaxJ, " convolutions; got ",
        config.streams, " streams, ", config.active, " active, width ", config.width, ", ",
        config.conv_widths.size(), " convolutions (use resources.device: cpu for larger ones)"));
  }
  for (int w : config.conv_widths) {
    if (w > xhc::kMaxTaps) {
      return absl::InvalidArgumentError(
          absl::StrCat("GPU residual streams: convolution width ", w, " above ", xhc::kMaxTaps));
    }
  }
  std::unique_ptr<XhcStreams> x(new XhcStreams(device, config, gemm));
  if (absl::Status s = x->Init(seed); !s.ok()) return s;
  return x;
}

template <typename S>
absl::Status XhcStreams<S>::Init(uint64_t seed) {
  N_ = config_.streams;
  C_ = config_.width;
  k_ = config_.active;
  m_ = config_.fixed;
  J_ = static_cast<int>(config_.conv_widths.size());
  L_ = static_cast<int>(config_.sublayers.size());
  // The CPU component of the same configuration: names, sizes, order and initial values.
  absl::StatusOr<ResidualStreams<float>> cpu = ResidualStreams<float>::Create(config_, seed);
  if (!cpu.ok()) return cpu.status();
  // The device buffer keeps the CPU's order, with the GEMMs' weight matrices (a sublayer's
  // group's router + pre rows, a sublayer's [w_res | w_post] rows, or w_post alone where it
  // does not mix) starting on 256-byte boundaries: cuBLASLt's tensor-core kernels want
  // 16-byte aligned operands, and the small parameters between them would leave the
  // matrices at any float offset. Padding never falls inside the runs the kernels read as
  // one (router + pre, w_res + w_post, the scalars, the convolutions).
  constexpr int64_t kAlign = 64;  // floats
  std::vector<ParamRef<float>> params = cpu->Parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamRef<float>& p = params[i];
    if (p.name.ends_with(".w_router") || p.name.ends_with(".w_res") || p.name.ends_with(".w") ||
        (p.name.ends_with(".w_post") && (i == 0 || !params[i - 1].name.ends_with(".w_res")))) {
      param_count_ = (param_count_ + kAlign - 1) / kAlign * kAlign;
    }
    names_.push_back(p.name);
    offsets_.push_back(param_count_);
    sizes_.push_back(p.size);
    shapes_.push_back(p.shape);
    offset_of_[p.name] = param_count_;
    param_count_ += p.size;
  }
  std::vector<float> host(static_cast<size_t>(param_count_), 0.0f);
  for (size_t i = 0; i < params.size(); ++i) {
    std::copy(params[i].value, params[i].value + params[i].size, host.begin() + offsets_[i]);
  }
  if (absl::Status s = values_.Resize({param_count_}); !s.ok()) return s;
  if (absl::Status s = grads_.Resize({param_count_}); !s.ok()) return s;
  if (absl::Status s = values_.CopyFrom(host); !s.ok()) return s;
  if (absl::Status s = grads_.Zero(); !s.ok()) return s;

  for (int l = 0; l < L_; ++l) {
    auto s = std::make_unique<Sublayer>(device_, l);
    absl::Status st = Dense() ? InitDenseSublayer(l, *s) : InitXhcSublayer(l, *s);
    if (!st.ok()) return st;
    sub_.push_back(std::move(s));
  }
  if (absl::Status s = corr_.Resize({N_}); !s.ok()) return s;
  return device_->Synchronize();
}

template <typename S>
int64_t XhcStreams<S>::OffsetOf(int l, const std::string& what) const {
  auto it = offset_of_.find(l < 0 ? what : absl::StrCat("sublayer", l, ".", what));
  return it == offset_of_.end() ? -1 : it->second;
}

template <typename S>
absl::Status XhcStreams<S>::InitDenseSublayer(int l, Sublayer& s) {
  // One projection w; the scalars adjacent in the order MapsOf reads them: hc s_a, s_b, a_m0
  // (N), a_r0 (N*N), b0 (N); mhc a_pre, a_post, a_res, b_pre (N), b_post (N), b_res (N*N).
  const bool hc = config_.mode == ResidualMode::kHc;
  s.w1 = OffsetOf(l, "w");
  s.a_pre = OffsetOf(l, hc ? "s_a" : "a_pre");
  const bool adjacent =
      hc ? OffsetOf(l, "s_b") == s.a_pre + 1 && OffsetOf(l, "a_m0") == s.a_pre + 2 &&
               OffsetOf(l, "a_r0") == s.a_pre + 2 + N_ &&
               OffsetOf(l, "b0") == s.a_pre + 2 + N_ + N_ * N_
         : OffsetOf(l, "a_post") == s.a_pre + 1 && OffsetOf(l, "a_res") == s.a_pre + 2 &&
               OffsetOf(l, "b_pre") == s.a_pre + 3 && OffsetOf(l, "b_post") == s.a_pre + 3 + N_ &&
               OffsetOf(l, "b_res") == s.a_pre + 3 + 2 * N_;
  if (s.w1 < 0 || s.a_pre < 0 || !adjacent) {
    return absl::InternalError(absl::StrCat(
        "GPU residual streams: ", std::string(ResidualModeName(config_.mode)), " sublayer ", l,
        "'s parameters are not laid out as the kernels expect (hyper_connections.cc "
        "changed?)"));
  }
  return absl::OkStatus();
}

template <typename S>
absl::Status XhcStreams<S>::InitXhcSublayer(int l, Sublayer& sl) {
  const int64_t nc = static_cast<int64_t>(N_) * C_;
  const int64_t kc = static_cast<int64_t>(k_) * C_;
  const int g = config_.group_size();
  const auto at = [&](int l2, const std::string& what) { return OffsetOf(l2, what); };
  Sublayer* s = &sl;
  s->mlp = config_.sublayers[static_cast<size_t>(l)] == SublayerKind::kMlp;
  s->Kr = s->mlp ? 1 + J_ : 1;
  s->s = l % g;
  s->mix = s->s == g - 1;
  s->a_pre = at(l, "a_pre");
  s->w2 = s->mix ? at(l, "w_res") : at(l, "w_post");
  s->a_res = s->mix ? at(l, "a_res") : -1;
  s->a_post = at(l, "a_post");
  // The kernels take the router and pre rows of a group as one matrix, [w_res | w_post] as
  // one, and the scalar parameters as adjacent runs: the CPU's layout, checked here.
  bool adjacent = at(l, "b_pre") == s->a_pre + 1 && s->w2 >= 0 && at(l, "b_post") == s->a_post + 1;
  if (s->s == 0) {
    s->w1 = g == 1 ? at(l, "w_router") : OffsetOf(-1, absl::StrCat("group", l / g, ".w_router"));
    for (int q = 0; q < g; ++q)
      adjacent = adjacent && at(l + q, "w_pre") == s->w1 + (1 + q) * N_ * nc;
    adjacent = adjacent && s->w1 >= 0;
  }
  if (s->mix) {
    adjacent = adjacent && at(l, "w_post") == s->w2 + k_ * k_ * kc &&
               at(l, "b_res") == s->a_res + 1 && s->a_post == s->a_res + 1 + k_ * k_;
  }
  if (!adjacent) {
    return absl::InternalError(absl::StrCat("GPU residual streams: sublayer ", l,
                                            "'s parameters are not laid out as the kernels "
                                            "expect (runtime/residual/xhc.cc changed?)"));
  }
  if (s->mlp) {
    s->conv = at(l, "conv0");
    int64_t next = s->conv;
    for (int j = 0; j < J_; ++j) {
      if (at(l, absl::StrCat("conv", j)) != next) {
        return absl::InternalError("GPU residual streams: convolutions not adjacent");
      }
      s->taps.push_back(config_.conv_widths[static_cast<size_t>(j)]);
      next += static_cast<int64_t>(s->taps.back()) * C_;
    }
  }
  if (s->s == 0) {
    if (absl::Status st = s->colsum.Resize({N_}); !st.ok()) return st;
  }
  return absl::OkStatus();
}

template <typename S>
std::vector<ParamRef<float>> XhcStreams<S>::Parameters() {
  std::vector<ParamRef<float>> out;
  for (size_t i = 0; i < names_.size(); ++i) {
    out.push_back({names_[i], values_.data() + offsets_[i], grads_.data() + offsets_[i], sizes_[i],
                   shapes_[i]});
  }
  return out;
}

template <typename S>
absl::Status XhcStreams<S>::CopyParametersFrom(ResidualStreams<float>& cpu) {
  for (const ParamRef<float>& p : cpu.Parameters()) {
    auto it = offset_of_.find(p.name);
    if (it == offset_of_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("no GPU parameter ", p.name));
    }
    if (absl::Status s = Check(cudaMemcpyAsync(values_.data() + it->second, p.value,
                                               sizeof(float) * static_cast<size_t>(p.size),
                                               cudaMemcpyHostToDevice, device_->stream()),
                               "copying parameters");
        !s.ok()) {
      return s;
    }
  }
  return device_->Synchronize();
}

template <typename S>
absl::Status XhcStreams<S>::GradientsToHost(std::vector<float>* grads) {
  std::vector<float> all;
  if (absl::Status s = grads_.CopyTo(&all); !s.ok()) return s;
  grads->clear();
  for (size_t i = 0; i < names_.size(); ++i) {
    grads->insert(grads->end(), all.begin() + offsets_[i], all.begin() + offsets_[i] + sizes_[i]);
  }
  return absl::OkStatus();
}

template <typename S>
absl::Status XhcStreams<S>::ZeroGrad() {
  return grads_.Zero();
}

template <typename S>
absl::Status XhcStreams<S>::Check(cudaError_t e, const char* what) const {
  return CudaCheck(e, absl::StrCat("xhc (GPU): ", what));
}

template <typename S>
absl::Status XhcStreams<S>::Order(bool ok, const char* call, int sublayer) const {
  if (ok) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("xhc (GPU): ", call, "(", sublayer,
                   ") out of order; the sequence is BeginBatch, SetState, ReadInput/WriteOutput "
                   "per sublayer, Collapse, then the reverse"));
}

template <typename S>
void XhcStreams<S>::Count(const char* name, int64_t read, int64_t written) {
  for (KernelTraffic& t : traffic_) {
    if (t.name == name) {
      t.read += read;
      t.written += written;
      ++t.calls;
      return;
    }
  }
  traffic_.push_back({name, read, written, 1});
}

template <typename S>
int64_t XhcStreams<S>::TrafficBytes() const {
  int64_t b = 0;
  for (const KernelTraffic& t : traffic_) b += t.read + t.written;
  return b;
}

template <typename S>
xhc::Layout XhcStreams<S>::LayoutOf(int l) const {
  xhc::Layout lay;
  lay.N = N_;
  lay.C = C_;
  lay.k = k_;
  lay.m = m_;
  lay.Kr = sub_[static_cast<size_t>(l)]->Kr;
  lay.J = sub_[static_cast<size_t>(l)]->mlp ? J_ : 0;
  lay.iters = config_.sinkhorn_iters;
  lay.g = config_.group_size();
  lay.s = sub_[static_cast<size_t>(l)]->s;
  lay.mix = sub_[static_cast<size_t>(l)]->mix;
  return lay;
}

template <typename S>
xhc::MapParams XhcStreams<S>::MapsOf(int l) {
  const Sublayer& s = *sub_[static_cast<size_t>(l)];
  const float* v = values_.data();
  xhc::MapParams p;
  if (config_.mode == ResidualMode::kHc) {  // s_a, s_b, A_m0, A_r0, B0 (xhc_kernels.h)
    p.a_pre = v + s.a_pre;
    p.a_post = v + s.a_pre + 1;
    p.b_pre = v + s.a_pre + 2;
    p.b_res = p.b_pre + N_;
    p.b_post = p.b_res + N_ * N_;
    return p;
  }
  if (config_.mode == ResidualMode::kMhc) {
    p.a_pre = v + s.a_pre;
    p.a_post = v + s.a_pre + 1;
    p.a_res = v + s.a_pre + 2;
    p.b_pre = v + s.a_pre + 3;
    p.b_post = p.b_pre + N_;
    p.b_res = p.b_post + N_;
    return p;
  }
  p.a_pre = v + s.a_pre;
  p.b_pre = v + s.a_pre + 1;
  if (s.mix) {
    p.a_res = v + s.a_res;
    p.b_res = v + s.a_res + 1;
  }
  p.a_post = v + s.a_post;
  p.b_post = v + s.a_post + 1;
  // Every sublayer of the group (ReadEntry's pre-mappings).
  const int first = l - s.s;
  for (int q = 0; q < config_.group_size(); ++q) {
    const Sublayer& o = *sub_[static_cast<size_t>(first + q)];
    p.group_a_pre[q] = v + o.a_pre;
    p.group_b_pre[q] = v + o.a_pre + 1;
  }
  int64_t off = s.conv;
  for (size_t j = 0; j < s.taps.size(); ++j) {
    p.conv[j] = v + off;
    p.conv_taps[j] = s.taps[j];
    off += static_cast<int64_t>(s.taps[j]) * C_;
  }
  return p;
}

template <typename S>
absl::StatusOr<const bf16*> XhcStreams<S>::ShadowOf(int64_t offset, int64_t n) {
  if (absl::Status s = shadow_.Resize({n}); !s.ok()) return s;
  if (absl::Status s =
          Check(kernels::F32ToBf16(n, values_.data() + offset, shadow_.data(), device_->stream()),
                "bf16 weights");
      !s.ok()) {
    return s;
  }
  return shadow_.data();
}

template <typename S>
absl::Status XhcStreams<S>::Project(const GemmShape& shape, const S* rows, int64_t weight,
                                    float* out) {
  if constexpr (std::is_same_v<S, float>) {
    return gemm_.Run(shape, 1.0f, rows, values_.data() + weight, 0.0f, out, gemm_precision_,
                     device_->stream());
  } else {
    absl::StatusOr<const bf16*> w = ShadowOf(weight, static_cast<int64_t>(shape.n) * shape.k);
    if (!w.ok()) return w.status();
    return gemm_.Run(shape, 1.0f, rows, *w, 0.0f, out, GemmPrecision::kBf16, DataType::kF32,
                     device_->stream());
  }
}

template <typename S>
absl::Status XhcStreams<S>::WeightGrad(const GemmShape& shape, const float* coeffs,
                                       int64_t coeff_count, const S* rows, int64_t grad) {
  if constexpr (std::is_same_v<S, float>) {
    return gemm_.Run(shape, 1.0f, coeffs, rows, 1.0f, grads_.data() + grad, gemm_precision_,
                     device_->stream());
  } else {
    if (absl::Status e =
            Check(kernels::F32ToBf16(coeff_count, coeffs, c_bf16_.data(), device_->stream()),
                  "logit gradients to bf16");
        !e.ok()) {
      return e;
    }
    return gemm_.Run(shape, 1.0f, c_bf16_.data(), rows, 1.0f, grads_.data() + grad,
                     GemmPrecision::kBf16, DataType::kF32, device_->stream());
  }
}

template <typename S>
absl::Status XhcStreams<S>::Reserve(int tokens) {
  if (tokens <= capacity_) return absl::OkStatus();
  if (Dense()) return ReserveDense(tokens);
  const int64_t T = tokens;
  const int64_t kc = static_cast<int64_t>(k_) * C_;
  const int g = config_.group_size();
  const int P1 = N_ + g * N_;
  const int KrMax = 1 + J_;
  const int P2Max = k_ * k_ + k_ * KrMax;
  const int C2Max = (P2Max + 7) / 8 * 8;
  for (int l = 0; l < L_; ++l) {
    Sublayer& s = *sub_[static_cast<size_t>(l)];
    const xhc::Layout lay = LayoutOf(l);
    if (s.s == 0) {
      if (absl::Status st = s.rec.Resize({T, lay.RecStride()}); !st.ok()) return st;
      if (absl::Status st = s.idx.Resize({T, k_}); !st.ok()) return st;
    }
    if (absl::Status st = s.coef.Resize({T, lay.CoefStride()}); !st.ok()) return st;
    if (absl::Status st = s.saved.Resize({T, lay.SavedStride()}); !st.ok()) return st;
  }
  const int wscal_cols = 2 + k_ * k_ + k_ * KrMax;
  std::vector<int> all_taps(config_.conv_widths.begin(), config_.conv_widths.end());
  xhc::Layout mlp = LayoutOf(0);
  mlp.J = J_;
  mlp.Kr = KrMax;
  for (absl::Status st :
       {x_.Resize({T, N_, C_}), dx_.Resize({T, N_, C_}), segment_.Resize({T}), z_.Resize({T, P1}),
        q_.Resize({T, P2Max}), da_.Resize({T, kc}), dg_.Resize({T, std::max(J_, 1), C_}),
        dp_.Resize({T, k_}), c2_.Resize({T, C2Max}), wscal_.Resize({T, wscal_cols}),
        rscal_.Resize({T, 1 + N_}), c1_.Resize({T, P1}), base_.Resize({T, std::max(g - 1, 1), C_}),
        dypre_.Resize({T, g, N_}),
        tape_.Resize({T, xhc::SinkhornTapeFloats(k_, config_.sinkhorn_iters)}),
        partial_.Resize(
            {std::max({int64_t{1}, xhc::ConvPartialFloats(mlp, T, all_taps.data()),
                       xhc::ColumnSumPartialFloats(T, std::max({wscal_cols, 1 + N_, N_}))})}),
        c_bf16_.Resize({T, std::max(P1, C2Max)})}) {
    if (!st.ok()) return st;
  }
  capacity_ = tokens;
  return absl::OkStatus();
}

template <typename S>
absl::Status XhcStreams<S>::BeginBatch(int tokens, std::span<const int32_t> segment_starts) {
  if (tokens <= 0) return absl::InvalidArgumentError("xhc (GPU): tokens must be positive");
  for (size_t i = 0; i < segment_starts.size(); ++i) {
    if (segment_starts[i] < 0 || segment_starts[i] >= tokens ||
        (i > 0 && segment_starts[i] <= segment_starts[i - 1])) {
      return absl::InvalidArgumentError(
          "xhc (GPU): segment_starts must be increasing token indices below tokens");
    }
  }
  if (absl::Status s = Reserve(tokens); !s.ok()) return s;
  tokens_ = tokens;
  segment_host_.assign(static_cast<size_t>(tokens), 0);
  size_t next = 0;
  int32_t start = 0;
  for (int t = 0; t < tokens; ++t) {
    while (next < segment_starts.size() && segment_starts[next] <= t)
      start = segment_starts[next++];
    segment_host_[static_cast<size_t>(t)] = start;
  }
  if (absl::Status s = segment_.Resize({tokens}); !s.ok()) return s;
  if (absl::Status s = segment_.CopyFrom(segment_host_); !s.ok()) return s;
  forward_pos_ = -1;
  backward_pos_ = -1;
  return absl::OkStatus();
}

template <typename S>
absl::Status XhcStreams<S>::SetState(std::span<const float> state) {
  const int64_t n = static_cast<int64_t>(tokens_) * N_ * C_;
  if (tokens_ == 0) return Order(false, "SetState", 0);
  if (static_cast<int64_t>(state.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("xhc (GPU): state has ", state.size(), " values, want tokens x N x C = ", n));
  }
  if (absl::Status s = x_.Resize({tokens_, N_, C_}); !s.ok()) return s;
  if constexpr (std::is_same_v<S, float>) {
    if (absl::Status s = x_.CopyFrom(state); !s.ok()) return s;
  } else {
    if (absl::Status s = dx_.Resize({tokens_, N_, C_}); !s.ok()) return s;
    if (absl::Status s = dx_.CopyFrom(state); !s.ok()) return s;
    if (absl::Status s =
            Check(kernels::F32ToBf16(n, dx_.data(), x_.data(), device_->stream()), "state to bf16");
        !s.ok()) {
      return s;
    }
  }
  forward_pos_ = 0;
  return device_->Synchronize();
}

template <typename S>
absl::Status XhcStreams<S>::Expand(const float* embedded) {
  if (tokens_ == 0) return Order(false, "Expand", 0);
  if (absl::Status s = x_.Resize({tokens_, N_, C_}); !s.ok()) return s;
  if (absl::Status s =
          Check(kernels::ExpandStreams<S>(tokens_, N_, C_, embedded, x_.data(), device_->stream()),
                "expand");
      !s.ok()) {
    return s;
  }
  forward_pos_ = 0;
  backward_pos_ = -1;
  return absl::OkStatus();
}

template <typename S>
absl::Status XhcStreams<S>::ExpandBackward(float* d_embedded) {
  if (absl::Status s = Order(backward_pos_ == 0, "ExpandBackward", 0); !s.ok()) return s;
  return Check(
      kernels::ExpandStreamsBackward(tokens_, N_, C_, dx_.data(), d_embedded, device_->stream()),
      "expand backward");
}

template <typename S>
absl::Status XhcStreams<S>::RestartFromInputState() {
  if (absl::Status s = Order(backward_pos_ == 0, "RestartFromInputState", 0); !s.ok()) return s;
  if (Dense()) {
    // hc and mhc do not walk the state back: sublayer 0 saved the batch's input.
    if (absl::Status s = Check(cudaMemcpyAsync(x_.data(), sub_[0]->saved.data(),
                                               sizeof(S) * static_cast<size_t>(x_.size()),
                                               cudaMemcpyDeviceToDevice, device_->stream()),
                               "restoring the input state");
        !s.ok()) {
      return s;
    }
  }
  forward_pos_ = 0;
  backward_pos_ = -1;
  return absl::OkStatus();
}

template <typename S>
typename XhcStreams<S>::Sublayer& XhcStreams<S>::EntryOf(int l) {
  return *sub_[static_cast<size_t>(l - sub_[static_cast<size_t>(l)]->s)];
}

template <typename S>
absl::Status XhcStreams<S>::ReadGroupEntry(int l, float* u) {
  Sublayer& s = *sub_[static_cast<size_t>(l)];
  const xhc::Layout lay = LayoutOf(l);
  const int T = tokens_;
  const int64_t nc = static_cast<int64_t>(N_) * C_;
  const int64_t kc = static_cast<int64_t>(k_) * C_;
  const int64_t sz = sizeof(S);
  const int P1 = lay.P1();
  cudaStream_t st = device_->stream();
  if (absl::Status e = Check(xhc::RouterColumnSums(lay, values_.data() + s.w1, s.colsum.data(), st),
                             "router column sums");
      !e.ok()) {
    return e;
  }
  // z = X W1^T: router rows then every sublayer's pre-mapping rows.
  if (absl::Status e = Project({.trans_b = true,
                                .m = T,
                                .n = P1,
                                .k = static_cast<int>(nc),
                                .lda = static_cast<int>(nc),
                                .ldb = static_cast<int>(nc),
                                .ldc = P1},
                               x_.data(), s.w1, z_.data());
      !e.ok()) {
    return e;
  }
  Count("fwd GEMM z = X W1^T", T * nc * sz, T * P1 * 4);
  if (absl::Status e =
          Check(xhc::ReadEntry<S>(lay, T, x_.data(), z_.data(), s.colsum.data(), MapsOf(l),
                                  s.rec.data(), s.idx.data(), u, lay.g > 1 ? base_.data() : nullptr,
                                  s.saved.data(), s.coef.data(), st),
                "ReadEntry");
      !e.ok()) {
    return e;
  }
  // The state once; u, the later sublayers' bases, the active rows, the record.
  Count("fwd ReadEntry (dense read + bases + gather)", T * (nc * sz + P1 * 4),
        T * (lay.g * C_ * 4 + kc * sz + lay.RecStride() * 4 + k_ * 4));
  return absl::OkStatus();
}

template <typename S>
absl::Status XhcStreams<S>::ReadInput(int l, float* u) {
  if (absl::Status s = Order(l >= 0 && l < L_ && forward_pos_ == 2 * l, "ReadInput", l); !s.ok())
    return s;
  if (Dense()) {
    if (absl::Status e = DenseReadInput(l, u); !e.ok()) return e;
    forward_pos_ = 2 * l + 1;
    return absl::OkStatus();
  }
  Sublayer& s = *sub_[static_cast<size_t>(l)];
  const xhc::Layout lay = LayoutOf(l);
  const xhc::MapParams p = MapsOf(l);
  const int T = tokens_;
  const int64_t kc = static_cast<int64_t>(k_) * C_;
  const int64_t sz = sizeof(S);
  cudaStream_t st = device_->stream();
  if (s.s == 0) {
    if (absl::Status e = ReadGroupEntry(l, u); !e.ok()) return e;
  } else {
    Sublayer& entry = EntryOf(l);
    if (absl::Status e =
            Check(xhc::ReadBase<S>(lay, T, x_.data(), base_.data(), entry.rec.data(),
                                   entry.idx.data(), u, s.saved.data(), s.coef.data(), st),
                  "ReadBase");
        !e.ok()) {
      return e;
    }
    // The base and the active rows in; u and the active rows (saved) out.
    Count("fwd ReadBase (read from bases + gather)", T * (C_ * 4 + kc * sz + k_ * 4 + k_ * 4),
          T * (C_ * 4 + kc * sz + 4));
  }
  // q = A W2^T over the gathered rows (saved, SavedStride apart).
  const int P2 = lay.P2();
  if (absl::Status e = Project({.trans_b = true,
                                .m = T,
                                .n = P2,
                                .k = static_cast<int>(kc),
                                .lda = static_cast<int>(lay.SavedStride()),
                                .ldb = static_cast<int>(kc),
                                .ldc = P2},
                               s.saved.data(), s.w2, q_.data());
      !e.ok()) {
    return e;
  }
  Count("fwd GEMM q = A W2^T", T * kc * sz, T * P2 * 4);
  if (absl::Status e =
          Check(xhc::ActiveMaps(lay, T, q_.data(), p, s.coef.data(), st), "ActiveMaps");
      !e.ok()) {
    return e;
  }
  Count("fwd ActiveMaps", T * P2 * 4, T * lay.CoefStride() * 4);
  forward_pos_ = 2 * l + 1;
  return absl::OkStatus();
}

template <typename S>
absl::Status XhcStreams<S>::WriteOutput(int l, const float* out) {
  if (absl::Status s = Order(l >= 0 && l < L_ && forward_pos_ == 2 * l + 1, "WriteOutput", l);
      !s.ok())
    return s;
  if (Dense()) {
    if (absl::Status e = DenseWriteOutput(l, out); !e.ok()) return e;
    forward_pos_ = 2 * l + 2;
    return absl::OkStatus();
  }
  Sublayer& s = *sub_[static_cast<size_t>(l)];
  Sublayer& entry = EntryOf(l);
  const xhc::Layout lay = LayoutOf(l);
  const int T = tokens_;
  const int64_t kc = static_cast<int64_t>(k_) * C_;
  const int64_t sz = sizeof(S);
  if (absl::Status e = Check(
          xhc::Write<S>(lay, T, out, segment_.data(), MapsOf(l), entry.rec.data(), entry.idx.data(),
                        s.coef.data(), x_.data(), s.saved.data(), device_->stream()),
          "Write");
      !e.ok()) {
    return e;
  }
  // out, the active rows in and out, out saved (the basis is computed again in the backward).
  Count(lay.mix ? "fwd Write (convolutions + Gram-Schmidt + mix + scatter)"
                : "fwd Write (convolutions + Gram-Schmidt + write-back)",
        T * (C_ * 4 + kc * sz + (lay.CoefStride() + lay.RecStride()) * 4), T * (kc * sz + C_ * sz));
  forward_pos_ = 2 * l + 2;
  return absl::OkStatus();
}

template <typename S>
absl::Status XhcStreams<S>::Collapse(float* y) {
  if (absl::Status s = Order(forward_pos_ == 2 * L_, "Collapse", 0); !s.ok()) return s;
  if (absl::Status e = Check(
          xhc::Collapse<S>(LayoutOf(0), tokens_, x_.data(), y, device_->stream()), "Collapse");
      !e.ok()) {
    return e;
  }
  forward_pos_ = 2 * L_ + 1;
  return absl::OkStatus();
}

template <typename S>
absl::Status XhcStreams<S>::CollapseBackward(const float* dy) {
  if (absl::Status s = Order(forward_pos_ == 2 * L_ + 1, "CollapseBackward", 0); !s.ok()) return s;
  if (absl::Status e =
          Check(xhc::CollapseBackward(LayoutOf(0), tokens_, dy, dx_.data(), device_->stream()),
                "CollapseBackward");
      !e.ok()) {
    return e;
  }
  backward_pos_ = 2 * L_;
  return absl::OkStatus();
}

template <typename S>
absl::StatusOr<const S*> XhcStreams<S>::RebuiltBasis(int l) {
  const xhc::Layout lay = LayoutOf(l);
  if (lay.J == 0) return nullptr;
  const int T = tokens_;
  if (absl::Status e = basis_.Resize({T, lay.J, C_}); !e.ok()) return e;
  if (absl::Status e =
          Check(xhc::RebuildBasis<S>(lay, T, sub_[static_cast<size_t>(l)]->saved.data(),
                                     segment_.data(), MapsOf(l), basis_.data(), device_->stream()),
                "RebuildBasis");
      !e.ok()) {
    return e;
  }
  // out (the earlier tokens' from L2); the basis rows.
  Count("bwd RebuildBasis (convolutions + Gram-Schmidt)", int64_t{T} * C_ * sizeof(S),
        int64_t{T} * lay.J * C_ * static_cast<int64_t>(sizeof(S)));
  return basis_.data();
}

template <typename S>
absl::Status XhcStreams<S>::WriteOutputBackward(int l, float* d_out) {
  if (absl::Status s =
          Order(l >= 0 && l < L_ && backward_pos_ == 2 * l + 2, "WriteOutputBackward", l);
      !s.ok())
    return s;
  if (Dense()) {
    if (absl::Status e = DenseWriteOutputBackward(l, d_out); !e.ok()) return e;
    backward_pos_ = 2 * l + 1;
    return absl::OkStatus();
  }
  Sublayer& s = *sub_[static_cast<size_t>(l)];
  Sublayer& entry = EntryOf(l);
  const xhc::Layout lay = LayoutOf(l);
  const xhc::MapParams p = MapsOf(l);
  const int T = tokens_;
  const int64_t kc = static_cast<int64_t>(k_) * C_;
  const int64_t sz = sizeof(S);
  const int P2 = lay.P2();
  cudaStream_t st = device_->stream();
  // The gate gradients accumulate over a group's sublayers, from its last (the first in the
  // backward) to its entry's ReadInputBackward.
  if (absl::Status e = s.mix ? Check(cudaMemsetAsync(dp_.data(), 0, sizeof(float) * T * k_, st),
                                     "zeroing the gate gradients")
                             : absl::OkStatus();
      !e.ok()) {
    return e;
  }
  absl::StatusOr<const S*> basis = RebuiltBasis(l);
  if (!basis.ok()) return basis.status();
  if (absl::Status e =
          Check(xhc::WriteBackward<S>(lay, T, dx_.data(), s.saved.data(), *basis, segment_.data(),
                                      p, entry.rec.data(), entry.idx.data(), s.coef.data(),
                                      da_.data(), d_out, dg_.data(), dp_.data(), c2_.data(),
                                      wscal_.data(), tape_.data(), st),
                "WriteBackward");
      !e.ok()) {
    return e;
  }
  // G rows, A, out and the basis (and, MLP, the earlier out rows from L2); dA, d_out, dg.
  Count("bwd WriteBackward", T * (kc * 4 + (k_ + lay.Kr) * C_ * sz),
        T * (kc * 4 + C_ * 4 + static_cast<int64_t>(lay.J) * C_ * 4 + lay.C2Stride() * 4));
  // dA += c2 W2 (fp32).
  const GemmShape dashape{.m = T,
                          .n = static_cast<int>(kc),
                          .k = P2,
                          .lda = lay.C2Stride(),
                          .ldb = static_cast<int>(kc),
                          .ldc = static_cast<int>(kc)};
  if (absl::Status e = gemm_.Run(dashape, 1.0f, c2_.data(), values_.data() + s.w2, 1.0f, da_.data(),
                                 gemm_precision_, st);
      !e.ok()) {
    return e;
  }
  Count("bwd GEMM dA += c2 W2", T * kc * 4, T * kc * 4);
  if (absl::Status e = Check(xhc::ScatterActive<S>(lay, T, da_.data(), s.saved.data(),
                                                   entry.idx.data(), dx_.data(), x_.data(), st),
                             "ScatterActive");
      !e.ok()) {
    return e;
  }
  Count("bwd ScatterActive (dX rows, state walked back)", T * (kc * 4 + kc * sz),
        T * (kc * 4 + kc * sz));
  if (s.mlp) {
    if (absl::Status e = Check(
            xhc::ConvolutionsBackward<S>(lay, T, dg_.data(), s.saved.data(), segment_.data(), p,
                                         d_out, grads_.data() + s.conv, partial_.data(), st),
            "ConvolutionsBackward");
        !e.ok()) {
      return e;
    }
    Count("bwd ConvolutionsBackward", T * (2 * J_ * C_ * 4 + C_ * 4 + C_ * sz), T * C_ * 4);
  }
  // dW2 += c2^T A.
  if (absl::Status e =
          WeightGrad({.trans_a = true,
                      .m = P2,
                      .n = static_cast<int>(kc),
                      .k = T,
                      .lda = lay.C2Stride(),
                      .ldb = static_cast<int>(lay.SavedStride()),
                      .ldc = static_cast<int>(kc)},
                     c2_.data(), static_cast<int64_t>(T) * lay.C2Stride(), s.saved.data(), s.w2);
      !e.ok()) {
    return e;
  }
  Count("bwd GEMM dW2 += c2^T A", T * kc * sz, 0);
  // a_res, b_res, a_post, b_post (adjacent) where the sublayer mixes; a_post, b_post only
  // (their records after the unused 1 + k*k) where it does not.
  const int skip = s.mix ? 0 : 1 + k_ * k_;
  if (absl::Status e =
          Check(xhc::SumScalars(T, lay.WriteScalStride(), lay.WriteScalStride() - skip,
                                wscal_.data() + skip, grads_.data() + (s.mix ? s.a_res : s.a_post),
                                partial_.data(), st),
                "write scalars");
      !e.ok()) {
    return e;
  }
  backward_pos_ = 2 * l + 1;
  return absl::OkStatus();
}

template <typename S>
absl::Status XhcStreams<S>::ReadInputBackward(int l, const float* d_u) {
  if (absl::Status s =
          Order(l >= 0 && l < L_ && backward_pos_ == 2 * l + 1, "ReadInputBackward", l);
      !s.ok())
    return s;
  if (Dense()) {
    if (absl::Status e = DenseReadInputBackward(l, d_u); !e.ok()) return e;
    backward_pos_ = 2 * l;
    return absl::OkStatus();
  }
  Sublayer& s = *sub_[static_cast<size_t>(l)];
  Sublayer& entry = EntryOf(l);
  const xhc::Layout lay = LayoutOf(l);
  const xhc::MapParams p = MapsOf(l);
  const int T = tokens_;
  const int64_t nc = static_cast<int64_t>(N_) * C_;
  const int64_t sz = sizeof(S);
  cudaStream_t st = device_->stream();
  if (absl::Status e =
          Check(xhc::ReadBackward<S>(lay, T, x_.data(), d_u, dp_.data(), entry.colsum.data(), p,
                                     entry.rec.data(), entry.idx.data(), dx_.data(), dypre_.data(),
                                     c1_.data(), rscal_.data(), st),
                "ReadBackward");
      !e.ok()) {
    return e;
  }
  Count(s.s == 0 ? "bwd ReadBackward (dense read + norms)" : "bwd ReadBackward (dense read)",
        T * (nc * sz + nc * 4 + C_ * 4), T * nc * 4);
  if (absl::Status e =
          Check(xhc::SumScalars(T, lay.ReadScalStride(), lay.ReadScalStride(), rscal_.data(),
                                grads_.data() + s.a_pre, partial_.data(), st),
                "read scalars");
      !e.ok()) {
    return e;
  }
  if (s.s == 0) {
    if (absl::Status e = EntryWeightGrads(l); !e.ok()) return e;
  }
  backward_pos_ = 2 * l;
  return absl::OkStatus();
}

template <typename S>
absl::Status XhcStreams<S>::EntryWeightGrads(int l) {
  Sublayer& s = *sub_[static_cast<size_t>(l)];
  const xhc::Layout lay = LayoutOf(l);
  const int T = tokens_;
  const int64_t nc = static_cast<int64_t>(N_) * C_;
  const int64_t sz = sizeof(S);
  const int P1 = lay.P1();
  cudaStream_t st = device_->stream();
  // dX += c1 W1 (fp32).
  const GemmShape dxshape{
      false, false, T, static_cast<int>(nc), P1, P1, static_cast<int>(nc), static_cast<int>(nc)};
  if (absl::Status e = gemm_.Run(dxshape, 1.0f, c1_.data(), values_.data() + s.w1, 1.0f, dx_.data(),
                                 gemm_precision_, st);
      !e.ok()) {
    return e;
  }
  Count("bwd GEMM dX += c1 W1", T * nc * 4, T * nc * 4);
  // dW1 += c1^T X.
  if (absl::Status e = WeightGrad({.trans_a = true,
                                   .m = P1,
                                   .n = static_cast<int>(nc),
                                   .k = T,
                                   .lda = P1,
                                   .ldb = static_cast<int>(nc),
                                   .ldc = static_cast<int>(nc)},
                                  c1_.data(), static_cast<int64_t>(T) * P1, x_.data(), s.w1);
      !e.ok()) {
    return e;
  }
  Count("bwd GEMM dW1 += c1^T X", T * nc * sz, 0);
  return Check(xhc::RouterCentring(lay, T, c1_.data(), s.rec.data(), grads_.data() + s.w1,
                                   corr_.data(), partial_.data(), st),
               "router centring");
}

template <typename S>
absl::Status XhcStreams<S>::StateToHost(std::vector<float>* state) {
  if constexpr (std::is_same_v<S, float>) {
    return x_.CopyTo(state);
  } else {
    DeviceTensor<float> f(device_, "xhc state (fp32 copy)");
    if (absl::Status s = f.Resize({tokens_, N_, C_}); !s.ok()) return s;
    if (absl::Status s = Check(kernels::Bf16ToF32(f.size(), x_.data(), f.data(), device_->stream()),
                               "state to fp32");
        !s.ok()) {
      return s;
    }
    return f.CopyTo(state);
  }
}

template <typename S>
absl::Status XhcStreams<S>::StateGradToHost(std::vector<float>* d_state) {
  if (absl::Status s = Order(backward_pos_ == 0, "StateGradToHost", 0); !s.ok()) return s;
  return dx_.CopyTo(d_state);
}

template <typename S>
absl::StatusOr<std::vector<SublayerMaps<float>>> XhcStreams<S>::Maps(int l) {
  if (l < 0 || l >= L_) return absl::InvalidArgumentError("xhc (GPU): no such sublayer");
  if (forward_pos_ < 2 * l + 1) return Order(false, "Maps", l);
  if (Dense()) return DenseMaps(l);
  Sublayer& s = *sub_[static_cast<size_t>(l)];
  Sublayer& entry = EntryOf(l);
  const xhc::Layout lay = LayoutOf(l);
  std::vector<float> rec, coef;
  std::vector<int32_t> idx;
  for (absl::Status st : {entry.rec.CopyTo(&rec), s.coef.CopyTo(&coef), entry.idx.CopyTo(&idx)}) {
    if (!st.ok()) return st;
  }
  std::vector<SublayerMaps<float>> out(static_cast<size_t>(tokens_));
  for (int t = 0; t < tokens_; ++t) {
    const float* r = rec.data() + static_cast<int64_t>(t) * lay.RecStride();
    const float* c = coef.data() + static_cast<int64_t>(t) * lay.CoefStride();
    SublayerMaps<float>& m = out[static_cast<size_t>(t)];
    m.active.assign(idx.begin() + static_cast<int64_t>(t) * k_,
                    idx.begin() + static_cast<int64_t>(t + 1) * k_);
    m.gates.assign(r + xhc::Layout::kGate, r + xhc::Layout::kGate + k_);
    m.h_pre.assign(r + lay.HpreOff(), r + lay.HpreOff() + N_);
    if (lay.mix) m.h_res.assign(c + lay.HresOff(), c + lay.HresOff() + k_ * k_);
    m.h_post.assign(c + lay.HpostOff(), c + lay.HpostOff() + k_ * lay.Kr);
  }
  return out;
}

// ---- hc and mhc: every sublayer reads, mixes and writes the full state (xhc_kernels.h's
// Dense*). Their projections run over Rows() rows per token of K = N*C / Rows() elements.

template <typename S>
xhc::DenseLayout XhcStreams<S>::DenseLayoutOf() const {
  xhc::DenseLayout d;
  d.hc = config_.mode == ResidualMode::kHc;
  d.N = N_;
  d.C = C_;
  d.iters = config_.sinkhorn_iters;
  return d;
}

template <typename S>
absl::Status XhcStreams<S>::ReserveDense(int tokens) {
  const int64_t T = tokens;
  const xhc::DenseLayout d = DenseLayoutOf();
  const int64_t zt = static_cast<int64_t>(d.Rows()) * d.P();
  for (const std::unique_ptr<Sublayer>& s : sub_) {
    for (absl::Status st : {s->coef.Resize({T, d.CoefStride()}), s->saved.Resize({T, N_, C_}),
                            s->out.Resize({T, C_})}) {
      if (!st.ok()) return st;
    }
  }
  // c2_ holds the write's dH_post / dH_res records, c1_ the projections' gradients.
  for (absl::Status st :
       {x_.Resize({T, N_, C_}), dx_.Resize({T, N_, C_}), segment_.Resize({T}), z_.Resize({T, zt}),
        c1_.Resize({T, zt}), c2_.Resize({T, d.DcoefStride()}), rscal_.Resize({T, d.ScalStride()}),
        partial_.Resize({xhc::ColumnSumPartialFloats(T, d.ScalStride())}),
        tape_.Resize({T, xhc::DenseTapeFloats(d)}), c_bf16_.Resize({T, zt})}) {
    if (!st.ok()) return st;
  }
  capacity_ = tokens;
  return absl::OkStatus();
}

template <typename S>
absl::Status XhcStreams<S>::DenseReadInput(int l, float* u) {
  Sublayer& s = *sub_[static_cast<size_t>(l)];
  const xhc::DenseLayout d = DenseLayoutOf();
  const int T = tokens_;
  const int64_t nc = static_cast<int64_t>(N_) * C_;
  const int64_t sz = sizeof(S);
  const int P = d.P(), K = static_cast<int>(nc / d.Rows());
  // z = X W^T over the projected rows (hc: every stream; mhc: the whole state).
  if (absl::Status e = Project(
          {.trans_b = true, .m = T * d.Rows(), .n = P, .k = K, .lda = K, .ldb = K, .ldc = P},
          x_.data(), s.w1, z_.data());
      !e.ok()) {
    return e;
  }
  Count("dense fwd GEMM z = X W^T", T * nc * sz, T * d.Rows() * P * 4);
  if (absl::Status e = Check(xhc::DenseRead<S>(d, T, x_.data(), z_.data(), MapsOf(l), s.coef.data(),
                                               u, s.saved.data(), device_->stream()),
                             "DenseRead");
      !e.ok()) {
    return e;
  }
  Count("dense fwd Read (maps + dense read + save)", T * (nc * sz + d.Rows() * P * 4),
        T * (C_ * 4 + nc * sz + d.CoefStride() * 4));
  return absl::OkStatus();
}

template <typename S>
absl::Status XhcStreams<S>::DenseWriteOutput(int l, const float* out) {
  Sublayer& s = *sub_[static_cast<size_t>(l)];
  const int T = tokens_;
  const int64_t nc = static_cast<int64_t>(N_) * C_;
  const int64_t sz = sizeof(S);
  if (absl::Status e = Check(xhc::DenseWrite<S>(DenseLayoutOf(), T, out, s.coef.data(), x_.data(),
                                                s.out.data(), device_->stream()),
                             "DenseWrite");
      !e.ok()) {
    return e;
  }
  Count("dense fwd Write (mix + write-back)", T * (C_ * 4 + nc * sz), T * (nc * sz + C_ * 4));
  return absl::OkStatus();
}

template <typename S>
absl::Status XhcStreams<S>::DenseWriteOutputBackward(int l, float* d_out) {
  Sublayer& s = *sub_[static_cast<size_t>(l)];
  const int T = tokens_;
  const int64_t nc = static_cast<int64_t>(N_) * C_;
  const int64_t sz = sizeof(S);
  if (absl::Status e = Check(xhc::DenseWriteBackward<S>(DenseLayoutOf(), T, s.saved.data(),
                                                        s.out.data(), s.coef.data(), dx_.data(),
                                                        d_out, c2_.data(), device_->stream()),
                             "DenseWriteBackward");
      !e.ok()) {
    return e;
  }
  Count("dense bwd WriteBackward", T * (nc * 4 + nc * sz + C_ * 4), T * (nc * 4 + C_ * 4));
  return absl::OkStatus();
}

template <typename S>
absl::Status XhcStreams<S>::DenseReadInputBackward(int l, const float* d_u) {
  Sublayer& s = *sub_[static_cast<size_t>(l)];
  const xhc::DenseLayout d = DenseLayoutOf();
  const int T = tokens_;
  const int64_t nc = static_cast<int64_t>(N_) * C_;
  const int64_t sz = sizeof(S);
  const int P = d.P(), K = static_cast<int>(nc / d.Rows()), rows = T * d.Rows();
  const int ss = d.ScalStride();
  cudaStream_t st = device_->stream();
  if (absl::Status e = Check(
          xhc::DenseReadBackward<S>(d, T, s.saved.data(), d_u, s.coef.data(), c2_.data(), MapsOf(l),
                                    dx_.data(), c1_.data(), rscal_.data(), tape_.data(), st),
          "DenseReadBackward");
      !e.ok()) {
    return e;
  }
  Count("dense bwd ReadBackward (dense read + maps + norms)", T * (nc * sz + nc * 4 + C_ * 4),
        T * nc * 4);
  // dX += c W (fp32), dW += c^T X over the saved input state, both over the projected rows.
  const GemmShape dxshape{false, false, rows, K, P, P, K, K};
  if (absl::Status e = gemm_.Run(dxshape, 1.0f, c1_.data(), values_.data() + s.w1, 1.0f, dx_.data(),
                                 gemm_precision_, st);
      !e.ok()) {
    return e;
  }
  Count("dense bwd GEMM dX += c W", T * nc * 4, T * nc * 4);
  if (absl::Status e =
          WeightGrad({.trans_a = true, .m = P, .n = K, .k = rows, .lda = P, .ldb = K, .ldc = K},
                     c1_.data(), static_cast<int64_t>(rows) * P, s.saved.data(), s.w1);
      !e.ok()) {
    return e;
  }
  Count("dense bwd GEMM dW += c^T X", T * nc * sz, 0);
  if (!d.hc)
    return Check(
        xhc::SumScalars(T, ss, ss, rscal_.data(), grads_.data() + s.a_pre, partial_.data(), st),
        "mhc scalars");
  // hc's records are s_a, s_b, A_m0, B0, A_r0; its parameters s_a, s_b, a_m0, a_r0, b0.
  const int n = N_;
  for (const auto& [rec, param, count] :
       {std::tuple{0, 0, 2 + n}, std::tuple{2 + n, 2 + n + n * n, n},
        std::tuple{2 + 2 * n, 2 + n, n * n}}) {
    if (absl::Status e =
            Check(xhc::SumScalars(T, ss, count, rscal_.data() + rec,
                                  grads_.data() + s.a_pre + param, partial_.data(), st),
                  "hc scalars");
        !e.ok()) {
      return e;
    }
  }
  return absl::OkStatus();
}

template <typename S>
absl::StatusOr<std::vector<SublayerMaps<float>>> XhcStreams<S>::DenseMaps(int l) {
  std::vector<float> coef;
  if (absl::Status st = sub_[static_cast<size_t>(l)]->coef.CopyTo(&coef); !st.ok()) return st;
  const xhc::DenseLayout d = DenseLayoutOf();
  const int n = N_;
  std::vector<SublayerMaps<float>> out(static_cast<size_t>(tokens_));
  for (int t = 0; t < tokens_; ++t) {
    const float* c = coef.data() + static_cast<int64_t>(t) * d.CoefStride();
    SublayerMaps<float>& m = out[static_cast<size_t>(t)];
    for (int i = 0; i < n; ++i) m.active.push_back(i);
    m.gates.assign(static_cast<size_t>(n), 1.0f);
    m.h_pre.assign(c + d.Pre(), c + d.Pre() + n);
    m.h_post.assign(c + d.Post(), c + d.Post() + n);
    m.h_res.assign(c + d.Res(), c + d.Res() + n * n);  // as the CPU stores it (hc: A_r)
  }
  return out;
}

template class XhcStreams<float>;
template class XhcStreams<bf16>;

}  // namespace rackrun::runtime::cuda
