// hc (dynamic Hyper-Connections) and mhc (Manifold-Constrained Hyper-Connections),
// DESIGN.md section 3 items 2 and 3. Both update every stream, so each sublayer saves its
// full input state (N x C per token) and the body output for the backward.
//
// Choices where the design leaves detail open:
//  - RMSNorm has no gain; eps = 1e-6 inside the sqrt.
//  - hc: B and A_m are per-stream scalars (HC paper: W_b, W_m are C x 1); the gating
//    scalars s_a, s_b start at 0.01 like mhc's a_* (the HC paper leaves them open).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "runtime/residual/kernels.h"
#include "runtime/residual/residual_impl.h"
#include "runtime/residual/sinkhorn.h"

namespace rackrun::runtime {

namespace {

using residual_internal::Axpy;
using residual_internal::Combine;
using residual_internal::Dot;
using residual_internal::Moments;
using residual_internal::ParallelWeightGrad;
using residual_internal::Project;
using residual_internal::ProjectTransposeAddPacked;
using residual_internal::Sigmoid;

constexpr double kNormEps = 1e-6;
constexpr int kTokenBlock = 8;

// State shared by hc and mhc: saved inputs, outputs and coefficient records.
template <typename T>
class DenseStreamsImpl : public ResidualStreams<T>::Impl {
 public:
  using Base = typename ResidualStreams<T>::Impl;
  using Base::Base;

 protected:
  struct Sublayer {
    std::vector<T> xprev;  // tokens x N x C (saved input state)
    std::vector<T> out;    // tokens x C (saved body output)
    std::vector<T> coef;   // tokens x coef_stride
    std::vector<T> dcoef;  // tokens x dcoef_stride (backward: from Write to Read)
  };

  void ReserveDense(int64_t coef_stride, int64_t dcoef_stride, int64_t scal_stride,
                    int64_t c_stride, int64_t scratch_elems) {
    const size_t cap = static_cast<size_t>(this->capacity);
    const int64_t nc = static_cast<int64_t>(this->nstreams) * this->width;
    sub_.resize(static_cast<size_t>(this->nsub));
    for (Sublayer& sl : sub_) {
      sl.coef.resize(cap * static_cast<size_t>(coef_stride));
      if (this->reserved_save) {
        sl.xprev.resize(cap * static_cast<size_t>(nc));
        sl.out.resize(cap * static_cast<size_t>(this->width));
        sl.dcoef.resize(cap * static_cast<size_t>(dcoef_stride));
      }
    }
    if (this->reserved_save) {
      scal_.resize(cap * static_cast<size_t>(scal_stride));
      c_.resize(cap * static_cast<size_t>(c_stride));
    }
    this->scratch_per_thread = scratch_elems + kTokenBlock * nc;
    this->scratch.resize(static_cast<size_t>(this->scratch_per_thread) *
                         static_cast<size_t>(this->threads));
  }

  // The paper's unfused rows (DESIGN.md mhc table) next to what the fused kernels touch.
  void CountRead() {
    const double nc = static_cast<double>(this->nstreams) * this->width;
    const double c = this->width;
    this->Count("compute coefficients", nc, 0, nc, 0);
    this->Count("apply pre", nc, c, 0, c);
    if (this->save) this->Count("save for backward", 0, 0, 0, nc);
  }
  void CountWrite() {
    const double nc = static_cast<double>(this->nstreams) * this->width;
    const double c = this->width;
    this->Count("apply post", c, nc, c, 0);
    this->Count("apply res", nc, nc, 0, 0);
    this->Count("merge", 2 * nc, nc, nc, nc);
    if (this->save) this->Count("save for backward", 0, 0, 0, c);
  }

  std::vector<Sublayer> sub_;
  std::vector<T> scal_;  // tokens x per-token scalar-parameter gradients
  std::vector<T> c_;     // tokens x projection-output gradients (already divided by rms)
};

// ---------------------------------------------------------------------------------------
// mhc: v = RMSNorm(vec X); H_pre = sigma(a_pre v W_pre + b_pre); H_post = 2 sigma(...);
// H_res = Sinkhorn(a_res mat(v W_res) + b_res); X' = H_res X + H_post^T F(H_pre X).

template <typename T>
class MhcImpl final : public DenseStreamsImpl<T> {
 public:
  explicit MhcImpl(const ResidualConfig& c)
      : DenseStreamsImpl<T>(c), sinkhorn_(c.streams, c.sinkhorn_iters) {}

  void DeclareParameters() override {
    const int n = this->nstreams;
    const int64_t nc = static_cast<int64_t>(n) * this->width;
    P_ = 2 * n + n * n;
    for (int l = 0; l < this->nsub; ++l) {
      const std::string p = absl::StrCat("sublayer", l, ".");
      Params q;
      // Rows [pre (N) | post (N) | res (N*N)] of one projection.
      q.w = this->AddParam(p + "w", P_ * nc);
      q.a_pre = this->AddParam(p + "a_pre", 1);
      q.a_post = this->AddParam(p + "a_post", 1);
      q.a_res = this->AddParam(p + "a_res", 1);
      q.b_pre = this->AddParam(p + "b_pre", n);
      q.b_post = this->AddParam(p + "b_post", n);
      q.b_res = this->AddParam(p + "b_res", n * n);
      params_.push_back(q);
    }
  }

  void InitParameters(uint64_t) override {
    // W = 0, gating scalars 0.01; biases break the symmetry between streams: b_pre = +2 on
    // stream (l mod N) and -2 elsewhere, b_res 0 on the diagonal and -2 off it, b_post 0.
    const int n = this->nstreams;
    for (int l = 0; l < this->nsub; ++l) {
      const Params& q = params_[static_cast<size_t>(l)];
      *this->value(q.a_pre) = *this->value(q.a_post) = *this->value(q.a_res) = T(0.01);
      for (int i = 0; i < n; ++i) this->value(q.b_pre)[i] = i == l % n ? T(2) : T(-2);
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j) this->value(q.b_res)[i * n + j] = i == j ? T(0) : T(-2);
    }
  }

  void Reserve() override {
    const int n = this->nstreams;
    this->ReserveDense(CoefStride(), n + n * n, 3 + 2 * n + n * n, P_,
                       kTokenBlock * P_ + sinkhorn_.tape_size() + 6 * n * n + n * this->width);
  }

  void Read(int l, T* u) override {
    const int n = this->nstreams;
    const int64_t C = this->width;
    const int64_t nc = n * C;
    const Params& q = params_[static_cast<size_t>(l)];
    auto& sl = this->sub_[static_cast<size_t>(l)];
    const T* w = this->value(q.w);
    const T a_pre = *this->value(q.a_pre), a_post = *this->value(q.a_post),
            a_res = *this->value(q.a_res);
    const T* b_pre = this->value(q.b_pre);
    const T* b_post = this->value(q.b_post);
    const T* b_res = this->value(q.b_res);
    const int nt = this->ntok;
#pragma omp parallel for schedule(static) if (this->Parallel())
    for (int t0 = 0; t0 < nt; t0 += kTokenBlock) {
      const int tb = std::min(kTokenBlock, nt - t0);
      T* sc = this->Scratch(omp_get_thread_num());
      T* zz = sc;
      T* logits = sc + kTokenBlock * P_;
      std::fill(zz, zz + tb * P_, T(0));
      const T* xb = this->X.data() + t0 * nc;
      Project(xb, nc, tb, w, nc, P_, nc, zz, P_);
      for (int i = 0; i < tb; ++i) {
        const int t = t0 + i;
        const T* x = xb + i * nc;
        T* coef = sl.coef.data() + t * CoefStride();
        T sum, sq;
        Moments(x, nc, &sum, &sq);
        const T r = std::sqrt(sq / static_cast<T>(nc) + static_cast<T>(kNormEps));
        coef[0] = r;
        T* y = coef + 1;
        for (int p = 0; p < P_; ++p) y[p] = zz[i * P_ + p] / r;
        T* hpre = coef + 1 + P_;
        T* hpost = hpre + n;
        T* hres = hpost + n;
        for (int j = 0; j < n; ++j) {
          hpre[j] = Sigmoid(a_pre * y[j] + b_pre[j]);
          hpost[j] = T(2) * Sigmoid(a_post * y[n + j] + b_post[j]);
        }
        for (int j = 0; j < n * n; ++j) logits[j] = a_res * y[2 * n + j] + b_res[j];
        sinkhorn_.Forward(logits, hres, nullptr);
        Combine(hpre, n, x, C, C, u + t * C);
        if (this->save) std::memcpy(sl.xprev.data() + t * nc, x, sizeof(T) * nc);
      }
    }
    this->CountRead();
  }

  void Write(int l, const T* out) override {
    const int n = this->nstreams;
    const int64_t C = this->width;
    const int64_t nc = n * C;
    auto& sl = this->sub_[static_cast<size_t>(l)];
    const int nt = this->ntok;
#pragma omp parallel for schedule(static) if (this->Parallel())
    for (int t = 0; t < nt; ++t) {
      T* x = this->X.data() + t * nc;
      const T* coef = sl.coef.data() + t * CoefStride();
      const T* hpost = coef + 1 + P_ + n;
      const T* hres = hpost + n;
      const T* xin;
      if (this->save) {
        xin = sl.xprev.data() + t * nc;
        std::memcpy(sl.out.data() + t * C, out + t * C, sizeof(T) * C);
      } else {
        T* copy = this->Scratch(omp_get_thread_num()) + this->scratch_per_thread - kTokenBlock * nc;
        std::memcpy(copy, x, sizeof(T) * nc);
        xin = copy;
      }
      for (int i = 0; i < n; ++i) {
        Combine(hres + i * n, n, xin, C, C, x + i * C);
        Axpy(hpost[i], out + t * C, x + i * C, C);
      }
    }
    this->CountWrite();
  }

  SublayerMaps<T> Maps(int l, int t) const override {
    const int n = this->nstreams;
    const T* coef = this->sub_[static_cast<size_t>(l)].coef.data() + t * CoefStride();
    const T* hpre = coef + 1 + P_;
    SublayerMaps<T> m;
    for (int i = 0; i < n; ++i) m.active.push_back(i);
    m.gates.assign(static_cast<size_t>(n), T(1));
    m.h_pre.assign(hpre, hpre + n);
    m.h_post.assign(hpre + n, hpre + 2 * n);
    m.h_res.assign(hpre + 2 * n, hpre + 2 * n + n * n);
    return m;
  }

  void WriteBackward(int l, T* d_out) override {
    const int n = this->nstreams;
    const int64_t C = this->width;
    const int64_t nc = n * C;
    auto& sl = this->sub_[static_cast<size_t>(l)];
    const int nt = this->ntok;
#pragma omp parallel for schedule(static) if (this->Parallel())
    for (int t = 0; t < nt; ++t) {
      T* g = this->dX.data() + t * nc;
      const T* x = sl.xprev.data() + t * nc;
      const T* out = sl.out.data() + t * C;
      const T* coef = sl.coef.data() + t * CoefStride();
      const T* hpost = coef + 1 + P_ + n;
      const T* hres = hpost + n;
      T* dcoef = sl.dcoef.data() + t * (n + n * n);
      T* gcopy = this->Scratch(omp_get_thread_num()) + this->scratch_per_thread - kTokenBlock * nc;
      std::memcpy(gcopy, g, sizeof(T) * nc);
      Combine(hpost, n, gcopy, C, C, d_out + t * C);
      for (int i = 0; i < n; ++i) {
        dcoef[i] = Dot(gcopy + i * C, out, C);  // dH_post
        for (int j = 0; j < n; ++j) dcoef[n + i * n + j] = Dot(gcopy + i * C, x + j * C, C);
      }
      // dX_j = sum_i H_res[i][j] G_i.
      T col[64];
      for (int j = 0; j < n; ++j) {
        for (int i = 0; i < n; ++i) col[i] = hres[i * n + j];
        Combine(col, n, gcopy, C, C, g + j * C);
      }
    }
  }

  void ReadBackward(int l, const T* d_u) override {
    const int n = this->nstreams;
    const int64_t C = this->width;
    const int64_t nc = n * C;
    const Params& q = params_[static_cast<size_t>(l)];
    auto& sl = this->sub_[static_cast<size_t>(l)];
    const T a_pre = *this->value(q.a_pre), a_post = *this->value(q.a_post),
            a_res = *this->value(q.a_res);
    const T* b_res = this->value(q.b_res);
    const int nt = this->ntok;
    const int ss = 3 + 2 * n + n * n;
    const T* wp = this->Pack(this->value(q.w), P_, nc);
#pragma omp parallel for schedule(static) if (this->Parallel())
    for (int t0 = 0; t0 < nt; t0 += kTokenBlock) {
      const int tb = std::min(kTokenBlock, nt - t0);
      T* sc = this->Scratch(omp_get_thread_num());
      T* sk_tape = sc + kTokenBlock * P_;
      T* sk_work = sk_tape + sinkhorn_.tape_size();
      T* logits = sk_work + 2 * n * n;
      T* hraw = logits + n * n;
      T* dz = hraw + n * n;
      T* dhpre = dz + n * n;
      for (int i = 0; i < tb; ++i) {
        const int t = t0 + i;
        const T* x = sl.xprev.data() + t * nc;
        T* dx = this->dX.data() + t * nc;
        const T* du = d_u + t * C;
        const T* coef = sl.coef.data() + t * CoefStride();
        const T r = coef[0];
        const T* y = coef + 1;
        const T* hpre = coef + 1 + P_;
        const T* hpost = hpre + n;
        const T* dcoef = sl.dcoef.data() + t * (n + n * n);
        T* c = this->c_.data() + t * P_;
        T* scal = this->scal_.data() + t * ss;
        std::fill(scal, scal + ss, T(0));
        for (int j = 0; j < n; ++j) {
          dhpre[j] = Dot(du, x + j * C, C);
          Axpy(hpre[j], du, dx + j * C, C);
        }
        T sum_dy_y = 0;
        for (int j = 0; j < n; ++j) {
          const T dl = dhpre[j] * hpre[j] * (T(1) - hpre[j]);
          scal[0] += dl * y[j];
          scal[3 + j] = dl;
          c[j] = a_pre * dl;
          const T h = hpost[j] / T(2);
          const T dlp = dcoef[j] * T(2) * h * (T(1) - h);
          scal[1] += dlp * y[n + j];
          scal[3 + n + j] = dlp;
          c[n + j] = a_post * dlp;
        }
        for (int j = 0; j < n * n; ++j) logits[j] = a_res * y[2 * n + j] + b_res[j];
        sinkhorn_.Forward(logits, hraw, sk_tape);
        sinkhorn_.Backward(logits, sk_tape, dcoef + n, dz, sk_work);
        for (int j = 0; j < n * n; ++j) {
          scal[2] += dz[j] * y[2 * n + j];
          scal[3 + 2 * n + j] = dz[j];
          c[2 * n + j] = a_res * dz[j];
        }
        for (int p = 0; p < P_; ++p) {
          sum_dy_y += c[p] * y[p];
          c[p] /= r;
        }
        Axpy(-sum_dy_y / (static_cast<T>(nc) * r * r), x, dx, nc);
      }
      ProjectTransposeAddPacked(this->c_.data() + t0 * P_, P_, tb, wp, P_, nc,
                                this->dX.data() + t0 * nc, nc);
    }
    ParallelWeightGrad(this->c_.data(), P_, nt, sl.xprev.data(), nc, P_, nc, this->grad(q.w), nc);
    for (int t = 0; t < nt; ++t) {
      const T* scal = this->scal_.data() + t * ss;
      *this->grad(q.a_pre) += scal[0];
      *this->grad(q.a_post) += scal[1];
      *this->grad(q.a_res) += scal[2];
      for (int j = 0; j < n; ++j) this->grad(q.b_pre)[j] += scal[3 + j];
      for (int j = 0; j < n; ++j) this->grad(q.b_post)[j] += scal[3 + n + j];
      for (int j = 0; j < n * n; ++j) this->grad(q.b_res)[j] += scal[3 + 2 * n + j];
    }
  }

 private:
  struct Params {
    int64_t w = 0, a_pre = 0, a_post = 0, a_res = 0, b_pre = 0, b_post = 0, b_res = 0;
  };
  // r, y (P), H_pre (N), H_post (N), H_res (N*N)
  int64_t CoefStride() const {
    const int n = this->nstreams;
    return 1 + P_ + 2 * n + n * n;
  }

  SinkhornProjection<T> sinkhorn_;
  int P_ = 0;
  std::vector<Params> params_;
};

// ---------------------------------------------------------------------------------------
// hc: per stream xbar_i = RMSNorm(x_i); A_m = s_a tanh(xbar W_m) + A_m0, A_r = s_a
// tanh(xbar W_r) + A_r0, B = s_b tanh(xbar W_b) + B0; h = A_m^T X; X' = B^T F(h) + A_r^T X.

template <typename T>
class HcImpl final : public DenseStreamsImpl<T> {
 public:
  using DenseStreamsImpl<T>::DenseStreamsImpl;

  void DeclareParameters() override {
    const int n = this->nstreams;
    P_ = n + 2;
    for (int l = 0; l < this->nsub; ++l) {
      const std::string p = absl::StrCat("sublayer", l, ".");
      Params q;
      // Rows [m (1) | r (N) | b (1)], each C wide, applied to every stream.
      q.w = this->AddParam(p + "w", static_cast<int64_t>(P_) * this->width);
      q.s_a = this->AddParam(p + "s_a", 1);
      q.s_b = this->AddParam(p + "s_b", 1);
      q.a_m0 = this->AddParam(p + "a_m0", n);
      q.a_r0 = this->AddParam(p + "a_r0", n * n);
      q.b0 = this->AddParam(p + "b0", n);
      params_.push_back(q);
    }
  }

  void InitParameters(uint64_t) override {
    // W = 0, B0 = 1, A_m0 = e_(l mod N), A_r0 = I: starts as a Pre-Norm transformer.
    const int n = this->nstreams;
    for (int l = 0; l < this->nsub; ++l) {
      const Params& q = params_[static_cast<size_t>(l)];
      *this->value(q.s_a) = *this->value(q.s_b) = T(0.01);
      for (int i = 0; i < n; ++i) {
        this->value(q.b0)[i] = T(1);
        this->value(q.a_m0)[i] = i == l % n ? T(1) : T(0);
        this->value(q.a_r0)[i * n + i] = T(1);
      }
    }
  }

  void Reserve() override {
    const int n = this->nstreams;
    this->ReserveDense(CoefStride(), n + n * n, 2 + 2 * n + n * n, static_cast<int64_t>(n) * P_,
                       kTokenBlock * n * P_ + 4 * n * n + 64);
  }

  void Read(int l, T* u) override {
    const int n = this->nstreams;
    const int64_t C = this->width;
    const int64_t nc = n * C;
    const Params& q = params_[static_cast<size_t>(l)];
    auto& sl = this->sub_[static_cast<size_t>(l)];
    const T* w = this->value(q.w);
    const T s_a = *this->value(q.s_a), s_b = *this->value(q.s_b);
    const T* a_m0 = this->value(q.a_m0);
    const T* a_r0 = this->value(q.a_r0);
    const T* b0 = this->value(q.b0);
    const int nt = this->ntok;
#pragma omp parallel for schedule(static) if (this->Parallel())
    for (int t0 = 0; t0 < nt; t0 += kTokenBlock) {
      const int tb = std::min(kTokenBlock, nt - t0);
      T* zz = this->Scratch(omp_get_thread_num());
      std::fill(zz, zz + tb * n * P_, T(0));
      const T* xb = this->X.data() + t0 * nc;
      // Rows are (token, stream) pairs, each C wide.
      Project(xb, C, tb * n, w, C, P_, C, zz, P_);
      for (int i = 0; i < tb; ++i) {
        const int t = t0 + i;
        const T* x = xb + i * nc;
        T* coef = sl.coef.data() + t * CoefStride();
        T* am = coef + n * (1 + P_);
        T* ar = am + n;
        T* bb = ar + n * n;
        for (int s = 0; s < n; ++s) {
          T sum, sq;
          Moments(x + s * C, C, &sum, &sq);
          const T r = std::sqrt(sq / static_cast<T>(C) + static_cast<T>(kNormEps));
          T* rec = coef + s * (1 + P_);
          rec[0] = r;
          for (int p = 0; p < P_; ++p) rec[1 + p] = zz[(i * n + s) * P_ + p] / r;
          am[s] = s_a * std::tanh(rec[1]) + a_m0[s];
          for (int j = 0; j < n; ++j) ar[s * n + j] = s_a * std::tanh(rec[2 + j]) + a_r0[s * n + j];
          bb[s] = s_b * std::tanh(rec[2 + n]) + b0[s];
        }
        Combine(am, n, x, C, C, u + t * C);
        if (this->save) std::memcpy(sl.xprev.data() + t * nc, x, sizeof(T) * nc);
      }
    }
    this->CountRead();
  }

  void Write(int l, const T* out) override {
    const int n = this->nstreams;
    const int64_t C = this->width;
    const int64_t nc = n * C;
    auto& sl = this->sub_[static_cast<size_t>(l)];
    const int nt = this->ntok;
#pragma omp parallel for schedule(static) if (this->Parallel())
    for (int t = 0; t < nt; ++t) {
      T* x = this->X.data() + t * nc;
      const T* coef = sl.coef.data() + t * CoefStride();
      const T* ar = coef + n * (1 + P_) + n;
      const T* bb = ar + n * n;
      const T* xin;
      if (this->save) {
        xin = sl.xprev.data() + t * nc;
        std::memcpy(sl.out.data() + t * C, out + t * C, sizeof(T) * C);
      } else {
        T* copy = this->Scratch(omp_get_thread_num()) + this->scratch_per_thread - kTokenBlock * nc;
        std::memcpy(copy, x, sizeof(T) * nc);
        xin = copy;
      }
      T col[64];
      for (int j = 0; j < n; ++j) {
        for (int i = 0; i < n; ++i) col[i] = ar[i * n + j];
        Combine(col, n, xin, C, C, x + j * C);
        Axpy(bb[j], out + t * C, x + j * C, C);
      }
    }
    this->CountWrite();
  }

  SublayerMaps<T> Maps(int l, int t) const override {
    const int n = this->nstreams;
    const T* am = this->sub_[static_cast<size_t>(l)].coef.data() + t * CoefStride() + n * (1 + P_);
    SublayerMaps<T> m;
    for (int i = 0; i < n; ++i) m.active.push_back(i);
    m.gates.assign(static_cast<size_t>(n), T(1));
    m.h_pre.assign(am, am + n);
    m.h_res.assign(am + n, am + n + n * n);
    m.h_post.assign(am + n + n * n, am + 2 * n + n * n);
    return m;
  }

  void WriteBackward(int l, T* d_out) override {
    const int n = this->nstreams;
    const int64_t C = this->width;
    const int64_t nc = n * C;
    auto& sl = this->sub_[static_cast<size_t>(l)];
    const int nt = this->ntok;
#pragma omp parallel for schedule(static) if (this->Parallel())
    for (int t = 0; t < nt; ++t) {
      T* g = this->dX.data() + t * nc;
      const T* x = sl.xprev.data() + t * nc;
      const T* out = sl.out.data() + t * C;
      const T* coef = sl.coef.data() + t * CoefStride();
      const T* ar = coef + n * (1 + P_) + n;
      const T* bb = ar + n * n;
      T* dcoef = sl.dcoef.data() + t * (n + n * n);  // dB (N), dA_r (N*N)
      T* gcopy = this->Scratch(omp_get_thread_num()) + this->scratch_per_thread - kTokenBlock * nc;
      std::memcpy(gcopy, g, sizeof(T) * nc);
      Combine(bb, n, gcopy, C, C, d_out + t * C);
      for (int j = 0; j < n; ++j) dcoef[j] = Dot(gcopy + j * C, out, C);
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j) dcoef[n + i * n + j] = Dot(gcopy + j * C, x + i * C, C);
      for (int i = 0; i < n; ++i) Combine(ar + i * n, n, gcopy, C, C, g + i * C);
    }
  }

  void ReadBackward(int l, const T* d_u) override {
    const int n = this->nstreams;
    const int64_t C = this->width;
    const int64_t nc = n * C;
    const Params& q = params_[static_cast<size_t>(l)];
    auto& sl = this->sub_[static_cast<size_t>(l)];
    const T s_a = *this->value(q.s_a), s_b = *this->value(q.s_b);
    const int nt = this->ntok;
    const int ss = 2 + 2 * n + n * n;
    const int64_t cs = static_cast<int64_t>(n) * P_;
    const T* wp = this->Pack(this->value(q.w), P_, C);
#pragma omp parallel for schedule(static) if (this->Parallel())
    for (int t0 = 0; t0 < nt; t0 += kTokenBlock) {
      const int tb = std::min(kTokenBlock, nt - t0);
      for (int i = 0; i < tb; ++i) {
        const int t = t0 + i;
        const T* x = sl.xprev.data() + t * nc;
        T* dx = this->dX.data() + t * nc;
        const T* du = d_u + t * C;
        const T* coef = sl.coef.data() + t * CoefStride();
        const T* am = coef + n * (1 + P_);
        const T* dcoef = sl.dcoef.data() + t * (n + n * n);
        T* c = this->c_.data() + t * cs;
        T* scal = this->scal_.data() + t * ss;  // ds_a, ds_b, dA_m0 (N), dB0 (N), dA_r0 (N*N)
        std::fill(scal, scal + ss, T(0));
        for (int s = 0; s < n; ++s) {
          const T dam = Dot(du, x + s * C, C);
          Axpy(am[s], du, dx + s * C, C);
          const T* rec = coef + s * (1 + P_);
          const T r = rec[0];
          T* cs_row = c + s * P_;
          // A_m
          T th = std::tanh(rec[1]);
          scal[0] += dam * th;
          scal[2 + s] = dam;
          cs_row[0] = s_a * dam * (T(1) - th * th);
          // A_r row s
          for (int j = 0; j < n; ++j) {
            const T dar = dcoef[n + s * n + j];
            th = std::tanh(rec[2 + j]);
            scal[0] += dar * th;
            scal[2 + 2 * n + s * n + j] = dar;
            cs_row[1 + j] = s_a * dar * (T(1) - th * th);
          }
          // B
          const T db = dcoef[s];
          th = std::tanh(rec[2 + n]);
          scal[1] += db * th;
          scal[2 + n + s] = db;
          cs_row[1 + n] = s_b * db * (T(1) - th * th);
          T sum_dy_y = 0;
          for (int p = 0; p < P_; ++p) {
            sum_dy_y += cs_row[p] * rec[1 + p];
            cs_row[p] /= r;
          }
          Axpy(-sum_dy_y / (static_cast<T>(C) * r * r), x + s * C, dx + s * C, C);
        }
      }
      ProjectTransposeAddPacked(this->c_.data() + t0 * cs, P_, tb * n, wp, P_, C,
                                this->dX.data() + t0 * nc, C);
    }
    ParallelWeightGrad(this->c_.data(), P_, nt * n, sl.xprev.data(), C, P_, C, this->grad(q.w), C);
    for (int t = 0; t < nt; ++t) {
      const T* scal = this->scal_.data() + t * ss;
      *this->grad(q.s_a) += scal[0];
      *this->grad(q.s_b) += scal[1];
      for (int j = 0; j < n; ++j) this->grad(q.a_m0)[j] += scal[2 + j];
      for (int j = 0; j < n; ++j) this->grad(q.b0)[j] += scal[2 + n + j];
      for (int j = 0; j < n * n; ++j) this->grad(q.a_r0)[j] += scal[2 + 2 * n + j];
    }
  }

 private:
  struct Params {
    int64_t w = 0, s_a = 0, s_b = 0, a_m0 = 0, a_r0 = 0, b0 = 0;
  };
  // Per stream: r, y (P); then A_m (N), A_r (N*N), B (N).
  int64_t CoefStride() const {
    const int n = this->nstreams;
    return static_cast<int64_t>(n) * (1 + P_) + 2 * n + n * n;
  }

  int P_ = 0;
  std::vector<Params> params_;
};

}  // namespace

template <typename T>
std::unique_ptr<typename ResidualStreams<T>::Impl> MakeHcImpl(const ResidualConfig& c) {
  return std::make_unique<HcImpl<T>>(c);
}
template <typename T>
std::unique_ptr<typename ResidualStreams<T>::Impl> MakeMhcImpl(const ResidualConfig& c) {
  return std::make_unique<MhcImpl<T>>(c);
}

template std::unique_ptr<ResidualStreams<float>::Impl> MakeHcImpl<float>(const ResidualConfig&);
template std::unique_ptr<ResidualStreams<double>::Impl> MakeHcImpl<double>(const ResidualConfig&);
template std::unique_ptr<ResidualStreams<float>::Impl> MakeMhcImpl<float>(const ResidualConfig&);
template std::unique_ptr<ResidualStreams<double>::Impl> MakeMhcImpl<double>(const ResidualConfig&);

}  // namespace rackrun::runtime
