// The GPU MoE layer's host-side permutation (runtime/cuda/expert_permutation.h) against the
// CPU expert-parallel path's layout of the same plan (comm::TokenDispatch) and against the
// stable counting sort the device computes (kernels::SlotRows). Runs without a GPU.
#include "runtime/cuda/expert_permutation.h"

#include <random>
#include <vector>

#include "comm/token_dispatch.h"
#include "gtest/gtest.h"
#include "planner/planner.h"

namespace rackrun::runtime::cuda {
namespace {

// Skewed routing: tokens x top_k distinct experts per token, expert e drawn with weight
// 1 / (e + 1).
std::vector<int32_t> Routing(int64_t tokens, int top_k, int experts, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> weight;
  for (int e = 0; e < experts; ++e) weight.push_back(1.0 / (e + 1));
  std::discrete_distribution<int> pick(weight.begin(), weight.end());
  std::vector<int32_t> selected;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> mine;
    while (static_cast<int>(mine.size()) < top_k) {
      const int e = pick(rng);
      if (std::find(mine.begin(), mine.end(), e) == mine.end()) mine.push_back(e);
    }
    selected.insert(selected.end(), mine.begin(), mine.end());
  }
  return selected;
}

planner::LoadMatrix LoadsOf(int ranks, int experts, const std::vector<std::vector<int32_t>>& sel) {
  planner::LoadMatrix loads(ranks, experts);
  for (int r = 0; r < ranks; ++r) {
    for (int32_t e : sel[static_cast<size_t>(r)]) ++loads.at(r, e);
  }
  return loads;
}

planner::Plan Solve(const std::string& policy, int ranks, int experts, int slots,
                    const planner::LoadMatrix& loads) {
  planner::Domain domain{ranks, experts / ranks, slots};
  absl::StatusOr<std::unique_ptr<planner::Planner>> p =
      planner::MakePlanner(policy, domain, planner::PlannerOptions{});
  EXPECT_TRUE(p.ok()) << p.status();
  absl::StatusOr<planner::Plan> plan = (*p)->Solve(loads, 0);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *plan;
}

TEST(ExpertPermutationTest, OneRankIsTheStableSortByExpertAndMatchesTokenDispatch) {
  const int experts = 16, top_k = 2;
  const int64_t tokens = 500;
  const std::vector<int32_t> sel = Routing(tokens, top_k, experts, 3);
  const planner::LoadMatrix loads = LoadsOf(1, experts, {sel});
  const planner::Plan plan = Solve("none", 1, experts, 0, loads);
  absl::StatusOr<ExpertPermutation> p = PermuteByPlan(plan, loads, sel);
  ASSERT_TRUE(p.ok()) << p.status();

  // The stable counting sort (what SlotRows computes from the counts' prefix sums).
  std::vector<int64_t> offsets(experts + 1, 0);
  for (int32_t e : sel) ++offsets[static_cast<size_t>(e) + 1];
  for (int e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1), sorted(sel.size());
  for (size_t c = 0; c < sel.size(); ++c) sorted[c] = cursor[static_cast<size_t>(sel[c])]++;
  EXPECT_EQ(p->row_of_choice, sorted);
  for (size_t c = 0; c < sel.size(); ++c) {
    EXPECT_EQ(p->choice_of_row[static_cast<size_t>(p->row_of_choice[c])], static_cast<int64_t>(c));
  }

  // The CPU expert-parallel layout of the same plan: the same batches, and every choice in
  // the batch of the instance TokenDispatch assigns it.
  absl::StatusOr<comm::TokenDispatch> d =
      comm::TokenDispatch::Create(plan, loads, 0, comm::TokenRouting{tokens, top_k, sel});
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(p->batches.size(), d->local_batches().size());
  for (size_t b = 0; b < p->batches.size(); ++b) {
    const comm::TokenDispatch::LocalBatch& want = d->local_batches()[b];
    EXPECT_EQ(p->batches[b],
              (ExpertBatch{want.instance, want.expert, want.master, want.offset, want.rows}));
    EXPECT_EQ(p->batches[b].offset, offsets[static_cast<size_t>(want.expert)]);
  }
  for (size_t c = 0; c < sel.size(); ++c) {
    const int64_t row = p->row_of_choice[c];
    int batch = 0;
    while (p->batches[static_cast<size_t>(batch)].offset +
               p->batches[static_cast<size_t>(batch)].rows <=
           row) {
      ++batch;
    }
    EXPECT_EQ(p->batches[static_cast<size_t>(batch)].instance, d->choice_instance()[c]);
  }
}

// Several ranks: every rank's batches are TokenDispatch's local batches for that rank
// (ultraep replicates the hot experts, so instances carry parts of several sources).
TEST(ExpertPermutationTest, BatchesOfEveryRankMatchTokenDispatch) {
  const int ranks = 4, experts = 16, top_k = 2;
  const int64_t tokens = 300;
  std::vector<std::vector<int32_t>> sel;
  for (int r = 0; r < ranks; ++r) sel.push_back(Routing(tokens, top_k, experts, 10 + r));
  const planner::LoadMatrix loads = LoadsOf(ranks, experts, sel);
  const planner::Plan plan = Solve("ultraep", ranks, experts, 2, loads);
  ASSERT_GT(plan.num_replicas(), 0);
  for (int r = 0; r < ranks; ++r) {
    absl::StatusOr<std::vector<ExpertBatch>> got = PlanBatches(plan, loads, r);
    ASSERT_TRUE(got.ok()) << got.status();
    absl::StatusOr<comm::TokenDispatch> d = comm::TokenDispatch::Create(
        plan, loads, r, comm::TokenRouting{tokens, top_k, sel[static_cast<size_t>(r)]});
    ASSERT_TRUE(d.ok()) << d.status();
    ASSERT_EQ(got->size(), d->local_batches().size()) << "rank " << r;
    for (size_t b = 0; b < got->size(); ++b) {
      const comm::TokenDispatch::LocalBatch& want = d->local_batches()[b];
      EXPECT_EQ((*got)[b],
                (ExpertBatch{want.instance, want.expert, want.master, want.offset, want.rows}))
          << "rank " << r << " batch " << b;
    }
  }
  // The whole permutation needs tokens on other GPUs: refused, saying so.
  absl::StatusOr<ExpertPermutation> p = PermuteByPlan(plan, loads, sel[0]);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnimplemented);
}

TEST(ExpertPermutationTest, RoutingThatIsNotThePlansIsRefusedNamingTheExpert) {
  const int experts = 4;
  const std::vector<int32_t> sel = {0, 1, 1, 2, 3, 3};
  const planner::LoadMatrix loads = LoadsOf(1, experts, {sel});
  const planner::Plan plan = Solve("none", 1, experts, 0, loads);
  std::vector<int32_t> other = {0, 1, 2, 2, 3, 3};
  absl::StatusOr<ExpertPermutation> p = PermuteByPlan(plan, loads, other);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("expert 1"), std::string::npos) << p.status();
  std::vector<int32_t> out_of_range = {0, 1, 1, 2, 3, 4};
  EXPECT_EQ(PermuteByPlan(plan, loads, out_of_range).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanBatches(plan, loads, 1).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rackrun::runtime::cuda
