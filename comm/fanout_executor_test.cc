// Relay fan-out on in-process ranks: every replica receives bit-identical bytes, in direct
// and relay schedules, with eager and round pacing; malformed input and silent peers.
#include "comm/fanout_executor.h"

#include "comm/inprocess_channel.h"
#include "comm/testing/channel_checks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::comm {
namespace {

using ::testing::HasSubstr;

struct Case {
  int ranks;
  FanoutPacing pacing;
};

class RelayFanoutTest : public ::testing::TestWithParam<Case> {};

TEST_P(RelayFanoutTest, EveryReplicaGetsIdenticalBytes) {
  absl::Status s = RunInProcessRanks(GetParam().ranks, {}, [&](DataChannel& channel) {
    testing::CheckRelayFanout(channel, GetParam().pacing);
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
}

INSTANTIATE_TEST_SUITE_P(
    RanksAndPacing, RelayFanoutTest,
    ::testing::Values(Case{1, FanoutPacing::kEager}, Case{2, FanoutPacing::kEager},
                      Case{4, FanoutPacing::kEager}, Case{6, FanoutPacing::kEager},
                      Case{9, FanoutPacing::kEager}, Case{2, FanoutPacing::kRounds},
                      Case{4, FanoutPacing::kRounds}, Case{9, FanoutPacing::kRounds}),
    [](const auto& param_info) {
      return std::to_string(param_info.param.ranks) + "ranks" +
             (param_info.param.pacing == FanoutPacing::kEager ? "Eager" : "Rounds");
    });

TEST(FanoutExecutor, RejectsScheduleWithoutSingleOrigin) {
  auto channels = CreateInProcessChannels(3);
  ASSERT_TRUE(channels.ok());
  // Expert 0 goes 1 -> 2 and 2 -> 1: nobody originates it.
  planner::FanoutSchedule cycle{{{0, 1, 2, 0}, {0, 2, 1, 1}}};
  std::vector<std::byte> buf(16);
  auto r = ExecuteFanout(*(*channels)[1], cycle, 16, {{0, std::span<std::byte>(buf)}});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("0 origin ranks"));

  planner::FanoutSchedule self{{{0, 1, 1, 0}}};
  r = ExecuteFanout(*(*channels)[1], self, 16, {{0, std::span<std::byte>(buf)}});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("two different ranks"));
}

TEST(FanoutExecutor, RejectsMissingOrWrongSizedBuffer) {
  auto channels = CreateInProcessChannels(2);
  ASSERT_TRUE(channels.ok());
  planner::FanoutSchedule schedule{{{3, 0, 1, 0}}};
  auto missing = ExecuteFanout(*(*channels)[0], schedule, 16, {});
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(), HasSubstr("buffers[expert 3] is missing"));
  std::vector<std::byte> small(8);
  auto wrong = ExecuteFanout(*(*channels)[1], schedule, 16, {{3, std::span<std::byte>(small)}});
  ASSERT_FALSE(wrong.ok());
  EXPECT_THAT(wrong.status().message(), HasSubstr("has 8 bytes"));
}

// A relay that never forwards: its leaf times out naming the relay, the expert and the
// chunk it waited for.
TEST(FanoutExecutor, SilentRelayTimesOutNamingIt) {
  for (FanoutPacing pacing : {FanoutPacing::kEager, FanoutPacing::kRounds}) {
    ChannelOptions options;
    options.timeout = absl::Milliseconds(300);
    planner::FanoutSchedule schedule{{{5, 0, 1, 0}, {5, 1, 2, 1}}};
    absl::Status s = RunInProcessRanks(3, options, [&](DataChannel& channel) {
      if (channel.rank() == 1) return absl::OkStatus();  // the relay stops answering
      std::vector<std::byte> buf(64, std::byte{1});
      FanoutExecutorOptions fanout;
      fanout.chunk_bytes = 16;
      fanout.pacing = pacing;
      auto r = ExecuteFanout(channel, schedule, 64, {{5, std::span<std::byte>(buf)}}, fanout);
      if (channel.rank() == 2) {
        EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
        EXPECT_THAT(r.status().message(), HasSubstr("FanoutExecutor on rank 2 of 3"));
        EXPECT_THAT(r.status().message(), HasSubstr("rank 1 (expert 5 chunk 0/4, recv)"));
      }
      return absl::OkStatus();
    });
    EXPECT_TRUE(s.ok()) << s;
  }
}

}  // namespace
}  // namespace rackrun::comm
