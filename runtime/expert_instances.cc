#include "runtime/expert_instances.h"

#include <algorithm>
#include <cstring>

namespace rackrun::runtime {

absl::Status HostExpertInstances::ReadMaster(int local, float* dst) {
  const int64_t n13 = 2 * static_cast<int64_t>(width()) * hidden();
  std::memcpy(dst, experts_->w13(local), static_cast<size_t>(n13) * sizeof(float));
  std::memcpy(dst + n13, experts_->w2(local),
              static_cast<size_t>(expert_floats() - n13) * sizeof(float));
  return absl::OkStatus();
}

absl::Status HostExpertInstances::BeginForward(const float* in, int64_t rows) {
  const int f = hidden();
  in_ = in;
  h13_.Resize({std::max<int64_t>(rows, 1), 2 * f});
  act_.Resize({std::max<int64_t>(rows, 1), f});
  return absl::OkStatus();
}

absl::Status HostExpertInstances::BeginBackward(const float* dy, int64_t rows) {
  const int f = hidden();
  dy_ = dy;
  dh13_.Resize({std::max<int64_t>(rows, 1), 2 * f});
  dact_.Resize({std::max<int64_t>(rows, 1), f});
  return absl::OkStatus();
}

void HostExpertInstances::ForEach(std::span<const Batch> batches, bool masters,
                                  absl::FunctionRef<void()> between,
                                  absl::FunctionRef<void(const Batch&)> body) {
  offsets_.resize(batches.size() + 1);
  offsets_[0] = 0;
  for (size_t i = 0; i < batches.size(); ++i) offsets_[i + 1] = batches[i].offset + batches[i].rows;
  // Every batch keeps the threading it would have in one pass over all batches.
  RunExpertBatches(offsets_, static_cast<int64_t>(width()) * hidden(), &cold_, [&](int i) {
    const Batch& b = batches[static_cast<size_t>(i)];
    if ((b.master >= 0) != masters) return;
    body(b);
    between();
  });
}

absl::Status HostExpertInstances::Forward(std::span<const Batch> batches, bool masters, Slots slots,
                                          float* out, absl::FunctionRef<void()> between) {
  const int c = width(), f = hidden();
  const int64_t n = expert_floats(), n13 = 2 * static_cast<int64_t>(c) * f;
  ForEach(batches, masters, between, [&](const Batch& b) {
    const float* w13 = b.master >= 0 ? experts_->w13(b.master) : slots.weights + b.slot * n;
    const float* w2 = b.master >= 0 ? experts_->w2(b.master) : slots.weights + b.slot * n + n13;
    const int64_t r0 = b.offset;
    SwigluForward(c, f, w13, w2, b.rows, in_ + r0 * c, h13_.data() + r0 * 2 * f,
                  act_.data() + r0 * f, out + r0 * c);
  });
  return absl::OkStatus();
}

absl::Status HostExpertInstances::Backward(std::span<const Batch> batches, bool masters,
                                           Slots slots, float* dx,
                                           absl::FunctionRef<void()> between) {
  const int c = width(), f = hidden();
  const int64_t n = expert_floats(), n13 = 2 * static_cast<int64_t>(c) * f;
  ForEach(batches, masters, between, [&](const Batch& b) {
    const bool m = b.master >= 0;
    const float* w = m ? nullptr : slots.weights + b.slot * n;
    float* g = m ? nullptr : slots.grads + b.slot * n;
    const int64_t r0 = b.offset;
    SwigluBackward(c, f, m ? experts_->w13(b.master) : w, m ? experts_->w2(b.master) : w + n13,
                   m ? experts_->dw13(b.master) : g, m ? experts_->dw2(b.master) : g + n13, b.rows,
                   in_ + r0 * c, h13_.data() + r0 * 2 * f, act_.data() + r0 * f, dy_ + r0 * c,
                   dh13_.data() + r0 * 2 * f, dact_.data() + r0 * f, dx + r0 * c);
  });
  return absl::OkStatus();
}

absl::Status HostExpertInstances::AddToMaster(int local, const float* g) {
  const int64_t n = expert_floats(), n13 = 2 * static_cast<int64_t>(width()) * hidden();
  float* dw13 = experts_->dw13(local);
  float* dw2 = experts_->dw2(local);
  for (int64_t j = 0; j < n13; ++j) dw13[j] += g[j];
  for (int64_t j = n13; j < n; ++j) dw2[j - n13] += g[j];
  return absl::OkStatus();
}

}  // namespace rackrun::runtime
