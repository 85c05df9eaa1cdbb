// hc (dynamic Hyper-Connections) and mhc (Manifold-Constrained Hyper-Connections),
// docs/design.md sections 5.2 and 5.3. Both update every stream, so each sublayer saves its
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
#include <initializer_list>
#include <utility>

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
using residual_internal::RmsOf;
using residual_internal::Sigmoid;

constexpr int kTokenBlock = 8;
// A block's Sinkhorns run as one batch.
static_assert(kTokenBlock <= SinkhornProjection<float>::kBatch);

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

  // The paper's unfused rows (docs/design.md section 5.8) next to what the fused kernels touch.
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

  // Where a mode keeps its maps. Each token projects `rows` rows of K = N*C / rows elements
  // through a P-row weight (mhc: 1 row, the whole state; hc: N rows, one per stream). Its
  // coefficient record (`stride` elements) holds H_pre (N) at `pre`, H_post (N) at `post` and
  // H_res[i][j] at res + i * res_row + j * res_col (mhc stores H_res; hc stores A_r = H_res^T).
  // dcoef holds dH_post (N), then dH_res in the same layout as H_res.
  struct MapLayout {
    int rows = 1;
    int p = 0;
    int64_t stride = 0;
    int64_t pre = 0, post = 0, res = 0;
    int64_t res_row = 0, res_col = 0;
  };
  virtual MapLayout Layout() const = 0;

  // Forward pass of Read: per block of tokens, projects the rows through `w` into the
  // block's outputs, then per token `maps(x, z, work, coef)` fills the coefficient record
  // from the state x, its rows x P projection z (not yet divided by any norm) and scratch
  // `work` (the thread's scratch after kTokenBlock * rows * P elements); then u = H_pre X,
  // and X is saved for the backward. After the block's tokens, `block_maps(t0, tb, work)`
  // may finish their records together (mhc: H_res's Sinkhorns, one token per vector lane).
  template <typename MapsFn, typename BlockFn>
  void ReadDense(int l, const T* w, T* u, const MapsFn& maps, const BlockFn& block_maps) {
    const MapLayout m = Layout();
    const int n = this->nstreams;
    const int64_t C = this->width;
    const int64_t nc = n * C;
    const int64_t K = nc / m.rows;
    const int64_t zt = static_cast<int64_t>(m.rows) * m.p;  // projection outputs per token
    Sublayer& sl = sub_[static_cast<size_t>(l)];
    const int nt = this->ntok;
#pragma omp parallel for schedule(static) if (this->Parallel())
    for (int t0 = 0; t0 < nt; t0 += kTokenBlock) {
      const int tb = std::min(kTokenBlock, nt - t0);
      T* zz = this->Scratch(omp_get_thread_num());
      std::fill(zz, zz + tb * zt, T(0));
      const T* xb = this->X.data() + t0 * nc;
      Project(xb, K, tb * m.rows, w, K, m.p, K, zz, m.p);
      for (int i = 0; i < tb; ++i) {
        const int t = t0 + i;
        const T* x = xb + i * nc;
        T* coef = sl.coef.data() + t * m.stride;
        maps(x, zz + i * zt, zz + kTokenBlock * zt, coef);
        Combine(coef + m.pre, n, x, C, C, u + t * C);
        if (this->save) std::memcpy(sl.xprev.data() + t * nc, x, sizeof(T) * nc);
      }
      block_maps(t0, tb, zz + kTokenBlock * zt);
    }
    CountRead();
  }

  // X' = H_res X + H_post^T out.
  void Write(int l, const T* out) final {
    const MapLayout m = Layout();
    const int n = this->nstreams;
    const int64_t C = this->width, nc = n * C;
    Sublayer& sl = sub_[static_cast<size_t>(l)];
    this->ForEachToken([&](int t) {
      T* x = this->X.data() + t * nc;
      const T* coef = sl.coef.data() + t * m.stride;
      const T* hpost = coef + m.post;
      const T* hres = coef + m.res;
      const T* xin;
      if (this->save) {
        xin = sl.xprev.data() + t * nc;
        std::memcpy(sl.out.data() + t * C, out + t * C, sizeof(T) * C);
      } else {
        T* copy = this->Scratch(omp_get_thread_num()) + this->scratch_per_thread - kTokenBlock * nc;
        std::memcpy(copy, x, sizeof(T) * nc);
        xin = copy;
      }
      T row[64];
      for (int i = 0; i < n; ++i) {
        for (int j = 0; j < n; ++j) row[j] = hres[i * m.res_row + j * m.res_col];
        Combine(row, n, xin, C, C, x + i * C);
        Axpy(hpost[i], out + t * C, x + i * C, C);
      }
    });
    CountWrite();
  }

  // d_out = H_post G; dH_post, dH_res into dcoef; G := H_res^T G.
  void WriteBackward(int l, T* d_out) final {
    const MapLayout m = Layout();
    const int n = this->nstreams;
    const int64_t C = this->width, nc = n * C;
    Sublayer& sl = sub_[static_cast<size_t>(l)];
    this->ForEachToken([&](int t) {
      T* g = this->dX.data() + t * nc;
      const T* x = sl.xprev.data() + t * nc;
      const T* out = sl.out.data() + t * C;
      const T* coef = sl.coef.data() + t * m.stride;
      const T* hpost = coef + m.post;
      const T* hres = coef + m.res;
      T* dcoef = sl.dcoef.data() + t * (n + n * n);
      T* gcopy = this->Scratch(omp_get_thread_num()) + this->scratch_per_thread - kTokenBlock * nc;
      std::memcpy(gcopy, g, sizeof(T) * nc);
      Combine(hpost, n, gcopy, C, C, d_out + t * C);
      for (int i = 0; i < n; ++i) {
        dcoef[i] = Dot(gcopy + i * C, out, C);
        for (int j = 0; j < n; ++j)
          dcoef[n + i * m.res_row + j * m.res_col] = Dot(gcopy + i * C, x + j * C, C);
      }
      // dX_j = sum_i H_res[i][j] G_i.
      T col[64];
      for (int j = 0; j < n; ++j) {
        for (int i = 0; i < n; ++i) col[i] = hres[i * m.res_row + j * m.res_col];
        Combine(col, n, gcopy, C, C, g + j * C);
      }
    });
  }

  SublayerMaps<T> Maps(int l, int t) const final {
    const MapLayout m = Layout();
    const int n = this->nstreams;
    const T* coef = sub_[static_cast<size_t>(l)].coef.data() + t * m.stride;
    SublayerMaps<T> maps;
    for (int i = 0; i < n; ++i) maps.active.push_back(i);
    maps.gates.assign(static_cast<size_t>(n), T(1));
    maps.h_pre.assign(coef + m.pre, coef + m.pre + n);
    maps.h_post.assign(coef + m.post, coef + m.post + n);
    maps.h_res.assign(coef + m.res, coef + m.res + n * n);
    return maps;
  }

  // What the backward of Read hands a mode for one token: the saved state x, its gradient
  // dx (already holding dX += H_pre du), the coefficient record, dH_pre (N), the dcoef
  // record of WriteBackward, and the rows * P projection-output gradients c and the
  // `scal_stride` scalar-parameter gradients (zeroed) the mode fills in; work is scratch.
  struct TokenGrad {
    int i;  // the token's index in its block
    const T* x;
    T* dx;
    const T* coef;
    const T* dpre;
    const T* dcoef;
    T* c;
    T* scal;
    T* work;
  };

  // Backward of Read: dH_pre and dX += H_pre du per token, `token_grad(TokenGrad)` for the
  // mode's coefficients, then dX += c W and dW += c^T X over all tokens (`w`: the weight's
  // parameter offset). dH_pre and `work` follow kTokenBlock * rows * P scratch elements.
  // Before a block's tokens, `block_grad(t0, tb, work)` may prepare what their token_grad
  // calls read from `work` (tg.i: the token's index in the block); token_grad then leaves
  // that part of `work` alone.
  template <typename BlockFn, typename GradFn>
  void ReadBackwardDense(int l, const T* d_u, int64_t w, int64_t scal_stride,
                         const BlockFn& block_grad, const GradFn& token_grad) {
    const MapLayout m = Layout();
    const int n = this->nstreams;
    const int64_t C = this->width;
    const int64_t nc = n * C;
    const int64_t K = nc / m.rows;
    const int64_t zt = static_cast<int64_t>(m.rows) * m.p;
    Sublayer& sl = sub_[static_cast<size_t>(l)];
    const int nt = this->ntok;
    const T* wp = this->Pack(this->value(w), m.p, K);
#pragma omp parallel for schedule(static) if (this->Parallel())
    for (int t0 = 0; t0 < nt; t0 += kTokenBlock) {
      const int tb = std::min(kTokenBlock, nt - t0);
      T* dpre = this->Scratch(omp_get_thread_num()) + kTokenBlock * zt;
      block_grad(t0, tb, dpre + n);
      for (int i = 0; i < tb; ++i) {
        const int t = t0 + i;
        TokenGrad tg;
        tg.i = i;
        tg.x = sl.xprev.data() + t * nc;
        tg.dx = this->dX.data() + t * nc;
        tg.coef = sl.coef.data() + t * m.stride;
        tg.dpre = dpre;
        tg.dcoef = sl.dcoef.data() + t * (n + n * n);
        tg.c = c_.data() + t * zt;
        tg.scal = scal_.data() + t * scal_stride;
        tg.work = dpre + n;
        const T* du = d_u + t * C;
        for (int j = 0; j < n; ++j) {
          dpre[j] = Dot(du, tg.x + j * C, C);
          Axpy(tg.coef[m.pre + j], du, tg.dx + j * C, C);
        }
        std::fill(tg.scal, tg.scal + scal_stride, T(0));
        token_grad(tg);
      }
      ProjectTransposeAddPacked(c_.data() + t0 * zt, m.p, tb * m.rows, wp, m.p, K,
                                this->dX.data() + t0 * nc, K);
    }
    ParallelWeightGrad(c_.data(), m.p, nt * m.rows, sl.xprev.data(), K, m.p, K, this->grad(w), K);
  }

  // Adds every token's scal_ record into the parameter gradients, in token order; the
  // record is the concatenation of `fields` (parameter offset, size).
  void AddScalarGrads(std::initializer_list<std::pair<int64_t, int>> fields) {
    int64_t ss = 0;
    for (const auto& f : fields) ss += f.second;
    for (int t = 0; t < this->ntok; ++t) {
      const T* scal = scal_.data() + t * ss;
      for (const auto& [offset, size] : fields) {
        T* g = this->grad(offset);
        for (int j = 0; j < size; ++j) g[j] += *scal++;
      }
    }
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
    this->ReserveDense(
        CoefStride(), n + n * n, 3 + 2 * n + n * n, P_,
        kTokenBlock * P_ + sinkhorn_.tape_size() + 3 * kTokenBlock * n * n + n * this->width);
  }

  void Read(int l, T* u) override {
    const int n = this->nstreams;
    const int64_t nc = static_cast<int64_t>(n) * this->width;
    const Params& q = params_[static_cast<size_t>(l)];
    const T a_pre = *this->value(q.a_pre), a_post = *this->value(q.a_post),
            a_res = *this->value(q.a_res);
    const T* b_pre = this->value(q.b_pre);
    const T* b_post = this->value(q.b_post);
    const T* b_res = this->value(q.b_res);
    const int64_t stride = CoefStride();
    T* coefs = this->sub_[static_cast<size_t>(l)].coef.data();
    // H_res = Sinkhorn(a_res mat(y_res) + b_res) for the block's tokens, one per vector lane.
    const auto block_maps = [&](int t0, int tb, T* work) {
      const T* zs[kTokenBlock];
      T* hs[kTokenBlock];
      for (int i = 0; i < tb; ++i) {
        T* coef = coefs + (t0 + i) * stride;
        const T* y = coef + 1;
        T* logits = work + i * n * n;
        for (int j = 0; j < n * n; ++j) logits[j] = a_res * y[2 * n + j] + b_res[j];
        zs[i] = logits;
        hs[i] = coef + 1 + P_ + 2 * n;
      }
      sinkhorn_.ForwardBatch(tb, zs, hs, nullptr);
    };
    const auto maps = [&](const T* x, const T* z, T*, T* coef) {
      T sum, sq;
      Moments(x, nc, &sum, &sq);
      const T r = RmsOf(sq, nc);
      coef[0] = r;
      T* y = coef + 1;
      for (int p = 0; p < P_; ++p) y[p] = z[p] / r;
      T* hpre = coef + 1 + P_;
      T* hpost = hpre + n;
      for (int j = 0; j < n; ++j) {
        hpre[j] = Sigmoid(a_pre * y[j] + b_pre[j]);
        hpost[j] = T(2) * Sigmoid(a_post * y[n + j] + b_post[j]);
      }
    };
    this->ReadDense(l, this->value(q.w), u, maps, block_maps);
  }

  void ReadBackward(int l, const T* d_u) override {
    const int n = this->nstreams;
    const int64_t nc = static_cast<int64_t>(n) * this->width;
    const Params& q = params_[static_cast<size_t>(l)];
    const T a_pre = *this->value(q.a_pre), a_post = *this->value(q.a_post),
            a_res = *this->value(q.a_res);
    const T* b_res = this->value(q.b_res);
    const int ss = 3 + 2 * n + n * n;
    const int64_t stride = CoefStride();
    const typename DenseStreamsImpl<T>::Sublayer& sl = this->sub_[static_cast<size_t>(l)];
    // The block's Sinkhorns recomputed and differentiated, one token per vector lane: `work`
    // holds the tape, then per token the logits, H_res and dL/dlogits (dz), n * n apart.
    const auto dz_of = [&](T* work, int i) {
      return work + sinkhorn_.tape_size() + (2 * kTokenBlock + i) * n * n;
    };
    const auto block_grad = [&](int t0, int tb, T* work) {
      T* tape = work;
      T* logits = work + sinkhorn_.tape_size();
      const T* zs[kTokenBlock];
      const T* dhs[kTokenBlock];
      T* hs[kTokenBlock];
      T* dzs[kTokenBlock];
      for (int i = 0; i < tb; ++i) {
        const T* y = sl.coef.data() + (t0 + i) * stride + 1;
        T* z = logits + i * n * n;
        for (int j = 0; j < n * n; ++j) z[j] = a_res * y[2 * n + j] + b_res[j];
        zs[i] = z;
        hs[i] = logits + (kTokenBlock + i) * n * n;
        dhs[i] = sl.dcoef.data() + (t0 + i) * (n + n * n) + n;
        dzs[i] = dz_of(work, i);
      }
      sinkhorn_.ForwardBatch(tb, zs, hs, tape);
      sinkhorn_.BackwardBatch(tb, zs, tape, dhs, dzs);
    };
    this->ReadBackwardDense(l, d_u, q.w, ss, block_grad, [&](const auto& tg) {
      const T* dz = dz_of(tg.work, tg.i);
      const T r = tg.coef[0];
      const T* y = tg.coef + 1;
      const T* hpre = tg.coef + 1 + P_;
      const T* hpost = hpre + n;
      T* c = tg.c;
      T* scal = tg.scal;  // da_pre, da_post, da_res, db_pre (N), db_post (N), db_res (N*N)
      T sum_dy_y = 0;
      for (int j = 0; j < n; ++j) {
        const T dl = tg.dpre[j] * hpre[j] * (T(1) - hpre[j]);
        scal[0] += dl * y[j];
        scal[3 + j] = dl;
        c[j] = a_pre * dl;
        const T h = hpost[j] / T(2);
        const T dlp = tg.dcoef[j] * T(2) * h * (T(1) - h);
        scal[1] += dlp * y[n + j];
        scal[3 + n + j] = dlp;
        c[n + j] = a_post * dlp;
      }
      for (int j = 0; j < n * n; ++j) {
        scal[2] += dz[j] * y[2 * n + j];
        scal[3 + 2 * n + j] = dz[j];
        c[2 * n + j] = a_res * dz[j];
      }
      for (int p = 0; p < P_; ++p) {
        sum_dy_y += c[p] * y[p];
        c[p] /= r;
      }
      Axpy(-sum_dy_y / (static_cast<T>(nc) * r * r), tg.x, tg.dx, nc);
    });
    this->AddScalarGrads(
        {{q.a_pre, 1}, {q.a_post, 1}, {q.a_res, 1}, {q.b_pre, n}, {q.b_post, n}, {q.b_res, n * n}});
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
  typename DenseStreamsImpl<T>::MapLayout Layout() const override {
    const int n = this->nstreams;
    typename DenseStreamsImpl<T>::MapLayout m;
    m.rows = 1;
    m.p = P_;
    m.stride = CoefStride();
    m.pre = 1 + P_;
    m.post = m.pre + n;
    m.res = m.post + n;
    m.res_row = n;
    m.res_col = 1;
    return m;
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
    const Params& q = params_[static_cast<size_t>(l)];
    const T s_a = *this->value(q.s_a), s_b = *this->value(q.s_b);
    const T* a_m0 = this->value(q.a_m0);
    const T* a_r0 = this->value(q.a_r0);
    const T* b0 = this->value(q.b0);
    // Projection rows are the token's streams, each C wide.
    const auto no_block = [](int, int, T*) {};
    this->ReadDense(
        l, this->value(q.w), u,
        [&](const T* x, const T* z, T*, T* coef) {
          T* am = coef + n * (1 + P_);
          T* ar = am + n;
          T* bb = ar + n * n;
          for (int s = 0; s < n; ++s) {
            T sum, sq;
            Moments(x + s * C, C, &sum, &sq);
            const T r = RmsOf(sq, C);
            T* rec = coef + s * (1 + P_);
            rec[0] = r;
            for (int p = 0; p < P_; ++p) rec[1 + p] = z[s * P_ + p] / r;
            am[s] = s_a * std::tanh(rec[1]) + a_m0[s];
            for (int j = 0; j < n; ++j)
              ar[s * n + j] = s_a * std::tanh(rec[2 + j]) + a_r0[s * n + j];
            bb[s] = s_b * std::tanh(rec[2 + n]) + b0[s];
          }
        },
        no_block);
  }

  void ReadBackward(int l, const T* d_u) override {
    const int n = this->nstreams;
    const int64_t C = this->width;
    const Params& q = params_[static_cast<size_t>(l)];
    const T s_a = *this->value(q.s_a), s_b = *this->value(q.s_b);
    const int ss = 2 + 2 * n + n * n;
    const auto no_block = [](int, int, T*) {};
    this->ReadBackwardDense(l, d_u, q.w, ss, no_block, [&](const auto& tg) {
      T* scal = tg.scal;  // ds_a, ds_b, dA_m0 (N), dB0 (N), dA_r0 (N*N)
      for (int s = 0; s < n; ++s) {
        const T dam = tg.dpre[s];
        const T* rec = tg.coef + s * (1 + P_);
        const T r = rec[0];
        T* cs_row = tg.c + s * P_;
        // A_m
        T th = std::tanh(rec[1]);
        scal[0] += dam * th;
        scal[2 + s] = dam;
        cs_row[0] = s_a * dam * (T(1) - th * th);
        // A_r row s
        for (int j = 0; j < n; ++j) {
          const T dar = tg.dcoef[n + s * n + j];
          th = std::tanh(rec[2 + j]);
          scal[0] += dar * th;
          scal[2 + 2 * n + s * n + j] = dar;
          cs_row[1 + j] = s_a * dar * (T(1) - th * th);
        }
        // B
        const T db = tg.dcoef[s];
        th = std::tanh(rec[2 + n]);
        scal[1] += db * th;
        scal[2 + n + s] = db;
        cs_row[1 + n] = s_b * db * (T(1) - th * th);
        T sum_dy_y = 0;
        for (int p = 0; p < P_; ++p) {
          sum_dy_y += cs_row[p] * rec[1 + p];
          cs_row[p] /= r;
        }
        Axpy(-sum_dy_y / (static_cast<T>(C) * r * r), tg.x + s * C, tg.dx + s * C, C);
      }
    });
    this->AddScalarGrads({{q.s_a, 1}, {q.s_b, 1}, {q.a_m0, n}, {q.b0, n}, {q.a_r0, n * n}});
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
  // A_r[i][j] is the weight of stream i in output stream j, so H_res = A_r^T.
  typename DenseStreamsImpl<T>::MapLayout Layout() const override {
    const int n = this->nstreams;
    typename DenseStreamsImpl<T>::MapLayout m;
    m.rows = n;
    m.p = P_;
    m.stride = CoefStride();
    m.pre = static_cast<int64_t>(n) * (1 + P_);
    m.res = m.pre + n;
    m.post = m.res + n * n;
    m.res_row = 1;
    m.res_col = n;
    return m;
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
