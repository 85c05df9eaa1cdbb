#include "runtime/cuda/engine.h"

#include <algorithm>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/cuda/device.h"
#include "runtime/cuda/gemm.h"
#include "runtime/cuda/model.h"
#include "runtime/cuda/optimizer.h"
#include "runtime/cuda/span_copy.h"

namespace rackrun::runtime::cuda {
namespace {

class GpuEngine final : public DeviceEngine {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceEngine>> Create(const DeviceEngineSetup& setup);

  std::string Describe() const override { return describe_; }

  absl::Status LoadState(Model<float>& model, AdamW& adam) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    if (absl::Status s = model_->CopyFromHost(model); !s.ok()) return s;
    std::vector<std::span<const float>> m, v;
    for (size_t i = 0; i < adam.tensors().size(); ++i) {
      m.emplace_back(adam.first_moment(i));
      v.emplace_back(adam.second_moment(i));
    }
    if (absl::Status s = adam_->CopyMomentsFrom(m, v); !s.ok()) return s;
    adam_->set_step(adam.step());
    return absl::OkStatus();
  }

  absl::Status StoreState(Model<float>& model, AdamW& adam) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    if (absl::Status s = model_->CopyToHost(model); !s.ok()) return s;
    std::vector<std::span<float>> m, v;
    for (size_t i = 0; i < adam.tensors().size(); ++i) {
      m.emplace_back(adam.first_moment(i));
      v.emplace_back(adam.second_moment(i));
    }
    if (absl::Status s = adam_->CopyMomentsTo(m, v); !s.ok()) return s;
    adam.set_step(adam_->step());
    return absl::OkStatus();
  }

  absl::Status ZeroGrad() override {
    if (absl::Status s = Current(); !s.ok()) return s;
    // A new step: marks left from evaluations since the last one are dropped.
    (void)model_->clock().Collect();
    model_->clock().Mark(Phase::kOther);
    return model_->ZeroGrad();
  }

  absl::StatusOr<double> ForwardBackward(std::span<const int32_t> inputs,
                                         std::span<const int32_t> targets, int batch,
                                         std::span<const int32_t> segment_starts,
                                         float grad_scale) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    return model_->ForwardBackward(inputs, targets, batch, segment_starts, grad_scale);
  }

  absl::StatusOr<double> Evaluate(std::span<const int32_t> inputs, std::span<const int32_t> targets,
                                  int batch, std::span<const int32_t> segment_starts) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    return model_->Evaluate(inputs, targets, batch, segment_starts);
  }

  const std::vector<std::vector<int64_t>>& expert_counts() const override {
    return model_->expert_counts();
  }
  double aux_loss() const override { return model_->aux_loss(); }

  absl::StatusOr<double> GradNorm(double clip) override {
    model_->clock().Mark(Phase::kOptimizer);
    clip_on_device_ = true;
    double norm = 0;
    if (absl::Status s = adam_->GradNorm(clip, &norm); !s.ok()) return s;
    return norm;
  }

  absl::Status OptimizerStep(double lr) override {
    model_->clock().Mark(Phase::kOptimizer);
    if (absl::Status s = adam_->Step(lr, clip_on_device_); !s.ok()) return s;
    absl::StatusOr<PhaseTimes> times = model_->clock().Collect();
    if (!times.ok()) return times.status();
    last_ = *times;
    return absl::OkStatus();
  }

  std::vector<ExpertParallelGroup::Layer> ExpertParallelLayers(bool shared_slots) override {
    return model_->ExpertParallelLayers(shared_slots);
  }

  absl::Status StoreGradients(Model<float>& model) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    return model_->GradientsToHost(model);
  }

  absl::Status LoadGradients(Model<float>& model) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    clip_on_device_ = false;
    return model_->GradientsFromHost(model);
  }

  bool reduces_gradients_on_device() const override { return true; }

  absl::StatusOr<std::span<float>> PackGradients(std::span<const size_t> tensors) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    absl::StatusOr<Packing*> p = PackingOf(tensors);
    if (!p.ok()) return p.status();
    if (absl::Status s = (*p)->pack->Run(); !s.ok()) return s;
    // The channel reads and writes the buffer on a stream of its own.
    if (absl::Status s = device_->Synchronize(); !s.ok()) return s;
    last_packed_ = *p;
    return std::span<float>((*p)->buffer.data(), static_cast<size_t>((*p)->pack->floats()));
  }

  absl::Status UnpackGradients(std::span<const size_t> tensors) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    if (last_packed_ == nullptr ||
        !std::equal(tensors.begin(), tensors.end(), last_packed_->tensors.begin(),
                    last_packed_->tensors.end())) {
      return absl::InvalidArgumentError(
          absl::StrCat("unpacking the gradients of ", tensors.size(),
                       " tensors: not the tensors of the last PackGradients"));
    }
    return last_packed_->unpack->Run();
  }

  absl::StatusOr<std::vector<double>> GradSquares() override {
    if (absl::Status s = Current(); !s.ok()) return s;
    model_->clock().Mark(Phase::kOptimizer);
    std::vector<double> squares;
    if (absl::Status s = adam_->TensorSquares(&squares); !s.ok()) return s;
    return squares;
  }

  absl::Status ScaleGradients(double scale) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    clip_on_device_ = true;
    return adam_->SetClipFactor(scale);
  }

  absl::StatusOr<DeviceStepStats> StepStats() override {
    DeviceStepStats st;
    st.device = absl::StrCat(device_->info().name, " (cuda:", device_->index(), ")");
    const AllocatorStats a = device_->allocator().stats();
    st.memory_in_use_bytes = a.in_use_bytes;
    st.memory_peak_bytes = a.peak_in_use_bytes;
    st.memory_peak_requested_bytes = a.peak_requested_bytes;
    st.memory_reserved_bytes = a.reserved_bytes;
    st.memory_total_bytes = device_->info().total_bytes;
    for (int p = 0; p < kPhases; ++p) st.phase_ms[static_cast<size_t>(p)] = last_[p];
    return st;
  }

  std::vector<std::pair<std::string, int64_t>> MemoryPeakBlocks() override {
    std::vector<std::pair<std::string, int64_t>> blocks;
    for (CachingAllocator::NamedBlock& b : device_->allocator().PeakBlocks())
      blocks.emplace_back(std::move(b.what), b.bytes);
    return blocks;
  }

 private:
  explicit GpuEngine(std::unique_ptr<Device> device) : device_(std::move(device)) {}

  // One list of tensors PackGradients packs (the trainer asks the same one or two lists every
  // step: the dense tensors, and the experts' across domains): its buffer and the two copies,
  // each one launch, built at the list's first pack.
  struct Packing {
    std::vector<size_t> tensors;
    DeviceTensor<float> buffer;
    std::unique_ptr<SpanCopy> pack, unpack;
  };

  // The packing of `tensors` (indices into params_), built at its first use; InvalidArgument
  // naming a bad index.
  absl::StatusOr<Packing*> PackingOf(std::span<const size_t> tensors) {
    for (const std::unique_ptr<Packing>& p : packings_) {
      if (std::equal(tensors.begin(), tensors.end(), p->tensors.begin(), p->tensors.end())) {
        return p.get();
      }
    }
    auto p =
        std::make_unique<Packing>(Packing{{tensors.begin(), tensors.end()},
                                          DeviceTensor<float>(device_.get(), "packed gradients"),
                                          nullptr,
                                          nullptr});
    int64_t floats = 0;
    for (const size_t i : tensors) {
      if (i >= params_.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "gradient tensor ", i, " asked of a model of ", params_.size(), " parameters"));
      }
      floats += params_[i].size;
    }
    if (absl::Status s = p->buffer.Resize({std::max<int64_t>(floats, 1)}); !s.ok()) return s;
    std::vector<kernels::CopySpan> pack, unpack;
    int64_t at = 0;
    for (const size_t i : tensors) {
      const ParamRef<float>& t = params_[i];
      pack.push_back({t.grad, p->buffer.data() + at, t.size});
      unpack.push_back({p->buffer.data() + at, t.grad, t.size});
      at += t.size;
    }
    absl::StatusOr<std::unique_ptr<SpanCopy>> packer =
        SpanCopy::Create(device_.get(), "packing gradients", std::move(pack));
    if (!packer.ok()) return packer.status();
    absl::StatusOr<std::unique_ptr<SpanCopy>> unpacker =
        SpanCopy::Create(device_.get(), "unpacking gradients", std::move(unpack));
    if (!unpacker.ok()) return unpacker.status();
    p->pack = *std::move(packer);
    p->unpack = *std::move(unpacker);
    packings_.push_back(std::move(p));
    return packings_.back().get();
  }
  // The engine's GPU is the calling thread's (a worker creates the trainer on one thread
  // and may run it on another).
  absl::Status Current() const {
    return CudaCheck(cudaSetDevice(device_->index()), "selecting the job's GPU");
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<GpuModel> model_;
  std::unique_ptr<DeviceAdamW> adam_;
  std::vector<ParamRef<float>> params_;             // the device model's, in the host model's order
  std::vector<std::unique_ptr<Packing>> packings_;  // PackGradients' lists and buffers
  Packing* last_packed_ = nullptr;
  std::string describe_;
  PhaseTimes last_{};
  // OptimizerStep scales by the factor of the last GradNorm (one rank), or applies the
  // gradients as LoadGradients gave them (the host clipped them: several ranks).
  bool clip_on_device_ = true;
};

absl::StatusOr<std::unique_ptr<DeviceEngine>> GpuEngine::Create(const DeviceEngineSetup& setup) {
  if (setup.spec == nullptr || setup.model == nullptr) {
    return absl::InvalidArgumentError("GPU engine: no spec or host model");
  }
  const std::string& name = setup.spec->model().precision();
  absl::StatusOr<GemmPrecision> precision = ParseGemmPrecision(name.empty() ? "fp32" : name);
  if (!precision.ok()) return precision.status();
  absl::StatusOr<std::unique_ptr<Device>> device =
      Device::Open(setup.device.GpuFor(setup.local_rank));
  if (!device.ok()) return device.status();
  std::unique_ptr<GpuEngine> e(new GpuEngine(*std::move(device)));
  absl::StatusOr<std::unique_ptr<GpuModel>> model =
      GpuModel::Create(e->device_.get(), *setup.model, *precision);
  if (!model.ok()) return model.status();
  e->model_ = *std::move(model);
  e->params_ = e->model_->Parameters();
  std::vector<DeviceOptimizedTensor> tensors;
  for (const ParamRef<float>& p : e->params_) {
    tensors.push_back({p.name, p.value, p.grad, p.size, DecaysWeight(p.name)});
  }
  absl::StatusOr<std::unique_ptr<DeviceAdamW>> adam =
      DeviceAdamW::Create(e->device_.get(), setup.adamw, std::move(tensors));
  if (!adam.ok()) return adam.status();
  e->adam_ = *std::move(adam);
  e->describe_ = absl::StrCat(e->device_->info().name, " (cuda:", e->device_->index(), "), ",
                              GemmPrecisionName(*precision));
  return std::unique_ptr<DeviceEngine>(std::move(e));
}

}  // namespace

DeviceEngineFactory GpuEngineFactory() { return &GpuEngine::Create; }

}  // namespace rackrun::runtime::cuda
