// The data-channel contract, token dispatch and relay fan-out on the MPI backend. Run by
// CTest as `mpirun -np 2` and `mpirun -np 4` (comm_mpi_np2, comm_mpi_np4): every rank runs
// the same tests in the same order; a failure on any rank fails the run, and a rank that
// fails early makes the others time out (named) rather than hang.
#include <mpi.h>

#include <cstdio>
#include <memory>

#include "comm/mpi_channel.h"
#include "comm/testing/channel_checks.h"
#include "gtest/gtest.h"

namespace rackrun::comm {
namespace {

DataChannel* g_channel = nullptr;

}  // namespace

// Prints a non-zero rank's failed assertions, one line each, prefixed with its rank.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_,
                 result.file_name() != nullptr ? result.file_name() : "?", result.line_number(),
                 result.message());
  }

 private:
  int rank_;
};

namespace {

TEST(MpiChannel, RankAndSizeComeFromTheLauncher) {
  int rank = -1;
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(g_channel->rank(), rank);
  EXPECT_EQ(g_channel->size(), size);
  EXPECT_EQ(g_channel->backend(), "mpi");
}
TEST(MpiChannel, Allgather) { testing::CheckAllgather(*g_channel); }
TEST(MpiChannel, AllToAllV) { testing::CheckAllToAllV(*g_channel); }
TEST(MpiChannel, Broadcast) { testing::CheckBroadcast(*g_channel); }
TEST(MpiChannel, Barrier) { testing::CheckBarrier(*g_channel); }
TEST(MpiChannel, AllReduceIsBitIdenticalInRankOrder) {
  testing::CheckAllReduce(*g_channel, /*fixed_order=*/true);
}
TEST(MpiChannel, SendRecv) { testing::CheckSendRecv(*g_channel); }
TEST(MpiChannel, BadArguments) { testing::CheckBadArguments(*g_channel); }
// Expert-parallel domains: groups of 2 (2 x 2 under -np 4, 1 x 2 under -np 2) and 1.
TEST(MpiChannel, SubChannels) {
  testing::CheckSubChannels(*g_channel, g_channel->size() % 2 == 0 ? 2 : 1);
  testing::CheckSubChannels(*g_channel, 1);
}

TEST(MpiTokenDispatch, RandomPlansMatchHomeComputation) {
  for (uint64_t seed : {1u, 2u, 3u}) testing::CheckTokenDispatch(*g_channel, seed, false);
}
TEST(MpiTokenDispatch, UltraEpPlansMatchHomeComputation) {
  for (uint64_t seed : {11u, 12u}) testing::CheckTokenDispatch(*g_channel, seed, true);
}

TEST(MpiRelayFanout, EagerPacing) { testing::CheckRelayFanout(*g_channel, FanoutPacing::kEager); }
TEST(MpiRelayFanout, RoundPacing) { testing::CheckRelayFanout(*g_channel, FanoutPacing::kRounds); }

// Last: the highest rank stops answering on a channel of its own; the others must get a
// timeout naming it, not hang.
TEST(MpiChannel, SilentRankTimesOutNamingIt) {
  ChannelOptions options;
  options.timeout = absl::Seconds(2);  // generous: the other ranks must not look silent under load
  absl::StatusOr<std::unique_ptr<DataChannel>> own = CreateMpiChannel(options);
  ASSERT_TRUE(own.ok()) << own.status();
  testing::CheckSilentRankTimesOut(**own, (*own)->size() - 1);
  // Everyone leaves together on the world channel, so the silent rank outlives the waits.
  ASSERT_TRUE(g_channel->Barrier().ok());
}

}  // namespace
}  // namespace rackrun::comm

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  rackrun::comm::ChannelOptions options;
  options.timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<rackrun::comm::DataChannel>> channel =
      rackrun::comm::CreateMpiChannel(options);
  if (!channel.ok()) {
    std::fprintf(stderr, "%s\n", std::string(channel.status().message()).c_str());
    return 2;
  }
  rackrun::comm::g_channel = channel->get();
  // Rank 0 prints the test log; the other ranks print only their failures, prefixed.
  if ((*channel)->rank() != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new rackrun::comm::FailurePrinter((*channel)->rank()));
  }
  const int result = RUN_ALL_TESTS();
  if (result != 0) {
    std::fprintf(stderr, "rank %d of %d: tests FAILED\n", (*channel)->rank(), (*channel)->size());
  }
  channel->reset();
  return result;
}
