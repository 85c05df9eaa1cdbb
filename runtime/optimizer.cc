#include "runtime/optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <utility>

namespace rackrun::runtime {

double LearningRateSchedule::At(int64_t step) const {
  if (warmup > 0 && step < warmup) {
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  }
  if (!cosine) return lr;
  const int64_t span = std::max<int64_t>(1, total - warmup);
  const double progress =
      std::clamp(static_cast<double>(step - warmup) / static_cast<double>(span), 0.0, 1.0);
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

bool DecaysWeight(std::string_view name) {
  const size_t dot = name.rfind('.');
  const std::string_view last = dot == std::string_view::npos ? name : name.substr(dot + 1);
  if (last.find("norm") != std::string_view::npos || last.find("gain") != std::string_view::npos ||
      last.find("bias") != std::string_view::npos) {
    return false;
  }
  if (last.starts_with("b_") || last.starts_with("a_") || last == "alpha" || last == "scale") {
    return false;
  }
  return true;
}

double GlobalGradNorm(const std::vector<OptimizedTensor>& tensors) {
  double sum = 0;
  for (const OptimizedTensor& t : tensors) {
    // Per-tensor partial sums in fixed 4096-element chunks keep the reduction order
    // independent of threads; chunks run in parallel, their sums add in order.
    const int64_t chunks = (t.size + 4095) / 4096;
    std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
#pragma omp parallel for schedule(static) if (chunks > 8)
    for (int64_t c = 0; c < chunks; ++c) {
      double s = 0;
      const int64_t end = std::min(t.size, (c + 1) * 4096);
      for (int64_t i = c * 4096; i < end; ++i) {
        const double g = t.grad[i];
        s += g * g;
      }
      partial[static_cast<size_t>(c)] = s;
    }
    for (const double s : partial) sum += s;
  }
  return std::sqrt(sum);
}

AdamW::AdamW(AdamWConfig config, std::vector<OptimizedTensor> tensors)
    : config_(config), tensors_(std::move(tensors)) {
  m_.reserve(tensors_.size());
  v_.reserve(tensors_.size());
  for (const OptimizedTensor& t : tensors_) {
    m_.emplace_back(static_cast<size_t>(t.size), 0.0f);
    v_.emplace_back(static_cast<size_t>(t.size), 0.0f);
  }
}

void AdamW::Step(double lr, double grad_scale) {
  ++step_;
  const double b1 = config_.beta1;
  const double b2 = config_.beta2;
  const double bias1 = 1.0 - std::pow(b1, static_cast<double>(step_));
  const double bias2 = 1.0 - std::pow(b2, static_cast<double>(step_));
  const auto fb1 = static_cast<float>(b1);
  const auto fb2 = static_cast<float>(b2);
  const auto scale = static_cast<float>(grad_scale);
  const auto step_size = static_cast<float>(lr / bias1);
  const auto inv_sqrt_bias2 = static_cast<float>(1.0 / std::sqrt(bias2));
  const auto eps = static_cast<float>(config_.eps);
  for (size_t k = 0; k < tensors_.size(); ++k) {
    const OptimizedTensor& t = tensors_[k];
    const auto shrink = static_cast<float>(t.decay ? 1.0 - lr * config_.weight_decay : 1.0);
    float* p = t.value;
    const float* g = t.grad;
    float* m = m_[k].data();
    float* v = v_[k].data();
#pragma omp parallel for schedule(static) if (t.size > 32768)
    for (int64_t i = 0; i < t.size; ++i) {
      const float gi = g[i] * scale;
      m[i] = fb1 * m[i] + (1.0f - fb1) * gi;
      v[i] = fb2 * v[i] + (1.0f - fb2) * gi * gi;
      p[i] = p[i] * shrink - step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bias2 + eps);
    }
  }
}

}  // namespace rackrun::runtime
