// The per-(source, instance) token counts of every policy's plans, against a digest taken
// from the dense ranks x instances split (Plan::split at 70a1404, before the split became
// sparse): the sparse layout must not change what any source sends to any instance.
// Inputs: generated loads (Zipf, lognormal, spikes, token jitter) over six domains, every
// policy, both split roundings, a few microbatches each (eplb's history included).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "planner/generate.h"
#include "planner/invariants.h"
#include "planner/plan.h"
#include "planner/planner.h"

namespace rackrun::planner {
namespace {

struct Digest {
  uint64_t h = 0xcbf29ce484222325ULL;
  void Mix(int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint64_t>(v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ULL;
    }
  }
};

// Instances, quotas and every (src, instance) count, source-major.
void MixPlan(const Plan& plan, const LoadMatrix& loads, Digest* d) {
  d->Mix(plan.ranks);
  d->Mix(plan.num_instances());
  for (const ExpertInstance& i : plan.instances) {
    d->Mix(i.expert);
    d->Mix(i.rank);
    d->Mix(i.master ? 1 : 0);
  }
  for (const int64_t q : plan.quota) d->Mix(q);
  const std::vector<int64_t> dense = DenseSplit(plan, loads);
  for (const int64_t v : dense) d->Mix(v);
}

TEST(SplitGoldenTest, PerSourceCountsMatchTheDenseSplit) {
  struct Case {
    int ranks, experts, slots, topk;
    PopularityModel popularity;
    double imbalance, sigma, jitter;
    int spikes;
  };
  const std::vector<Case> cases = {
      {8, 256, 2, 8, PopularityModel::kZipf, 2.0, 1.5, 0.0, 0},
      {16, 64, 2, 4, PopularityModel::kZipf, 2.0, 1.5, 0.0, 0},
      {64, 256, 2, 8, PopularityModel::kLognormal, 2.0, 1.5, 0.0, 0},
      {64, 256, 4, 8, PopularityModel::kZipf, 1.5, 1.5, 0.0, 3},
      {32, 256, 2, 8, PopularityModel::kZipf, 2.0, 1.5, 0.3, 0},
      {4, 8, 1, 2, PopularityModel::kZipf, 1.3, 1.5, 0.2, 0},
  };
  Digest digest;
  int plans = 0;
  for (const Case& c : cases) {
    GeneratorOptions g;
    g.ranks = c.ranks;
    g.experts = c.experts;
    g.topk = c.topk;
    g.tokens_per_rank = 4096;
    g.token_jitter = c.jitter;
    g.imbalance = c.imbalance;
    g.popularity = c.popularity;
    g.lognormal_sigma = c.sigma;
    g.spike_experts = c.spikes;
    g.spike_rate = 0.5;
    g.microbatches = 3;
    absl::StatusOr<LoadGenerator> generator = LoadGenerator::Create(g);
    ASSERT_TRUE(generator.ok()) << generator.status();
    const Domain domain{c.ranks, c.experts / c.ranks, c.slots};
    for (const SplitRounding rounding :
         {SplitRounding::kLargestRemainder, SplitRounding::kCumulative}) {
      for (const std::string policy :
           {"ultraep", "ultraep-search", "greedy", "eplb", "none", "ideal"}) {
        PlannerOptions options;
        options.split_rounding = rounding;
        options.eplb_interval = 2;
        options.refine = policy != "ultraep-search";
        absl::StatusOr<std::unique_ptr<Planner>> planner =
            MakePlanner(policy == "ultraep-search" ? "ultraep" : policy, domain, options);
        ASSERT_TRUE(planner.ok()) << planner.status();
        Plan plan;
        for (int64_t mb = 0; mb < g.microbatches; ++mb) {
          absl::StatusOr<TraceEntry> entry = generator->Generate(mb, 0);
          ASSERT_TRUE(entry.ok()) << entry.status();
          ASSERT_TRUE((*planner)->SolveInto(entry->loads, 0, &plan).ok());
          InvariantOptions invariants;
          invariants.masters_at_home = policy != "eplb";
          invariants.enforce_slot_budget = policy != "ideal";
          ASSERT_TRUE(CheckPlanInvariants(domain, entry->loads, plan, invariants).ok())
              << policy << " EP" << c.ranks;
          MixPlan(plan, entry->loads, &digest);
          ++plans;
        }
      }
    }
  }
  EXPECT_EQ(plans, 216);
  EXPECT_EQ(digest.h, 0x9cace169a76539b4ULL) << std::hex << digest.h;
}

}  // namespace
}  // namespace rackrun::planner
