// Expert-parallel MoE layers on 2 and 4 in-process ranks against one unsharded layer:
// outputs, input gradients and every parameter gradient agree for every policy, replicas
// really run, and faults are reported with the rank, layer and microbatch; a pass prepared
// before its rows arrive is the same pass.
#include "runtime/expert_parallel.h"

#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/inprocess_channel.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/expert_instances.h"
#include "runtime/expert_parallel_testing.h"
#include "runtime/layers/moe.h"
#include "runtime/plan_source.h"

namespace rackrun::runtime {
namespace {

using ep_testing::ExpectNear;
using ep_testing::Result;

using ::testing::HasSubstr;

constexpr int kWidth = 16;
constexpr int kExperts = 8;
constexpr int kTopK = 2;
constexpr int kHidden = 12;
constexpr int kTokens = 96;  // global tokens per microbatch
constexpr int kPasses = 3;   // microbatches, gradients accumulate over them

MoeLayerConfig Config(int ranks, int rank) {
  MoeLayerConfig c;
  c.width = kWidth;
  c.experts = kExperts;
  c.top_k = kTopK;
  c.expert_hidden = kHidden;
  c.aux_loss_coef = 0.05;  // its gradient uses the counts over all ranks
  c.local_experts = kExperts / ranks;
  c.expert_first = rank * c.local_experts;
  return c;
}

// Deterministic pseudo-random values in [-scale, scale).
std::vector<float> Uniform(size_t n, uint64_t seed, float scale, float offset = 0) {
  std::vector<float> v(n);
  uint64_t x = seed * 0x9e3779b97f4a7c15ULL + 1;
  for (float& f : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    f = offset + scale * (static_cast<float>(x >> 40) / static_cast<float>(1 << 24) * 2 - 1);
  }
  return v;
}

// Same initial weights on every shard, then a router that sends most tokens to experts 0
// and 1 (both homed on rank 0): the load the balancer has to move.
void InitSkewed(MoeLayer<float>& layer) {
  NormalInit rng(7);
  layer.Init(rng, 0.3, 0.3);
  ParamRef<float> router = layer.Parameters()[1];  // [C x E]
  for (int i = 0; i < kWidth; ++i) {
    router.value[i * kExperts + 0] += 0.4f;
    router.value[i * kExperts + 1] += 0.25f;
  }
}

std::vector<float> Input(int pass) {
  return Uniform(static_cast<size_t>(kTokens) * kWidth, 100 + pass, 1.0f, 0.3f);
}
std::vector<float> Upstream(int pass) {
  return Uniform(static_cast<size_t>(kTokens) * kWidth, 200 + pass, 1.0f);
}

// The microbatches every test here runs (ep_testing::RunPasses).
const ep_testing::Passes& TestPasses() {
  static const ep_testing::Passes* const p =
      new ep_testing::Passes{kTokens, kWidth, kPasses, &Input, &Upstream};
  return *p;
}

Result Reference() {
  MoeLayer<float> layer(Config(1, 0), "m");
  InitSkewed(layer);
  Result r;
  ep_testing::RunPasses(TestPasses(), layer, 0, kTokens, nullptr, r);
  return r;
}

std::vector<Result> RunExpertParallel(int ranks, const ExpertParallelOptions& options,
                                      absl::Duration timeout = absl::Seconds(20)) {
  std::vector<Result> results(static_cast<size_t>(ranks));
  comm::ChannelOptions channel_options;
  channel_options.timeout = timeout;
  const absl::Status run =
      comm::RunInProcessRanks(ranks, channel_options, [&](comm::DataChannel& channel) {
        omp_set_num_threads(1);
        const int rank = channel.rank();
        Result& r = results[static_cast<size_t>(rank)];
        MoeLayer<float> layer(Config(ranks, rank), "m");
        InitSkewed(layer);
        absl::StatusOr<std::unique_ptr<ExpertParallelGroup>> group =
            ExpertParallelGroup::Create(channel, {&layer}, options);
        if (!group.ok()) {
          r.status = group.status();
          return r.status;
        }
        const int rows = kTokens / ranks;
        ep_testing::RunPasses(TestPasses(), layer, rank * rows, rows, group->get(), r);
        r.stats = (*group)->stats();
        return r.status;
      });
  (void)run;  // per-rank statuses are checked by the callers
  return results;
}

class ExpertParallelTest : public ::testing::TestWithParam<ep_testing::RanksPolicySlots> {};

TEST_P(ExpertParallelTest, MatchesTheUnshardedLayer) {
  const auto [ranks, policy, shared_slots] = GetParam();
  const Result ref = Reference();
  ASSERT_TRUE(ref.status.ok()) << ref.status;
  ep_testing::ExpectRanksMatchReference(
      TestPasses(), RunExpertParallel(ranks, ep_testing::OptionsFor(policy, shared_slots)), ref,
      policy, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(RanksAndPolicies, ExpertParallelTest, ep_testing::RanksPolicySlotsValues(),
                         ep_testing::RanksPolicySlotsName);

TEST(ExpertParallelGroupTest, RerunsAreBitIdentical) {
  ExpertParallelOptions options;
  options.policy = "ultraep";
  const std::vector<Result> a = RunExpertParallel(4, options);
  const std::vector<Result> b = RunExpertParallel(4, options);
  for (int rank = 0; rank < 4; ++rank) {
    ASSERT_TRUE(a[static_cast<size_t>(rank)].status.ok());
    EXPECT_EQ(a[static_cast<size_t>(rank)].out, b[static_cast<size_t>(rank)].out);
    EXPECT_EQ(a[static_cast<size_t>(rank)].du, b[static_cast<size_t>(rank)].du);
    EXPECT_EQ(a[static_cast<size_t>(rank)].grads, b[static_cast<size_t>(rank)].grads);
  }
}

TEST(ExpertParallelGroupTest, EplbKeepsReplicasCurrentWithoutRefanning) {
  // EPLB keeps a placement for eplb_interval microbatches; no optimizer step runs in
  // between (WeightsChanged), so the slots stay current and no fan-out is repeated.
  ExpertParallelOptions options;
  options.policy = "eplb";
  options.planner.eplb_window = 4;
  options.planner.eplb_interval = 2;
  const std::vector<Result> r = RunExpertParallel(2, options);
  ASSERT_TRUE(r[0].status.ok()) << r[0].status;
  EXPECT_GE(r[0].stats.fanouts + r[0].stats.fanouts_skipped, kPasses);
  EXPECT_GT(r[0].stats.fanouts_skipped, 0);
}

TEST(ExpertParallelGroupTest, SharedSlotsAreFetchedAgainForBackward) {
  // Three MoE layers on one set of replica slots, run F0 F1 F2 B2 B1 B0: later forwards take
  // the slots, so layers 1 and 0 fan their replicas out again in backward, and layer 0
  // reuses layer 2's gradient buffer. Everything still equals the unsharded layers.
  constexpr int kRanks = 2;
  constexpr int kLayers = 3;
  const float scale = 0.5f;
  std::vector<Result> ref(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    MoeLayer<float> layer(Config(1, 0), "m");
    InitSkewed(layer);
    const std::vector<float> u = Input(10 * l), dout = Upstream(10 * l);
    ref[l].out.resize(u.size());
    ref[l].du.resize(u.size());
    ASSERT_TRUE(layer.Forward(u.data(), kTokens, ref[l].out.data()).ok());
    ASSERT_TRUE(layer.Backward(dout.data(), scale, ref[l].du.data()).ok());
    for (const ParamRef<float>& p : layer.Parameters())
      ref[l].grads.emplace_back(p.grad, p.grad + p.size);
  }
  std::vector<std::vector<Result>> got(kRanks, std::vector<Result>(kLayers));
  std::vector<ExpertParallelStats> stats(kRanks);
  const int rows = kTokens / kRanks;
  const absl::Status run = comm::RunInProcessRanks(kRanks, {}, [&](comm::DataChannel& ch) {
    omp_set_num_threads(1);
    const int rank = ch.rank();
    std::vector<std::unique_ptr<MoeLayer<float>>> layers;
    for (int l = 0; l < kLayers; ++l) {
      layers.push_back(std::make_unique<MoeLayer<float>>(Config(kRanks, rank), "m"));
      InitSkewed(*layers.back());
    }
    ExpertParallelOptions options;
    options.policy = "ultraep";
    options.share_slots = true;
    std::vector<MoeLayer<float>*> raw;
    for (auto& l : layers) raw.push_back(l.get());
    absl::StatusOr<std::unique_ptr<ExpertParallelGroup>> group =
        ExpertParallelGroup::Create(ch, raw, options);
    if (!group.ok()) return group.status();
    (*group)->BeginMicrobatch(0, true);
    std::vector<std::vector<float>> u(kLayers), dout(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      u[l] = Input(10 * l);
      dout[l] = Upstream(10 * l);
      Result& r = got[rank][l];
      r.out.resize(static_cast<size_t>(rows) * kWidth);
      r.du.resize(r.out.size());
      absl::Status s = layers[l]->Forward(u[l].data() + static_cast<size_t>(rank) * rows * kWidth,
                                          rows, r.out.data());
      if (!s.ok()) return s;
    }
    for (int l = kLayers - 1; l >= 0; --l) {
      Result& r = got[rank][l];
      absl::Status s =
          layers[l]->Backward(dout[l].data() + static_cast<size_t>(rank) * rows * kWidth,
                              scale * static_cast<float>(rows) / kTokens, r.du.data());
      if (!s.ok()) return s;
    }
    if (absl::Status s = (*group)->FinishMicrobatch(); !s.ok()) return s;
    for (int l = 0; l < kLayers; ++l) {
      for (const ParamRef<float>& p : layers[l]->Parameters()) {
        got[rank][l].grads.emplace_back(p.grad, p.grad + p.size);
      }
    }
    stats[rank] = (*group)->stats();
    return absl::OkStatus();
  });
  ASSERT_TRUE(run.ok()) << run;
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> out, du, w13, w2;
    std::vector<float> router(ref[l].grads[1].size(), 0.0f);
    for (int rank = 0; rank < kRanks; ++rank) {
      const Result& r = got[rank][l];
      out.insert(out.end(), r.out.begin(), r.out.end());
      du.insert(du.end(), r.du.begin(), r.du.end());
      w13.insert(w13.end(), r.grads[2].begin(), r.grads[2].end());
      w2.insert(w2.end(), r.grads[3].begin(), r.grads[3].end());
      for (size_t i = 0; i < router.size(); ++i) router[i] += r.grads[1][i];
    }
    const std::string layer = " of layer " + std::to_string(l);
    ExpectNear(out, ref[l].out, 1e-5, "output" + layer);
    ExpectNear(du, ref[l].du, 1e-5, "input gradient" + layer);
    ExpectNear(router, ref[l].grads[1], 1e-5, "router gradient" + layer);
    ExpectNear(w13, ref[l].grads[2], 1e-5, "expert w13 gradient" + layer);
    ExpectNear(w2, ref[l].grads[3], 1e-5, "expert w2 gradient" + layer);
  }
  // Layers 0 and 1 had replicas and lost the slots to later layers: their backward fetched
  // them again.
  EXPECT_GT(stats[0].layers[0].replicas, 0);
  EXPECT_GT(stats[0].layers[1].replicas, 0);
  EXPECT_GE(stats[0].refetches, 2);
}

TEST(ExpertParallelGroupTest, PlanPhaseSaysHowLongItWaitedInTheLoadExchange) {
  // Rank 1 reaches the MoE layer 150 ms after rank 0: rank 0's plan phase is then almost
  // all load exchange (the allgather waits for rank 1), and the exchange is part of plan_s.
  constexpr double kLate = 0.15;
  std::vector<ExpertParallelStats> stats(2);
  const absl::Status run = comm::RunInProcessRanks(2, {}, [&](comm::DataChannel& ch) {
    omp_set_num_threads(1);
    MoeLayer<float> layer(Config(2, ch.rank()), "m");
    InitSkewed(layer);
    ExpertParallelOptions options;
    options.policy = "ultraep";
    absl::StatusOr<std::unique_ptr<ExpertParallelGroup>> group =
        ExpertParallelGroup::Create(ch, {&layer}, options);
    if (!group.ok()) return group.status();
    (*group)->BeginMicrobatch(0, true);
    const int rows = kTokens / 2;
    const std::vector<float> u = Input(0);
    std::vector<float> out(static_cast<size_t>(rows) * kWidth);
    if (ch.rank() == 1) std::this_thread::sleep_for(std::chrono::duration<double>(kLate));
    absl::Status s =
        layer.Forward(u.data() + static_cast<size_t>(ch.rank()) * rows * kWidth, rows, out.data());
    if (!s.ok()) return s;
    stats[static_cast<size_t>(ch.rank())] = (*group)->stats();
    return absl::OkStatus();
  });
  ASSERT_TRUE(run.ok()) << run;
  EXPECT_GE(stats[0].plan_exchange_s, 0.8 * kLate);
  for (const ExpertParallelStats& st : stats) {
    EXPECT_GT(st.plan_exchange_s, 0);
    EXPECT_LE(st.plan_exchange_s, st.plan_s);
  }
  // Rank 1 arrived last: it did not wait for rank 0.
  EXPECT_LT(stats[1].plan_exchange_s, stats[0].plan_exchange_s);
}

TEST(ExpertParallelGroupTest, PlanDisagreementNamesRankLayerAndMicrobatch) {
  // In band the fingerprints ride in the next load exchange: microbatch 1's plan is
  // compared when microbatch 2 exchanges its loads.
  ExpertParallelOptions options;
  options.policy = "ultraep";
  const ScopedFaultInjection fault(*FaultInjection::Parse("plan_hash:rank=1,layer=0,microbatch=1"));
  const std::vector<Result> r = RunExpertParallel(2, options);
  for (int rank = 0; rank < 2; ++rank) {
    const absl::Status& s = r[static_cast<size_t>(rank)].status;
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("ranks disagree on the plan of MoE layer 0, microbatch 1"));
    EXPECT_THAT(std::string(s.message()), HasSubstr("rank 1 solved fingerprint"));
    EXPECT_THAT(std::string(s.message()), HasSubstr("MoE layer 0, microbatch 2, comparing"));
  }
}

// Plans from a source that exchanges nothing among the ranks (as the coordinator's): the
// in-band planner behind an interface that does not carry fingerprints.
class NonCarryingSource final : public PlanSource {
 public:
  explicit NonCarryingSource(std::unique_ptr<InBandPlanSource> inner) : inner_(std::move(inner)) {}
  const char* name() const override { return "test"; }
  absl::Status Solve(const Request& request, planner::LoadMatrix* loads,
                     planner::Plan* plan) override {
    return inner_->Solve(request, loads, plan);
  }

 private:
  std::unique_ptr<InBandPlanSource> inner_;
};

TEST(ExpertParallelGroupTest, PlanDisagreementFromANonCarryingSourceIsFoundAtOnce) {
  // Three layers; rank 1's plan of layer 1 in microbatch 0 disagrees. A carrying source
  // finds it at layer 2; a source that carries nothing compares after every solve.
  const ScopedFaultInjection fault(*FaultInjection::Parse("plan_hash:rank=1,layer=1,microbatch=0"));
  for (const bool carrying : {true, false}) {
    std::vector<absl::Status> status(2);
    const absl::Status run = comm::RunInProcessRanks(2, {}, [&](comm::DataChannel& ch) {
      omp_set_num_threads(1);
      std::vector<std::unique_ptr<MoeLayer<float>>> layers;
      std::vector<MoeLayer<float>*> raw;
      for (int l = 0; l < 3; ++l) {
        layers.push_back(std::make_unique<MoeLayer<float>>(Config(2, ch.rank()), "m"));
        InitSkewed(*layers.back());
        raw.push_back(layers.back().get());
      }
      ExpertParallelOptions options;
      options.policy = "ultraep";
      std::unique_ptr<NonCarryingSource> source;
      if (!carrying) {
        planner::Domain domain{2, kExperts / 2, options.slots};
        absl::StatusOr<std::unique_ptr<InBandPlanSource>> inner =
            InBandPlanSource::Create(ch, domain, options.policy, options.planner);
        if (!inner.ok()) return inner.status();
        source = std::make_unique<NonCarryingSource>(*std::move(inner));
        options.plan_source = source.get();
      }
      absl::StatusOr<std::unique_ptr<ExpertParallelGroup>> group =
          ExpertParallelGroup::Create(ch, raw, options);
      if (!group.ok()) return group.status();
      (*group)->BeginMicrobatch(0, true);
      const int rows = kTokens / 2;
      const std::vector<float> u = Input(0);
      std::vector<float> out(static_cast<size_t>(rows) * kWidth);
      absl::Status s;
      for (int l = 0; l < 3 && s.ok(); ++l) {
        s = layers[static_cast<size_t>(l)]->Forward(
            u.data() + static_cast<size_t>(ch.rank()) * rows * kWidth, rows, out.data());
      }
      status[static_cast<size_t>(ch.rank())] = s;
      return absl::OkStatus();
    });
    ASSERT_TRUE(run.ok()) << run;
    for (const absl::Status& s : status) {
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr("rank 1 solved fingerprint"));
      if (carrying) {
        EXPECT_THAT(std::string(s.message()), HasSubstr("MoE layer 2, microbatch 0"));
        EXPECT_THAT(std::string(s.message()), HasSubstr("the plan of MoE layer 1, microbatch 0"));
      } else {
        EXPECT_THAT(std::string(s.message()), HasSubstr("MoE layer 1, microbatch 0"));
        EXPECT_THAT(std::string(s.message()), HasSubstr("ranks disagree on the plan: rank 1"));
      }
    }
  }
}

TEST(ExpertParallelGroupTest, BadSetupsAreNamed) {
  comm::ChannelOptions channel_options;
  const absl::Status run = comm::RunInProcessRanks(2, channel_options, [](comm::DataChannel& ch) {
    MoeLayer<float> whole(Config(1, 0), "m");  // all experts: not a shard of 2 ranks
    absl::StatusOr<std::unique_ptr<ExpertParallelGroup>> g =
        ExpertParallelGroup::Create(ch, {&whole}, {});
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(g.status().message()), HasSubstr("not rank"));
    MoeLayer<float> shard(Config(2, ch.rank()), "m");
    ExpertParallelOptions options;
    options.policy = "fastest";  // no such policy
    g = ExpertParallelGroup::Create(ch, {&shard}, options);
    EXPECT_THAT(std::string(g.status().message()), HasSubstr("balancer.policy"));
    return absl::OkStatus();
  });
  EXPECT_TRUE(run.ok()) << run;
}

// A pass prepared first (PrepareForward / PrepareBackward, as the GPU layer does while its
// rows travel) computes what the same pass preparing itself computes, bit for bit; a Forward
// over other rows than the prepared ones is refused on every rank, before any exchange.
TEST(ExpertParallelGroupTest, APreparedPassIsTheSamePass) {
  comm::ChannelOptions channel_options;
  channel_options.timeout = absl::Seconds(20);
  const absl::Status run = comm::RunInProcessRanks(2, channel_options, [](comm::DataChannel& ch) {
    omp_set_num_threads(1);
    MoeLayer<float> layer(Config(2, ch.rank()), "m");
    InitSkewed(layer);
    std::unique_ptr<ExpertExecutor<float>> executor;
    std::vector<ExpertParallelGroup::Layer> layers;
    layers.push_back(
        {layer.config(), std::make_unique<HostExpertInstances>(&layer.experts()),
         [&executor](std::unique_ptr<ExpertExecutor<float>> e) { executor = std::move(e); }});
    ExpertParallelOptions options;
    options.policy = "ultraep";
    absl::StatusOr<std::unique_ptr<ExpertParallelGroup>> group =
        ExpertParallelGroup::Create(ch, std::move(layers), options);
    if (!group.ok()) return group.status();
    // Rows grouped by expert, most of them for experts 0 and 1 (rank 0's): replicas run.
    std::vector<int64_t> offsets = {0};
    for (int e = 0; e < kExperts; ++e) offsets.push_back(offsets.back() + (e < 2 ? 20 : 3));
    const size_t n = static_cast<size_t>(offsets.back()) * kWidth;
    const std::vector<float> rows = Uniform(n, 50 + ch.rank(), 1.0f);
    const std::vector<float> dout = Uniform(n, 60 + ch.rank(), 1.0f);
    std::vector<float> out[2], dx[2];
    for (int pass = 0; pass < 2; ++pass) {
      (*group)->BeginMicrobatch(pass, /*training=*/true);
      out[pass].assign(n, 0.0f);
      dx[pass].assign(n, 0.0f);
      if (pass == 1) {
        EXPECT_TRUE(executor->PrepareForward(offsets).ok());
      }
      if (absl::Status s = executor->Forward(offsets, rows.data(), out[pass].data()); !s.ok()) {
        return s;
      }
      if (pass == 1) {
        EXPECT_TRUE(executor->PrepareBackward().ok());
      }
      if (absl::Status s = executor->Backward(offsets, dout.data(), dx[pass].data()); !s.ok()) {
        return s;
      }
      if (absl::Status s = (*group)->FinishMicrobatch(); !s.ok()) return s;
    }
    EXPECT_EQ(out[0], out[1]) << "rank " << ch.rank();
    EXPECT_EQ(dx[0], dx[1]) << "rank " << ch.rank();
    EXPECT_GT((*group)->stats().layers[0].replicas, 0);
    (*group)->BeginMicrobatch(2, /*training=*/true);
    EXPECT_TRUE(executor->PrepareForward(offsets).ok());
    std::vector<int64_t> fewer = offsets;
    fewer.back() -= 1;
    const absl::Status s = executor->Forward(fewer, rows.data(), out[0].data());
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat("over ", offsets.back() - 1,
                                                                 " rows after PrepareForward "
                                                                 "over ",
                                                                 offsets.back())));
    executor.reset();  // before its group
    return absl::OkStatus();
  });
  EXPECT_TRUE(run.ok()) << run;
}

}  // namespace
}  // namespace rackrun::runtime
