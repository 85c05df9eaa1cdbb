#include "runtime/layers/rmsnorm.h"

#include <algorithm>
#include <cmath>

#include "runtime/cpu/parallel.h"

namespace rackrun::runtime {

template <typename T>
RmsNorm<T>::RmsNorm(int width, const std::string& name) : width_(width) {
  gain_.Allocate(name, {width});
  gain_.value.Fill(T(1));
}

template <typename T>
void RmsNorm<T>::Forward(const T* x, int64_t rows, T* y) {
  inv_rms_.Resize({rows});
  const int c = width_;
  const T* g = gain_.value.data();
  T* inv = inv_rms_.data();
#pragma omp parallel for schedule(static) if (rows * c >= cpu::kParallelMinWork)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * c;
    T* yr = y + r * c;
    T ss = 0;
    for (int i = 0; i < c; ++i) ss += xr[i] * xr[i];
    const T s = T(1) / std::sqrt(ss / static_cast<T>(c) + static_cast<T>(kEpsilon));
    inv[r] = s;
    for (int i = 0; i < c; ++i) yr[i] = g[i] * xr[i] * s;
  }
}

template <typename T>
void RmsNorm<T>::Backward(const T* x, const T* dy, int64_t rows, T* dx) {
  const int c = width_;
  const T* g = gain_.value.data();
  const T* inv = inv_rms_.data();
#pragma omp parallel for schedule(static) if (rows * c >= cpu::kParallelMinWork)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * c;
    const T* dyr = dy + r * c;
    T* dxr = dx + r * c;
    const T s = inv[r];
    T dot = 0;
    for (int i = 0; i < c; ++i) dot += g[i] * dyr[i] * xr[i];
    const T k = s * s * s * dot / static_cast<T>(c);
    for (int i = 0; i < c; ++i) dxr[i] = s * g[i] * dyr[i] - k * xr[i];
  }
  // Gain gradient: each channel sums over rows in row order (thread-count independent).
  T* dg = gain_.grad.data();
  constexpr int kBlock = 16;
  const int blocks = (c + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (rows * c >= cpu::kParallelMinWork)
  for (int b = 0; b < blocks; ++b) {
    const int i0 = b * kBlock;
    const int i1 = std::min(c, i0 + kBlock);
    T acc[kBlock] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const T s = inv[r];
      const T* xr = x + r * c;
      const T* dyr = dy + r * c;
      for (int i = i0; i < i1; ++i) acc[i - i0] += dyr[i] * xr[i] * s;
    }
    for (int i = i0; i < i1; ++i) dg[i] += acc[i - i0];
  }
}

template class RmsNorm<float>;
template class RmsNorm<double>;

}  // namespace rackrun::runtime
