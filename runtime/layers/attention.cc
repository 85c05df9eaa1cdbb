#include "runtime/layers/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "runtime/cpu/gemm.h"
#include "runtime/cpu/math.h"
#include "runtime/cpu/parallel.h"

namespace rackrun::runtime {

namespace {

// Runs body(bh, b, h) for every (sequence b, head h) pair bh = b * heads + h, over the
// OpenMP threads (static schedule) when the work, pairs x seq^2, is large enough.
template <typename Body>
void ForEachSequenceHead(int batch, int heads, int seq, Body&& body) {
  const int pairs = batch * heads;
#pragma omp parallel for schedule(static) if (static_cast <int64_t>(pairs) * seq * seq >= \
                                              cpu::kParallelMinWork)
  for (int bh = 0; bh < pairs; ++bh) body(bh, bh / heads, bh % heads);
}

// Query rows per causal block: keys beyond the block's last row are never computed.
constexpr int kQueryBlock = 64;

}  // namespace

template <typename T>
Attention<T>::Attention(int width, int heads, int max_seq, double rope_theta,
                        const std::string& prefix)
    : width_(width),
      heads_(heads),
      head_dim_(width / heads),
      max_seq_(max_seq),
      norm_(width, prefix + ".norm") {
  wqkv_.Allocate(prefix + ".wqkv", {width, 3 * width});
  wo_.Allocate(prefix + ".wo", {width, width});
  const int half = head_dim_ / 2;
  rope_cos_.Resize({max_seq, half});
  rope_sin_.Resize({max_seq, half});
  for (int p = 0; p < max_seq; ++p) {
    for (int i = 0; i < half; ++i) {
      const double freq = std::pow(rope_theta, -2.0 * i / head_dim_);
      rope_cos_[p * half + i] = static_cast<T>(std::cos(p * freq));
      rope_sin_[p * half + i] = static_cast<T>(std::sin(p * freq));
    }
  }
}

template <typename T>
void Attention<T>::Init(NormalInit& rng, double std, double out_std) {
  rng.Fill(wqkv_.value, std);
  rng.Fill(wo_.value, out_std);
}

template <typename T>
std::vector<ParamRef<T>> Attention<T>::Parameters() {
  return {norm_.gain().Ref(), wqkv_.Ref(), wo_.Ref()};
}

template <typename T>
void Attention<T>::ApplyRope(T* qkv, int64_t tokens, int seq, bool inverse) const {
  const int half = head_dim_ / 2;
  const int c3 = 3 * width_;
  const T sign = inverse ? T(-1) : T(1);
#pragma omp parallel for schedule(static) if (tokens * width_ >= cpu::kParallelMinWork)
  for (int64_t t = 0; t < tokens; ++t) {
    const int pos = static_cast<int>(t % seq);
    const T* cs = rope_cos_.data() + static_cast<int64_t>(pos) * half;
    const T* sn = rope_sin_.data() + static_cast<int64_t>(pos) * half;
    // q and k: the first 2 * width columns.
    for (int part = 0; part < 2; ++part) {
      for (int h = 0; h < heads_; ++h) {
        T* x = qkv + t * c3 + part * width_ + h * head_dim_;
        for (int i = 0; i < half; ++i) {
          const T x0 = x[2 * i], x1 = x[2 * i + 1];
          const T c = cs[i], s = sign * sn[i];
          x[2 * i] = x0 * c - x1 * s;
          x[2 * i + 1] = x0 * s + x1 * c;
        }
      }
    }
  }
}

template <typename T>
void Attention<T>::Forward(const T* u, int batch, int seq, const int32_t* doc_start, T* out) {
  u_ = u;
  doc_start_ = doc_start;
  batch_ = batch;
  seq_ = seq;
  const int64_t tokens = static_cast<int64_t>(batch) * seq;
  const int c = width_, c3 = 3 * width_, d = head_dim_;
  xn_.Resize({tokens, c});
  qkv_.Resize({tokens, c3});
  probs_.Resize({static_cast<int64_t>(batch) * heads_, seq, seq});
  attn_.Resize({tokens, c});

  norm_.Forward(u, tokens, xn_.data());
  cpu::Gemm<T>(false, false, static_cast<int>(tokens), c3, c, T(1), xn_.data(), c,
               wqkv_.value.data(), c3, T(0), qkv_.data(), c3);
  ApplyRope(qkv_.data(), tokens, seq, /*inverse=*/false);

  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  ForEachSequenceHead(batch, heads_, seq, [&](int bh, int b, int h) {
    const T* q = qkv_.data() + static_cast<int64_t>(b) * seq * c3 + h * d;
    const T* k = q + c;
    const T* v = q + 2 * c;
    T* p = probs_.data() + static_cast<int64_t>(bh) * seq * seq;
    const int32_t* ds = doc_start + static_cast<int64_t>(b) * seq;
    T* o = attn_.data() + static_cast<int64_t>(b) * seq * c + h * d;
    // Causal blocks: query rows [i0, i1) only need keys [doc_start[i0], i1).
    for (int i0 = 0; i0 < seq; i0 += kQueryBlock) {
      const int i1 = std::min(seq, i0 + kQueryBlock);
      const int k0 = ds[i0];
      T* pb = p + static_cast<int64_t>(i0) * seq;
      cpu::GemmSerial<T>(false, true, i1 - i0, i1 - k0, d, scale, q + static_cast<int64_t>(i0) * c3,
                         c3, k + static_cast<int64_t>(k0) * c3, c3, T(0), pb + k0, seq);
      for (int i = i0; i < i1; ++i) {
        T* pr = p + static_cast<int64_t>(i) * seq;
        const int j0 = ds[i];
        T mx = pr[j0];
        for (int j = j0 + 1; j <= i; ++j) mx = std::max(mx, pr[j]);
        T sum = 0;
        for (int j = j0; j <= i; ++j) pr[j] = cpu::Exp(pr[j] - mx);
        for (int j = j0; j <= i; ++j) sum += pr[j];
        const T inv = T(1) / sum;
        for (int j = 0; j < j0; ++j) pr[j] = 0;
        for (int j = j0; j <= i; ++j) pr[j] *= inv;
        for (int j = i + 1; j < seq; ++j) pr[j] = 0;
      }
      cpu::GemmSerial<T>(false, false, i1 - i0, d, i1 - k0, T(1), pb + k0, seq,
                         v + static_cast<int64_t>(k0) * c3, c3, T(0),
                         o + static_cast<int64_t>(i0) * c, c);
    }
  });
  cpu::Gemm<T>(false, false, static_cast<int>(tokens), c, c, T(1), attn_.data(), c,
               wo_.value.data(), c, T(0), out, c);
}

template <typename T>
void Attention<T>::Backward(const T* dout, T* du) {
  const int batch = batch_, seq = seq_;
  const int64_t tokens = static_cast<int64_t>(batch) * seq;
  const int c = width_, c3 = 3 * width_, d = head_dim_;
  dattn_.Resize({tokens, c});
  dqkv_.Resize({tokens, c3});
  dxn_.Resize({tokens, c});
  const int threads = omp_get_max_threads();
  dscores_.Resize({threads, seq, seq});

  // Output projection.
  cpu::Gemm<T>(true, false, c, c, static_cast<int>(tokens), T(1), attn_.data(), c, dout, c, T(1),
               wo_.grad.data(), c);
  cpu::Gemm<T>(false, true, static_cast<int>(tokens), c, c, T(1), dout, c, wo_.value.data(), c,
               T(0), dattn_.data(), c);

  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  ForEachSequenceHead(batch, heads_, seq, [&](int bh, int b, int h) {
    const int64_t base = static_cast<int64_t>(b) * seq * c3 + h * d;
    const T* q = qkv_.data() + base;
    const T* k = q + c;
    const T* v = q + 2 * c;
    T* dq = dqkv_.data() + base;
    T* dk = dq + c;
    T* dv = dq + 2 * c;
    const T* p = probs_.data() + static_cast<int64_t>(bh) * seq * seq;
    const T* dof = dattn_.data() + static_cast<int64_t>(b) * seq * c + h * d;
    T* ds = dscores_.data() + static_cast<int64_t>(omp_get_thread_num()) * seq * seq;
    const int32_t* dst = doc_start_ + static_cast<int64_t>(b) * seq;
    for (int i = 0; i < seq; ++i) {
      std::fill(dk + static_cast<int64_t>(i) * c3, dk + static_cast<int64_t>(i) * c3 + d, T(0));
      std::fill(dv + static_cast<int64_t>(i) * c3, dv + static_cast<int64_t>(i) * c3 + d, T(0));
    }
    for (int i0 = 0; i0 < seq; i0 += kQueryBlock) {
      const int i1 = std::min(seq, i0 + kQueryBlock);
      const int k0 = dst[i0];
      const int rows = i1 - i0, cols = i1 - k0;
      const T* pb = p + static_cast<int64_t>(i0) * seq + k0;
      T* db = ds + static_cast<int64_t>(i0) * seq + k0;
      const T* dob = dof + static_cast<int64_t>(i0) * c;
      // dP = dO V^T; dV += P^T dO.
      cpu::GemmSerial<T>(false, true, rows, cols, d, T(1), dob, c,
                         v + static_cast<int64_t>(k0) * c3, c3, T(0), db, seq);
      cpu::GemmSerial<T>(true, false, cols, d, rows, T(1), pb, seq, dob, c, T(1),
                         dv + static_cast<int64_t>(k0) * c3, c3);
      // dS = P * (dP - rowsum(P * dP)) * scale, zero outside the mask.
      for (int i = i0; i < i1; ++i) {
        const T* pr = p + static_cast<int64_t>(i) * seq;
        T* dr = ds + static_cast<int64_t>(i) * seq;
        const int j0 = dst[i];
        T dot = 0;
        for (int j = j0; j <= i; ++j) dot += pr[j] * dr[j];
        for (int j = k0; j < j0; ++j) dr[j] = 0;
        for (int j = j0; j <= i; ++j) dr[j] = pr[j] * (dr[j] - dot) * scale;
        for (int j = i + 1; j < i1; ++j) dr[j] = 0;
      }
      // dQ = dS K; dK += dS^T Q (rotated coordinates).
      cpu::GemmSerial<T>(false, false, rows, d, cols, T(1), db, seq,
                         k + static_cast<int64_t>(k0) * c3, c3, T(0),
                         dq + static_cast<int64_t>(i0) * c3, c3);
      cpu::GemmSerial<T>(true, false, cols, d, rows, T(1), db, seq,
                         q + static_cast<int64_t>(i0) * c3, c3, T(1),
                         dk + static_cast<int64_t>(k0) * c3, c3);
    }
  });
  // Rotary is orthogonal: its transpose is the inverse rotation.
  ApplyRope(dqkv_.data(), tokens, seq, /*inverse=*/true);

  cpu::Gemm<T>(true, false, c, c3, static_cast<int>(tokens), T(1), xn_.data(), c, dqkv_.data(), c3,
               T(1), wqkv_.grad.data(), c3);
  cpu::Gemm<T>(false, true, static_cast<int>(tokens), c, c3, T(1), dqkv_.data(), c3,
               wqkv_.value.data(), c3, T(0), dxn_.data(), c);
  norm_.Backward(u_, dxn_.data(), tokens, du);
}

template class Attention<float>;
template class Attention<double>;

}  // namespace rackrun::runtime
