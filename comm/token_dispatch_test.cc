// Token dispatch/combine on 1, 2 and 4 in-process ranks: dispatch + expert + combine
// equals computing everything at home, for random hand-built plans and ultraep plans.
#include "comm/token_dispatch.h"

#include <algorithm>
#include <span>
#include <vector>

#include "comm/inprocess_channel.h"
#include "comm/testing/channel_checks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::comm {
namespace {

using ::testing::HasSubstr;

class TokenDispatchTest : public ::testing::TestWithParam<int> {};

TEST_P(TokenDispatchTest, RandomPlansMatchHomeComputation) {
  for (uint64_t seed : {1u, 2u, 3u, 4u, 5u}) {
    absl::Status s = RunInProcessRanks(GetParam(), {}, [&](DataChannel& channel) {
      testing::CheckTokenDispatch(channel, seed, /*use_ultraep=*/false);
      return absl::OkStatus();
    });
    ASSERT_TRUE(s.ok()) << s;
  }
}

TEST_P(TokenDispatchTest, UltraEpPlansMatchHomeComputation) {
  for (uint64_t seed : {11u, 12u, 13u}) {
    absl::Status s = RunInProcessRanks(GetParam(), {}, [&](DataChannel& channel) {
      testing::CheckTokenDispatch(channel, seed, /*use_ultraep=*/true);
      return absl::OkStatus();
    });
    ASSERT_TRUE(s.ok()) << s;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, TokenDispatchTest, ::testing::Values(1, 2, 4),
                         [](const auto& param_info) {
                           return std::to_string(param_info.param) + "ranks";
                         });

// The assignment rule on a small plan worked by hand: expert 0 (home rank 0) has a
// replica on rank 1; rank 0's three choices for expert 0 split 1 (master) + 2 (replica).
TEST(TokenDispatch, AssignsChoicesToInstancesInChoiceOrder) {
  planner::Plan plan;
  plan.ranks = 2;
  plan.experts = 2;
  plan.instances = {{0, 0, true}, {0, 1, false}, {1, 1, true}};
  plan.first = {0, 2, 3};
  // Expert 0 is replicated: columns for instances 0 and 1, split[column * 2 + src].
  ASSERT_EQ(planner::IndexSplitColumns(&plan), 2);
  plan.split = {1, 0,   // master: rank 0 sends 1, rank 1 nothing
                2, 0};  // replica: rank 0 sends 2
  plan.quota = {1, 2, 1};
  planner::LoadMatrix loads(2, 2);  // rank 0: 3 to expert 0, 1 to expert 1 (unreplicated)
  loads.at(0, 0) = 3;
  loads.at(0, 1) = 1;
  TokenRouting routing;
  routing.num_tokens = 2;
  routing.top_k = 2;
  routing.expert = {0, 1, 0, 0};  // choices 0,2,3 -> expert 0; choice 1 -> expert 1
  absl::StatusOr<TokenDispatch> d = TokenDispatch::Create(plan, loads, 0, routing);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->choice_instance(), (std::vector<int>{0, 2, 1, 1}));
  ASSERT_EQ(d->local_batches().size(), 1u);
  EXPECT_EQ(d->local_batches()[0].instance, 0);
  EXPECT_EQ(d->expert_rows(), 1);

  absl::StatusOr<TokenDispatch> d1 = TokenDispatch::Create(plan, loads, 1, TokenRouting{0, 2, {}});
  ASSERT_TRUE(d1.ok()) << d1.status();
  ASSERT_EQ(d1->local_batches().size(), 2u);
  EXPECT_EQ(d1->local_batches()[0].rows, 2);
  EXPECT_EQ(d1->local_batches()[1].offset, 2);
}

// Rows already grouped by expert (as the MoE layer hands them over) give the layout of
// Create with the equivalent routing, without regrouping.
// Grouped rows worked by hand: expert 0 (home rank 0) has a replica on rank 1; rank 0's three
// rows for it split 1 (master) + 2 (replica), rank 1's two go to the master; expert 1 (home
// rank 1) is not replicated. Rank r's rows by expert: GroupedOffsets(r).
struct HandPlan {
  planner::Plan plan;
  planner::LoadMatrix loads{2, 2};
};
HandPlan GroupedHandPlan() {
  HandPlan h;
  planner::Plan& plan = h.plan;
  plan.ranks = 2;
  plan.experts = 2;
  plan.instances = {{0, 0, true}, {0, 1, false}, {1, 1, true}};
  plan.first = {0, 2, 3};
  EXPECT_EQ(planner::IndexSplitColumns(&plan), 2);
  plan.split = {1, 2,   // expert 0's master: rank 0 sends 1, rank 1 sends 2
                2, 0};  // its replica: rank 0 sends 2
  plan.quota = {3, 2, 4};
  h.loads.at(0, 0) = 3;
  h.loads.at(0, 1) = 1;
  h.loads.at(1, 0) = 2;
  h.loads.at(1, 1) = 3;
  return h;
}
std::vector<int64_t> GroupedOffsets(int rank) {
  return rank == 0 ? std::vector<int64_t>{0, 3, 4} : std::vector<int64_t>{0, 2, 5};
}

TEST(TokenDispatch, GroupedRowsLayOutLikeTheirRouting) {
  const HandPlan h = GroupedHandPlan();
  const planner::Plan& plan = h.plan;
  const planner::LoadMatrix& loads = h.loads;
  for (int rank = 0; rank < 2; ++rank) {
    const std::vector<int64_t> offsets = GroupedOffsets(rank);
    TokenRouting routing;
    routing.num_tokens = offsets.back();
    routing.top_k = 1;
    for (int e = 0; e < 2; ++e) {
      for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) routing.expert.push_back(e);
    }
    absl::StatusOr<TokenDispatch> want = TokenDispatch::Create(plan, loads, rank, routing);
    absl::StatusOr<TokenDispatch> got = TokenDispatch::CreateGrouped(plan, loads, rank, offsets);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->choice_instance(), want->choice_instance()) << "rank " << rank;
    EXPECT_EQ(got->expert_rows(), want->expert_rows());
    ASSERT_EQ(got->local_batches().size(), want->local_batches().size());
    for (size_t b = 0; b < got->local_batches().size(); ++b) {
      EXPECT_EQ(got->local_batches()[b].instance, want->local_batches()[b].instance);
      EXPECT_EQ(got->local_batches()[b].rows, want->local_batches()[b].rows);
      EXPECT_EQ(got->local_batches()[b].offset, want->local_batches()[b].offset);
    }
  }
  // Rows that disagree with the plan's split, and malformed offsets, are refused.
  const absl::StatusOr<TokenDispatch> wrong =
      TokenDispatch::CreateGrouped(plan, loads, 0, std::vector<int64_t>{0, 1, 4});
  ASSERT_FALSE(wrong.ok());
  EXPECT_THAT(wrong.status().message(), HasSubstr("routing sends 1 tokens to expert 0"));
  const absl::StatusOr<TokenDispatch> short_offsets =
      TokenDispatch::CreateGrouped(plan, loads, 0, std::vector<int64_t>{0, 3});
  ASSERT_FALSE(short_offsets.ok());
  EXPECT_THAT(short_offsets.status().message(), HasSubstr("offsets has 2 entries"));
}

// A RowMover's own packing, buffers and exchange hook (what runtime/cuda/device_rows.h does on a
// GPU) carry a dispatch and its combine: the same rows as the host's default, and every row of
// both directions passes through the mover.
class RecordingMover final : public RowMover {
 public:
  absl::Status Gather(const float* src, std::span<const int64_t> index, int64_t divisor,
                      int64_t width, float* dst) override {
    for (size_t q = 0; q < index.size(); ++q) {
      std::copy_n(src + index[q] / divisor * width, width, dst + static_cast<int64_t>(q) * width);
    }
    gathered += static_cast<int64_t>(index.size());
    return absl::OkStatus();
  }
  absl::Status Scatter(const float* src, std::span<const int64_t> index, int64_t width,
                       float* dst) override {
    for (size_t q = 0; q < index.size(); ++q) {
      std::copy_n(src + static_cast<int64_t>(q) * width, width, dst + index[q] * width);
    }
    scattered += static_cast<int64_t>(index.size());
    return absl::OkStatus();
  }
  absl::StatusOr<float*> Buffer(int which, int64_t floats) override {
    buffers[which].assign(static_cast<size_t>(floats), -1.0f);
    return buffers[which].data();
  }
  absl::Status BeforeExchange() override {
    ++exchanges;
    return absl::OkStatus();
  }
  std::vector<float> buffers[2];
  int64_t gathered = 0, scattered = 0, exchanges = 0;
};

TEST(TokenDispatch, ARowMoverCarriesDispatchAndCombine) {
  const HandPlan h = GroupedHandPlan();
  constexpr int64_t kWidth = 3;
  const absl::Status s = RunInProcessRanks(2, {}, [&](DataChannel& channel) {
    const int rank = channel.rank();
    const std::vector<int64_t> offsets = GroupedOffsets(rank);
    absl::StatusOr<TokenDispatch> d = TokenDispatch::CreateGrouped(h.plan, h.loads, rank, offsets);
    if (!d.ok()) return d.status();
    std::vector<float> rows(static_cast<size_t>(offsets.back() * kWidth));
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(100 * rank + i);
    const size_t expert_floats = static_cast<size_t>(d->expert_rows() * kWidth);
    std::vector<float> in_host(expert_floats), in_mover(expert_floats);
    RecordingMover mover;
    for (absl::Status step : {d->DispatchChoices(channel, rows, kWidth, in_host),
                              d->DispatchChoices(channel, rows, kWidth, in_mover, &mover)}) {
      if (!step.ok()) return step;
    }
    EXPECT_EQ(in_mover, in_host) << "rank " << rank;
    // The experts: negate; the combine brings each row back to its source.
    for (float& v : in_mover) v = -v;
    std::vector<float> back(rows.size(), 0.0f);
    if (absl::Status step = d->Combine(channel, in_mover, kWidth, back, &mover); !step.ok()) {
      return step;
    }
    for (size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(back[i], -rows[i]) << "rank " << rank;
    EXPECT_EQ(mover.gathered, offsets.back() + d->expert_rows());
    EXPECT_EQ(mover.scattered, d->expert_rows() + offsets.back());
    EXPECT_EQ(mover.exchanges, 2);
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
}

TEST(TokenDispatch, RejectsMalformedInput) {
  planner::Plan plan;
  plan.ranks = 1;
  plan.experts = 1;
  plan.instances = {{0, 0, true}};
  plan.first = {0, 1};
  planner::IndexSplitColumns(&plan);  // unreplicated: the split is the loads
  plan.quota = {2};
  planner::LoadMatrix loads(1, 1);
  loads.at(0, 0) = 2;

  TokenRouting short_routing{2, 1, {0}};
  auto a = TokenDispatch::Create(plan, loads, 0, short_routing);
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(a.status().message(), HasSubstr("routing.expert has 1 entries"));

  TokenRouting out_of_range{2, 1, {0, 3}};
  auto b = TokenDispatch::Create(plan, loads, 0, out_of_range);
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(b.status().message(), HasSubstr("routing.expert[1] = 3"));

  auto c = TokenDispatch::Create(plan, loads, 1, TokenRouting{2, 1, {0, 0}});
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("rank 1"));

  planner::Plan bad_first = plan;
  bad_first.first = {0};
  auto e = TokenDispatch::Create(bad_first, loads, 0, TokenRouting{2, 1, {0, 0}});
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(e.status().message(), HasSubstr("plan.first"));

  // The loads must be the plan's shape, and a sparse split of the wrong size is refused.
  auto f = TokenDispatch::Create(plan, planner::LoadMatrix(1, 2), 0, TokenRouting{2, 1, {0, 0}});
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(f.status().message(), HasSubstr("pass the loads the plan was solved from"));
  planner::Plan bad_split = plan;
  bad_split.split = {2};
  auto g = TokenDispatch::Create(bad_split, loads, 0, TokenRouting{2, 1, {0, 0}});
  ASSERT_FALSE(g.ok());
  EXPECT_THAT(g.status().message(), HasSubstr("plan.split has 1 entries"));

  // Buffer sizes are checked against the layout.
  auto d = TokenDispatch::Create(plan, loads, 0, TokenRouting{2, 1, {0, 0}});
  ASSERT_TRUE(d.ok());
  auto channels = CreateInProcessChannels(1);
  ASSERT_TRUE(channels.ok());
  std::vector<float> x(3), expert_in(4);
  absl::Status s = d->DispatchTokens(*(*channels)[0], x, 2, expert_in);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("x has 3 floats"));
}

TEST(WeightedCombine, RejectsSizeMismatch) {
  std::vector<float> choices(4), weights(2), y(1);
  absl::Status s = WeightedCombine(choices, weights, 1, 2, 2, y);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("WeightedCombine"));
}

}  // namespace
}  // namespace rackrun::comm
