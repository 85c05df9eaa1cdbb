#include "runtime/cuda/phase_clock.h"

#include <utility>

namespace rackrun::runtime::cuda {

const char* PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kGemm:
      return "gemm";
    case Phase::kAttention:
      return "attention";
    case Phase::kStreams:
      return "streams";
    case Phase::kRouting:
      return "routing";
    case Phase::kOptimizer:
      return "optimizer";
    case Phase::kOther:
      return "other";
  }
  return "?";
}

void PhaseClock::Mark(Phase phase) {
  if (!error_.ok()) return;
  if (used_ == events_.size()) {
    absl::StatusOr<Event> e = Event::Create(/*timing=*/true);
    if (!e.ok()) {
      error_ = e.status();
      return;
    }
    events_.push_back(*std::move(e));
    phases_.push_back(phase);
  }
  phases_[used_] = phase;
  if (absl::Status s = events_[used_].Record(device_->stream()); !s.ok()) {
    error_ = s;
    return;
  }
  ++used_;
}

absl::StatusOr<PhaseTimes> PhaseClock::Collect() {
  PhaseTimes times{};
  if (used_ > 0) Mark(Phase::kOther);  // the end of the last phase
  if (!error_.ok()) {
    absl::Status e = std::exchange(error_, absl::OkStatus());
    used_ = 0;
    return e;
  }
  if (used_ > 0) {
    if (absl::Status s = events_[used_ - 1].Synchronize(); !s.ok()) return s;
  }
  for (size_t i = 0; i + 1 < used_; ++i) {
    absl::StatusOr<float> ms = events_[i + 1].ElapsedMs(events_[i]);
    if (!ms.ok()) {
      used_ = 0;
      return ms.status();
    }
    times[static_cast<size_t>(phases_[i])] += *ms;
  }
  used_ = 0;
  return times;
}

}  // namespace rackrun::runtime::cuda
