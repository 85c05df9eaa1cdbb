#include "runtime/residual/sinkhorn.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace rackrun::runtime {
namespace {

// kBatch lanes of T as one GCC vector (split into the machine's registers by the
// compiler: one AVX2 register of floats, two of doubles). Element-wise arithmetic, so
// lane i computes what the scalar code computes for matrix i. Declared with T's
// alignment: the tape lives in callers' scratch at any T-aligned address.
template <typename T>
struct LanesOf;
template <>
struct LanesOf<float> {
  typedef float type __attribute__((vector_size(8 * sizeof(float)), aligned(sizeof(float))));
};
template <>
struct LanesOf<double> {
  typedef double type __attribute__((vector_size(8 * sizeof(double)), aligned(sizeof(double))));
};
template <typename T>
using Lanes = typename LanesOf<T>::type;
static_assert(sizeof(Lanes<float>) == SinkhornProjection<float>::kBatch * sizeof(float));
static_assert(sizeof(Lanes<double>) == SinkhornProjection<double>::kBatch * sizeof(double));

// dst[e][i] = src[i][e] for the count matrices of nn elements (lane i = matrix i); lanes
// past count are 0.
template <typename T>
void ToLanes(int count, const T* const* src, int nn, Lanes<T>* dst) {
  for (int e = 0; e < nn; ++e) {
    Lanes<T> v = {};
    for (int i = 0; i < count; ++i) v[i] = src[i][e];
    dst[e] = v;
  }
}

}  // namespace

template <typename T>
SinkhornProjection<T>::SinkhornProjection(int n, int iters) : n_(n), iters_(iters) {
  if (n < 1 || n > kMaxN || iters < 1) std::abort();  // configs are validated before
}

// Tape layout, in Lanes (one element of every matrix of the batch): M0 (n*n), then per
// iteration: B (n*n, after the column step), column sums c (n), row sums r (n). The output
// of iteration k's row step is B_k / (r_k + eps).
template <typename T>
void SinkhornProjection<T>::ForwardBatch(int count, const T* const* z, T* const* h, T* tape) const {
  using V = Lanes<T>;
  const int n = n_;
  const int nn = n * n;
  const T eps = static_cast<T>(kEps);
  V m[kMaxN * kMaxN];
  // Lanes past `count` start from zeros (M0 = 1): finite throughout, their results are
  // dropped.
  ToLanes(count, z, nn, m);
  for (int a = 0; a < n; ++a) {
    V mx = m[a * n];
    for (int b = 1; b < n; ++b) mx = mx < m[a * n + b] ? m[a * n + b] : mx;  // std::max
    for (int b = 0; b < n; ++b) {
      const V d = m[a * n + b] - mx;
      V ex;
      for (int i = 0; i < kBatch; ++i) ex[i] = i < count ? std::exp(d[i]) : T(1);
      m[a * n + b] = ex;
    }
  }
  V* step = reinterpret_cast<V*>(tape);
  if (step != nullptr) {
    std::copy(m, m + nn, step);
    step += nn;
  }
  for (int it = 0; it < iters_; ++it) {
    V col[kMaxN];
    V row[kMaxN];
    V* c = step != nullptr ? step + nn : col;
    V* r = step != nullptr ? step + nn + n : row;
    for (int b = 0; b < n; ++b) c[b] = V{};
    for (int a = 0; a < n; ++a)
      for (int b = 0; b < n; ++b) c[b] += m[a * n + b];
    for (int b = 0; b < n; ++b) {
      const V d = c[b] + eps;
      for (int a = 0; a < n; ++a) m[a * n + b] /= d;
    }
    if (step != nullptr) std::copy(m, m + nn, step);
    for (int a = 0; a < n; ++a) {
      V s = {};
      for (int b = 0; b < n; ++b) s += m[a * n + b];
      r[a] = s;
      const V d = s + eps;
      for (int b = 0; b < n; ++b) m[a * n + b] /= d;
    }
    if (step != nullptr) step += nn + 2 * n;
  }
  for (int e = 0; e < nn; ++e)
    for (int i = 0; i < count; ++i) h[i][e] = m[e][i];
}

template <typename T>
void SinkhornProjection<T>::BackwardBatch(int count, const T* const* z, const T* tape,
                                          const T* const* dh, T* const* dz) const {
  using V = Lanes<T>;
  const int n = n_;
  const int nn = n * n;
  const T eps = static_cast<T>(kEps);
  const V* vt = reinterpret_cast<const V*>(tape);
  V g[kMaxN * kMaxN];  // gradient w.r.t. the current matrix
  ToLanes(count, dh, nn, g);
  for (int it = iters_ - 1; it >= 0; --it) {
    const V* b_mat = vt + nn + static_cast<int64_t>(it) * (nn + 2 * n);
    const V* c = b_mat + nn;
    const V* r = b_mat + nn + n;
    // Row step: y = B / (r + eps).
    for (int a = 0; a < n; ++a) {
      const V inv = T(1) / (r[a] + eps);
      V gy = {};
      for (int b = 0; b < n; ++b) {
        const V y = b_mat[a * n + b] * inv;
        gy += g[a * n + b] * y;
      }
      for (int b = 0; b < n; ++b) g[a * n + b] = (g[a * n + b] - gy) * inv;
    }
    // Column step: B = A / (c + eps), y = B.
    for (int b = 0; b < n; ++b) {
      const V inv = T(1) / (c[b] + eps);
      V gy = {};
      for (int a = 0; a < n; ++a) gy += g[a * n + b] * b_mat[a * n + b];
      for (int a = 0; a < n; ++a) g[a * n + b] = (g[a * n + b] - gy) * inv;
    }
  }
  // M0 = exp(Z - max_b Z[a][b]): dZ = dM0 * M0, and the row's total through its argmax.
  const V* m0 = vt;
  for (int e = 0; e < nn; ++e) g[e] *= m0[e];
  for (int i = 0; i < count; ++i) {
    const T* zi = z[i];
    T* d = dz[i];
    for (int a = 0; a < n; ++a) {
      int arg = 0;
      for (int b = 1; b < n; ++b)
        if (zi[a * n + b] > zi[a * n + arg]) arg = b;
      T total = 0;
      for (int b = 0; b < n; ++b) {
        d[a * n + b] = g[a * n + b][i];
        total += d[a * n + b];
      }
      d[a * n + arg] -= total;
    }
  }
}

template class SinkhornProjection<float>;
template class SinkhornProjection<double>;

}  // namespace rackrun::runtime
