#include "coordinator/scheduler.h"

#include <gtest/gtest.h>

namespace rackrun::coordinator {
namespace {

QueuedJob Job(const std::string& id, int ranks, const std::string& channel = "", int64_t not_before = 0) {
  QueuedJob q;
  q.job_id = id;
  q.spec.mutable_resources()->set_ranks(ranks);
  q.spec.mutable_resources()->set_channel(channel);
  q.not_before_ms = not_before;
  return q;
}

IdleWorker W(const std::string& id, const std::string& host, int launcher_rank,
             std::vector<std::string> channels = {"ucx", "gloo"}) {
  return IdleWorker{id, host, 1, launcher_rank, "", std::move(channels)};
}

TEST(SchedulerTest, RanksAreDeterministicByHostThenLauncherRank) {
  std::vector<IdleWorker> idle = {W("w-3", "b", 0), W("w-1", "a", 1), W("w-2", "a", 0), W("w-4", "b", -1)};
  std::vector<Placement> p = Schedule({Job("j-1", 4)}, idle, 0);
  ASSERT_EQ(p.size(), 1u);
  ASSERT_EQ(p[0].ranks.size(), 4u);
  EXPECT_EQ(p[0].ranks[0].worker_id, "w-2");
  EXPECT_EQ(p[0].ranks[1].worker_id, "w-1");
  EXPECT_EQ(p[0].ranks[2].worker_id, "w-4");
  EXPECT_EQ(p[0].ranks[3].worker_id, "w-3");
  std::reverse(idle.begin(), idle.end());
  std::vector<Placement> again = Schedule({Job("j-1", 4)}, idle, 0);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(again[0].ranks[r].worker_id, p[0].ranks[r].worker_id);
}

TEST(SchedulerTest, FifoWithoutOvertaking) {
  std::vector<IdleWorker> idle = {W("w-1", "a", 0), W("w-2", "a", 1)};
  // j-1 needs 3: nothing starts, j-2 (1 rank) waits behind it.
  EXPECT_TRUE(Schedule({Job("j-1", 3), Job("j-2", 1)}, idle, 0).empty());
  std::vector<Placement> p = Schedule({Job("j-1", 1), Job("j-2", 0), Job("j-3", 1)}, idle, 0);
  ASSERT_EQ(p.size(), 2u);  // 0 ranks means 1
  EXPECT_EQ(p[0].job_id, "j-1");
  EXPECT_EQ(p[0].ranks[0].worker_id, "w-1");
  EXPECT_EQ(p[1].job_id, "j-2");
  EXPECT_EQ(p[1].ranks[0].worker_id, "w-2");
}

TEST(SchedulerTest, ChannelKindAndBackoff) {
  std::vector<IdleWorker> idle = {W("w-1", "a", 0, {"ucx", "gloo"}),
                                  W("w-2", "a", 1, {"ucx", "gloo", "nccl"})};
  std::vector<Placement> p = Schedule({Job("j-1", 1, "nccl")}, idle, 0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].ranks[0].worker_id, "w-2");
  EXPECT_TRUE(Schedule({Job("j-1", 2, "nccl")}, idle, 0).empty());
  EXPECT_TRUE(Schedule({Job("j-1", 1, "", 100)}, idle, 99).empty());
  EXPECT_EQ(Schedule({Job("j-1", 1, "", 100)}, idle, 100).size(), 1u);
}

}  // namespace
}  // namespace rackrun::coordinator
