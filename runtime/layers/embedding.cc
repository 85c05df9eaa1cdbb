#include "runtime/layers/embedding.h"

#include <algorithm>

#include "runtime/cpu/parallel.h"

namespace rackrun::runtime {

template <typename T>
Embedding<T>::Embedding(int vocab, int width, const std::string& name)
    : vocab_(vocab), width_(width) {
  table_.Allocate(name, {vocab, width});
}

template <typename T>
void Embedding<T>::Forward(const int32_t* tokens, int64_t count, T* out) const {
  const int c = width_;
  const T* table = table_.value.data();
#pragma omp parallel for schedule(static) if (count * c >= cpu::kParallelMinWork)
  for (int64_t t = 0; t < count; ++t) {
    const T* src = table + static_cast<int64_t>(tokens[t]) * c;
    std::copy(src, src + c, out + t * c);
  }
}

template <typename T>
void Embedding<T>::Backward(const int32_t* tokens, int64_t count, const T* dout) {
  const int c = width_;
  T* grad = table_.grad.data();
  constexpr int kBlock = 16;
  const int blocks = (c + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (count * c >= cpu::kParallelMinWork)
  for (int b = 0; b < blocks; ++b) {
    const int i0 = b * kBlock;
    const int i1 = std::min(c, i0 + kBlock);
    for (int64_t t = 0; t < count; ++t) {
      T* g = grad + static_cast<int64_t>(tokens[t]) * c;
      const T* d = dout + t * c;
      for (int i = i0; i < i1; ++i) g[i] += d[i];
    }
  }
}

template class Embedding<float>;
template class Embedding<double>;

}  // namespace rackrun::runtime
