#include "coordinator/planning.h"

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "planner/invariants.h"
#include "planner/planner.h"
#include "rpc/plan_codec.h"

namespace rackrun::coordinator {
namespace {

rackrun::v1::JobSpec Spec(const std::string& policy) {
  rackrun::v1::JobSpec s;
  s.mutable_model()->set_width(16);
  s.mutable_model()->mutable_moe()->set_experts(8);
  s.mutable_model()->mutable_moe()->set_expert_hidden(32);
  rackrun::v1::BalancerSpec* b = s.mutable_balancer();
  b->set_policy(policy);
  b->set_slots(2);
  b->set_eps(0.01);
  b->set_min_replica_tokens(1);
  b->set_locality(true);
  b->set_eplb_window(4);
  b->set_eplb_interval(2);
  b->set_mode("coordinator");
  return s;
}

// The in-band planner, built the way runtime/trainer.cc and expert_parallel.cc build it.
std::unique_ptr<planner::Planner> InBand(const rackrun::v1::JobSpec& spec, int ranks) {
  const rackrun::v1::BalancerSpec& b = spec.balancer();
  planner::PlannerOptions po;
  po.eps = b.eps();
  po.min_replica_tokens = b.min_replica_tokens();
  po.locality_aware_split = b.locality();
  po.eplb_window = b.eplb_window();
  po.eplb_interval = b.eplb_interval();
  po.expert_bytes = 3 * int64_t{spec.model().width()} * spec.model().moe().expert_hidden() * 4;
  planner::Domain d{ranks, spec.model().moe().experts() / ranks, b.slots()};
  return *planner::MakePlanner(b.policy(), d, po);
}

class PlanningEquivalence : public ::testing::TestWithParam<std::string> {};

TEST_P(PlanningEquivalence, CoordinatorPlansEqualInBandPlans) {
  const int ranks = 4;
  const rackrun::v1::JobSpec spec = Spec(GetParam());
  Planning planning;
  ASSERT_TRUE(planning.Open("j-1", 1, spec, ranks).ok());
  std::unique_ptr<planner::Planner> train = InBand(spec, ranks);
  std::unique_ptr<planner::Planner> eval = InBand(spec, ranks);
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> tokens(0, 400);
  for (int64_t mb = 0; mb < 12; ++mb) {
    for (int layer = 0; layer < 2; ++layer) {
      const bool training = mb % 4 != 3;
      planner::LoadMatrix loads(ranks, 8);
      for (int r = 0; r < ranks; ++r) {
        for (int e = 0; e < 8; ++e)
          loads.at(r, e) = tokens(rng) * (e == 2 ? 5 : 1);  // a hot expert
      }
      for (int r = ranks - 1; r >= 0; --r) {  // rows arrive in any order
        rackrun::v1::LoadRow row;
        row.set_job_id("j-1");
        row.set_attempt(1);
        row.set_rank(r);
        row.set_microbatch(mb);
        row.set_layer(layer);
        row.set_training(training);
        for (int e = 0; e < 8; ++e) row.add_loads(loads.at(r, e));
        ASSERT_TRUE(planning.AddRow(row).ok());
      }
      planner::Plan expected;
      ASSERT_TRUE((training ? train : eval)->SolveInto(loads, layer, &expected).ok());
      for (int r = 0; r < ranks; ++r) {
        auto reply = planning.NextReply("j-1", 1, r, absl::Seconds(1));
        ASSERT_TRUE(reply.ok() && reply->has_value());
        const rackrun::v1::PlanReply& got = **reply;
        ASSERT_TRUE(got.error().empty()) << got.error();
        EXPECT_EQ(got.microbatch(), mb);
        EXPECT_EQ(got.layer(), layer);
        planner::Plan decoded;
        planner::LoadMatrix decoded_loads;
        ASSERT_TRUE(rpc::PlanFromMessage(got.plan(), &decoded, &decoded_loads).ok());
        EXPECT_TRUE(decoded == expected) << "microbatch " << mb << " layer " << layer;
        EXPECT_EQ(decoded_loads.ranks, ranks);
        EXPECT_EQ(decoded_loads.counts, loads.counts);
        EXPECT_EQ(got.fingerprint(), planner::PlanFingerprint(expected));
        EXPECT_EQ(planner::PlanFingerprint(decoded), got.fingerprint());
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, PlanningEquivalence,
                         ::testing::Values("ultraep", "eplb", "none"));

rackrun::v1::LoadRow Row(int rank, int domain, int64_t microbatch, int layer, bool training,
                         const planner::LoadMatrix& loads, int row_of_loads) {
  rackrun::v1::LoadRow row;
  row.set_job_id("j-1");
  row.set_attempt(1);
  row.set_rank(rank);
  row.set_domain(domain);
  row.set_microbatch(microbatch);
  row.set_layer(layer);
  row.set_training(training);
  for (int e = 0; e < loads.experts; ++e) row.add_loads(loads.at(row_of_loads, e));
  return row;
}

// 2 x 2 (4 ranks, parallelism.expert_parallel 2): each domain's plans are what that
// domain's in-band planner (2 ranks, its own history) solves from its own ranks' rows, and
// reach only that domain's ranks.
TEST_P(PlanningEquivalence, EachDomainPlansLikeItsInBandGroup) {
  const int ranks = 4, g = 2;
  rackrun::v1::JobSpec spec = Spec(GetParam());
  spec.mutable_parallelism()->set_expert_parallel(g);
  Planning planning;
  ASSERT_TRUE(planning.Open("j-1", 1, spec, ranks).ok());
  std::vector<std::unique_ptr<planner::Planner>> train, eval;
  for (int d = 0; d < ranks / g; ++d) {
    train.push_back(InBand(spec, g));
    eval.push_back(InBand(spec, g));
  }
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> tokens(0, 400);
  for (int64_t mb = 0; mb < 10; ++mb) {
    for (int layer = 0; layer < 2; ++layer) {
      const bool training = mb % 4 != 3;
      // Each domain its own loads, with a different hot expert.
      std::vector<planner::LoadMatrix> loads(2, planner::LoadMatrix(g, 8));
      for (int d = 0; d < 2; ++d) {
        for (int r = 0; r < g; ++r) {
          for (int e = 0; e < 8; ++e) loads[d].at(r, e) = tokens(rng) * (e == 2 + 3 * d ? 6 : 1);
        }
      }
      for (const int rank : {3, 0, 2, 1}) {  // the domains' rows interleaved
        ASSERT_TRUE(
            planning.AddRow(Row(rank, rank / g, mb, layer, training, loads[rank / g], rank % g))
                .ok());
      }
      for (int d = 0; d < 2; ++d) {
        planner::Plan expected;
        ASSERT_TRUE((training ? train : eval)[d]->SolveInto(loads[d], layer, &expected).ok());
        for (int rank = d * g; rank < d * g + g; ++rank) {
          auto reply = planning.NextReply("j-1", 1, rank, absl::Seconds(1));
          ASSERT_TRUE(reply.ok() && reply->has_value()) << "rank " << rank;
          const rackrun::v1::PlanReply& got = **reply;
          ASSERT_TRUE(got.error().empty()) << got.error();
          EXPECT_EQ(got.domain(), d);
          EXPECT_EQ(got.microbatch(), mb);
          EXPECT_EQ(got.layer(), layer);
          planner::Plan decoded;
          planner::LoadMatrix decoded_loads;
          ASSERT_TRUE(rpc::PlanFromMessage(got.plan(), &decoded, &decoded_loads).ok());
          EXPECT_TRUE(decoded == expected)
              << "microbatch " << mb << " layer " << layer << " domain " << d;
          EXPECT_EQ(decoded_loads.ranks, g);
          EXPECT_EQ(decoded_loads.counts, loads[d].counts);
          EXPECT_EQ(got.fingerprint(), planner::PlanFingerprint(expected));
        }
      }
      for (int rank = 0; rank < ranks; ++rank) {  // one reply per rank, no more
        auto extra = planning.NextReply("j-1", 1, rank, absl::ZeroDuration());
        ASSERT_TRUE(extra.ok());
        EXPECT_FALSE(extra->has_value()) << "rank " << rank << " got another domain's plan";
      }
    }
  }
}

// ultraep in domains of 2 ranks (parallelism.expert_parallel 2), and planning opened for
// attempt 1 of job j-1 on 4 ranks (2 x 2); null when Open fails.
rackrun::v1::JobSpec TwoByTwoSpec() {
  rackrun::v1::JobSpec spec = Spec("ultraep");
  spec.mutable_parallelism()->set_expert_parallel(2);
  return spec;
}
std::unique_ptr<Planning> OpenTwoByTwo() {
  auto planning = std::make_unique<Planning>();
  if (!planning->Open("j-1", 1, TwoByTwoSpec(), 4).ok()) return nullptr;
  return planning;
}

// One domain's slow rank does not hold back another domain: domain 1's plans are served,
// microbatch after microbatch (to a rank already waiting for them), while domain 0 still
// waits for rank 1's row; domain 0's plan comes when that row arrives.
TEST(PlanningTest, ADomainIsPlannedWhileAnotherWaitsForARank) {
  const std::unique_ptr<Planning> opened = OpenTwoByTwo();
  ASSERT_NE(opened, nullptr);
  Planning& planning = *opened;
  // The metrics hook learns which domain each solve was for (rackrun_plan_solve_seconds'
  // domain label); it runs under Planning's lock, so no lock of its own.
  std::vector<std::pair<std::string, int>> solved;
  planning.SetSolveObserver([&](const std::string& job_id, int domain, double s) {
    EXPECT_GE(s, 0);
    solved.emplace_back(job_id, domain);
  });
  planner::LoadMatrix loads(2, 8);
  for (int r = 0; r < 2; ++r) {
    for (int e = 0; e < 8; ++e) loads.at(r, e) = 10 + 7 * r + (e == 1 ? 300 : e);
  }
  ASSERT_TRUE(planning.AddRow(Row(0, 0, 0, 0, true, loads, 0)).ok());  // rank 1 is slow
  for (int64_t mb = 0; mb < 3; ++mb) {
    // Rank 2 waits for its plan before domain 1's rows are in; they arrive meanwhile.
    absl::StatusOr<std::optional<rackrun::v1::PlanReply>> waited;
    std::thread waiter([&] { waited = planning.NextReply("j-1", 1, 2, absl::Seconds(30)); });
    ASSERT_TRUE(planning.AddRow(Row(3, 1, mb, 0, true, loads, 1)).ok());
    ASSERT_TRUE(planning.AddRow(Row(2, 1, mb, 0, true, loads, 0)).ok());
    waiter.join();
    ASSERT_TRUE(waited.ok() && waited->has_value()) << "microbatch " << mb;
    EXPECT_EQ((*waited)->domain(), 1);
    EXPECT_EQ((*waited)->microbatch(), mb);
    EXPECT_TRUE((*waited)->error().empty()) << (*waited)->error();
    auto rank3 = planning.NextReply("j-1", 1, 3, absl::ZeroDuration());
    ASSERT_TRUE(rank3.ok() && rank3->has_value());
    EXPECT_EQ((*rank3)->fingerprint(), (*waited)->fingerprint());
    for (const int waiting : {0, 1}) {
      auto none = planning.NextReply("j-1", 1, waiting, absl::ZeroDuration());
      ASSERT_TRUE(none.ok());
      EXPECT_FALSE(none->has_value()) << "domain 0 was planned without rank 1's row";
    }
  }
  ASSERT_TRUE(planning.AddRow(Row(1, 0, 0, 0, true, loads, 1)).ok());
  for (const int rank : {0, 1}) {
    auto reply = planning.NextReply("j-1", 1, rank, absl::Seconds(1));
    ASSERT_TRUE(reply.ok() && reply->has_value());
    EXPECT_EQ((*reply)->domain(), 0);
    EXPECT_EQ((*reply)->microbatch(), 0);
    EXPECT_TRUE((*reply)->error().empty()) << (*reply)->error();
  }
  planning.SetSolveObserver(nullptr);
  const std::vector<std::pair<std::string, int>> expected = {
      {"j-1", 1}, {"j-1", 1}, {"j-1", 1}, {"j-1", 0}};
  EXPECT_EQ(solved, expected) << "one observation per solve, naming its domain";
}

// A row whose domain is not its rank's, and a layout that does not tile the ranks.
TEST(PlanningTest, RowsNameTheirRanksDomain) {
  const std::unique_ptr<Planning> opened = OpenTwoByTwo();
  ASSERT_NE(opened, nullptr);
  Planning& planning = *opened;
  planner::LoadMatrix loads(2, 8);
  const absl::Status wrong = planning.AddRow(Row(3, 0, 0, 0, true, loads, 1));
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(wrong.message()).find("domain: rank 3 is in expert-parallel domain 1"),
            std::string::npos)
      << wrong;
  EXPECT_TRUE(planning.AddRow(Row(3, 1, 0, 0, true, loads, 1)).ok());
  const absl::Status untiled = planning.Open("j-2", 1, TwoByTwoSpec(), 3);
  EXPECT_EQ(untiled.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(untiled.message()).find("parallelism.expert_parallel"), std::string::npos)
      << untiled;
}

TEST(PlanningTest, BadRowsAndClosedAttempts) {
  Planning planning;
  rackrun::v1::LoadRow row;
  row.set_job_id("j-1");
  row.set_attempt(1);
  row.add_loads(1);
  EXPECT_EQ(planning.AddRow(row).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(planning.Open("j-1", 1, Spec("ultraep"), 2).ok());
  EXPECT_EQ(planning.AddRow(row).code(), absl::StatusCode::kInvalidArgument);  // 1 load, 8 experts
  row.clear_loads();
  for (int e = 0; e < 8; ++e) row.add_loads(1);
  row.set_rank(5);
  EXPECT_EQ(planning.AddRow(row).code(), absl::StatusCode::kInvalidArgument);
  row.set_rank(0);
  EXPECT_TRUE(planning.AddRow(row).ok());
  EXPECT_EQ(planning.AddRow(row).code(), absl::StatusCode::kInvalidArgument);  // twice
  planning.Close("j-1", 1);
  EXPECT_EQ(planning.NextReply("j-1", 1, 0, absl::Milliseconds(1)).status().code(),
            absl::StatusCode::kCancelled);
  rackrun::v1::JobSpec odd = Spec("ultraep");
  odd.mutable_model()->mutable_moe()->set_experts(6);
  EXPECT_EQ(planning.Open("j-2", 1, odd, 4).code(), absl::StatusCode::kInvalidArgument);
}

// Checkpoints of coordinator-mode planning: a rank asks for its domain's planner state
// (state_request) and a resumed attempt restores it (restore_state chunks).
class PlanningStateTest : public ::testing::Test {
 protected:
  static constexpr int kRanks = 4, kG = 2;
  static rackrun::v1::JobSpec EplbSpec(int window = 4) {
    rackrun::v1::JobSpec spec = Spec("eplb");
    spec.mutable_balancer()->set_eplb_window(window);
    spec.mutable_parallelism()->set_expert_parallel(kG);
    return spec;
  }
  // Deterministic loads of (microbatch, layer, rank): a hot expert per domain.
  static planner::LoadMatrix Loads(int64_t mb, int layer, int domain) {
    planner::LoadMatrix loads(kG, 8);
    std::mt19937 rng(static_cast<unsigned>(mb * 131 + layer * 17 + domain));
    std::uniform_int_distribution<int> tokens(0, 400);
    for (int r = 0; r < kG; ++r) {
      for (int e = 0; e < 8; ++e)
        loads.at(r, e) = tokens(rng) * (e == (mb / 3 + domain) % 8 ? 6 : 1);
    }
    return loads;
  }
  // Plans microbatches [from, to) of 2 layers (every 4th an evaluation one) on `attempt`
  // and returns every rank's fingerprints of the training ones in order; the evaluation
  // ones' go to `evaluation` when given.
  static std::vector<uint64_t> Run(Planning& planning, int attempt, int64_t from, int64_t to,
                                   std::vector<uint64_t>* evaluation = nullptr) {
    std::vector<uint64_t> fingerprints;
    for (int64_t mb = from; mb < to; ++mb) {
      for (int layer = 0; layer < 2; ++layer) {
        const bool training = mb % 4 != 3;
        for (int rank = 0; rank < kRanks; ++rank) {
          rackrun::v1::LoadRow row =
              Row(rank, rank / kG, mb, layer, training, Loads(mb, layer, rank / kG), rank % kG);
          row.set_attempt(attempt);
          EXPECT_TRUE(planning.AddRow(row).ok());
        }
        for (int rank = 0; rank < kRanks; ++rank) {
          auto reply = planning.NextReply("j-1", attempt, rank, absl::Seconds(5));
          EXPECT_TRUE(reply.ok() && reply->has_value());
          if (!reply.ok() || !reply->has_value()) return fingerprints;
          EXPECT_TRUE((*reply)->error().empty()) << (*reply)->error();
          if (training) {
            fingerprints.push_back((*reply)->fingerprint());
          } else if (evaluation != nullptr) {
            evaluation->push_back((*reply)->fingerprint());
          }
        }
      }
    }
    return fingerprints;
  }
  static rackrun::v1::LoadRow StateRow(int attempt, int rank) {
    rackrun::v1::LoadRow row;
    row.set_job_id("j-1");
    row.set_attempt(attempt);
    row.set_rank(rank);
    row.set_domain(rank / kG);
    return row;
  }
  // Asks for rank's domain's state; the chunks it came in are appended to `chunks`.
  static std::string Save(Planning& planning, int attempt, int rank,
                          std::vector<size_t>* chunks = nullptr) {
    rackrun::v1::LoadRow row = StateRow(attempt, rank);
    row.set_state_request(true);
    EXPECT_TRUE(planning.AddRow(row).ok());
    std::string state;
    while (true) {
      auto reply = planning.NextReply("j-1", attempt, rank, absl::Seconds(5));
      EXPECT_TRUE(reply.ok() && reply->has_value());
      if (!reply.ok() || !reply->has_value()) return state;
      EXPECT_EQ((*reply)->domain(), rank / kG);
      EXPECT_FALSE((*reply)->has_plan());
      EXPECT_LE((*reply)->planner_state().size(), rpc::kPlannerStateChunkBytes);
      if (chunks != nullptr) chunks->push_back((*reply)->planner_state().size());
      state += (*reply)->planner_state();
      if ((*reply)->planner_state_last()) return state;
    }
  }
  // Restores rank's domain from `state` in chunks; the coordinator's answer.
  static rackrun::v1::PlanReply Restore(Planning& planning, int attempt, int rank,
                                        const std::string& state) {
    const std::vector<std::string_view> chunks = rpc::PlannerStateChunks(state);
    for (size_t i = 0; i < chunks.size(); ++i) {
      rackrun::v1::LoadRow row = StateRow(attempt, rank);
      row.set_restore_state(chunks[i].data(), chunks[i].size());
      row.set_restore_state_last(i + 1 == chunks.size());
      EXPECT_TRUE(planning.AddRow(row).ok());
    }
    auto reply = planning.NextReply("j-1", attempt, rank, absl::Seconds(5));
    EXPECT_TRUE(reply.ok() && reply->has_value());
    return reply.ok() && reply->has_value() ? **reply : rackrun::v1::PlanReply();
  }
};

// Save after 6 microbatches, restore on a new attempt: the following plans, of training
// and of evaluation microbatches, equal the uninterrupted attempt's, domain by domain, and
// a saved state round-trips.
TEST_F(PlanningStateTest, SaveRestoreEqualsAndPlansLikeTheUninterruptedRun) {
  Planning planning;
  ASSERT_TRUE(planning.Open("j-1", 1, EplbSpec(), kRanks).ok());
  ASSERT_FALSE(Run(planning, 1, 0, 6).empty());
  std::vector<std::string> saved(kRanks);
  for (int rank = 0; rank < kRanks; ++rank) saved[rank] = Save(planning, 1, rank);
  EXPECT_FALSE(saved[0].empty());
  EXPECT_EQ(saved[1], saved[0]);  // the same on every rank of a domain
  EXPECT_EQ(saved[3], saved[2]);
  EXPECT_NE(saved[2], saved[0]);  // domains keep their own history
  std::vector<uint64_t> uninterrupted_eval;
  const std::vector<uint64_t> uninterrupted = Run(planning, 1, 6, 14, &uninterrupted_eval);
  ASSERT_FALSE(uninterrupted_eval.empty());

  ASSERT_TRUE(planning.Open("j-1", 2, EplbSpec(), kRanks).ok());
  for (int rank = 0; rank < kRanks; ++rank) {
    const rackrun::v1::PlanReply r = Restore(planning, 2, rank, saved[rank]);
    EXPECT_TRUE(r.state_restored()) << r.error();
    EXPECT_EQ(r.domain(), rank / kG);
  }
  for (int rank : {0, 3}) EXPECT_EQ(Save(planning, 2, rank), saved[rank]);
  std::vector<uint64_t> restored_eval;
  EXPECT_EQ(Run(planning, 2, 6, 14, &restored_eval), uninterrupted);
  EXPECT_EQ(restored_eval, uninterrupted_eval);

  // Without the restore the plans differ, of training and of evaluation microbatches
  // (the test can fail).
  ASSERT_TRUE(planning.Open("j-1", 3, EplbSpec(), kRanks).ok());
  std::vector<uint64_t> fresh_eval;
  EXPECT_NE(Run(planning, 3, 6, 14, &fresh_eval), uninterrupted);
  EXPECT_NE(fresh_eval, uninterrupted_eval);

  // A policy without history: one empty last chunk, and an empty state restores.
  ASSERT_TRUE(planning.Open("j-2", 1, TwoByTwoSpec(), kRanks).ok());
  rackrun::v1::LoadRow ask = StateRow(1, 1);
  ask.set_job_id("j-2");
  ask.set_state_request(true);
  ASSERT_TRUE(planning.AddRow(ask).ok());
  auto empty = planning.NextReply("j-2", 1, 1, absl::Seconds(1));
  ASSERT_TRUE(empty.ok() && empty->has_value());
  EXPECT_TRUE((*empty)->planner_state().empty());
  EXPECT_TRUE((*empty)->planner_state_last());
}

// A state over 1 MiB (a long window) travels in chunks of at most
// rpc::kPlannerStateChunkBytes both ways; a bigger chunk is refused.
TEST_F(PlanningStateTest, StatesOverOneMiBTravelInChunks) {
  const int window = 20000;  // 20000 x 8 experts x 8 bytes x 2 layers: about 2.5 MB
  Planning planning;
  ASSERT_TRUE(planning.Open("j-1", 1, EplbSpec(window), kRanks).ok());
  ASSERT_FALSE(Run(planning, 1, 0, 3).empty());
  std::vector<size_t> chunks;
  const std::string state = Save(planning, 1, 0, &chunks);
  EXPECT_GT(state.size(), 2 * rpc::kPlannerStateChunkBytes);
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0], rpc::kPlannerStateChunkBytes);
  EXPECT_EQ(chunks[1], rpc::kPlannerStateChunkBytes);
  const std::string other = Save(planning, 1, 2);
  const std::vector<uint64_t> uninterrupted = Run(planning, 1, 3, 8);

  ASSERT_TRUE(planning.Open("j-1", 2, EplbSpec(window), kRanks).ok());
  for (int rank = 0; rank < kRanks; ++rank) {
    const rackrun::v1::PlanReply r = Restore(planning, 2, rank, rank < kG ? state : other);
    EXPECT_TRUE(r.state_restored()) << r.error();
  }
  EXPECT_EQ(Save(planning, 2, 1), state);
  EXPECT_EQ(Run(planning, 2, 3, 8), uninterrupted);

  ASSERT_TRUE(planning.Open("j-1", 3, EplbSpec(window), kRanks).ok());
  rackrun::v1::LoadRow big = StateRow(3, 0);
  big.set_restore_state(std::string(rpc::kPlannerStateChunkBytes + 1, 'x'));
  const absl::Status refused = planning.AddRow(big);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(refused.message()).find("restore_state: chunks of at most 1048576 bytes"),
            std::string::npos)
      << refused;
}

// Malformed bytes, a state of other settings, a restore after planning began, ranks of a
// domain restoring different states, and malformed state rows: clear errors.
TEST_F(PlanningStateTest, CorruptOrMismatchedStatesGiveClearErrors) {
  Planning planning;
  ASSERT_TRUE(planning.Open("j-1", 1, EplbSpec(), kRanks).ok());
  ASSERT_FALSE(Run(planning, 1, 0, 4).empty());
  const std::string state = Save(planning, 1, 0);
  const std::string later = (Run(planning, 1, 4, 6), Save(planning, 1, 0));
  ASSERT_NE(later, state);

  ASSERT_TRUE(planning.Open("j-1", 2, EplbSpec(), kRanks).ok());
  rackrun::v1::PlanReply r = Restore(planning, 2, 0, state.substr(0, state.size() - 5));
  EXPECT_FALSE(r.state_restored());
  EXPECT_EQ(r.error_code(), static_cast<int>(absl::StatusCode::kDataLoss));
  EXPECT_NE(r.error().find("restoring the planner state of domain 0: planner states of"),
            std::string::npos)
      << r.error();
  r = Restore(planning, 2, 1, "not a state");
  EXPECT_EQ(r.error_code(), static_cast<int>(absl::StatusCode::kDataLoss)) << r.error();

  ASSERT_TRUE(planning.Open("j-1", 3, EplbSpec(/*window=*/5), kRanks).ok());
  r = Restore(planning, 3, 2, state);
  EXPECT_EQ(r.error_code(), static_cast<int>(absl::StatusCode::kFailedPrecondition)) << r.error();
  EXPECT_NE(r.error().find("window 4"), std::string::npos) << r.error();

  ASSERT_TRUE(planning.Open("j-1", 4, EplbSpec(), kRanks).ok());
  EXPECT_TRUE(Restore(planning, 4, 0, state).state_restored());
  r = Restore(planning, 4, 1, later);
  EXPECT_EQ(r.error_code(), static_cast<int>(absl::StatusCode::kDataLoss)) << r.error();
  EXPECT_NE(r.error().find("differs from"), std::string::npos) << r.error();
  EXPECT_TRUE(Restore(planning, 4, 1, state).state_restored());  // the same bytes again: fine

  ASSERT_TRUE(planning.Open("j-1", 5, EplbSpec(), kRanks).ok());
  ASSERT_FALSE(Run(planning, 5, 0, 1).empty());
  r = Restore(planning, 5, 3, state);
  EXPECT_EQ(r.error_code(), static_cast<int>(absl::StatusCode::kFailedPrecondition)) << r.error();
  EXPECT_NE(r.error().find("have already planned"), std::string::npos) << r.error();

  rackrun::v1::LoadRow both = StateRow(5, 0);
  both.set_state_request(true);
  both.set_restore_state("x");
  EXPECT_EQ(planning.AddRow(both).code(), absl::StatusCode::kInvalidArgument);
  rackrun::v1::LoadRow loaded = StateRow(5, 0);
  loaded.set_state_request(true);
  loaded.add_loads(1);
  const absl::Status with_loads = planning.AddRow(loaded);
  EXPECT_EQ(with_loads.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(with_loads.message()).find("loads: a state_request row carries no loads"),
            std::string::npos)
      << with_loads;
}

TEST(PlanCodecTest, RejectsInconsistentSizes) {
  rackrun::v1::PlanMessage m;
  m.set_ranks(2);
  m.set_experts(2);
  m.add_instance_expert(0);
  planner::Plan p;
  planner::LoadMatrix l;
  EXPECT_EQ(rpc::PlanFromMessage(m, &p, &l).code(), absl::StatusCode::kInvalidArgument);
}

// A plan with a replicated expert round-trips with its loads; every damaged size of the
// sparse split, the loads or first is refused with the field named.
TEST(PlanCodecTest, SparseSplitRoundTripsAndMalformedPlansAreRefused) {
  const planner::Domain domain{2, 2, 1};
  planner::LoadMatrix loads(2, 4);
  for (int s = 0; s < 2; ++s) {
    for (int e = 0; e < 4; ++e) loads.at(s, e) = 3 + s + e;
  }
  loads.at(0, 0) = 90;
  loads.at(1, 0) = 70;
  auto planner = planner::MakePlanner("ultraep", domain, planner::PlannerOptions{});
  ASSERT_TRUE(planner.ok());
  absl::StatusOr<planner::Plan> plan = (*planner)->Solve(loads, 0);
  ASSERT_TRUE(plan.ok());
  ASSERT_GT(plan->num_replicas(), 0);
  ASSERT_EQ(plan->split.size(), 4u);  // expert 0: master + replica, 2 sources each
  rackrun::v1::PlanMessage m;
  rpc::PlanToMessage(*plan, loads, &m);
  planner::Plan p;
  planner::LoadMatrix l;
  ASSERT_TRUE(rpc::PlanFromMessage(m, &p, &l).ok());
  EXPECT_TRUE(p == *plan);
  EXPECT_EQ(l.counts, loads.counts);
  EXPECT_TRUE(planner::CheckPlanInvariants(domain, l, p).ok());

  const auto refused = [&p, &l](const rackrun::v1::PlanMessage& bad, const std::string& field) {
    const absl::Status s = rpc::PlanFromMessage(bad, &p, &l);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(std::string(s.message()).find(field), std::string::npos) << s;
  };
  rackrun::v1::PlanMessage bad = m;
  bad.add_replicated_split(1);
  refused(bad,
          "plan.replicated_split: 5 entries, expected ranks x instances of replicated "
          "experts = 2 x 2");
  bad = m;
  bad.mutable_loads()->RemoveLast();
  refused(bad, "plan.loads: 7 entries, expected ranks x experts = 2 x 4");
  bad = m;
  bad.clear_replicated_split();  // a plan from a coordinator that sends the old dense split
  refused(bad, "plan.replicated_split: 0 entries");
  bad = m;
  bad.set_first(1, bad.first(2) + 1);
  refused(bad, "plan.first: descends at expert 1");
  bad = m;
  bad.set_first(0, 1);
  refused(bad, "plan.first: runs from 1");
}

}  // namespace
}  // namespace rackrun::coordinator
