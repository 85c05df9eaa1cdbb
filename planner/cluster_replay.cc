#include "planner/cluster_replay.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/random.h"

namespace rackrun::planner {
namespace {

// The tokens of the source rank that sends most: its (token, expert) pairs / topk.
int64_t MaxSourceTokens(const LoadMatrix& loads, int topk) {
  int64_t most = 0;
  for (int src = 0; src < loads.ranks; ++src) {
    int64_t row = 0;
    for (int e = 0; e < loads.experts; ++e) row += loads.at(src, e);
    most = std::max(most, row);
  }
  return (most + topk - 1) / topk;
}

StepTime MeanOf(const std::vector<StepTime>& steps) {
  StepTime m;
  if (steps.empty()) return m;
  for (const StepTime& s : steps) {
    m.moe_forward_s += s.moe_forward_s;
    m.moe_backward_s += s.moe_backward_s;
    m.moe_compute_s += s.moe_compute_s;
    m.moe_a2a_s += s.moe_a2a_s;
    m.balancing_s += s.balancing_s;
    m.dense_s += s.dense_s;
    m.last_backward_s += s.last_backward_s;
    m.compute_s += s.compute_s;
    m.allreduce_s += s.allreduce_s;
    m.exposed_allreduce_s += s.exposed_allreduce_s;
    m.total_s += s.total_s;
  }
  const double n = static_cast<double>(steps.size());
  for (double* f : {&m.moe_forward_s, &m.moe_backward_s, &m.moe_compute_s, &m.moe_a2a_s,
                    &m.balancing_s, &m.dense_s, &m.last_backward_s, &m.compute_s, &m.allreduce_s,
                    &m.exposed_allreduce_s, &m.total_s}) {
    *f /= n;
  }
  return m;
}

template <typename T>
void Append(std::vector<T>& to, const std::vector<T>& from) {
  to.insert(to.end(), from.begin(), from.end());
}

}  // namespace

ClusterReplay::ClusterReplay(ReplayOptions replay, ClusterModel model, int topk)
    : options_(std::move(replay)), model_(model), topk_(std::max(topk, 1)) {
  const size_t slots = options_.policies.size() + 1;  // every policy, then the ideal
  for (int d = 0; d < model_.domains; ++d) {
    DomainRun run{Replay(options_), -1, {}, {}, {}};
    run.current.resize(slots);
    run.done.resize(slots);
    domains_.push_back(std::move(run));
  }
}

void ClusterReplay::CloseMicrobatch(DomainRun& run) {
  if (run.current.empty() || run.current[0].layers.empty()) return;
  run.step.push_back(run.current);
  for (MicrobatchLayers& mb : run.current) mb.layers.clear();
  if (static_cast<int>(run.step.size()) < model_.microbatches_per_step) return;
  for (size_t p = 0; p < run.done.size(); ++p) {
    std::vector<MicrobatchLayers> mbs;
    for (std::vector<MicrobatchLayers>& step_mb : run.step) mbs.push_back(std::move(step_mb[p]));
    run.done[p].push_back(StepOfDomain(mbs, model_, options_.hardware));
  }
  run.step.clear();
}

absl::Status ClusterReplay::Add(int domain, const TraceEntry& entry) {
  if (domain < 0 || domain >= model_.domains) {
    return absl::InvalidArgumentError(
        absl::StrCat("domain ", domain, " is out of range; the cluster has ", model_.domains));
  }
  if (shape_ranks_ == 0) {
    shape_ranks_ = entry.loads.ranks;
    shape_experts_ = entry.loads.experts;
  } else if (entry.loads.ranks != shape_ranks_ || entry.loads.experts != shape_experts_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "domain ", domain, ", microbatch ", entry.microbatch, ": loads of ", entry.loads.ranks,
        " ranks x ", entry.loads.experts, " experts, but the first entry had ", shape_ranks_, " x ",
        shape_experts_, "; every domain has the same shape"));
  }
  DomainRun& run = domains_[static_cast<size_t>(domain)];
  if (absl::Status s = run.replay.Add(entry); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("domain ", domain, ": ", s.message()));
  }
  const Replay::LastEntry& last = run.replay.last();
  if (!last.measured) return absl::OkStatus();
  if (entry.microbatch != run.microbatch) {
    CloseMicrobatch(run);
    run.microbatch = entry.microbatch;
  }
  const int64_t tokens = MaxSourceTokens(entry.loads, topk_);
  for (size_t p = 0; p < run.current.size(); ++p) {
    MicrobatchLayers& mb = run.current[p];
    mb.layers.push_back(p < last.policies.size() ? last.policies[p] : last.ideal);
    mb.max_rank_tokens = tokens;
  }
  return absl::OkStatus();
}

absl::Status ClusterReplay::Finish() {
  size_t steps = 0;
  for (size_t d = 0; d < domains_.size(); ++d) {
    DomainRun& run = domains_[d];
    CloseMicrobatch(run);
    const int64_t measured = static_cast<int64_t>(run.replay.measured_microbatches());
    if (!run.step.empty() || run.done[0].empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "domain ", d, " measured ", measured,
          " microbatches, not a whole number (at least 1) of steps of microbatches_per_step ",
          model_.microbatches_per_step));
    }
    if (d == 0) steps = run.done[0].size();
    if (run.done[0].size() != steps) {
      return absl::InvalidArgumentError(absl::StrCat("domain ", d, " measured ", run.done[0].size(),
                                                     " steps, domain 0 ", steps,
                                                     "; every domain needs as many"));
    }
  }
  reduce_ = GradientReduceTime(model_, options_.hardware, domains_[0].replay.domain().ranks);
  steps_.clear();
  const size_t slots = options_.policies.size() + 1;
  for (size_t p = 0; p < slots; ++p) {
    PolicySteps ps;
    ps.policy = p < options_.policies.size() ? options_.policies[p] : std::string("ideal step");
    for (size_t s = 0; s < steps; ++s) {
      std::vector<StepTime> of_domains;
      for (const DomainRun& run : domains_) of_domains.push_back(run.done[p][s]);
      ps.steps.push_back(JobStep(of_domains, reduce_, model_));
    }
    ps.mean = MeanOf(ps.steps);
    steps_.push_back(std::move(ps));
  }
  return absl::OkStatus();
}

std::vector<PolicyReplay> ClusterReplay::Merged() const {
  std::vector<PolicyReplay> merged = domains_[0].replay.results();
  for (size_t d = 1; d < domains_.size(); ++d) {
    const std::vector<PolicyReplay>& more = domains_[d].replay.results();
    for (size_t p = 0; p < merged.size() && p < more.size(); ++p) {
      PolicyReplay& m = merged[p];
      const PolicyReplay& r = more[p];
      Append(m.before, r.before);
      Append(m.after, r.after);
      Append(m.replicas, r.replicas);
      Append(m.fanout_bytes, r.fanout_bytes);
      Append(m.direct_ms, r.direct_ms);
      Append(m.relay_ms, r.relay_ms);
      Append(m.percent, r.percent);
      Append(m.solve_us, r.solve_us);
      m.replacement_bytes += r.replacement_bytes;
      m.layer_s += r.layer_s;
      m.ideal_s += r.ideal_s;
      m.parts.dispatch_s += r.parts.dispatch_s;
      m.parts.exposed_fanout_s += r.parts.exposed_fanout_s;
      m.parts.compute_s += r.parts.compute_s;
      m.parts.combine_s += r.parts.combine_s;
      m.parts.replacement_s += r.parts.replacement_s;
      m.plan_hash = base::SplitMix64(m.plan_hash ^ r.plan_hash);
    }
  }
  return merged;
}

}  // namespace rackrun::planner
