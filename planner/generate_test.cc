#include "planner/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::planner {
namespace {

using ::testing::HasSubstr;

// Home-placement max/mean rank load, computed here from the matrix (not via the library).
double HomeImbalance(const LoadMatrix& m) {
  const int per_rank = m.experts / m.ranks;
  std::vector<double> rank_load(static_cast<size_t>(m.ranks), 0.0);
  double total = 0;
  for (int src = 0; src < m.ranks; ++src) {
    for (int e = 0; e < m.experts; ++e) {
      rank_load[static_cast<size_t>(e / per_rank)] += static_cast<double>(m.at(src, e));
      total += static_cast<double>(m.at(src, e));
    }
  }
  return *std::max_element(rank_load.begin(), rank_load.end()) / (total / m.ranks);
}

GeneratorOptions Ep64(double imbalance) {
  GeneratorOptions o;
  o.ranks = 64;
  o.experts = 256;
  o.topk = 8;
  o.tokens_per_rank = 8192;
  o.imbalance = imbalance;
  o.seed = 7;
  return o;
}

TEST(GenerateTest, ValidateNamesTheField) {
  GeneratorOptions o = Ep64(2);
  o.experts = 100;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("experts is 100"));
  o = Ep64(2);
  o.topk = 0;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("topk is 0"));
  o = Ep64(0.5);
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("imbalance is 0.5"));
  o = Ep64(2);
  o.token_jitter = 1.0;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("token_jitter is 1"));
  o = Ep64(2);
  o.shift_every = 0;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("shift_every is 0"));
  EXPECT_FALSE(LoadGenerator::Create(o).ok());
}

TEST(GenerateTest, LognormalAndSpikeOptionsAreValidated) {
  GeneratorOptions o = Ep64(2);
  o.lognormal_sigma = 0;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("lognormal_sigma is 0"));
  o = Ep64(2);
  o.spike_experts = 300;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("spike_experts is 300"));
  o = Ep64(2);
  o.spike_min = 30;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("spike factors are 30..20"));
  o = Ep64(2);
  o.spike_rate = 1.5;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("spike_rate is 1.5"));
  EXPECT_EQ(*ParsePopularityModel("lognormal"), PopularityModel::kLognormal);
  EXPECT_EQ(PopularityModelName(PopularityModel::kZipf), "zipf");
  EXPECT_THAT(std::string(ParsePopularityModel("pareto").status().message()),
              HasSubstr("use zipf or lognormal"));
}

TEST(GenerateTest, LognormalTailGrowsWithSigmaAndIsDeterministic) {
  double previous = 0;
  for (const double sigma : {0.5, 1.0, 2.0}) {
    GeneratorOptions o = Ep64(1);
    o.popularity = PopularityModel::kLognormal;
    o.lognormal_sigma = sigma;
    absl::StatusOr<LoadGenerator> g = LoadGenerator::Create(o);
    ASSERT_TRUE(g.ok()) << g.status();
    absl::StatusOr<LoadGenerator::Popularity> p = g->ExpectedPopularity(0, 0);
    ASSERT_TRUE(p.ok());
    EXPECT_DOUBLE_EQ(p->exponent, sigma);  // not calibrated
    EXPECT_NEAR(std::accumulate(p->inclusion.begin(), p->inclusion.end(), 0.0), 8.0, 1e-9);
    const LoadMatrix a = g->Generate(0, 0)->loads;
    EXPECT_EQ(a.counts, g->Generate(0, 0)->loads.counts);
    const double imbalance = HomeImbalance(a);
    EXPECT_GT(imbalance, previous) << sigma;
    previous = imbalance;
  }
}

TEST(GenerateTest, SpikesLiftOneToNExpertsInSpikedEntriesOnly) {
  GeneratorOptions o = Ep64(1.5);
  o.microbatches = 40;
  const LoadGenerator plain = *LoadGenerator::Create(o);
  o.spike_experts = 3;
  o.spike_rate = 0.5;
  const LoadGenerator spiky = *LoadGenerator::Create(o);
  int spiked = 0;
  for (int t = 0; t < 40; ++t) {
    const std::vector<double> a = plain.ExpectedPopularity(t, 0)->inclusion;
    const std::vector<double> b = spiky.ExpectedPopularity(t, 0)->inclusion;
    int up = 0;
    for (size_t e = 0; e < a.size(); ++e) {
      // A spike of x5..x20 on the weight: clearly more probable (or capped at 1).
      if (b[e] > 1.5 * a[e] || (b[e] == 1.0 && a[e] < 1.0)) ++up;
    }
    EXPECT_LE(up, 3) << "microbatch " << t;
    if (up > 0) ++spiked;
    if (up == 0) {
      EXPECT_EQ(a, b) << "microbatch " << t;
    }
  }
  EXPECT_GT(spiked, 10);  // about half of 40
  EXPECT_LT(spiked, 30);
}

TEST(GenerateTest, GenerateAllIsMicrobatchMajor) {
  GeneratorOptions o;
  o.ranks = 4;
  o.experts = 16;
  o.topk = 2;
  o.tokens_per_rank = 64;
  o.imbalance = 1.3;
  o.microbatches = 3;
  o.layers = 2;
  absl::StatusOr<LoadGenerator> generator = LoadGenerator::Create(o);
  ASSERT_TRUE(generator.ok()) << generator.status();
  absl::StatusOr<std::vector<TraceEntry>> all = generator->GenerateAll();
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 6u);
  for (size_t i = 0; i < all->size(); ++i) {
    const TraceEntry& e = (*all)[i];
    EXPECT_EQ(e.microbatch, static_cast<int64_t>(i / 2));
    EXPECT_EQ(e.layer, static_cast<int>(i % 2));
    EXPECT_EQ(e.loads.counts, generator->Generate(e.microbatch, e.layer)->loads.counts);
  }
}

TEST(GenerateTest, ParsesLoadShiftNames) {
  EXPECT_EQ(*ParseLoadShift("drift"), LoadShift::kDrift);
  EXPECT_EQ(*ParseLoadShift("jump"), LoadShift::kJump);
  EXPECT_EQ(*ParseLoadShift("none"), LoadShift::kNone);
  EXPECT_THAT(std::string(ParseLoadShift("walk").status().message()), HasSubstr("drift"));
}

TEST(GenerateTest, CalibratesTheExpectedAndRealisedImbalance) {
  for (double target : {1.0, 1.5, 2.0, 3.0}) {
    absl::StatusOr<LoadGenerator> gen = LoadGenerator::Create(Ep64(target));
    ASSERT_TRUE(gen.ok()) << gen.status();
    absl::StatusOr<LoadGenerator::Popularity> p = gen->ExpectedPopularity(0, 0);
    ASSERT_TRUE(p.ok());
    // Expected imbalance from the inclusion probabilities is exact up to bisection.
    double max_rank = 0;
    for (int r = 0; r < 64; ++r) {
      max_rank = std::max(max_rank, std::accumulate(p->inclusion.begin() + 4 * r,
                                                    p->inclusion.begin() + 4 * r + 4, 0.0));
    }
    EXPECT_NEAR(max_rank / (8.0 / 64), target, 1e-6) << target;
    EXPECT_NEAR(std::accumulate(p->inclusion.begin(), p->inclusion.end(), 0.0), 8.0, 1e-9);
    for (double x : p->inclusion) {
      EXPECT_GE(x, 0.0);
      EXPECT_LE(x, 1.0);
    }
    // Sampling noise at 8k tokens per rank is about 1%.
    absl::StatusOr<TraceEntry> entry = gen->Generate(0, 0);
    ASSERT_TRUE(entry.ok());
    EXPECT_NEAR(HomeImbalance(entry->loads), target, 0.04 * target) << target;
  }
}

TEST(GenerateTest, EveryTokenPicksTopkDistinctExperts) {
  GeneratorOptions o = Ep64(3);
  o.token_jitter = 0.25;
  o.layers = 2;
  absl::StatusOr<LoadGenerator> gen = LoadGenerator::Create(o);
  ASSERT_TRUE(gen.ok()) << gen.status();
  absl::StatusOr<TraceEntry> l0 = gen->Generate(4, 0);
  absl::StatusOr<TraceEntry> l1 = gen->Generate(4, 1);
  ASSERT_TRUE(l0.ok() && l1.ok());
  bool varied = false;
  for (int src = 0; src < o.ranks; ++src) {
    int64_t row0 = 0;
    int64_t row1 = 0;
    int64_t max_count = 0;
    for (int e = 0; e < o.experts; ++e) {
      row0 += l0->loads.at(src, e);
      row1 += l1->loads.at(src, e);
      max_count = std::max(max_count, l0->loads.at(src, e));
    }
    ASSERT_EQ(row0 % o.topk, 0);
    const int64_t tokens = row0 / o.topk;
    // Both layers of a microbatch see the same tokens; counts stay within the jitter band.
    EXPECT_EQ(row1, row0);
    EXPECT_GE(tokens, static_cast<int64_t>(std::floor(8192 * 0.75)));
    EXPECT_LE(tokens, static_cast<int64_t>(std::ceil(8192 * 1.25)));
    varied = varied || tokens != 8192;
    // An expert gets a token at most once (distinct experts per token).
    EXPECT_LE(max_count, tokens);
  }
  EXPECT_TRUE(varied);
}

// Reference comparison: per-source empirical frequencies match the inclusion probabilities.
TEST(GenerateTest, RoutingFrequenciesMatchInclusionProbabilities) {
  GeneratorOptions o;
  o.ranks = 2;
  o.experts = 16;
  o.topk = 4;
  o.tokens_per_rank = 200000;
  o.imbalance = 1.15;
  o.seed = 3;
  absl::StatusOr<LoadGenerator> gen = LoadGenerator::Create(o);
  ASSERT_TRUE(gen.ok()) << gen.status();
  absl::StatusOr<LoadGenerator::Popularity> p = gen->ExpectedPopularity(0, 0);
  absl::StatusOr<TraceEntry> entry = gen->Generate(0, 0);
  ASSERT_TRUE(p.ok() && entry.ok());
  const double n = static_cast<double>(o.tokens_per_rank);
  for (int src = 0; src < o.ranks; ++src) {
    for (int e = 0; e < o.experts; ++e) {
      const double pe = p->inclusion[static_cast<size_t>(e)];
      const double sd = std::sqrt(n * pe * (1 - pe));
      EXPECT_NEAR(static_cast<double>(entry->loads.at(src, e)), n * pe, 5 * sd + 1)
          << "src " << src << " expert " << e;
    }
  }
}

TEST(GenerateTest, DeterministicFromTheSeed) {
  GeneratorOptions o = Ep64(2);
  o.token_jitter = 0.1;
  absl::StatusOr<LoadGenerator> a = LoadGenerator::Create(o);
  absl::StatusOr<LoadGenerator> b = LoadGenerator::Create(o);
  o.seed = 8;
  absl::StatusOr<LoadGenerator> c = LoadGenerator::Create(o);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(*a->Generate(2, 0), *b->Generate(2, 0));
  EXPECT_FALSE(*a->Generate(2, 0) == *c->Generate(2, 0));
  EXPECT_FALSE(*a->Generate(2, 0) == *a->Generate(3, 0));
}

double L1(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += std::abs(a[i] - b[i]);
  return d;
}

TEST(GenerateTest, JumpChangesHotExpertsAtOnceAndDriftGradually) {
  GeneratorOptions o = Ep64(2);
  o.shift_every = 10;
  o.microbatches = 40;
  o.shift = LoadShift::kJump;
  absl::StatusOr<LoadGenerator> jump = LoadGenerator::Create(o);
  o.shift = LoadShift::kDrift;
  absl::StatusOr<LoadGenerator> drift = LoadGenerator::Create(o);
  o.shift = LoadShift::kNone;
  absl::StatusOr<LoadGenerator> still = LoadGenerator::Create(o);
  ASSERT_TRUE(jump.ok() && drift.ok() && still.ok());
  auto inclusion = [](const LoadGenerator& g, int64_t mb) {
    return g.ExpectedPopularity(mb, 0)->inclusion;
  };
  EXPECT_EQ(inclusion(*still, 0), inclusion(*still, 25));
  EXPECT_EQ(inclusion(*jump, 0), inclusion(*jump, 9));
  const double jump_step = L1(inclusion(*jump, 9), inclusion(*jump, 10));
  EXPECT_GT(jump_step, 1.0);
  double max_drift_step = 0;
  for (int64_t mb = 0; mb < 20; ++mb) {
    const double step = L1(inclusion(*drift, mb), inclusion(*drift, mb + 1));
    EXPECT_GT(step, 0.0) << mb;
    max_drift_step = std::max(max_drift_step, step);
  }
  EXPECT_LT(max_drift_step, 0.5 * jump_step);
  // Drift reaches the next profile after shift_every microbatches.
  EXPECT_GT(L1(inclusion(*drift, 0), inclusion(*drift, 10)), 1.0);
  // The calibrated expected imbalance holds at every microbatch.
  for (int64_t mb : {3, 10, 17}) {
    std::vector<double> p = inclusion(*drift, mb);
    double max_rank = 0;
    for (int r = 0; r < 64; ++r) {
      max_rank = std::max(max_rank, std::accumulate(p.begin() + 4 * r, p.begin() + 4 * r + 4, 0.0));
    }
    EXPECT_NEAR(max_rank / (8.0 / 64), 2.0, 1e-6) << mb;
  }
}

TEST(GenerateTest, UnreachableImbalanceSaysSo) {
  GeneratorOptions o;
  o.ranks = 8;
  o.experts = 8;
  o.topk = 8;  // every token visits every expert: imbalance is always 1
  o.tokens_per_rank = 16;
  o.imbalance = 2;
  absl::StatusOr<LoadGenerator> gen = LoadGenerator::Create(o);
  ASSERT_FALSE(gen.ok());
  EXPECT_THAT(std::string(gen.status().message()), HasSubstr("imbalance 2 is unreachable"));
}

}  // namespace
}  // namespace rackrun::planner
