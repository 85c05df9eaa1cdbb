#include "runtime/cuda/optimizer.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"

namespace rackrun::runtime::cuda {

DeviceAdamW::DeviceAdamW(Device* device, AdamWConfig config,
                         std::vector<DeviceOptimizedTensor> tensors)
    : device_(device),
      config_(config),
      tensors_(std::move(tensors)),
      moments_(device, "AdamW moments"),
      chunk_tensor_(device, "AdamW chunk table"),
      chunk_start_(device, "AdamW chunk starts"),
      table_(device, "AdamW tensor table"),
      partial_(device, "gradient norm partials"),
      norm_(device, "gradient norm"),
      scale_(device, "gradient scale") {}

absl::StatusOr<std::unique_ptr<DeviceAdamW>> DeviceAdamW::Create(
    Device* device, AdamWConfig config, std::vector<DeviceOptimizedTensor> tensors) {
  std::unique_ptr<DeviceAdamW> a(new DeviceAdamW(device, config, std::move(tensors)));
  if (absl::Status s = a->Init(); !s.ok()) return s;
  return a;
}

absl::Status DeviceAdamW::Init() {
  int64_t total = 0;
  std::vector<int32_t> chunk_tensor;
  std::vector<int64_t> chunk_start;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    moment_offset_.push_back(total);
    total += 2 * tensors_[i].size;
    for (int64_t s = 0; s < tensors_[i].size; s += kernels::kChunk) {
      chunk_tensor.push_back(static_cast<int32_t>(i));
      chunk_start.push_back(s);
    }
  }
  chunks_ = static_cast<int64_t>(chunk_tensor.size());
  chunk_tensor_host_ = chunk_tensor;
  const int64_t table_ints =
      static_cast<int64_t>(tensors_.size() * sizeof(kernels::AdamTensor) / sizeof(int32_t)) + 1;
  for (absl::Status s :
       {moments_.Resize({std::max<int64_t>(total, 1)}),
        chunk_tensor_.Resize({std::max<int64_t>(chunks_, 1)}),
        chunk_start_.Resize({std::max<int64_t>(chunks_, 1)}), table_.Resize({table_ints}),
        partial_.Resize({std::max<int64_t>(chunks_, 1)}), norm_.Resize({1}), scale_.Resize({1})}) {
    if (!s.ok()) return s;
  }
  if (absl::Status s = moments_.Zero(); !s.ok()) return s;
  if (chunks_ > 0) {
    if (absl::Status s = chunk_tensor_.CopyFrom(chunk_tensor); !s.ok()) return s;
    if (absl::Status s = chunk_start_.CopyFrom(chunk_start); !s.ok()) return s;
  }
  const std::vector<float> one = {1.0f};
  if (absl::Status s = scale_.CopyFrom(one); !s.ok()) return s;
  if (absl::Status s = UploadTable(); !s.ok()) return s;
  return device_->Synchronize();
}

absl::Status DeviceAdamW::UploadTable() {
  std::vector<kernels::AdamTensor> table;
  float* m = moments_.data();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const DeviceOptimizedTensor& t = tensors_[i];
    kernels::AdamTensor a;
    a.value = t.value;
    a.grad = t.grad;
    a.m = m + moment_offset_[i];
    a.v = m + moment_offset_[i] + t.size;
    a.size = t.size;
    a.decay = t.decay ? 1 : 0;
    table.push_back(a);
  }
  // Staged by CUDA before the call returns (pageable memory); Init waits for it.
  return CudaCheck(
      cudaMemcpyAsync(table_.data(), table.data(), table.size() * sizeof(kernels::AdamTensor),
                      cudaMemcpyHostToDevice, device_->stream()),
      "AdamW table");
}

absl::Status DeviceAdamW::GradNorm(double clip, double* norm) {
  const auto* table = reinterpret_cast<const kernels::AdamTensor*>(table_.data());
  if (absl::Status s = CudaCheck(
          kernels::GradNormAndClip(static_cast<int>(tensors_.size()), table, chunks_,
                                   chunk_tensor_.data(), chunk_start_.data(), partial_.data(), clip,
                                   norm_.data(), scale_.data(), device_->stream()),
          "gradient norm");
      !s.ok()) {
    return s;
  }
  if (norm == nullptr) return absl::OkStatus();
  std::vector<double> host;
  if (absl::Status s = norm_.CopyTo(&host); !s.ok()) return s;
  *norm = host[0];
  return absl::OkStatus();
}

absl::Status DeviceAdamW::TensorSquares(std::vector<double>* squares) {
  squares->assign(tensors_.size(), 0.0);
  if (chunks_ == 0) return absl::OkStatus();
  const auto* table = reinterpret_cast<const kernels::AdamTensor*>(table_.data());
  if (absl::Status s =
          CudaCheck(kernels::GradSquares(table, chunks_, chunk_tensor_.data(), chunk_start_.data(),
                                         partial_.data(), device_->stream()),
                    "gradient squares");
      !s.ok()) {
    return s;
  }
  std::vector<double> partial;
  if (absl::Status s = partial_.CopyTo(&partial); !s.ok()) return s;
  for (int64_t q = 0; q < chunks_; ++q) {
    (*squares)[static_cast<size_t>(chunk_tensor_host_[static_cast<size_t>(q)])] +=
        partial[static_cast<size_t>(q)];
  }
  return absl::OkStatus();
}

absl::Status DeviceAdamW::SetClipFactor(double scale) {
  const std::vector<float> factor = {static_cast<float>(scale)};
  return scale_.CopyFrom(factor);
}

absl::Status DeviceAdamW::Step(double lr, bool use_clip_factor) {
  ++step_;
  const double bias1 = 1.0 - std::pow(config_.beta1, static_cast<double>(step_));
  const double bias2 = 1.0 - std::pow(config_.beta2, static_cast<double>(step_));
  const auto* table = reinterpret_cast<const kernels::AdamTensor*>(table_.data());
  return CudaCheck(
      kernels::AdamWStep(
          static_cast<int>(tensors_.size()), table, chunks_, chunk_tensor_.data(),
          chunk_start_.data(), static_cast<float>(config_.beta1), static_cast<float>(config_.beta2),
          static_cast<float>(lr / bias1), static_cast<float>(1.0 / std::sqrt(bias2)),
          static_cast<float>(config_.eps), static_cast<float>(1.0 - lr * config_.weight_decay),
          use_clip_factor ? scale_.data() : nullptr, device_->stream()),
      "AdamW step");
}

absl::Status DeviceAdamW::MomentsToHost(size_t i, std::vector<float>* m, std::vector<float>* v) {
  if (i >= tensors_.size()) return absl::InvalidArgumentError("no such tensor");
  std::vector<float> all;
  if (absl::Status s = moments_.CopyTo(&all); !s.ok()) return s;
  const int64_t o = moment_offset_[i], n = tensors_[i].size;
  m->assign(all.begin() + o, all.begin() + o + n);
  v->assign(all.begin() + o + n, all.begin() + o + 2 * n);
  return absl::OkStatus();
}

absl::Status DeviceAdamW::CopyMomentsTo(const std::vector<std::span<float>>& m,
                                        const std::vector<std::span<float>>& v) {
  if (m.size() != tensors_.size() || v.size() != tensors_.size()) {
    return absl::InvalidArgumentError("AdamW moments: one span per tensor wanted");
  }
  std::vector<float> all;
  if (absl::Status s = moments_.CopyTo(&all); !s.ok()) return s;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const int64_t o = moment_offset_[i], n = tensors_[i].size;
    if (static_cast<int64_t>(m[i].size()) != n || static_cast<int64_t>(v[i].size()) != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("AdamW moments of ", tensors_[i].name, ": ", n, " values wanted"));
    }
    std::copy_n(all.begin() + o, n, m[i].begin());
    std::copy_n(all.begin() + o + n, n, v[i].begin());
  }
  return absl::OkStatus();
}

absl::Status DeviceAdamW::CopyMomentsFrom(const std::vector<std::span<const float>>& m,
                                          const std::vector<std::span<const float>>& v) {
  if (m.size() != tensors_.size() || v.size() != tensors_.size()) {
    return absl::InvalidArgumentError("AdamW moments: one span per tensor wanted");
  }
  std::vector<float> all(static_cast<size_t>(moments_.size()), 0.0f);
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const int64_t o = moment_offset_[i], n = tensors_[i].size;
    if (static_cast<int64_t>(m[i].size()) != n || static_cast<int64_t>(v[i].size()) != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("AdamW moments of ", tensors_[i].name, ": ", n, " values wanted"));
    }
    std::copy_n(m[i].begin(), n, all.begin() + o);
    std::copy_n(v[i].begin(), n, all.begin() + o + n);
  }
  if (absl::Status s = moments_.CopyFrom(all); !s.ok()) return s;
  return device_->Synchronize();
}

}  // namespace rackrun::runtime::cuda
