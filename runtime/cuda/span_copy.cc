#include "runtime/cuda/span_copy.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace rackrun::runtime::cuda {

SpanCopy::SpanCopy(Device* device, std::string name)
    : device_(device),
      name_(std::move(name)),
      spans_(device, name_ + ": span table"),
      chunk_span_(device, name_ + ": chunk spans"),
      chunk_start_(device, name_ + ": chunk starts") {}

absl::StatusOr<std::unique_ptr<SpanCopy>> SpanCopy::Create(Device* device, std::string name,
                                                           std::vector<kernels::CopySpan> spans) {
  std::unique_ptr<SpanCopy> c(new SpanCopy(device, std::move(name)));
  std::vector<int32_t> chunk_span;
  std::vector<int64_t> chunk_start;
  for (size_t i = 0; i < spans.size(); ++i) {
    if (spans[i].size < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(c->name_, ": span ", i, " has a negative size (", spans[i].size, ")"));
    }
    c->floats_ += spans[i].size;
    for (int64_t s = 0; s < spans[i].size; s += kernels::kChunk) {
      chunk_span.push_back(static_cast<int32_t>(i));
      chunk_start.push_back(s);
    }
  }
  c->chunks_ = static_cast<int64_t>(chunk_span.size());
  if (c->chunks_ == 0) return c;
  const int64_t table_ints =
      static_cast<int64_t>(spans.size() * sizeof(kernels::CopySpan) / sizeof(int32_t)) + 1;
  for (absl::Status s : {c->spans_.Resize({table_ints}), c->chunk_span_.Resize({c->chunks_}),
                         c->chunk_start_.Resize({c->chunks_})}) {
    if (!s.ok()) return s;
  }
  // Pageable sources: CUDA stages them before each call returns.
  if (absl::Status s = CudaCheck(
          cudaMemcpyAsync(c->spans_.data(), spans.data(), spans.size() * sizeof(kernels::CopySpan),
                          cudaMemcpyHostToDevice, device->stream()),
          absl::StrCat(c->name_, ": span table"));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = c->chunk_span_.CopyFrom(chunk_span); !s.ok()) return s;
  if (absl::Status s = c->chunk_start_.CopyFrom(chunk_start); !s.ok()) return s;
  return c;
}

absl::Status SpanCopy::Run() {
  const auto* spans = reinterpret_cast<const kernels::CopySpan*>(spans_.data());
  return CudaCheck(kernels::CopySpans(spans, chunks_, chunk_span_.data(), chunk_start_.data(),
                                      device_->stream()),
                   name_);
}

}  // namespace rackrun::runtime::cuda
