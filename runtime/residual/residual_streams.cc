#include "runtime/residual/residual_streams.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "runtime/residual/kernels.h"
#include "runtime/residual/residual_impl.h"

namespace rackrun::runtime {

namespace {

constexpr std::pair<ResidualMode, std::string_view> kModeNames[] = {
    {ResidualMode::kVanilla, "vanilla"},
    {ResidualMode::kHc, "hc"},
    {ResidualMode::kMhc, "mhc"},
    {ResidualMode::kXhc, "xhc"},
    {ResidualMode::kXhcFlash, "xhc_flash"},
    {ResidualMode::kXhcFlash4, "xhc_flash4"},
};

bool IsXhcFamily(ResidualMode mode) {
  return mode == ResidualMode::kXhc || mode == ResidualMode::kXhcFlash ||
         mode == ResidualMode::kXhcFlash4;
}

}  // namespace

absl::StatusOr<ResidualMode> ParseResidualMode(std::string_view name) {
  std::vector<std::string_view> names;
  for (const auto& [mode, n] : kModeNames) {
    if (n == name) return mode;
    names.push_back(n);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "model.residual: unknown residual mode '", std::string(name), "'; use one of ",
      absl::StrJoin(names, ", ", [](std::string* o, std::string_view n) { o->append(n); })));
}

std::string_view ResidualModeName(ResidualMode mode) {
  for (const auto& [m, n] : kModeNames)
    if (m == mode) return n;
  return "unknown";
}

ResidualConfig ResidualConfig::ForMode(ResidualMode mode, int width,
                                       std::vector<SublayerKind> sublayers) {
  ResidualConfig c;
  c.mode = mode;
  c.width = width;
  c.sublayers = std::move(sublayers);
  switch (mode) {
    case ResidualMode::kVanilla:
      c.streams = c.active = c.fixed = 1;
      break;
    case ResidualMode::kHc:
    case ResidualMode::kMhc:
      c.streams = c.active = c.fixed = 4;
      break;
    case ResidualMode::kXhc:
    case ResidualMode::kXhcFlash:
    case ResidualMode::kXhcFlash4:
      c.streams = 16;
      c.active = 4;
      c.fixed = 2;
      break;
  }
  return c;
}

std::vector<SublayerKind> ResidualConfig::Transformer(int blocks) {
  std::vector<SublayerKind> s;
  for (int b = 0; b < blocks; ++b) {
    s.push_back(SublayerKind::kAttention);
    s.push_back(SublayerKind::kMlp);
  }
  return s;
}

int ResidualConfig::group_size() const {
  if (mode == ResidualMode::kXhcFlash) return 2;
  if (mode == ResidualMode::kXhcFlash4) return 4;
  return 1;
}

absl::Status ResidualConfig::Validate() const {
  const std::string_view m = ResidualModeName(mode);
  if (width <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("residual.width must be positive (the model width C), got ", width));
  if (sublayers.empty())
    return absl::InvalidArgumentError(
        "residual.sublayers is empty: list the model's sublayers (attention, mlp, ...)");
  if (streams <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("residual.streams must be positive, got ", streams));
  if (mode == ResidualMode::kVanilla && streams != 1)
    return absl::InvalidArgumentError(
        absl::StrCat("residual.streams must be 1 for vanilla, got ", streams));
  if ((mode == ResidualMode::kHc || mode == ResidualMode::kMhc) && streams > 16)
    return absl::InvalidArgumentError(absl::StrCat(
        "residual.streams = ", streams, " is too large for ", std::string(m), "; use at most 16"));
  if (mode == ResidualMode::kMhc || IsXhcFamily(mode)) {
    if (sinkhorn_iters < 1)
      return absl::InvalidArgumentError(
          absl::StrCat("residual.sinkhorn_iters must be at least 1, got ", sinkhorn_iters));
  }
  if (IsXhcFamily(mode)) {
    if (streams > 64)
      return absl::InvalidArgumentError(
          absl::StrCat("residual.streams = ", streams, " exceeds 64; use at most 64"));
    if (active > 16)
      return absl::InvalidArgumentError(
          absl::StrCat("residual.active (k) = ", active, " exceeds 16; use at most 16"));
    if (conv_widths.size() > 7)
      return absl::InvalidArgumentError(
          absl::StrCat("residual.conv_widths has ", conv_widths.size(), " entries; use at most 7"));
    if (active <= 0 || active > streams)
      return absl::InvalidArgumentError(
          absl::StrCat("residual.active (k) must be in [1, streams]; got k = ", active,
                       " with N = ", streams, ": lower k or raise N"));
    if (fixed < 0 || fixed > active)
      return absl::InvalidArgumentError(
          absl::StrCat("residual.fixed (m) must be in [0, active]; got m = ", fixed,
                       " with k = ", active, ": lower m or raise k"));
    for (size_t j = 0; j < conv_widths.size(); ++j)
      if (conv_widths[j] <= 0)
        return absl::InvalidArgumentError(
            absl::StrCat("residual.conv_widths[", j, "] must be positive, got ", conv_widths[j]));
    const int g = group_size();
    if (g > 1) {
      if (sublayers.size() % static_cast<size_t>(g) != 0)
        return absl::InvalidArgumentError(
            absl::StrCat("residual.sublayers: ", std::string(m), " schedules groups of ", g,
                         " sublayers but the model has ", sublayers.size(), "; use a multiple of ",
                         g, " or mode xhc"));
      for (size_t l = g - 1; l < sublayers.size(); l += g)
        if (sublayers[l] != SublayerKind::kMlp)
          return absl::InvalidArgumentError(absl::StrCat("residual.sublayers[", l, "] ends a ",
                                                         std::string(m),
                                                         " group and must be an MLP sublayer"));
    }
  }
  return absl::OkStatus();
}

double ResidualTraffic::PaperPerSublayer(int width) const {
  if (sublayer_tokens == 0 || width <= 0) return 0;
  double s = 0;
  for (const TrafficStep& step : steps)
    s += static_cast<double>(step.paper_read + step.paper_written);
  return s / static_cast<double>(sublayer_tokens) / width;
}

double ResidualTraffic::FusedPerSublayer(int width) const {
  if (sublayer_tokens == 0 || width <= 0) return 0;
  double s = 0;
  for (const TrafficStep& step : steps)
    s += static_cast<double>(step.fused_read + step.fused_written);
  return s / static_cast<double>(sublayer_tokens) / width;
}

// ---------------------------------------------------------------------------------------
// Impl shared state.

template <typename T>
ResidualStreams<T>::Impl::Impl(const ResidualConfig& c)
    : config(c), nstreams(c.streams), width(c.width), nsub(static_cast<int>(c.sublayers.size())) {}

template <typename T>
int64_t ResidualStreams<T>::Impl::AddParam(std::string name, int64_t size) {
  const int64_t offset = static_cast<int64_t>(values.size());
  slots.push_back({std::move(name), offset, size});
  values.resize(values.size() + static_cast<size_t>(size), T(0));
  grads.resize(values.size(), T(0));
  return offset;
}

template <typename T>
void ResidualStreams<T>::Impl::Count(std::string_view step, double paper_read, double paper_written,
                                     double fused_read, double fused_written) {
  TrafficStep* s = nullptr;
  for (TrafficStep& existing : traffic.steps)
    if (existing.name == step) s = &existing;
  if (s == nullptr) {
    traffic.steps.push_back(TrafficStep{std::string(step)});
    s = &traffic.steps.back();
  }
  const double t = static_cast<double>(ntok);
  s->paper_read += static_cast<int64_t>(paper_read * t);
  s->paper_written += static_cast<int64_t>(paper_written * t);
  s->fused_read += static_cast<int64_t>(fused_read * t);
  s->fused_written += static_cast<int64_t>(fused_written * t);
}

template <typename T>
const T* ResidualStreams<T>::Impl::Pack(const T* w, int P, int64_t K) {
  const size_t need = static_cast<size_t>(residual_internal::PanelSize<T>(P, K));
  if (packed.size() < need) packed.resize(need);
  residual_internal::PackPanels(w, K, P, K, packed.data());
  return packed.data();
}

// ---------------------------------------------------------------------------------------
// vanilla: x' = x + F(x). Nothing to save: the backward does not depend on x.

namespace {

template <typename T>
class VanillaImpl final : public ResidualStreams<T>::Impl {
 public:
  using Base = typename ResidualStreams<T>::Impl;
  using Base::Base;

  void DeclareParameters() override {}
  void InitParameters(uint64_t) override {}
  void Reserve() override {}

  void Read(int, T* u) override {
    Copy(this->X.data(), u);
    // F reads x itself in the paper's accounting; our interface copies it out.
    const double c = this->width;
    this->Count("body input", 0, 0, c, c);
  }
  void Write(int, const T* out) override {
    const int64_t n = static_cast<int64_t>(this->ntok) * this->width;
    T* x = this->X.data();
#pragma omp parallel for schedule(static) if (this->Parallel())
    for (int64_t b = 0; b < n; b += 4096)
      residual_internal::Axpy(T(1), out + b, x + b, std::min<int64_t>(4096, n - b));
    const double c = this->width;
    this->Count("merge", 2 * c, c, 2 * c, c);
  }
  void WriteBackward(int, T* d_out) override { Copy(this->dX.data(), d_out); }
  SublayerMaps<T> Maps(int, int) const override {
    return SublayerMaps<T>{{0}, {T(1)}, {T(1)}, {}, {T(1)}};
  }
  void ReadBackward(int, const T* d_u) override {
    const int64_t n = static_cast<int64_t>(this->ntok) * this->width;
    T* dx = this->dX.data();
#pragma omp parallel for schedule(static) if (this->Parallel())
    for (int64_t b = 0; b < n; b += 4096)
      residual_internal::Axpy(T(1), d_u + b, dx + b, std::min<int64_t>(4096, n - b));
  }

 private:
  // The state (ntok x width) copied in blocks over the threads, as Write adds them: on one
  // thread these copies were the part of a vanilla step that did not scale (docs/results.md).
  void Copy(const T* from, T* to) const {
    const int64_t n = static_cast<int64_t>(this->ntok) * this->width;
#pragma omp parallel for schedule(static) if (this->Parallel())
    for (int64_t b = 0; b < n; b += 4096) {
      std::memcpy(to + b, from + b,
                  sizeof(T) * static_cast<size_t>(std::min<int64_t>(4096, n - b)));
    }
  }
};

}  // namespace

template <typename T>
std::unique_ptr<typename ResidualStreams<T>::Impl> MakeVanillaImpl(const ResidualConfig& c) {
  return std::make_unique<VanillaImpl<T>>(c);
}

// ---------------------------------------------------------------------------------------
// ResidualStreams: validation of calls, then dispatch to the mode.

template <typename T>
ResidualStreams<T>::ResidualStreams(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
template <typename T>
ResidualStreams<T>::ResidualStreams(ResidualStreams&&) noexcept = default;
template <typename T>
ResidualStreams<T>& ResidualStreams<T>::operator=(ResidualStreams&&) noexcept = default;
template <typename T>
ResidualStreams<T>::~ResidualStreams() = default;

template <typename T>
absl::StatusOr<ResidualStreams<T>> ResidualStreams<T>::Create(const ResidualConfig& config,
                                                              uint64_t seed) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  std::unique_ptr<Impl> impl;
  switch (config.mode) {
    case ResidualMode::kVanilla:
      impl = MakeVanillaImpl<T>(config);
      break;
    case ResidualMode::kHc:
      impl = MakeHcImpl<T>(config);
      break;
    case ResidualMode::kMhc:
      impl = MakeMhcImpl<T>(config);
      break;
    case ResidualMode::kXhc:
    case ResidualMode::kXhcFlash:
    case ResidualMode::kXhcFlash4:
      impl = MakeXhcImpl<T>(config);
      break;
  }
  if (impl == nullptr) return absl::InternalError("ResidualStreams: unhandled residual mode");
  impl->DeclareParameters();
  impl->InitParameters(seed);
  return ResidualStreams<T>(std::move(impl));
}

template <typename T>
const ResidualConfig& ResidualStreams<T>::config() const {
  return impl_->config;
}
template <typename T>
int ResidualStreams<T>::streams() const {
  return impl_->nstreams;
}

template <typename T>
std::vector<ParamRef<T>> ResidualStreams<T>::Parameters() {
  std::vector<ParamRef<T>> refs;
  for (const auto& slot : impl_->slots)
    refs.push_back(
        ParamRef<T>{slot.name, impl_->value(slot.offset), impl_->grad(slot.offset), slot.size, {}});
  return refs;
}

template <typename T>
void ResidualStreams<T>::ZeroGrad() {
  std::fill(impl_->grads.begin(), impl_->grads.end(), T(0));
}

template <typename T>
absl::Status ResidualStreams<T>::BeginBatch(int tokens, std::span<const int32_t> segment_starts,
                                            bool save_for_backward) {
  Impl& m = *impl_;
  if (tokens <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("BeginBatch: tokens must be positive, got ", tokens));
  for (size_t i = 0; i < segment_starts.size(); ++i) {
    const int32_t s = segment_starts[i];
    if (s < 0 || s >= tokens)
      return absl::InvalidArgumentError(absl::StrCat("BeginBatch: segment_starts[", i, "] = ", s,
                                                     " is outside [0, ", tokens, ")"));
    if (i > 0 && s <= segment_starts[i - 1])
      return absl::InvalidArgumentError(
          absl::StrCat("BeginBatch: segment_starts must be strictly increasing; entry ", i, " is ",
                       s, " after ", segment_starts[i - 1]));
  }
  m.ntok = tokens;
  m.save = save_for_backward;
  // Per-thread scratch is sized for the thread count at reservation: re-reserve if the
  // OpenMP team grew since.
  const int threads = std::max(1, omp_get_max_threads());
  const bool grow =
      tokens > m.capacity || (save_for_backward && !m.reserved_save) || threads > m.threads;
  m.threads = std::max(m.threads, threads);
  if (grow) {
    m.capacity = std::max(tokens, m.capacity);
    m.reserved_save = m.reserved_save || save_for_backward;
    const size_t state = static_cast<size_t>(m.capacity) * m.nstreams * m.width;
    m.X.resize(state);
    if (m.reserved_save) m.dX.resize(state);
    m.segment_of.resize(static_cast<size_t>(m.capacity));
    m.Reserve();
  }
  size_t next = 0;
  int32_t current = 0;
  for (int t = 0; t < tokens; ++t) {
    if (next < segment_starts.size() && segment_starts[next] == t) {
      current = t;
      ++next;
    }
    m.segment_of[static_cast<size_t>(t)] = current;
  }
  m.batch_ready = true;
  m.forward_pos = -1;
  m.backward_pos = -1;
  return absl::OkStatus();
}

namespace {

absl::Status CheckSize(std::string_view call, std::string_view arg, size_t got, int64_t want,
                       std::string_view shape) {
  if (static_cast<int64_t>(got) != want)
    return absl::InvalidArgumentError(absl::StrCat(std::string(call), ": ", std::string(arg),
                                                   " has ", got, " elements, expected ", want, " (",
                                                   std::string(shape), ")"));
  return absl::OkStatus();
}

// What every per-sublayer call checks first: the sublayer index, then that its argument
// (`got` elements) holds tokens x width.
template <typename Impl>
absl::Status CheckSublayerCall(std::string_view call, int sublayer, const Impl& m,
                               std::string_view arg, size_t got) {
  if (sublayer < 0 || sublayer >= m.nsub)
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(call), ": sublayer ", sublayer, " is outside [0, ", m.nsub, ")"));
  return CheckSize(call, arg, got, static_cast<int64_t>(m.ntok) * m.width, "tokens x width");
}

// dst[t][i] = src[t] for every token t and stream i (tokens x C -> tokens x N x C).
template <typename T>
void ReplicateStreams(const T* src, int tokens, int N, int64_t C, bool parallel, T* dst) {
#pragma omp parallel for schedule(static) if (parallel)
  for (int t = 0; t < tokens; ++t)
    for (int i = 0; i < N; ++i)
      std::memcpy(dst + (static_cast<int64_t>(t) * N + i) * C, src + t * C, sizeof(T) * C);
}

// dst[t] = sum_i src[t][i] (tokens x N x C -> tokens x C), streams added in index order.
template <typename T>
void SumStreams(const T* src, int tokens, int N, int64_t C, bool parallel, T* dst) {
  T one[64];  // N <= 64 (Validate); no allocation per call
  std::fill(one, one + N, T(1));
#pragma omp parallel for schedule(static) if (parallel)
  for (int t = 0; t < tokens; ++t)
    residual_internal::Combine(one, N, src + static_cast<int64_t>(t) * N * C, C, C, dst + t * C);
}

}  // namespace

#define RACKRUN_RETURN_IF_ERROR(expr)         \
  do {                                        \
    if (absl::Status s_ = (expr); !s_.ok()) { \
      return s_;                              \
    }                                         \
  } while (false)

template <typename T>
absl::Status ResidualStreams<T>::Expand(std::span<const T> embedding) {
  Impl& m = *impl_;
  if (!m.batch_ready) return absl::FailedPreconditionError("Expand: call BeginBatch first");
  RACKRUN_RETURN_IF_ERROR(CheckSize("Expand", "embedding", embedding.size(),
                                    static_cast<int64_t>(m.ntok) * m.width, "tokens x width"));
  ReplicateStreams(embedding.data(), m.ntok, m.nstreams, m.width, m.Parallel(), m.X.data());
  m.forward_pos = 0;
  m.backward_pos = -1;
  return absl::OkStatus();
}

template <typename T>
absl::Status ResidualStreams<T>::SetState(std::span<const T> state) {
  Impl& m = *impl_;
  if (!m.batch_ready) return absl::FailedPreconditionError("SetState: call BeginBatch first");
  RACKRUN_RETURN_IF_ERROR(CheckSize("SetState", "state", state.size(),
                                    static_cast<int64_t>(m.ntok) * m.nstreams * m.width,
                                    "tokens x streams x width"));
  std::memcpy(m.X.data(), state.data(), sizeof(T) * state.size());
  m.forward_pos = 0;
  m.backward_pos = -1;
  return absl::OkStatus();
}

namespace {

absl::Status SequenceError(std::string_view call, int sublayer, std::string_view expected) {
  return absl::FailedPreconditionError(
      absl::StrCat(std::string(call), "(", sublayer, ") out of order: ", std::string(expected)));
}

}  // namespace

template <typename T>
absl::Status ResidualStreams<T>::ReadInput(int sublayer, std::span<T> body_in) {
  Impl& m = *impl_;
  RACKRUN_RETURN_IF_ERROR(CheckSublayerCall("ReadInput", sublayer, m, "body_in", body_in.size()));
  if (m.forward_pos != 2 * sublayer)
    return SequenceError("ReadInput", sublayer,
                         "call BeginBatch, Expand, then ReadInput/WriteOutput for sublayers "
                         "0, 1, ... in order");
  m.Read(sublayer, body_in.data());
  m.forward_pos = 2 * sublayer + 1;
  return absl::OkStatus();
}

template <typename T>
absl::Status ResidualStreams<T>::WriteOutput(int sublayer, std::span<const T> body_out) {
  Impl& m = *impl_;
  RACKRUN_RETURN_IF_ERROR(
      CheckSublayerCall("WriteOutput", sublayer, m, "body_out", body_out.size()));
  if (m.forward_pos != 2 * sublayer + 1)
    return SequenceError("WriteOutput", sublayer, "call ReadInput for the same sublayer first");
  m.Write(sublayer, body_out.data());
  m.traffic.sublayer_tokens += m.ntok;
  m.forward_pos = 2 * sublayer + 2;
  return absl::OkStatus();
}

template <typename T>
absl::Status ResidualStreams<T>::Collapse(std::span<T> out) {
  Impl& m = *impl_;
  RACKRUN_RETURN_IF_ERROR(CheckSize("Collapse", "out", out.size(),
                                    static_cast<int64_t>(m.ntok) * m.width, "tokens x width"));
  if (m.forward_pos != 2 * m.nsub)
    return absl::FailedPreconditionError(
        "Collapse: every sublayer's ReadInput/WriteOutput must run first");
  SumStreams(m.X.data(), m.ntok, m.nstreams, m.width, m.Parallel(), out.data());
  m.forward_pos = 2 * m.nsub + 1;
  m.backward_pos = 2 * m.nsub + 2;
  return absl::OkStatus();
}

template <typename T>
absl::Status ResidualStreams<T>::CollapseBackward(std::span<const T> d_out) {
  Impl& m = *impl_;
  RACKRUN_RETURN_IF_ERROR(CheckSize("CollapseBackward", "d_out", d_out.size(),
                                    static_cast<int64_t>(m.ntok) * m.width, "tokens x width"));
  if (!m.save)
    return absl::FailedPreconditionError(
        "CollapseBackward: the batch was started with save_for_backward = false");
  if (m.forward_pos != 2 * m.nsub + 1 || m.backward_pos != 2 * m.nsub + 2)
    return absl::FailedPreconditionError(
        "CollapseBackward: run the whole forward (through Collapse) first, once");
  ReplicateStreams(d_out.data(), m.ntok, m.nstreams, m.width, m.Parallel(), m.dX.data());
  m.backward_pos = 2 * m.nsub + 1;
  return absl::OkStatus();
}

template <typename T>
absl::Status ResidualStreams<T>::WriteOutputBackward(int sublayer, std::span<T> d_body_out) {
  Impl& m = *impl_;
  RACKRUN_RETURN_IF_ERROR(
      CheckSublayerCall("WriteOutputBackward", sublayer, m, "d_body_out", d_body_out.size()));
  if (m.backward_pos != 2 * sublayer + 3)
    return SequenceError("WriteOutputBackward", sublayer,
                         "the backward runs CollapseBackward, then sublayers L-1 ... 0 in "
                         "reverse forward order");
  m.WriteBackward(sublayer, d_body_out.data());
  m.backward_pos = 2 * sublayer + 2;
  return absl::OkStatus();
}

template <typename T>
absl::Status ResidualStreams<T>::ReadInputBackward(int sublayer, std::span<const T> d_body_in) {
  Impl& m = *impl_;
  RACKRUN_RETURN_IF_ERROR(
      CheckSublayerCall("ReadInputBackward", sublayer, m, "d_body_in", d_body_in.size()));
  if (m.backward_pos != 2 * sublayer + 2)
    return SequenceError("ReadInputBackward", sublayer,
                         "call WriteOutputBackward for the same sublayer first");
  m.ReadBackward(sublayer, d_body_in.data());
  m.backward_pos = 2 * sublayer + 1;
  return absl::OkStatus();
}

template <typename T>
absl::Status ResidualStreams<T>::ExpandBackward(std::span<T> d_embedding) {
  Impl& m = *impl_;
  RACKRUN_RETURN_IF_ERROR(CheckSize("ExpandBackward", "d_embedding", d_embedding.size(),
                                    static_cast<int64_t>(m.ntok) * m.width, "tokens x width"));
  if (m.backward_pos != 1)
    return absl::FailedPreconditionError(
        "ExpandBackward: run every sublayer's backward (down to ReadInputBackward(0)) first");
  SumStreams(m.dX.data(), m.ntok, m.nstreams, m.width, m.Parallel(), d_embedding.data());
  m.backward_pos = 0;
  return absl::OkStatus();
}

template <typename T>
absl::Status ResidualStreams<T>::StateBackward(std::span<T> d_state) {
  Impl& m = *impl_;
  RACKRUN_RETURN_IF_ERROR(CheckSize("StateBackward", "d_state", d_state.size(),
                                    static_cast<int64_t>(m.ntok) * m.nstreams * m.width,
                                    "tokens x streams x width"));
  if (m.backward_pos != 1)
    return absl::FailedPreconditionError(
        "StateBackward: run every sublayer's backward (down to ReadInputBackward(0)) first");
  std::memcpy(d_state.data(), m.dX.data(), sizeof(T) * d_state.size());
  m.backward_pos = 0;
  return absl::OkStatus();
}

template <typename T>
std::span<const T> ResidualStreams<T>::state() const {
  return std::span<const T>(impl_->X.data(),
                            static_cast<size_t>(impl_->ntok) * impl_->nstreams * impl_->width);
}

template <typename T>
absl::StatusOr<SublayerMaps<T>> ResidualStreams<T>::Maps(int sublayer, int token) const {
  const Impl& m = *impl_;
  if (sublayer < 0 || sublayer >= m.nsub || token < 0 || token >= m.ntok)
    return absl::InvalidArgumentError(absl::StrCat("Maps: sublayer ", sublayer, " / token ", token,
                                                   " outside [0, ", m.nsub, ") x [0, ", m.ntok,
                                                   ")"));
  if (!m.batch_ready || m.forward_pos < 2 * sublayer + 1)
    return absl::FailedPreconditionError(
        absl::StrCat("Maps: ReadInput(", sublayer, ") has not run in this batch"));
  return m.Maps(sublayer, token);
}

template <typename T>
const ResidualTraffic& ResidualStreams<T>::traffic() const {
  return impl_->traffic;
}

template <typename T>
void ResidualStreams<T>::ResetTraffic() {
  impl_->traffic = ResidualTraffic{};
}

template class ResidualStreams<float>;
template class ResidualStreams<double>;

}  // namespace rackrun::runtime
