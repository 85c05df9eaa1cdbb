// The data-channel contract on the in-process backend (threads), for 1 to 4 ranks; the
// same checks run under mpirun in tests/mpi/mpi_comm_test.cc.
#include "comm/inprocess_channel.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/testing/channel_checks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::comm {
namespace {

using ::testing::HasSubstr;

class InProcessChannelTest : public ::testing::TestWithParam<int> {
 protected:
  // Runs `check` on every rank; failures are recorded by the check's assertions.
  void OnAllRanks(const std::function<void(DataChannel&)>& check) {
    ChannelOptions options;
    options.timeout = absl::Seconds(30);
    absl::Status s = RunInProcessRanks(GetParam(), options, [&](DataChannel& channel) {
      EXPECT_EQ(channel.size(), GetParam());
      EXPECT_EQ(channel.backend(), "inprocess");
      check(channel);
      return absl::OkStatus();
    });
    ASSERT_TRUE(s.ok()) << s;
  }
};

TEST_P(InProcessChannelTest, Allgather) { OnAllRanks(testing::CheckAllgather); }
TEST_P(InProcessChannelTest, AllToAllV) { OnAllRanks(testing::CheckAllToAllV); }
TEST_P(InProcessChannelTest, Broadcast) { OnAllRanks(testing::CheckBroadcast); }
TEST_P(InProcessChannelTest, Barrier) { OnAllRanks(testing::CheckBarrier); }
TEST_P(InProcessChannelTest, AllReduceIsBitIdenticalInRankOrder) {
  OnAllRanks([](DataChannel& c) { testing::CheckAllReduce(c, /*fixed_order=*/true); });
}
TEST_P(InProcessChannelTest, SendRecv) { OnAllRanks(testing::CheckSendRecv); }
TEST_P(InProcessChannelTest, BadArguments) { OnAllRanks(testing::CheckBadArguments); }

INSTANTIATE_TEST_SUITE_P(Ranks, InProcessChannelTest, ::testing::Values(1, 2, 3, 4),
                         [](const auto& param_info) {
                           return std::to_string(param_info.param) + "ranks";
                         });

// Sub-groups of 4 ranks as 2 x 2 (and 1 x 4, 4 x 1) and of 2 as 1 x 2.
TEST(InProcessChannel, SubChannels) {
  for (const auto& [ranks, group] : {std::pair{4, 2}, {4, 4}, {4, 1}, {2, 1}}) {
    SCOPED_TRACE(absl::StrCat(ranks, " ranks, groups of ", group));
    ChannelOptions options;
    options.timeout = absl::Seconds(30);
    absl::Status s = RunInProcessRanks(ranks, options, [&](DataChannel& channel) {
      testing::CheckSubChannels(channel, group);
      return absl::OkStatus();
    });
    EXPECT_TRUE(s.ok()) << s;
  }
}

TEST(InProcessChannel, SilentRankTimesOutNamingIt) {
  for (int ranks : {2, 4}) {
    ChannelOptions options;
    options.timeout = absl::Seconds(1);
    absl::Status s = RunInProcessRanks(ranks, options, [&](DataChannel& channel) {
      testing::CheckSilentRankTimesOut(channel, ranks - 1);
      return absl::OkStatus();
    });
    EXPECT_TRUE(s.ok()) << s;
  }
}

// progress() counts every collective at entry and on success, and is read by another
// thread while a rank waits in a collective its peer has not reached.
TEST(InProcessChannel, ProgressCountsCollectives) {
  ChannelOptions options;
  options.timeout = absl::Seconds(30);
  absl::StatusOr<std::vector<std::unique_ptr<DataChannel>>> channels =
      CreateInProcessChannels(2, options);
  ASSERT_TRUE(channels.ok());
  DataChannel& zero = *(*channels)[0];
  DataChannel& one = *(*channels)[1];
  std::atomic<bool> observed{false};
  auto rank_body = [&](DataChannel& c) {
    int64_t x = c.rank();
    std::vector<int64_t> all(2);
    EXPECT_TRUE(c.Allgather(&x, all.data(), 1, DataType::kInt64).ok());
    EXPECT_TRUE(c.AllReduce(&x, &x, 1, DataType::kInt64, ReduceOp::kSum).ok());
    EXPECT_TRUE(c.Broadcast(&x, 1, DataType::kInt64, 0).ok());
    const int64_t counts[2] = {1, 1}, displs[2] = {0, 1};
    EXPECT_TRUE(
        c.AllToAllV(all.data(), counts, displs, all.data(), counts, displs, DataType::kInt64).ok());
    // Rank 1 reaches the barrier only once the observer has seen rank 0 wait in it.
    if (c.rank() == 1) {
      while (!observed.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_TRUE(c.Barrier().ok());
    // A call that fails its checks was entered but did not complete.
    EXPECT_FALSE(c.Broadcast(&x, -1, DataType::kInt64, 0).ok());
  };
  std::thread t0([&] { rank_body(zero); });
  std::thread t1([&] { rank_body(one); });
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  // Rank 0 can be in the barrier before rank 1 has counted its all-to-all as completed:
  // wait for both.
  while ((zero.progress().collectives_entered < 5 || one.progress().collectives_completed < 4) &&
         absl::Now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(zero.progress().collectives_entered, 5);
  EXPECT_EQ(zero.progress().collectives_completed, 4);
  EXPECT_EQ(one.progress().collectives_entered, 4);
  EXPECT_EQ(one.progress().collectives_completed, 4);
  observed = true;
  t0.join();
  t1.join();
  for (DataChannel* c : {&zero, &one}) {
    EXPECT_EQ(c->progress().collectives_entered, 6);
    EXPECT_EQ(c->progress().collectives_completed, 5);
  }
}

TEST(InProcessChannel, RejectsZeroRanks) {
  auto channels = CreateInProcessChannels(0);
  ASSERT_FALSE(channels.ok());
  EXPECT_THAT(channels.status().message(), HasSubstr("ranks=0"));
}

TEST(ChannelOptions, TimeoutFromEnvironment) {
  setenv("RACKRUN_COMM_TIMEOUT_S", "2.5", 1);
  absl::StatusOr<ChannelOptions> options = ChannelOptions::FromEnv();
  ASSERT_TRUE(options.ok());
  EXPECT_EQ(options->timeout, absl::Milliseconds(2500));
  setenv("RACKRUN_COMM_TIMEOUT_S", "soon", 1);
  options = ChannelOptions::FromEnv();
  ASSERT_FALSE(options.ok());
  EXPECT_THAT(options.status().message(), HasSubstr("RACKRUN_COMM_TIMEOUT_S"));
  unsetenv("RACKRUN_COMM_TIMEOUT_S");
}

}  // namespace
}  // namespace rackrun::comm
