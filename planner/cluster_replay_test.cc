#include "planner/cluster_replay.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/generate.h"
#include "planner/planner.h"
#include "planner/simulator.h"

namespace rackrun::planner {
namespace {

using ::testing::HasSubstr;

GeneratorOptions Small(uint64_t seed) {
  GeneratorOptions g;
  g.ranks = 8;
  g.experts = 32;
  g.topk = 4;
  g.tokens_per_rank = 512;
  g.imbalance = 1.5;
  g.microbatches = 4;
  g.layers = 2;
  g.seed = seed;
  return g;
}

std::vector<TraceEntry> Entries(const GeneratorOptions& g) {
  absl::StatusOr<LoadGenerator> generator = LoadGenerator::Create(g);
  EXPECT_TRUE(generator.ok()) << generator.status();
  absl::StatusOr<std::vector<TraceEntry>> entries = generator->GenerateAll();
  EXPECT_TRUE(entries.ok()) << entries.status();
  return *std::move(entries);
}

ReplayOptions Options() {
  ReplayOptions o;
  o.policies = {"ultraep", "eplb", "none"};
  o.planner.eplb_window = 2;
  o.planner.eplb_interval = 2;
  absl::StatusOr<HardwareModel> hw = HardwarePreset("h200-nvl72");
  EXPECT_TRUE(hw.ok()) << hw.status();
  o.hardware = *hw;
  o.planner.expert_bytes = o.hardware.expert_bytes();
  return o;
}

ClusterModel Model(int domains) {
  ClusterModel m;
  m.domains = domains;
  m.microbatches_per_step = 2;
  return m;
}

TEST(ClusterReplayTest, OneDomainIsTheReplay) {
  const std::vector<TraceEntry> entries = Entries(Small(3));
  Replay plain(Options());
  ClusterReplay cluster(Options(), Model(1), 4);
  for (const TraceEntry& e : entries) {
    ASSERT_TRUE(plain.Add(e).ok());
    ASSERT_TRUE(cluster.Add(0, e).ok());
  }
  ASSERT_TRUE(cluster.Finish().ok());
  const std::vector<PolicyReplay> merged = cluster.Merged();
  ASSERT_EQ(merged.size(), plain.results().size());
  for (size_t p = 0; p < merged.size(); ++p) {
    const PolicyReplay& a = merged[p];
    const PolicyReplay& b = plain.results()[p];
    EXPECT_EQ(a.plan_hash, b.plan_hash) << a.policy;
    EXPECT_EQ(a.after, b.after);
    EXPECT_EQ(a.percent, b.percent);
    EXPECT_DOUBLE_EQ(a.layer_s, b.layer_s);
    EXPECT_DOUBLE_EQ(a.ideal_s, b.ideal_s);
    EXPECT_EQ(a.replacement_bytes, b.replacement_bytes);
  }
  // One domain: no scale-out traffic, only the dense all-reduce inside the rack.
  EXPECT_EQ(cluster.reduce().dense_scaleout_s, 0);
  EXPECT_EQ(cluster.reduce().expert_scaleout_s, 0);
  EXPECT_GT(cluster.reduce().dense_scaleup_s, 0);
}

TEST(ClusterReplayTest, StepsAddUpTheDomainsLayers) {
  // Two domains with their own streams; 4 microbatches = 2 steps of 2.
  ClusterReplay cluster(Options(), Model(2), 4);
  std::vector<std::vector<TraceEntry>> streams;
  for (int d = 0; d < 2; ++d) streams.push_back(Entries(Small(DomainSeed(3, d))));
  for (size_t i = 0; i < streams[0].size(); ++i) {
    for (int d = 0; d < 2; ++d) ASSERT_TRUE(cluster.Add(d, streams[d][i]).ok());
  }
  ASSERT_TRUE(cluster.Finish().ok());
  ASSERT_EQ(cluster.steps().size(), 4u);  // three policies and the ideal
  EXPECT_EQ(cluster.steps().back().policy, "ideal step");
  const PolicySteps& ultraep = cluster.steps()[0];
  const PolicySteps& none = cluster.steps()[2];
  ASSERT_EQ(ultraep.steps.size(), 2u);
  // Every domain planned every entry itself: as many solves in each domain.
  EXPECT_EQ(cluster.domain(0).results()[0].solve_us.size(), 8u);
  EXPECT_EQ(cluster.domain(1).results()[0].solve_us.size(), 8u);
  // The domains' loads differ (independent streams).
  EXPECT_NE(cluster.domain(0).results()[0].plan_hash, cluster.domain(1).results()[0].plan_hash);

  // The job's step is the slower domain's: recompute it from the domains' layer sums.
  // Balancing shortens compute; nothing beats the ideal; the all-reduce is the same.
  const StepTime& ideal = cluster.steps().back().mean;
  EXPECT_LT(ultraep.mean.moe_compute_s, none.mean.moe_compute_s);
  EXPECT_LE(ideal.total_s, ultraep.mean.total_s);
  EXPECT_LE(ideal.total_s, none.mean.total_s);
  EXPECT_DOUBLE_EQ(ultraep.mean.allreduce_s, none.mean.allreduce_s);
  EXPECT_GT(cluster.reduce().expert_scaleout_s, 0);
  for (const StepTime& s : ultraep.steps) {
    EXPECT_DOUBLE_EQ(s.total_s, s.compute_s + s.exposed_allreduce_s);
    EXPECT_DOUBLE_EQ(s.compute_s, s.moe_compute_s + s.moe_a2a_s + s.balancing_s + s.dense_s);
  }
  // none moves no weights.
  EXPECT_EQ(none.mean.balancing_s, 0);

  // The merged figures hold both domains' entries.
  EXPECT_EQ(cluster.Merged()[0].after.size(), 16u);
}

TEST(ClusterReplayTest, StepOfOneDomainMatchesStepOfDomain) {
  // With one domain, the job's step is StepOfDomain over the layer times Replay reported,
  // plus the exposed all-reduce.
  const std::vector<TraceEntry> entries = Entries(Small(5));
  Replay plain(Options());
  ClusterReplay cluster(Options(), Model(1), 4);
  std::vector<MicrobatchLayers> mbs(2);
  for (size_t i = 0; i < 4; ++i) {  // the first 2 microbatches
    ASSERT_TRUE(plain.Add(entries[i]).ok());
    ASSERT_TRUE(cluster.Add(0, entries[i]).ok());
    MicrobatchLayers& mb = mbs[i / 2];
    mb.layers.push_back(plain.last().policies[2]);  // none
    int64_t most = 0;
    for (int src = 0; src < 8; ++src) {
      int64_t row = 0;
      for (int e = 0; e < 32; ++e) row += entries[i].loads.at(src, e);
      most = std::max(most, row);
    }
    mb.max_rank_tokens = (most + 3) / 4;
  }
  ASSERT_TRUE(cluster.Finish().ok());
  const StepTime expected = JobStep({StepOfDomain(mbs, Model(1), Options().hardware)},
                                    GradientReduceTime(Model(1), Options().hardware, 8), Model(1));
  ASSERT_EQ(cluster.steps()[2].steps.size(), 1u);
  EXPECT_DOUBLE_EQ(cluster.steps()[2].steps[0].total_s, expected.total_s);
  EXPECT_DOUBLE_EQ(cluster.steps()[2].steps[0].dense_s, expected.dense_s);
}

TEST(ClusterReplayTest, Errors) {
  const std::vector<TraceEntry> entries = Entries(Small(3));
  {
    ClusterReplay cluster(Options(), Model(2), 4);
    absl::Status s = cluster.Add(2, entries[0]);
    EXPECT_THAT(std::string(s.message()), HasSubstr("domain 2 is out of range"));
  }
  {
    // 3 measured microbatches are not whole steps of 2.
    ClusterReplay cluster(Options(), Model(1), 4);
    for (size_t i = 0; i < 6; ++i) ASSERT_TRUE(cluster.Add(0, entries[i]).ok());
    absl::Status s = cluster.Finish();
    EXPECT_THAT(std::string(s.message()), HasSubstr("measured 3 microbatches, not a whole number"));
  }
  {
    // Domains of different shapes, whichever domain comes first.
    GeneratorOptions small = Small(3);
    small.ranks = 4;
    small.experts = 16;
    const TraceEntry other = Entries(small)[0];
    for (int first : {0, 1}) {
      ClusterReplay cluster(Options(), Model(2), 4);
      ASSERT_TRUE(cluster.Add(first, entries[0]).ok());
      absl::Status s = cluster.Add(1 - first, other);
      EXPECT_THAT(std::string(s.message()),
                  HasSubstr("but the first entry had 8 x 32; every domain has the same shape"));
    }
  }
  {
    // A domain that measured fewer steps.
    ClusterReplay cluster(Options(), Model(2), 4);
    for (const TraceEntry& e : entries) ASSERT_TRUE(cluster.Add(0, e).ok());
    for (size_t i = 0; i < 4; ++i) ASSERT_TRUE(cluster.Add(1, entries[i]).ok());
    absl::Status s = cluster.Finish();
    EXPECT_THAT(std::string(s.message()), HasSubstr("domain 1 measured 1 steps, domain 0 2"));
  }
}

}  // namespace
}  // namespace rackrun::planner
