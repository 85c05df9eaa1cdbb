#include "runtime/layers/lm_head.h"

#include <cmath>

#include "runtime/cpu/gemm.h"
#include "runtime/cpu/math.h"
#include "runtime/cpu/parallel.h"

namespace rackrun::runtime {

template <typename T>
LmHead<T>::LmHead(int width, int vocab, const std::string& name) : width_(width), vocab_(vocab) {
  weight_.Allocate(name, {width, vocab});
}

template <typename T>
double LmHead<T>::Forward(const T* x, const int32_t* targets, int64_t rows, int64_t* counted) {
  rows_ = rows;
  targets_ = targets;
  logits_.Resize({rows, vocab_});
  row_loss_.Resize({rows});
  const int v = vocab_;
  cpu::Gemm<T>(false, false, static_cast<int>(rows), v, width_, T(1), x, width_,
               weight_.value.data(), v, T(0), logits_.data(), v);
  T* logits = logits_.data();
  double* loss = row_loss_.data();
#pragma omp parallel for schedule(static) if (rows * v >= cpu::kParallelMinWork)
  for (int64_t r = 0; r < rows; ++r) {
    T* lr = logits + r * v;
    T mx = lr[0];
    for (int j = 1; j < v; ++j) mx = std::max(mx, lr[j]);
    T sum = 0;
    for (int j = 0; j < v; ++j) lr[j] = cpu::Exp(lr[j] - mx);
    for (int j = 0; j < v; ++j) sum += lr[j];
    const T inv = T(1) / sum;
    for (int j = 0; j < v; ++j) lr[j] *= inv;
    const int32_t tgt = targets[r];
    loss[r] = tgt >= 0 ? -std::log(static_cast<double>(lr[tgt])) : 0.0;
  }
  double total = 0;
  int64_t n = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] >= 0) {
      total += loss[r];
      ++n;
    }
  }
  counted_ = n;
  if (counted != nullptr) *counted = n;
  return n > 0 ? total / static_cast<double>(n) : 0.0;
}

template <typename T>
void LmHead<T>::Backward(const T* x, T grad_scale, T* dx) {
  const int v = vocab_;
  const int64_t rows = rows_;
  T* p = logits_.data();  // becomes dlogits in place
  const T scale = counted_ > 0 ? grad_scale / static_cast<T>(counted_) : T(0);
#pragma omp parallel for schedule(static) if (rows * v >= cpu::kParallelMinWork)
  for (int64_t r = 0; r < rows; ++r) {
    T* pr = p + r * v;
    const int32_t tgt = targets_[r];
    if (tgt < 0) {
      for (int j = 0; j < v; ++j) pr[j] = 0;
      continue;
    }
    pr[tgt] -= T(1);
    for (int j = 0; j < v; ++j) pr[j] *= scale;
  }
  // dW += x^T dlogits; dx = dlogits W^T.
  cpu::Gemm<T>(true, false, width_, v, static_cast<int>(rows), T(1), x, width_, p, v, T(1),
               weight_.grad.data(), v);
  cpu::Gemm<T>(false, true, static_cast<int>(rows), width_, v, T(1), p, v, weight_.value.data(), v,
               T(0), dx, width_);
}

template class LmHead<float>;
template class LmHead<double>;

}  // namespace rackrun::runtime
