#include "runtime/layers/moe.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "base/clock.h"
#include "runtime/cpu/gemm.h"
#include "runtime/cpu/math.h"
#include "runtime/cpu/parallel.h"

namespace rackrun::runtime {
namespace {

// out[t] (+)= sum over j < k of w[t, j] * src[row[t, j]] (w = 1 when `weights` is null): the
// k dispatched rows of every token gathered back to it, overwriting `out` unless `add`.
// Parallel over tokens (static schedule), so sums keep their order on any thread count.
template <typename T>
void GatherRows(int64_t tokens, int k, int c, const int64_t* row, const T* weights, const T* src,
                bool add, T* out) {
#pragma omp parallel for schedule(static) if (tokens * k * c >= cpu::kParallelMinWork)
  for (int64_t t = 0; t < tokens; ++t) {
    T* o = out + t * c;
    if (!add) std::fill(o, o + c, T(0));
    for (int j = 0; j < k; ++j) {
      const T* y = src + row[t * k + j] * c;
      if (weights == nullptr) {
        for (int i = 0; i < c; ++i) o[i] += y[i];
      } else {
        const T g = weights[t * k + j];
        for (int i = 0; i < c; ++i) o[i] += g * y[i];
      }
    }
  }
}

}  // namespace

// ---------------------------------------------------------------- SwiGLU math

template <typename T>
void SwigluForward(int width, int hidden, const T* w13, const T* w2, int64_t rows, const T* x,
                   T* h13, T* act, T* y) {
  if (rows == 0) return;
  const int c = width, f = hidden, r = static_cast<int>(rows);
  cpu::Gemm<T>(false, false, r, 2 * f, c, T(1), x, c, w13, 2 * f, T(0), h13, 2 * f);
#pragma omp parallel for schedule(static) if (rows * f >= cpu::kParallelMinWork)
  for (int64_t i = 0; i < rows; ++i) {
    const T* g = h13 + i * 2 * f;
    const T* up = g + f;
    T* a = act + i * f;
    for (int j = 0; j < f; ++j) a[j] = g[j] * cpu::Sigmoid(g[j]) * up[j];
  }
  cpu::Gemm<T>(false, false, r, c, f, T(1), act, f, w2, c, T(0), y, c);
}

template <typename T>
void SwigluBackward(int width, int hidden, const T* w13, const T* w2, T* dw13, T* dw2, int64_t rows,
                    const T* x, const T* h13, const T* act, const T* dy, T* dh13, T* dact, T* dx) {
  if (rows == 0) return;
  const int c = width, f = hidden, r = static_cast<int>(rows);
  // dact = dy W2^T; dW2 += act^T dy.
  cpu::Gemm<T>(false, true, r, f, c, T(1), dy, c, w2, c, T(0), dact, f);
  cpu::Gemm<T>(true, false, f, c, r, T(1), act, f, dy, c, T(1), dw2, c);
#pragma omp parallel for schedule(static) if (rows * f >= cpu::kParallelMinWork)
  for (int64_t i = 0; i < rows; ++i) {
    const T* g = h13 + i * 2 * f;
    const T* up = g + f;
    const T* da = dact + i * f;
    T* dg = dh13 + i * 2 * f;
    T* dup = dg + f;
    for (int j = 0; j < f; ++j) {
      const T s = cpu::Sigmoid(g[j]);
      const T silu = g[j] * s;
      dup[j] = da[j] * silu;
      dg[j] = da[j] * up[j] * (s + g[j] * s * (T(1) - s));
    }
  }
  cpu::Gemm<T>(true, false, c, 2 * f, r, T(1), x, c, dh13, 2 * f, T(1), dw13, 2 * f);
  cpu::Gemm<T>(false, true, r, c, 2 * f, T(1), dh13, 2 * f, w13, 2 * f, T(0), dx, c);
}

template void SwigluForward<float>(int, int, const float*, const float*, int64_t, const float*,
                                   float*, float*, float*);
template void SwigluForward<double>(int, int, const double*, const double*, int64_t, const double*,
                                    double*, double*, double*);
template void SwigluBackward<float>(int, int, const float*, const float*, float*, float*, int64_t,
                                    const float*, const float*, const float*, const float*, float*,
                                    float*, float*);
template void SwigluBackward<double>(int, int, const double*, const double*, double*, double*,
                                     int64_t, const double*, const double*, const double*,
                                     const double*, double*, double*, double*);

// ---------------------------------------------------------------- SwigluExperts

template <typename T>
SwigluExperts<T>::SwigluExperts(int count, int width, int hidden, const std::string& prefix,
                                int first)
    : count_(count), width_(width), hidden_(hidden), first_(first) {
  w13_.Allocate(prefix + ".w13", {count, width, 2 * hidden});
  w2_.Allocate(prefix + ".w2", {count, hidden, width});
}

template <typename T>
void SwigluExperts<T>::Init(NormalInit& rng, double std, double out_std, int total) {
  if (total == 0) total = count_;
  // Same draw order as one [total x ...] tensor per weight: all w13 experts, then all w2.
  const int64_t n13 = static_cast<int64_t>(width_) * 2 * hidden_;
  const int64_t n2 = static_cast<int64_t>(hidden_) * width_;
  for (int pass = 0; pass < 2; ++pass) {
    Tensor<T>& w = pass == 0 ? w13_.value : w2_.value;
    const int64_t n = pass == 0 ? n13 : n2;
    const double sd = pass == 0 ? std : out_std;
    for (int e = 0; e < total; ++e) {
      const bool mine = e >= first_ && e < first_ + count_;
      T* dst = mine ? w.data() + static_cast<int64_t>(e - first_) * n : nullptr;
      for (int64_t i = 0; i < n; ++i) {
        const double v = sd * rng.Next();
        if (mine) dst[i] = static_cast<T>(v);
      }
    }
  }
}

template <typename T>
void SwigluExperts<T>::Forward(int e, int64_t rows, const T* x, T* h13, T* act, T* y) const {
  SwigluForward(width_, hidden_, w13(e), w2(e), rows, x, h13, act, y);
}

template <typename T>
void SwigluExperts<T>::Backward(int e, int64_t rows, const T* x, const T* h13, const T* act,
                                const T* dy, T* dh13, T* dact, T* dx) {
  SwigluBackward(width_, hidden_, w13(e), w2(e), dw13(e), dw2(e), rows, x, h13, act, dy, dh13, dact,
                 dx);
}

// ---------------------------------------------------------- LocalExpertExecutor

void RunExpertBatches(std::span<const int64_t> offsets, int64_t work_per_row,
                      std::vector<int>* cold, absl::FunctionRef<void(int)> body) {
  const int batches = static_cast<int>(offsets.size()) - 1;
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int64_t total = offsets.back() - offsets.front();
  if (threads <= 1 || total * work_per_row < 64 * cpu::kParallelMinWork) {
    for (int i = 0; i < batches; ++i) body(i);
    return;
  }
  // Hot batches (at least 1/threads of all rows) run one at a time on every thread; the
  // rest run side by side, one batch per thread, each single-threaded. Batches write
  // disjoint rows and gradients and a serial batch computes the same values on any
  // thread, so the dynamic schedule stays deterministic.
  cold->clear();
  for (int i = 0; i < batches; ++i) {
    const int64_t rows = offsets[i + 1] - offsets[i];
    if (rows == 0) continue;
    if (rows * threads >= total) {
      body(i);
    } else {
      cold->push_back(i);
    }
  }
  const int n = static_cast<int>(cold->size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int i = 0; i < n; ++i) body((*cold)[static_cast<size_t>(i)]);
}

template <typename T>
absl::Status LocalExpertExecutor<T>::CheckHoldsEveryExpert(std::span<const int64_t> offsets) const {
  if (static_cast<int>(offsets.size()) != experts_->count() + 1) {
    return absl::FailedPreconditionError(
        "this MoE layer holds a shard of its experts; run it with an expert-parallel executor");
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status LocalExpertExecutor<T>::Forward(std::span<const int64_t> offsets, const T* dispatched,
                                             T* expert_out) {
  if (absl::Status s = CheckHoldsEveryExpert(offsets); !s.ok()) return s;
  const int64_t rows = offsets.back();
  const int f = experts_->hidden();
  const int c = experts_->width();
  input_ = dispatched;
  h13_.Resize({std::max<int64_t>(rows, 1), 2 * f});
  act_.Resize({std::max<int64_t>(rows, 1), f});
  RunExpertBatches(offsets, static_cast<int64_t>(c) * f, &small_, [&](int e) {
    const int64_t r0 = offsets[e];
    experts_->Forward(e, offsets[e + 1] - r0, dispatched + r0 * c, h13_.data() + r0 * 2 * f,
                      act_.data() + r0 * f, expert_out + r0 * c);
  });
  return absl::OkStatus();
}

template <typename T>
absl::Status LocalExpertExecutor<T>::Backward(std::span<const int64_t> offsets,
                                              const T* dexpert_out, T* ddispatched) {
  if (absl::Status s = CheckHoldsEveryExpert(offsets); !s.ok()) return s;
  const int64_t rows = offsets.back();
  const int f = experts_->hidden();
  const int c = experts_->width();
  dh13_.Resize({std::max<int64_t>(rows, 1), 2 * f});
  dact_.Resize({std::max<int64_t>(rows, 1), f});
  RunExpertBatches(offsets, static_cast<int64_t>(c) * f, &small_, [&](int e) {
    const int64_t r0 = offsets[e];
    experts_->Backward(e, offsets[e + 1] - r0, input_ + r0 * c, h13_.data() + r0 * 2 * f,
                       act_.data() + r0 * f, dexpert_out + r0 * c, dh13_.data() + r0 * 2 * f,
                       dact_.data() + r0 * f, ddispatched + r0 * c);
  });
  return absl::OkStatus();
}

// ---------------------------------------------------------------- routing math

template <typename T>
void RouteTopK(int64_t tokens, int experts, int k, const T* bias, T* scores, int32_t* selected,
               T* weights) {
  const int ne = experts;
  T* w = weights;
  int32_t* sel = selected;
#pragma omp parallel for schedule(static) if (tokens * ne >= cpu::kParallelMinWork)
  for (int64_t t = 0; t < tokens; ++t) {
    T* s = scores + t * ne;
    T mx = s[0];
    for (int e = 1; e < ne; ++e) mx = std::max(mx, s[e]);
    T sum = 0;
    for (int e = 0; e < ne; ++e) s[e] = cpu::Exp(s[e] - mx);
    for (int e = 0; e < ne; ++e) sum += s[e];
    const T inv = T(1) / sum;
    for (int e = 0; e < ne; ++e) s[e] *= inv;
    // Top-k by biased score, ties to the lower expert index; best first.
    int32_t* st = sel + t * k;
    T gate_sum = 0;
    for (int j = 0; j < k; ++j) {
      int best = -1;
      T best_v = 0;
      for (int e = 0; e < ne; ++e) {
        bool taken = false;
        for (int i = 0; i < j; ++i) taken |= st[i] == e;
        if (taken) continue;
        const T v = s[e] + (bias != nullptr ? bias[e] : T(0));
        if (best < 0 || v > best_v) {
          best = e;
          best_v = v;
        }
      }
      st[j] = best;
      gate_sum += s[best];
    }
    for (int j = 0; j < k; ++j) w[t * k + j] = s[st[j]] / gate_sum;
  }
}

template <typename T>
void RouterBackward(int64_t tokens, int experts, int k, const T* scores, const int32_t* selected,
                    const T* weights, const T* dweights, const T* aux, T* dlogits) {
  const int ne = experts;
#pragma omp parallel for schedule(static) if (tokens * ne >= cpu::kParallelMinWork)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* s = scores + t * ne;
    const int32_t* sel = selected + t * k;
    T dot = 0;
    T gate_sum = 0;
    for (int j = 0; j < k; ++j) {
      dot += dweights[t * k + j] * weights[t * k + j];
      gate_sum += s[sel[j]];
    }
    T* d = dlogits + t * ne;
    std::fill(d, d + ne, T(0));
    for (int j = 0; j < k; ++j) d[sel[j]] = (dweights[t * k + j] - dot) / gate_sum;
    if (aux != nullptr)
      for (int e = 0; e < ne; ++e) d[e] += aux[e];
    // Softmax backward in place: dlogit = s * (ds - sum s ds).
    T sd = 0;
    for (int e = 0; e < ne; ++e) sd += s[e] * d[e];
    for (int e = 0; e < ne; ++e) d[e] = s[e] * (d[e] - sd);
  }
}

template void RouteTopK<float>(int64_t, int, int, const float*, float*, int32_t*, float*);
template void RouteTopK<double>(int64_t, int, int, const double*, double*, int32_t*, double*);
template void RouterBackward<float>(int64_t, int, int, const float*, const int32_t*, const float*,
                                    const float*, const float*, float*);
template void RouterBackward<double>(int64_t, int, int, const double*, const int32_t*,
                                     const double*, const double*, const double*, double*);

// -------------------------------------------------------------------- MoeLayer

template <typename T>
MoeLayer<T>::MoeLayer(const MoeLayerConfig& config, const std::string& prefix)
    : config_(config),
      norm_(config.width, prefix + ".norm"),
      experts_(config.local_experts > 0 ? config.local_experts : config.experts, config.width,
               config.expert_hidden, prefix + ".experts", config.expert_first),
      bias_name_(prefix + ".router_bias") {
  router_.Allocate(prefix + ".router", {config.width, config.experts});
  bias_.Resize({config.experts});
  bias_.Zero();
  if (config.shared_expert) {
    shared_ = std::make_unique<SwigluExperts<T>>(1, config.width, config.shared_hidden,
                                                 prefix + ".shared");
  }
  executor_ = std::make_unique<LocalExpertExecutor<T>>(&experts_);
  counts_.assign(static_cast<size_t>(config.experts), 0);
  offsets_.assign(static_cast<size_t>(config.experts) + 1, 0);
}

template <typename T>
void MoeLayer<T>::Init(NormalInit& rng, double std, double out_std) {
  rng.Fill(router_.value, std);
  experts_.Init(rng, std, out_std, config_.experts);
  if (shared_) shared_->Init(rng, std, out_std);
}

template <typename T>
std::vector<ParamRef<T>> MoeLayer<T>::Parameters() {
  std::vector<ParamRef<T>> params = {norm_.gain().Ref(), router_.Ref()};
  for (auto& p : experts_.Parameters()) params.push_back(p);
  if (shared_) {
    for (auto& p : shared_->Parameters()) params.push_back(p);
  }
  return params;
}

template <typename T>
std::vector<ParamRef<T>> MoeLayer<T>::Buffers() {
  return {ParamRef<T>{bias_name_, bias_.data(), nullptr, bias_.size(), {bias_.size()}}};
}

template <typename T>
void MoeLayer<T>::SetExecutor(std::unique_ptr<ExpertExecutor<T>> executor) {
  executor_ = std::move(executor);
}

template <typename T>
absl::Status MoeLayer<T>::Forward(const T* u, int64_t tokens, T* out) {
  u_ = u;
  tokens_ = tokens;
  const int c = config_.width, ne = config_.experts, k = config_.top_k;
  xn_.Resize({tokens, c});
  scores_.Resize({tokens, ne});
  selected_.Resize({tokens, k});
  weights_.Resize({tokens, k});
  slot_row_.Resize({tokens, k});
  dispatched_.Resize({tokens * k, c});
  expert_out_.Resize({tokens * k, c});

  norm_.Forward(u, tokens, xn_.data());
  cpu::Gemm<T>(false, false, static_cast<int>(tokens), ne, c, T(1), xn_.data(), c,
               router_.value.data(), ne, T(0), scores_.data(), ne);
  const double t0 = base::NowSeconds();
  T* scores = scores_.data();
  int32_t* sel = selected_.data();
  RouteTopK<T>(tokens, ne, k, bias_.data(), scores, sel, weights_.data());
  // Exact counts and a stable counting sort of the slots by expert.
  std::fill(counts_.begin(), counts_.end(), 0);
  for (int64_t i = 0; i < tokens * k; ++i) ++counts_[static_cast<size_t>(sel[i])];
  offsets_[0] = 0;
  for (int e = 0; e < ne; ++e) offsets_[e + 1] = offsets_[e] + counts_[e];
  {
    int64_t* row = slot_row_.data();
    // Reuse the tail of offsets as running cursors without allocating.
    std::vector<int64_t>& cursor = offsets_;
    for (int64_t i = 0; i < tokens * k; ++i) row[i] = cursor[static_cast<size_t>(sel[i])]++;
    for (int e = ne; e > 0; --e) cursor[e] = cursor[e - 1];
    cursor[0] = 0;
  }
  const int64_t* row = slot_row_.data();
  T* disp = dispatched_.data();
  const T* xn = xn_.data();
#pragma omp parallel for schedule(static) if (tokens * k * c >= cpu::kParallelMinWork)
  for (int64_t i = 0; i < tokens * k; ++i) {
    const T* src = xn + (i / k) * c;
    std::copy(src, src + c, disp + row[i] * c);
  }
  routing_seconds_ = base::NowSeconds() - t0;

  const double e0 = base::NowSeconds(), g0 = cpu::GemmSeconds();
  if (absl::Status s = executor_->Forward(offsets_, dispatched_.data(), expert_out_.data());
      !s.ok()) {
    return s;
  }
  expert_seconds_ = (base::NowSeconds() - e0) - (cpu::GemmSeconds() - g0);

  // Aux loss value: f_e from the counts over every rank (known once the executor has
  // exchanged loads), P_e over this process's tokens. Ranks' values weighted by their
  // token shares then sum to the aux loss of the whole batch.
  aux_loss_ = 0;
  if (config_.aux_loss_coef > 0) {
    const std::vector<int64_t>& counts = global_counts();
    int64_t slots = 0;
    for (int e = 0; e < ne; ++e) slots += counts[e];
    slot_fraction_.resize(static_cast<size_t>(ne));
    double total = 0;
    for (int e = 0; e < ne; ++e) {
      double p = 0;
      for (int64_t t = 0; t < tokens; ++t) p += static_cast<double>(scores[t * ne + e]);
      const double f =
          static_cast<double>(counts[e]) / static_cast<double>(std::max<int64_t>(slots, 1));
      slot_fraction_[static_cast<size_t>(e)] = f;
      total += f * p / static_cast<double>(tokens);
    }
    aux_loss_ = config_.aux_loss_coef * ne * total;
  }

  if (shared_) {
    shared_h13_.Resize({tokens, 2 * config_.shared_hidden});
    shared_act_.Resize({tokens, config_.shared_hidden});
    shared_->Forward(0, tokens, xn_.data(), shared_h13_.data(), shared_act_.data(), out);
  }
  const double t1 = base::NowSeconds();
  GatherRows(tokens, k, c, row, weights_.data(), expert_out_.data(), /*add=*/shared_ != nullptr,
             out);
  routing_seconds_ += base::NowSeconds() - t1;
  return absl::OkStatus();
}

template <typename T>
absl::Status MoeLayer<T>::Backward(const T* dout, T grad_scale, T* du) {
  const int64_t tokens = tokens_;
  const int c = config_.width, ne = config_.experts, k = config_.top_k;
  dexpert_out_.Resize({tokens * k, c});
  ddispatched_.Resize({tokens * k, c});
  dxn_.Resize({tokens, c});
  dscores_.Resize({tokens, ne});
  dweights_.Resize({tokens, k});

  const double t0 = base::NowSeconds();
  const T* eo = expert_out_.data();
  const int64_t* row = slot_row_.data();
  const T* w = weights_.data();
  const int32_t* sel = selected_.data();
  const T* scores = scores_.data();
  T* deo = dexpert_out_.data();
  T* ds = dscores_.data();
  T* dw = dweights_.data();
  // Expert-output gradients placed in dispatched order, and the gate gradients
  // dL/dw[t, j] = <dout[t], expert_out[row(t, j)]>.
#pragma omp parallel for schedule(static) if (tokens * k * c >= cpu::kParallelMinWork)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* d = dout + t * c;
    for (int j = 0; j < k; ++j) {
      const T* y = eo + row[t * k + j] * c;
      T* dy = deo + row[t * k + j] * c;
      const T g = w[t * k + j];
      T acc = 0;
      for (int i = 0; i < c; ++i) {
        acc += d[i] * y[i];
        dy[i] = g * d[i];
      }
      dw[t * k + j] = acc;
    }
  }
  const T* aux = nullptr;
  if (config_.aux_loss_coef > 0) {
    // d(coef * E * sum_e f_e P_e)/d s_te = coef * E * f_e / T, f_e from the Forward.
    aux_grad_.resize(static_cast<size_t>(ne));
    for (int e = 0; e < ne; ++e) {
      const double f = slot_fraction_[static_cast<size_t>(e)];
      aux_grad_[static_cast<size_t>(e)] =
          static_cast<T>(grad_scale * config_.aux_loss_coef * ne * f / static_cast<double>(tokens));
    }
    aux = aux_grad_.data();
  }
  RouterBackward<T>(tokens, ne, k, scores, sel, w, dw, aux, ds);
  routing_seconds_ += base::NowSeconds() - t0;

  const double e0 = base::NowSeconds(), g0 = cpu::GemmSeconds();
  if (absl::Status s = executor_->Backward(offsets_, dexpert_out_.data(), ddispatched_.data());
      !s.ok()) {
    return s;
  }
  expert_seconds_ += (base::NowSeconds() - e0) - (cpu::GemmSeconds() - g0);

  T* dxn = dxn_.data();
  if (shared_) {
    dshared_h13_.Resize({tokens, 2 * config_.shared_hidden});
    dshared_act_.Resize({tokens, config_.shared_hidden});
    shared_->Backward(0, tokens, xn_.data(), shared_h13_.data(), shared_act_.data(), dout,
                      dshared_h13_.data(), dshared_act_.data(), dxn);
  }
  const double t1 = base::NowSeconds();
  GatherRows<T>(tokens, k, c, row, /*weights=*/nullptr, ddispatched_.data(),
                /*add=*/shared_ != nullptr, dxn);
  routing_seconds_ += base::NowSeconds() - t1;
  // Router: dWr += xn^T dlogits; dxn += dlogits Wr^T.
  cpu::Gemm<T>(true, false, c, ne, static_cast<int>(tokens), T(1), xn_.data(), c, ds, ne, T(1),
               router_.grad.data(), ne);
  cpu::Gemm<T>(false, true, static_cast<int>(tokens), c, ne, T(1), ds, ne, router_.value.data(), ne,
               T(1), dxn, c);
  norm_.Backward(u_, dxn, tokens, du);
  return absl::OkStatus();
}

template <typename T>
void MoeLayer<T>::UpdateSelectionBias() {
  if (config_.bias_update_rate <= 0) return;
  const int ne = config_.experts;
  // Every rank of an expert-parallel layer steps its copy with the same (global) counts.
  const std::vector<int64_t>& counts = global_counts();
  int64_t total = 0;
  for (int e = 0; e < ne; ++e) total += counts[e];
  const double mean = static_cast<double>(total) / ne;
  for (int e = 0; e < ne; ++e) {
    const double err = mean - static_cast<double>(counts[e]);
    const double sign = err > 0 ? 1.0 : (err < 0 ? -1.0 : 0.0);
    bias_[e] += static_cast<T>(config_.bias_update_rate * sign);
  }
}

template class SwigluExperts<float>;
template class SwigluExperts<double>;
template class LocalExpertExecutor<float>;
template class LocalExpertExecutor<double>;
template class MoeLayer<float>;
template class MoeLayer<double>;

}  // namespace rackrun::runtime
