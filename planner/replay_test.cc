#include "planner/replay.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "planner/generate.h"
#include "planner/invariants.h"
#include "planner/planner.h"
#include "planner/simulator.h"

namespace rackrun::planner {
namespace {

std::string MessageOf(const absl::Status& status) { return std::string(status.message()); }

// microbatches x layers generated entries, microbatch-major, on 8 ranks x 4 experts.
std::vector<TraceEntry> Entries(int64_t microbatches, int layers) {
  GeneratorOptions g;
  g.ranks = 8;
  g.experts = 32;
  g.topk = 4;
  g.tokens_per_rank = 512;
  g.imbalance = 1.5;
  g.microbatches = microbatches;
  g.layers = layers;
  g.shift = LoadShift::kJump;
  g.shift_every = 3;
  absl::StatusOr<LoadGenerator> generator = LoadGenerator::Create(g);
  EXPECT_TRUE(generator.ok()) << generator.status();
  absl::StatusOr<std::vector<TraceEntry>> entries = generator->GenerateAll();
  EXPECT_TRUE(entries.ok()) << entries.status();
  return *std::move(entries);
}

ReplayOptions Options() {
  ReplayOptions o;
  for (const PolicyTraits& p : Policies()) o.policies.emplace_back(p.name);
  o.slots = 2;
  o.planner.eplb_window = 4;
  o.planner.eplb_interval = 3;
  absl::StatusOr<HardwareModel> hw = HardwarePreset("h200-nvl72");
  EXPECT_TRUE(hw.ok()) << hw.status();
  o.hardware = *hw;
  o.planner.expert_bytes = o.hardware.expert_bytes();
  return o;
}

TEST(ReplayTest, CollectsEveryPolicysFigures) {
  const std::vector<TraceEntry> entries = Entries(10, 2);
  Replay replay(Options());
  for (const TraceEntry& e : entries) ASSERT_TRUE(replay.Add(e).ok());
  EXPECT_EQ(replay.domain().ranks, 8);
  EXPECT_EQ(replay.domain().masters_per_rank, 4);
  EXPECT_EQ(replay.domain().slots_per_rank, 2);
  EXPECT_EQ(replay.entries(), 20);
  EXPECT_EQ(replay.microbatches(), 10u);
  EXPECT_EQ(replay.measured_microbatches(), 10u);
  EXPECT_EQ(replay.layers(), 2u);
  ASSERT_EQ(replay.results().size(), Policies().size());
  for (size_t i = 0; i < Policies().size(); ++i) {
    const PolicyReplay& r = replay.results()[i];
    const PolicyTraits& traits = Policies()[i];
    SCOPED_TRACE(r.policy);
    EXPECT_EQ(r.policy, traits.name);
    for (const std::vector<double>* v : {&r.before, &r.after, &r.replicas, &r.fanout_bytes,
                                         &r.direct_ms, &r.relay_ms, &r.percent, &r.solve_us}) {
      EXPECT_EQ(v->size(), entries.size());
    }
    EXPECT_GT(r.layer_s, 0);
    EXPECT_GT(r.ideal_s, 0);
    EXPECT_NEAR(r.parts.dispatch_s + r.parts.exposed_fanout_s + r.parts.compute_s +
                    r.parts.combine_s + r.parts.replacement_s,
                r.layer_s, 1e-9 * r.layer_s);
    double fanout = 0, replicas = 0;
    for (size_t j = 0; j < entries.size(); ++j) {
      EXPECT_GE(r.before[j], 1.0);
      fanout += r.fanout_bytes[j];
      replicas += r.replicas[j];
      EXPECT_EQ(r.fanout_bytes[j] > 0, r.direct_ms[j] > 0);
    }
    if (traits.split == TokenSplit::kMastersOnly) {
      EXPECT_EQ(replicas, 0);
      EXPECT_EQ(r.after, r.before);
    } else {
      EXPECT_GT(replicas, 0);
    }
    // Resident replicas move weights only by re-placement; the others fan out every plan.
    if (traits.resident_replicas) {
      EXPECT_EQ(fanout, 0);
      EXPECT_GT(r.replacement_bytes, 0);
    } else {
      EXPECT_EQ(r.replacement_bytes, 0);
      EXPECT_EQ(fanout > 0, replicas > 0);
    }
    // The bound is charged no fan-out and balances perfectly.
    if (traits.bound) {
      EXPECT_EQ(r.parts.exposed_fanout_s, 0);
      for (const double after : r.after) EXPECT_NEAR(after, 1.0, 1e-3);
    }
  }
}

// The replay's fingerprint is the chain of the plans a planner of the same policy makes.
TEST(ReplayTest, PlanHashChainsThePoliciesPlans) {
  const std::vector<TraceEntry> entries = Entries(6, 2);
  ReplayOptions options = Options();
  Replay replay(options);
  Replay again(options);
  for (const TraceEntry& e : entries) {
    ASSERT_TRUE(replay.Add(e).ok());
    ASSERT_TRUE(again.Add(e).ok());
  }
  for (size_t i = 0; i < options.policies.size(); ++i) {
    const std::string& name = options.policies[i];
    absl::StatusOr<std::unique_ptr<Planner>> planner =
        MakePlanner(name, replay.domain(), options.planner);
    ASSERT_TRUE(planner.ok());
    uint64_t hash = kFingerprintSeed;
    for (const TraceEntry& e : entries) {
      absl::StatusOr<Plan> plan = (*planner)->Solve(e.loads, e.layer);
      ASSERT_TRUE(plan.ok());
      hash = PlanFingerprint(*plan, hash);
    }
    EXPECT_EQ(replay.results()[i].plan_hash, hash) << name;
    EXPECT_EQ(again.results()[i].plan_hash, hash) << name;
  }
}

TEST(ReplayTest, WarmupMicrobatchesArePlannedButNotMeasured) {
  const std::vector<TraceEntry> entries = Entries(5, 2);
  ReplayOptions options = Options();
  options.policies = {"eplb"};
  Replay all(options);
  options.warmup = 2;
  Replay warm(options);
  for (const TraceEntry& e : entries) {
    ASSERT_TRUE(all.Add(e).ok());
    ASSERT_TRUE(warm.Add(e).ok());
  }
  EXPECT_EQ(warm.entries(), 6);
  EXPECT_EQ(warm.microbatches(), 5u);
  EXPECT_EQ(warm.measured_microbatches(), 3u);
  const PolicyReplay& w = warm.results()[0];
  const PolicyReplay& a = all.results()[0];
  EXPECT_EQ(w.solve_us.size(), 10u);
  ASSERT_EQ(w.after.size(), 6u);
  // The warm-up built eplb's history: the measured entries are the full run's last ones.
  EXPECT_EQ(w.after, std::vector<double>(a.after.end() - 6, a.after.end()));
  EXPECT_EQ(w.plan_hash, a.plan_hash);
}

TEST(ReplayTest, ErrorsNameThePolicyAndEntry) {
  std::vector<TraceEntry> entries = Entries(2, 1);
  ReplayOptions options = Options();
  options.policies = {"ultraep", "magic"};
  Replay unknown(options);
  absl::Status s = unknown.Add(entries[0]);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(MessageOf(s).find("unknown planner policy 'magic'"), std::string::npos) << s;

  options = Options();
  options.slots = -1;
  Replay bad_domain(options);
  EXPECT_NE(MessageOf(bad_domain.Add(entries[0])).find("domain.slots_per_rank"), std::string::npos);

  Replay replay(Options());
  ASSERT_TRUE(replay.Add(entries[0]).ok());
  TraceEntry other = entries[1];
  other.loads = LoadMatrix(8, 16);  // not the domain of the first entry
  s = replay.Add(other);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MessageOf(s).find("policy ultraep, microbatch 1, layer 0: "), 0u) << s;
}

}  // namespace
}  // namespace rackrun::planner
