#include "runtime/cuda/expert_instances.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/cuda/kernels.h"
#include "runtime/cuda/model_kernels.h"

namespace rackrun::runtime::cuda {

DeviceExpertInstances::DeviceExpertInstances(Device* device, MatMul* matmul,
                                             const ExpertShard& shard, const std::string& name,
                                             std::shared_ptr<DeviceSlots> slots)
    : device_(device),
      matmul_(matmul),
      shard_(shard),
      name_(name),
      slots_(slots != nullptr ? std::move(slots) : std::make_shared<DeviceSlots>(device, name)),
      in_(device, name + " expert rows"),
      h13_(device, name + " expert h13"),
      act_(device, name + " expert activations"),
      out_(device, name + " expert outputs"),
      dy_(device, name + " expert output gradients"),
      dh13_(device, name + " expert h13 gradients"),
      dact_(device, name + " expert activation gradients"),
      dx_(device, name + " expert row gradients"),
      grad_(device, name + " replica gradient"),
      rows_(device, name),
      fanout_(device, name + " masters to fan out"),
      incoming_(device, name + " replica gradients received") {}

namespace {

// Whether `p` points into `t` (std::less: a total order over pointers into different arrays).
bool Inside(const float* p, const DeviceTensor<float>& t) {
  const std::less<const float*> before;
  return !before(p, t.data()) && before(p, t.data() + t.size());
}

}  // namespace

absl::Status DeviceExpertInstances::Check(cudaError_t e, const char* what) const {
  return CudaCheck(e, absl::StrCat(name_, " (GPU experts): ", what));
}

absl::Status DeviceExpertInstances::Copy(float* dst, const float* src, int64_t floats,
                                         cudaMemcpyKind kind, const char* what,
                                         cudaStream_t stream) {
  if (floats == 0) return absl::OkStatus();
  return Check(cudaMemcpyAsync(dst, src, static_cast<size_t>(floats) * sizeof(float), kind,
                               stream != nullptr ? stream : device_->stream()),
               what);
}

absl::Status DeviceExpertInstances::Wait(const absl::Status& issued) {
  return issued.ok() ? device_->Synchronize() : issued;
}

const float* DeviceExpertInstances::W13(const Batch& b) const {
  const int64_t n13 = 2 * static_cast<int64_t>(shard_.width) * shard_.hidden;
  return b.master >= 0 ? shard_.w13 + b.master * n13
                       : slots_->weights.data() + b.slot * expert_floats();
}

const float* DeviceExpertInstances::W2(const Batch& b) const {
  const int64_t n13 = 2 * static_cast<int64_t>(shard_.width) * shard_.hidden;
  return b.master >= 0 ? shard_.w2 + b.master * (n13 / 2)
                       : slots_->weights.data() + b.slot * expert_floats() + n13;
}

float* DeviceExpertInstances::DW13(const Batch& b) {
  const int64_t n13 = 2 * static_cast<int64_t>(shard_.width) * shard_.hidden;
  return b.master >= 0 ? shard_.dw13 + b.master * n13
                       : slots_->grads.data() + b.slot * expert_floats();
}

float* DeviceExpertInstances::DW2(const Batch& b) {
  const int64_t n13 = 2 * static_cast<int64_t>(shard_.width) * shard_.hidden;
  return b.master >= 0 ? shard_.dw2 + b.master * (n13 / 2)
                       : slots_->grads.data() + b.slot * expert_floats() + n13;
}

absl::Status DeviceExpertInstances::ReadMaster(int local, float* dst) {
  const int64_t n13 = 2 * static_cast<int64_t>(shard_.width) * shard_.hidden;
  // Before the first WeightsChanged: after everything on the compute stream.
  cudaStream_t st = device_->stream();
  if (weights_final_.get() != nullptr) {
    if (reads_.get() == nullptr) {
      absl::StatusOr<Stream> s = Stream::Create();
      if (!s.ok()) return s.status();
      reads_ = *std::move(s);
    }
    st = reads_.get();
    if (absl::Status s = weights_final_.MakeWait(st); !s.ok()) return s;
  }
  const bool on_device = Inside(dst, fanout_);  // into FanoutStaging's buffer
  const cudaMemcpyKind kind = on_device ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost;
  if (absl::Status s = Copy(dst, shard_.w13 + local * n13, n13, kind, "reading a master's w13", st);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Copy(dst + n13, shard_.w2 + local * (n13 / 2), n13 / 2, kind,
                            "reading a master's w2", st);
      !s.ok()) {
    return s;
  }
  return Check(cudaStreamSynchronize(st), "waiting for a master's weights");
}

absl::Status DeviceExpertInstances::WeightsChanged() {
  if (weights_final_.get() == nullptr) {
    absl::StatusOr<Event> e = Event::Create();
    if (!e.ok()) return e.status();
    weights_final_ = *std::move(e);
  }
  return weights_final_.Record(device_->stream());
}

// The channel writes these buffers on a stream of its own: a block the caching allocator hands
// out anew may still be read by work queued on the compute stream (it is stream-ordered there),
// so the compute stream finishes first whenever one moved.
absl::Status DeviceExpertInstances::ResizeForChannel(DeviceTensor<float>& t, int experts) {
  const float* before = t.data();
  if (absl::Status s = t.Resize({std::max(experts, 1), expert_floats()}); !s.ok()) return s;
  return t.data() == before ? absl::OkStatus() : device_->Synchronize();
}

absl::StatusOr<float*> DeviceExpertInstances::FanoutStaging(int experts) {
  if (absl::Status s = ResizeForChannel(fanout_, experts); !s.ok()) return s;
  return fanout_.data();
}

absl::Status DeviceExpertInstances::SizeSlots(int slots, bool for_channel) {
  const int64_t rows = std::max(slots, 1);
  for (absl::Status s : {for_channel ? ResizeForChannel(slots_->weights, slots)
                                     : slots_->weights.Resize({rows, expert_floats()}),
                         slots_->grads.Resize({rows, expert_floats()})}) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<float*> DeviceExpertInstances::SlotWeights(int slots) {
  if (absl::Status s = SizeSlots(slots, /*for_channel=*/true); !s.ok()) return s;
  return slots_->weights.data();
}

absl::StatusOr<float*> DeviceExpertInstances::SlotGradients(int buffer, int slots) {
  DeviceTensor<float>& t = slots_->outgoing[buffer % 2];
  if (absl::Status s = ResizeForChannel(t, slots); !s.ok()) return s;
  if (absl::Status s = t.Zero(); !s.ok()) return s;
  return t.data();
}

absl::StatusOr<float*> DeviceExpertInstances::GradientStaging(int count) {
  // The channel writes here on its stream: the adds issued from here come first.
  if (added_.get() != nullptr) {
    if (absl::Status s = added_.Synchronize(); !s.ok()) return s;
  }
  if (absl::Status s = ResizeForChannel(incoming_, count); !s.ok()) return s;
  return incoming_.data();
}

absl::Status DeviceExpertInstances::SlotsArrived(const float* weights, int count) {
  slot_count_ = count;
  // Fanned out on the device: SlotWeights sized the store the channel wrote.
  if (weights == slots_->weights.data() && slots_->weights.dim(0) >= count) {
    return absl::OkStatus();
  }
  if (absl::Status s = SizeSlots(count, /*for_channel=*/false); !s.ok()) return s;
  return Copy(slots_->weights.data(), weights, count * expert_floats(), cudaMemcpyHostToDevice,
              "replica weights to the device");
}

absl::Status DeviceExpertInstances::ResizeForward(int64_t rows) {
  const int c = shard_.width, f = shard_.hidden;
  const int64_t alloc = std::max<int64_t>(rows, 1);
  for (absl::Status s : {in_.Resize({alloc, c}), h13_.Resize({alloc, 2 * f}),
                         act_.Resize({alloc, f}), out_.Resize({alloc, c})}) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status DeviceExpertInstances::ResizeBackward(int64_t rows) {
  const int c = shard_.width, f = shard_.hidden;
  const int64_t alloc = std::max<int64_t>(rows, 1);
  for (absl::Status s : {dy_.Resize({alloc, c}), dh13_.Resize({alloc, 2 * f}),
                         dact_.Resize({alloc, f}), dx_.Resize({alloc, c})}) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<float*> DeviceExpertInstances::Rows(RowsOf which, int64_t rows) {
  const bool forward = which == RowsOf::kIn || which == RowsOf::kOut;
  if (absl::Status s = forward ? ResizeForward(rows) : ResizeBackward(rows); !s.ok()) return s;
  switch (which) {
    case RowsOf::kIn:
      return in_.data();
    case RowsOf::kOut:
      return out_.data();
    case RowsOf::kDy:
      return dy_.data();
    case RowsOf::kDx:
      return dx_.data();
  }
  return absl::InvalidArgumentError("unknown row buffer");
}

absl::Status DeviceExpertInstances::BeginForward(const float* in, int64_t rows) {
  if (absl::Status s = ResizeForward(rows); !s.ok()) return s;
  if (in == in_.data()) return absl::OkStatus();  // dispatched on the device (Rows)
  return Copy(in_.data(), in, rows * shard_.width, cudaMemcpyHostToDevice,
              "expert rows to the device");
}

absl::Status DeviceExpertInstances::FinishPass(std::span<const Batch> batches, bool masters,
                                               float* host, absl::FunctionRef<void()> between) {
  if (host == nullptr && masters) return absl::OkStatus();  // the replicas' pass waits
  if (pass_done_.get() == nullptr) {
    absl::StatusOr<Event> e = Event::Create();
    if (!e.ok()) return e.status();
    pass_done_ = *std::move(e);
  }
  if (absl::Status s = pass_done_.Record(device_->stream()); !s.ok()) return s;
  // The fan-out in flight moves on while the GPU computes.
  for (;;) {
    absl::StatusOr<bool> done = pass_done_.Done();
    if (!done.ok()) return done.status();
    if (*done) break;
    between();
    std::this_thread::yield();
  }
  if (host == nullptr) return absl::OkStatus();
  const int c = shard_.width;
  for (const Batch& b : batches) {
    if ((b.master >= 0) != masters || b.rows == 0) continue;
    std::memcpy(host + b.offset * c, staging_.data() + b.offset * c,
                static_cast<size_t>(b.rows * c) * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status DeviceExpertInstances::Forward(std::span<const Batch> batches, bool masters,
                                            Slots /*slots*/, float* out,
                                            absl::FunctionRef<void()> between) {
  const int c = shard_.width, f = shard_.hidden;
  const bool on_device = out == out_.data();  // combined on the device (Rows)
  if (absl::Status s = on_device
                           ? absl::OkStatus()
                           : staging_.Reserve(out_.size(), name_ + " expert rows (host staging)");
      !s.ok()) {
    return s;
  }
  for (const Batch& b : batches) {
    if ((b.master >= 0) != masters || b.rows == 0) continue;
    const int rows = static_cast<int>(b.rows);
    const int64_t r0 = b.offset;
    if (absl::Status s = matmul_->Run(
            {.m = rows, .n = 2 * f, .k = c, .lda = c, .ldb = 2 * f, .ldc = 2 * f}, 1.0f,
            in_.data() + r0 * c, W13(b), 0.0f, h13_.data() + r0 * 2 * f, /*rows_vary=*/true);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Check(kernels::SwigluActivation(b.rows, f, h13_.data() + r0 * 2 * f,
                                                         act_.data() + r0 * f, device_->stream()),
                               "SwiGLU");
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            matmul_->Run({.m = rows, .n = c, .k = f, .lda = f, .ldb = c, .ldc = c}, 1.0f,
                         act_.data() + r0 * f, W2(b), 0.0f, out_.data() + r0 * c, true);
        !s.ok()) {
      return s;
    }
    if (on_device) continue;
    if (absl::Status s = Copy(staging_.data() + r0 * c, out_.data() + r0 * c, b.rows * c,
                              cudaMemcpyDeviceToHost, "expert outputs to the host");
        !s.ok()) {
      return s;
    }
  }
  return FinishPass(batches, masters, on_device ? nullptr : out, between);
}

absl::Status DeviceExpertInstances::BeginBackward(const float* dy, int64_t rows) {
  if (absl::Status s = ResizeBackward(rows); !s.ok()) return s;
  if (dy == dy_.data()) return absl::OkStatus();  // dispatched on the device (Rows)
  return Copy(dy_.data(), dy, rows * shard_.width, cudaMemcpyHostToDevice,
              "expert output gradients to the device");
}

absl::Status DeviceExpertInstances::Backward(std::span<const Batch> batches, bool masters,
                                             Slots slots, float* dx,
                                             absl::FunctionRef<void()> between) {
  const int c = shard_.width, f = shard_.hidden;
  const bool on_device = dx == dx_.data();  // combined on the device (Rows)
  if (absl::Status s = on_device
                           ? absl::OkStatus()
                           : staging_.Reserve(dx_.size(), name_ + " expert rows (host staging)");
      !s.ok()) {
    return s;
  }
  // This microbatch's replica gradients start from zero, as the executor's host slots do
  // (zeroed here, after any refetch's SlotsArrived has sized them).
  if (!masters && slot_count_ > 0) {
    if (absl::Status s = slots_->grads.Zero(); !s.ok()) return s;
  }
  for (const Batch& b : batches) {
    if ((b.master >= 0) != masters || b.rows == 0) continue;
    const int rows = static_cast<int>(b.rows);
    const int64_t r0 = b.offset;
    // dW2 += act^T dy; dact = dy W2^T.
    if (absl::Status s =
            matmul_->LinearBackward(rows, f, c, act_.data() + r0 * f, dy_.data() + r0 * c, W2(b),
                                    DW2(b), dact_.data() + r0 * f, false, true);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Check(kernels::SwigluActivationBackward(
                                   b.rows, f, h13_.data() + r0 * 2 * f, dact_.data() + r0 * f,
                                   dh13_.data() + r0 * 2 * f, device_->stream()),
                               "SwiGLU backward");
        !s.ok()) {
      return s;
    }
    // dW13 += x^T dh13; dx = dh13 W13^T.
    if (absl::Status s =
            matmul_->LinearBackward(rows, c, 2 * f, in_.data() + r0 * c, dh13_.data() + r0 * 2 * f,
                                    W13(b), DW13(b), dx_.data() + r0 * c, false, true);
        !s.ok()) {
      return s;
    }
    if (on_device) continue;
    if (absl::Status s = Copy(staging_.data() + r0 * c, dx_.data() + r0 * c, b.rows * c,
                              cudaMemcpyDeviceToHost, "expert row gradients to the host");
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = FinishPass(batches, masters, on_device ? nullptr : dx, between); !s.ok()) {
    return s;
  }
  if (masters) return absl::OkStatus();
  // The replicas' gradients, for the executor to send to their masters (to the host, or into
  // its device buffer: SlotGradients): one wait for all.
  const int64_t n = expert_floats();
  const bool device_grads =
      slots.grads == slots_->outgoing[0].data() || slots.grads == slots_->outgoing[1].data();
  for (const Batch& b : batches) {
    if (b.master >= 0) continue;
    if (absl::Status s = Copy(slots.grads + b.slot * n, slots_->grads.data() + b.slot * n, n,
                              device_grads ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost,
                              "replica gradients for their masters");
        !s.ok()) {
      return s;
    }
  }
  return device_->Synchronize();
}

absl::Status DeviceExpertInstances::AddToMaster(int local, const float* g) {
  const int64_t n = expert_floats(), n13 = 2 * static_cast<int64_t>(shard_.width) * shard_.hidden;
  const float* src = g;  // received on the device (GradientStaging)
  if (!Inside(g, incoming_)) {
    if (absl::Status s = grad_.Resize({n}); !s.ok()) return s;
    if (absl::Status s =
            Copy(grad_.data(), g, n, cudaMemcpyHostToDevice, "a replica gradient to the device");
        !s.ok()) {
      return s;
    }
    src = grad_.data();
  }
  cudaStream_t st = device_->stream();
  if (absl::Status s =
          Check(kernels::AddInPlace(n13, src, shard_.dw13 + local * n13, st), "dW13 add");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Check(
          kernels::AddInPlace(n - n13, src + n13, shard_.dw2 + local * (n13 / 2), st), "dW2 add");
      !s.ok()) {
    return s;
  }
  if (added_.get() == nullptr) {
    absl::StatusOr<Event> e = Event::Create();
    if (!e.ok()) return e.status();
    added_ = *std::move(e);
  }
  return added_.Record(st);
}

}  // namespace rackrun::runtime::cuda
