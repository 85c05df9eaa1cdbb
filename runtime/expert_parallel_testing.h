// Shared by the expert-parallel layer tests, runtime/expert_parallel_test.cc (CPU ranks) and
// runtime/cuda/expert_parallel_test.cc (ranks sharing a GPU): one rank's results, the
// microbatches run through a CPU MoE layer, and the check of every rank's results against the
// unsharded layer's. Test code only (it includes gtest).
#ifndef RACKRUN_RUNTIME_EXPERT_PARALLEL_TESTING_H_
#define RACKRUN_RUNTIME_EXPERT_PARALLEL_TESTING_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "runtime/expert_parallel.h"
#include "runtime/layers/moe.h"

namespace rackrun::runtime::ep_testing {

// One rank's (or the unsharded layer's) results over the passes.
struct Result {
  std::vector<float> out, du;             // [passes x rows x C], this rank's rows
  std::vector<std::vector<float>> grads;  // per parameter: norm, router, w13, w2 (the shard's)
  ExpertParallelStats stats;
  absl::Status status;
};

// The microbatches: `passes` of `tokens` global rows of width `width`, pass p's inputs and
// output gradients (tokens x width each) from input(p) and upstream(p).
struct Passes {
  int tokens = 0;
  int width = 0;
  int passes = 0;
  std::function<std::vector<float>(int)> input, upstream;
};

// Runs the passes on rows [row0, row0 + rows) of `layer` (`group`: its expert-parallel group,
// or null for the unsharded layer), then the parameter gradients into r.grads. The aux loss's
// gradient scale is this rank's share of the tokens (as the trainer scales it), so the ranks'
// aux gradients add up to the whole batch's. Stops at the first error (in r.status).
inline void RunPasses(const Passes& p, MoeLayer<float>& layer, int row0, int rows,
                      ExpertParallelGroup* group, Result& r) {
  const float grad_scale = 0.5f * static_cast<float>(rows) / static_cast<float>(p.tokens);
  const size_t at = static_cast<size_t>(row0) * static_cast<size_t>(p.width);
  for (int pass = 0; pass < p.passes; ++pass) {
    const std::vector<float> u = p.input(pass), dout = p.upstream(pass);
    std::vector<float> out(static_cast<size_t>(rows) * static_cast<size_t>(p.width)),
        du(out.size());
    if (group != nullptr) group->BeginMicrobatch(pass, /*training=*/true);
    r.status = layer.Forward(u.data() + at, rows, out.data());
    if (!r.status.ok()) return;
    r.status = layer.Backward(dout.data() + at, grad_scale, du.data());
    if (!r.status.ok()) return;
    r.out.insert(r.out.end(), out.begin(), out.end());
    r.du.insert(r.du.end(), du.begin(), du.end());
  }
  // Earlier passes' replica gradients were completed by the next pass's Forward; the last
  // one's here.
  if (group != nullptr) {
    r.status = group->FinishMicrobatch();
    if (!r.status.ok()) return;
  }
  for (const ParamRef<float>& param : layer.Parameters()) {
    r.grads.emplace_back(param.grad, param.grad + param.size);
  }
}

// Largest difference relative to the tensor's largest magnitude (a NaN counts as infinite):
// elements that are small results of cancelling sums (input gradients) carry the
// reassociation error of their terms, so a per-element relative error would measure the
// cancellation, not a bug.
inline void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, double tol,
                       const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0, scale = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
    double d = std::abs(static_cast<double>(got[i]) - want[i]);
    if (std::isnan(d)) d = std::numeric_limits<double>::infinity();
    if (d > worst) {
      worst = d;
      at = i;
    }
  }
  EXPECT_LE(worst, tol * scale) << what << " differs at " << at << ": " << got[at] << " vs "
                                << want[at] << " (largest magnitude " << scale << ")";
}

// The options the rank-vs-reference tests run: `policy` with 2 slots, shared or per layer,
// EPLB re-placing every microbatch.
inline ExpertParallelOptions OptionsFor(const std::string& policy, bool shared_slots) {
  ExpertParallelOptions options;
  options.policy = policy;
  options.slots = 2;
  options.share_slots = shared_slots;
  options.planner.eplb_window = 1;
  options.planner.eplb_interval = 1;
  return options;
}

// Their parameters: ranks (2, 4) x policy (none, ultraep, eplb) x shared slots, and the
// test names ("ultraep_4ranks_shared_slots").
using RanksPolicySlots = std::tuple<int, std::string, bool>;
inline auto RanksPolicySlotsValues() {
  return ::testing::Combine(::testing::Values(2, 4), ::testing::Values("none", "ultraep", "eplb"),
                            ::testing::Bool());
}
inline std::string RanksPolicySlotsName(const ::testing::TestParamInfo<RanksPolicySlots>& info) {
  return std::get<1>(info.param) + "_" + std::to_string(std::get<0>(info.param)) + "ranks_" +
         (std::get<2>(info.param) ? "shared" : "perlayer") + "_slots";
}

// Every rank's outputs and input gradients against the reference's rows, the ranks' summed
// norm and router gradients (partial sums per rank) and the masters' expert gradients (rank r
// holds experts [r * E/R, (r + 1) * E/R)) against the reference's, within `tol` of each
// array's scale. Unless the policy is none, the balancer replicated and moved work (EPLB only
// after its first microbatch).
inline void ExpectRanksMatchReference(const Passes& p, const std::vector<Result>& results,
                                      const Result& ref, const std::string& policy, double tol) {
  ASSERT_TRUE(ref.status.ok()) << ref.status;
  const int ranks = static_cast<int>(results.size());
  const size_t per_pass = static_cast<size_t>(p.tokens / ranks) * static_cast<size_t>(p.width);
  const auto slice = [](const std::vector<float>& v, size_t at, size_t n) {
    return std::vector<float>(v.begin() + static_cast<std::ptrdiff_t>(at),
                              v.begin() + static_cast<std::ptrdiff_t>(at + n));
  };
  std::vector<std::vector<float>> dense(2), experts(2);
  for (size_t k = 0; k < 2; ++k) dense[k].assign(ref.grads[k].size(), 0.0f);
  int64_t replicas = 0;
  double before = 0, after = 0;
  for (int rank = 0; rank < ranks; ++rank) {
    const Result& r = results[static_cast<size_t>(rank)];
    ASSERT_TRUE(r.status.ok()) << "rank " << rank << ": " << r.status;
    for (int pass = 0; pass < p.passes; ++pass) {
      SCOPED_TRACE(::testing::Message() << "rank " << rank << " pass " << pass);
      const size_t ref_at =
          static_cast<size_t>(pass) * static_cast<size_t>(p.tokens) * static_cast<size_t>(p.width) +
          static_cast<size_t>(rank) * per_pass;
      const size_t at = static_cast<size_t>(pass) * per_pass;
      ExpectNear(slice(r.out, at, per_pass), slice(ref.out, ref_at, per_pass), tol, "output");
      ExpectNear(slice(r.du, at, per_pass), slice(ref.du, ref_at, per_pass), tol, "input gradient");
    }
    for (size_t k = 0; k < 2; ++k) {
      for (size_t i = 0; i < dense[k].size(); ++i) dense[k][i] += r.grads[k][i];
      experts[k].insert(experts[k].end(), r.grads[2 + k].begin(), r.grads[2 + k].end());
    }
    replicas += r.stats.layers[0].replicas;
    before += r.stats.layers[0].imbalance_before;
    after += r.stats.layers[0].imbalance_after;
  }
  ExpectNear(dense[0], ref.grads[0], tol, "norm gain gradient");
  ExpectNear(dense[1], ref.grads[1], tol, "router gradient");
  ExpectNear(experts[0], ref.grads[2], tol, "expert w13 gradient");
  ExpectNear(experts[1], ref.grads[3], tol, "expert w2 gradient");
  if (policy == "none") {
    EXPECT_EQ(replicas, 0);
  } else {
    EXPECT_GT(replicas, 0) << "the skew should have made the balancer replicate";
    EXPECT_LT(after, before);
  }
}

}  // namespace rackrun::runtime::ep_testing

#endif  // RACKRUN_RUNTIME_EXPERT_PARALLEL_TESTING_H_
