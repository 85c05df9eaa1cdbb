#include "runtime/residual/sinkhorn.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace rackrun::runtime {

// Tape layout: M0 (n*n), then per iteration: B (n*n, after the column step), column sums
// c (n), row sums r (n). The output of iteration k's row step is B_k / (r_k + eps).
template <typename T>
void SinkhornProjection<T>::Forward(const T* z, T* h, T* tape) const {
  const int n = n_;
  const T eps = static_cast<T>(kEps);
  for (int a = 0; a < n; ++a) {
    T mx = z[a * n];
    for (int b = 1; b < n; ++b) mx = std::max(mx, z[a * n + b]);
    for (int b = 0; b < n; ++b) h[a * n + b] = std::exp(z[a * n + b] - mx);
  }
  if (tape != nullptr) std::memcpy(tape, h, sizeof(T) * n * n);
  T* step = tape == nullptr ? nullptr : tape + n * n;
  for (int it = 0; it < iters_; ++it) {
    T col[64];
    T row[64];
    T* c = step != nullptr ? step + n * n : col;
    T* r = step != nullptr ? step + n * n + n : row;
    for (int b = 0; b < n; ++b) c[b] = 0;
    for (int a = 0; a < n; ++a)
      for (int b = 0; b < n; ++b) c[b] += h[a * n + b];
    for (int a = 0; a < n; ++a)
      for (int b = 0; b < n; ++b) h[a * n + b] /= (c[b] + eps);
    if (step != nullptr) std::memcpy(step, h, sizeof(T) * n * n);
    for (int a = 0; a < n; ++a) {
      T s = 0;
      for (int b = 0; b < n; ++b) s += h[a * n + b];
      r[a] = s;
      for (int b = 0; b < n; ++b) h[a * n + b] /= (s + eps);
    }
    if (step != nullptr) step += n * n + 2 * n;
  }
}

template <typename T>
void SinkhornProjection<T>::Backward(const T* z, const T* tape, const T* dh, T* dz, T* work) const {
  const int n = n_;
  const T eps = static_cast<T>(kEps);
  T* g = work;          // gradient w.r.t. the current matrix
  T* y = work + n * n;  // output of the step being undone
  std::memcpy(g, dh, sizeof(T) * n * n);
  for (int it = iters_ - 1; it >= 0; --it) {
    const T* step = tape + n * n + static_cast<int64_t>(it) * (n * n + 2 * n);
    const T* b_mat = step;
    const T* c = step + n * n;
    const T* r = step + n * n + n;
    // Row step: y = B / (r + eps).
    for (int a = 0; a < n; ++a) {
      const T inv = T(1) / (r[a] + eps);
      T gy = 0;
      for (int b = 0; b < n; ++b) {
        y[a * n + b] = b_mat[a * n + b] * inv;
        gy += g[a * n + b] * y[a * n + b];
      }
      for (int b = 0; b < n; ++b) g[a * n + b] = (g[a * n + b] - gy) * inv;
    }
    // Column step: B = A / (c + eps), y = B.
    for (int b = 0; b < n; ++b) {
      const T inv = T(1) / (c[b] + eps);
      T gy = 0;
      for (int a = 0; a < n; ++a) gy += g[a * n + b] * b_mat[a * n + b];
      for (int a = 0; a < n; ++a) g[a * n + b] = (g[a * n + b] - gy) * inv;
    }
  }
  // M0 = exp(Z - max_b Z[a][b]).
  const T* m0 = tape;
  for (int a = 0; a < n; ++a) {
    int arg = 0;
    for (int b = 1; b < n; ++b)
      if (z[a * n + b] > z[a * n + arg]) arg = b;
    T total = 0;
    for (int b = 0; b < n; ++b) {
      dz[a * n + b] = g[a * n + b] * m0[a * n + b];
      total += dz[a * n + b];
    }
    dz[a * n + arg] -= total;
  }
}

template class SinkhornProjection<float>;
template class SinkhornProjection<double>;

}  // namespace rackrun::runtime
