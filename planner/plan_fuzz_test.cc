// Thousands of random and adversarial loads through every policy; every plan must pass
// CheckPlanInvariants and be bit-identical when solved again, in this process and in
// another one.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/random.h"
#include "gtest/gtest.h"
#include "planner/baseline_planners.h"
#include "planner/invariants.h"
#include "planner/plan.h"
#include "planner/planner.h"
#include "planner/quota_planner.h"

namespace rackrun::planner {
namespace {

// The project's PRNG with small adapters: the same cases on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : x_(base::Xoshiro256::FromSeed(seed)) {}
  int Below(int n) { return static_cast<int>(x_.Below(static_cast<uint64_t>(n))); }
  double Unit() { return x_.Uniform(); }
  uint64_t Next() { return x_.Next(); }

 private:
  base::Xoshiro256 x_;
};

enum Pattern {
  kZipf,
  kAllZero,
  kOneExpert,
  kEmptyRank,
  kHotBeyondSlots,
  kSparse,
  kHuge,
  kUniform,
  kPatterns
};

const char* PatternName(int p) {
  static const char* kNames[] = {"zipf",      "all-zero", "one-expert", "empty-rank",
                                 "hot>slots", "sparse",   "huge",       "uniform"};
  return kNames[p];
}

LoadMatrix MakeLoads(const Domain& domain, int pattern, Rng& rng) {
  const int ranks = domain.ranks;
  const int experts = domain.experts();
  LoadMatrix loads(ranks, experts);
  std::vector<double> weight(static_cast<size_t>(experts));
  const double skew = 1.5 * rng.Unit();
  for (int e = 0; e < experts; ++e) {
    weight[static_cast<size_t>(e)] = std::pow(1.0 + rng.Below(experts), -skew);
  }
  const double scale = 1.0 + rng.Below(2000);
  switch (pattern) {
    case kZipf:
    case kEmptyRank:
      for (int s = 0; s < ranks; ++s) {
        for (int e = 0; e < experts; ++e) {
          loads.at(s, e) =
              static_cast<int64_t>(weight[static_cast<size_t>(e)] * scale * rng.Unit() * 2);
        }
      }
      if (pattern == kEmptyRank) {
        const int r = rng.Below(ranks);
        for (int s = 0; s < ranks; ++s) {
          for (int m = 0; m < domain.masters_per_rank; ++m)
            loads.at(s, r * domain.masters_per_rank + m) = 0;
        }
        const int src = rng.Below(ranks);
        for (int e = 0; e < experts; ++e) loads.at(src, e) = 0;
      }
      break;
    case kAllZero:
      break;
    case kOneExpert: {
      const int e = rng.Below(experts);
      for (int s = 0; s < ranks; ++s) loads.at(s, e) = 1 + rng.Below(5000);
      break;
    }
    case kHotBeyondSlots: {
      const int hot = std::min(experts, ranks * domain.slots_per_rank + 1 + rng.Below(4));
      for (int s = 0; s < ranks; ++s) {
        for (int e = 0; e < experts; ++e) loads.at(s, e) = rng.Below(3);
      }
      for (int h = 0; h < hot; ++h) {
        const int e = rng.Below(experts);
        for (int s = 0; s < ranks; ++s) loads.at(s, e) += 500 + rng.Below(500);
      }
      break;
    }
    case kSparse:
      for (int64_t& c : loads.counts) c = rng.Below(10) == 0 ? rng.Below(3) : 0;
      break;
    case kHuge:
      for (int64_t& c : loads.counts) c = static_cast<int64_t>(rng.Next() % (int64_t{1} << 30));
      break;
    case kUniform:
    default: {
      const int64_t v = rng.Below(100);
      for (int64_t& c : loads.counts) c = v;
      break;
    }
  }
  return loads;
}

InvariantOptions InvariantsFor(const std::string& policy, const PlannerOptions& options) {
  InvariantOptions invariants;
  if (policy == "ultraep" || policy == "greedy") {
    invariants.master_keeps_a_token = !options.allow_zero_master_quota;
  }
  if (policy == "eplb") invariants.masters_at_home = false;
  if (policy == "ideal") invariants.enforce_slot_budget = false;
  return invariants;
}

int64_t MaxOf(const std::vector<int64_t>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

// Plans `count` random inputs of domains drawn from `ranks_choices` with every policy.
void FuzzPolicies(uint64_t seed, int count, const std::vector<int>& ranks_choices) {
  Rng rng(seed);
  // The fuzzing must reach the interesting paths: replicas, relayed fan-out, replans.
  int with_replicas = 0;
  int with_relays = 0;
  const std::vector<std::string> policies = {"ultraep", "greedy", "eplb", "none", "ideal"};
  for (int c = 0; c < count; ++c) {
    Domain domain;
    domain.ranks =
        ranks_choices[static_cast<size_t>(rng.Below(static_cast<int>(ranks_choices.size())))];
    domain.masters_per_rank = 1 + rng.Below(domain.ranks >= 64 ? 4 : 6);
    domain.slots_per_rank = rng.Below(5);
    const int pattern = rng.Below(kPatterns);
    PlannerOptions options;
    options.eps = rng.Below(4) == 0 ? 0.0 : 0.001 * rng.Below(50);
    options.min_replica_tokens = rng.Below(3) == 0 ? 1 + rng.Below(200) : 1;
    options.allow_zero_master_quota = rng.Below(4) == 0;
    options.eplb_window = 1 + rng.Below(4);
    options.eplb_interval = 1 + rng.Below(2);
    options.fanout.mode = rng.Below(2) == 0 ? FanoutMode::kRelay : FanoutMode::kDirect;
    options.locality_aware_split = rng.Below(4) != 0;
    options.split_rounding =
        rng.Below(2) == 0 ? SplitRounding::kLargestRemainder : SplitRounding::kCumulative;
    const std::string where =
        absl::StrCat("case ", c, ": ", domain.ranks, " ranks x ", domain.masters_per_rank,
                     " masters + ", domain.slots_per_rank, " slots, ", PatternName(pattern));
    // eplb plans from history: feed it two earlier microbatches first.
    std::vector<LoadMatrix> history;
    for (int h = 0; h < 2; ++h) history.push_back(MakeLoads(domain, rng.Below(kPatterns), rng));
    const LoadMatrix loads = MakeLoads(domain, pattern, rng);
    const std::vector<int64_t> home = HomeRankLoads(domain, loads);
    int64_t ultraep_max = -1;
    int64_t greedy_max = -1;
    for (const std::string& policy : policies) {
      SCOPED_TRACE(absl::StrCat(where, ", ", policy));
      auto first = MakePlanner(policy, domain, options);
      auto second = MakePlanner(policy, domain, options);
      ASSERT_TRUE(first.ok() && second.ok());
      for (const LoadMatrix& past : history) {
        ASSERT_TRUE((*first)->Solve(past, 0).ok());
        ASSERT_TRUE((*second)->Solve(past, 0).ok());
      }
      absl::StatusOr<Plan> plan = (*first)->Solve(loads, 0);
      ASSERT_TRUE(plan.ok()) << plan.status();
      const absl::Status check =
          CheckPlanInvariants(domain, loads, *plan, InvariantsFor(policy, options));
      ASSERT_TRUE(check.ok()) << check;
      // Determinism in-process: a second planner, and SolveInto into a used plan.
      Plan again = *plan;
      again.split.assign(again.split.size() + 3, -7);
      again.split_column.assign(again.split_column.size(), -7);
      ASSERT_TRUE((*second)->SolveInto(loads, 0, &again).ok());
      ASSERT_EQ(again, *plan);

      with_replicas += plan->num_replicas() > 0 ? 1 : 0;
      for (const WeightTransfer& t : plan->fanout.transfers) {
        if (t.stage == 1) {
          ++with_relays;
          break;
        }
      }
      const std::vector<int64_t> after = plan->RankLoads();
      if (policy == "ultraep" || policy == "greedy" || policy == "ideal") {
        // Balancing never makes the busiest rank busier.
        EXPECT_LE(MaxOf(after), MaxOf(home));
      }
      if (policy == "ultraep") ultraep_max = MaxOf(after);
      if (policy == "greedy") greedy_max = MaxOf(after);
      if (policy == "greedy" && options.min_replica_tokens == 1) {
        // The refinement keeps ultraep's busiest rank at or below greedy's, unless the
        // homes are already within the first threshold tried, ceil(mean * (1 + eps)).
        int64_t total = 0;
        for (const int64_t l : home) total += l;
        const double mean = static_cast<double>(total) / domain.ranks;
        const int64_t first_try =
            std::max(static_cast<int64_t>(std::ceil(mean * (1 + options.eps))),
                     (total + domain.ranks - 1) / domain.ranks);
        EXPECT_LE(ultraep_max, std::max(greedy_max, first_try));
      }
      if (policy == "ideal") {
        EXPECT_LE(MaxOf(after) - *std::min_element(after.begin(), after.end()), 1);
      }
      if (policy == "none") {
        EXPECT_EQ(after, home);
      }
    }
  }
  EXPECT_GT(with_replicas, count / 4);
  EXPECT_GT(with_relays, 0);
}

TEST(PlanFuzzTest, SmallDomains) { FuzzPolicies(1, 3000, {1, 2, 3, 8}); }

TEST(PlanFuzzTest, RackDomains) { FuzzPolicies(2, 150, {64, 72}); }

TEST(PlanFuzzTest, LargeDomains) { FuzzPolicies(3, 6, {256}); }

TEST(PlanFuzzTest, UltraepNeverExceedsItsThreshold) {
  Rng rng(4);
  for (int c = 0; c < 300; ++c) {
    const Domain domain{8 + rng.Below(60), 1 + rng.Below(4), 1 + rng.Below(3)};
    const LoadMatrix loads = MakeLoads(domain, kZipf, rng);
    QuotaPlanner planner(domain, PlannerOptions{});
    absl::StatusOr<Plan> plan = planner.Solve(loads, 0);
    ASSERT_TRUE(plan.ok());
    if (planner.last_threshold() > 0) {
      EXPECT_LE(MaxOf(plan->RankLoads()), planner.last_threshold()) << "case " << c;
    } else if (plan->num_replicas() > 0) {
      // The search was skipped: refinement's greedy candidate ended below the first
      // threshold tried, max(ceil(mean * (1 + eps)), ceil(mean)).
      int64_t total = 0;
      for (const int64_t v : loads.counts) total += v;
      const double mean = static_cast<double>(total) / domain.ranks;
      const int64_t first_try = std::max(static_cast<int64_t>(std::ceil(mean * 1.01)),
                                         (total + domain.ranks - 1) / domain.ranks);
      EXPECT_LT(MaxOf(plan->RankLoads()), first_try) << "case " << c;
      EXPECT_EQ(planner.last_oracle_calls(), 0) << "case " << c;
    }
  }
}

// Solves a fixed set of inputs with every policy and hashes all plans together.
uint64_t HashOfFixedInputs() {
  Rng rng(99);
  uint64_t h = 0;
  for (int c = 0; c < 40; ++c) {
    const Domain domain{c % 5 == 0 ? 64 : 8, 1 + c % 4, c % 3};
    const LoadMatrix loads = MakeLoads(domain, c % kPatterns, rng);
    for (const char* policy : {"ultraep", "greedy", "eplb", "none", "ideal"}) {
      auto planner = MakePlanner(policy, domain, PlannerOptions{});
      if (!planner.ok()) return 0;
      for (int t = 0; t < 3; ++t) {
        absl::StatusOr<Plan> plan = (*planner)->Solve(loads, 0);
        if (!plan.ok()) return 0;
        h = h * 31 + PlanFingerprint(*plan);
      }
    }
  }
  return h;
}

TEST(PlanFuzzTest, BitIdenticalAcrossProcesses) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(fds[0]);
    const uint64_t h = HashOfFixedInputs();
    const ssize_t written = write(fds[1], &h, sizeof(h));
    _exit(written == static_cast<ssize_t>(sizeof(h)) ? 0 : 1);
  }
  close(fds[1]);
  uint64_t from_child = 0;
  const ssize_t got = read(fds[0], &from_child, sizeof(from_child));
  close(fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ASSERT_EQ(got, static_cast<ssize_t>(sizeof(from_child)));
  const uint64_t here = HashOfFixedInputs();
  EXPECT_NE(here, 0u);
  EXPECT_EQ(from_child, here);
}

}  // namespace
}  // namespace rackrun::planner
