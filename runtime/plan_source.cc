#include "runtime/plan_source.h"

#include <algorithm>
#include <cstddef>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/clock.h"

namespace rackrun::runtime {

absl::Status PlanSource::RestoreState(std::string_view state) {
  if (state.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("the ", name(), " plan source keeps no balancer history here"));
}

absl::StatusOr<std::unique_ptr<InBandPlanSource>> InBandPlanSource::Create(
    comm::DataChannel& channel, const planner::Domain& domain, std::string_view policy,
    const planner::PlannerOptions& options) {
  std::unique_ptr<InBandPlanSource> source(new InBandPlanSource(channel));
  for (auto* p : {&source->train_, &source->eval_}) {
    absl::StatusOr<std::unique_ptr<planner::Planner>> planner =
        planner::MakePlanner(policy, domain, options);
    if (!planner.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("balancer.policy: ", planner.status().message()));
    }
    *p = *std::move(planner);
  }
  return source;
}

absl::Status InBandPlanSource::Solve(const Request& request, planner::LoadMatrix* loads,
                                     planner::Plan* plan) {
  const int64_t experts = static_cast<int64_t>(request.local_loads.size());
  const int ranks = channel_.size();
  if (loads->ranks != ranks || loads->experts != experts) {
    *loads = planner::LoadMatrix(ranks, static_cast<int>(experts));
  }
  const size_t words = static_cast<size_t>(experts) + 1;
  row_.resize(words);
  rows_.resize(words * static_cast<size_t>(ranks));
  std::copy(request.local_loads.begin(), request.local_loads.end(), row_.begin());
  row_.back() = static_cast<int64_t>(request.previous_fingerprint);
  const double t0 = base::NowSeconds();
  const absl::Status exchanged = channel_.Allgather(
      row_.data(), rows_.data(), static_cast<int64_t>(words), comm::DataType::kInt64);
  last_exchange_s_ = base::NowSeconds() - t0;
  if (!exchanged.ok()) {
    return absl::Status(exchanged.code(),
                        absl::StrCat("exchanging expert loads: ", exchanged.message()));
  }
  carried_.resize(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    const int64_t* src = rows_.data() + static_cast<size_t>(r) * words;
    std::copy(src, src + experts, loads->counts.begin() + static_cast<ptrdiff_t>(r * experts));
    carried_[static_cast<size_t>(r)] = static_cast<uint64_t>(src[experts]);
  }
  planner::Planner& planner = request.training ? *train_ : *eval_;
  if (absl::Status s = planner.SolveInto(*loads, request.layer, plan); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("planning: ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace rackrun::runtime
