// The data-channel contract on the UCX backend (comm/testing/store_channel_checks.h: ranks as
// threads, UCX's shared-memory and loopback transports, 1/2/4 ranks, absent, silent,
// destroyed and killed peers), wrong sizes and cancelled receives on the eager and
// rendezvous paths, and the data address's interface.
#include "comm/ucx_channel.h"

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/testing/channel_checks.h"
#include "comm/testing/store_channel_checks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::comm {
namespace {

using ::testing::HasSubstr;
using testing::RunStoreRanks;

UcxChannelOptions Options(absl::Duration timeout) {
  UcxChannelOptions options;
  options.channel.timeout = timeout;
  options.address = "127.0.0.1";  // UCX's network transports on the loopback interface only
  return options;
}

absl::StatusOr<std::unique_ptr<DataChannel>> Factory(RendezvousStore& store,
                                                     const std::string& prefix, int rank, int size,
                                                     absl::Duration timeout) {
  return CreateUcxChannel(store, prefix, rank, size, Options(timeout));
}

class UcxChannelTest : public ::testing::TestWithParam<int> {
 protected:
  void OnAllRanks(const std::function<void(DataChannel&)>& check) {
    testing::CheckOnRanks(Factory, GetParam(), "ucx", check);
  }
};

TEST_P(UcxChannelTest, Allgather) { OnAllRanks(testing::CheckAllgather); }
TEST_P(UcxChannelTest, AllToAllV) { OnAllRanks(testing::CheckAllToAllV); }
TEST_P(UcxChannelTest, Broadcast) { OnAllRanks(testing::CheckBroadcast); }
TEST_P(UcxChannelTest, Barrier) { OnAllRanks(testing::CheckBarrier); }
TEST_P(UcxChannelTest, AllReduceIsBitIdenticalInRankOrder) {
  OnAllRanks([](DataChannel& c) { testing::CheckAllReduce(c, /*fixed_order=*/true); });
}
TEST_P(UcxChannelTest, SendRecv) { OnAllRanks(testing::CheckSendRecv); }
TEST_P(UcxChannelTest, BadArguments) { OnAllRanks(testing::CheckBadArguments); }
TEST_P(UcxChannelTest, TokenDispatchMatchesHome) {
  OnAllRanks([](DataChannel& c) {
    testing::CheckTokenDispatch(c, 1, /*use_ultraep=*/false);
    testing::CheckTokenDispatch(c, 11, /*use_ultraep=*/true);
  });
}
// Sub-channels (DataChannel::Split) on UCX's transport: the expert-parallel domains.
TEST_P(UcxChannelTest, SubChannels) {
  OnAllRanks([](DataChannel& c) { testing::CheckSubChannels(c, c.size() >= 4 ? 2 : c.size()); });
}
TEST_P(UcxChannelTest, FanoutExecutor) {
  OnAllRanks([](DataChannel& c) { testing::CheckRelayFanout(c, FanoutPacing::kAuto); });
}

INSTANTIATE_TEST_SUITE_P(Ranks, UcxChannelTest, ::testing::Values(1, 2, 4),
                         [](const auto& param_info) {
                           return std::to_string(param_info.param) + "ranks";
                         });

TEST(UcxChannel, AllReduceEqualsInProcessBitForBit) {
  testing::CheckAllReduceEqualsInProcessBitForBit(Factory);
}

// Between two ranks, on UCX's eager and rendezvous paths: a message larger or smaller than
// the posted receive fails that receive with InvalidArgument and is consumed, and the next
// message on the same (peer, tag) arrives intact. A receive destroyed before its message
// came is cancelled without consuming anything (MPI_Cancel's rule): the message goes to
// the next receive.
TEST(UcxChannel, WrongSizeAndCancelledReceivesKeepThePairInOrder) {
  InMemoryRendezvousStore store;
  absl::Status s =
      RunStoreRanks(Factory, store, "job/sizes", 2, absl::Seconds(30), [](DataChannel& ch) {
        const absl::Duration t = absl::Seconds(20);
        for (const int64_t n : {int64_t{3}, int64_t{100000}}) {  // 12 bytes eager, 400 KB not
          const auto count = static_cast<size_t>(n);
          std::vector<int32_t> larger(count + 1, -1), smaller(count - 1, -3), right(count),
              first(count, -2);
          for (size_t i = 0; i < count; ++i) right[i] = static_cast<int32_t>(i * 3 + count);
          if (ch.rank() == 0) {
            auto a = ch.Isend(larger.data(), n + 1, DataType::kInt32, 1, 20);
            auto b = ch.Isend(smaller.data(), n - 1, DataType::kInt32, 1, 20);
            auto c = ch.Isend(right.data(), n, DataType::kInt32, 1, 20);
            if (!a.ok() || !b.ok() || !c.ok()) return absl::InternalError("Isend failed");
            for (auto* r : {&a, &b, &c}) {
              // A send whose message the receiver refused may report that refusal too.
              (void)(**r)->Wait(t);
            }
            if (absl::Status w = ch.Barrier(); !w.ok()) return w;  // rank 1 cancelled its receive
            auto d = ch.Isend(first.data(), n, DataType::kInt32, 1, 21);
            auto e = ch.Isend(right.data(), n, DataType::kInt32, 1, 21);
            if (!d.ok() || !e.ok()) return absl::InternalError("Isend failed");
            if (absl::Status w = (*d)->Wait(t); !w.ok()) return w;
            if (absl::Status w = (*e)->Wait(t); !w.ok()) return w;
          } else {
            std::vector<int32_t> got(count, 0), refused(count, 0);
            auto a = ch.Irecv(refused.data(), n, DataType::kInt32, 0, 20);
            auto b = ch.Irecv(refused.data(), n, DataType::kInt32, 0, 20);
            auto c = ch.Irecv(got.data(), n, DataType::kInt32, 0, 20);
            if (!a.ok() || !b.ok() || !c.ok()) return absl::InternalError("Irecv failed");
            absl::Status too_large = (*a)->Wait(t);
            EXPECT_EQ(too_large.code(), absl::StatusCode::kInvalidArgument)
                << n << ": " << too_large;
            EXPECT_THAT(too_large.message(),
                        HasSubstr(absl::StrCat("message has more than the ", n * 4,
                                               " bytes the receive was posted for")));
            absl::Status too_small = (*b)->Wait(t);
            EXPECT_EQ(too_small.code(), absl::StatusCode::kInvalidArgument)
                << n << ": " << too_small;
            EXPECT_THAT(too_small.message(),
                        HasSubstr(absl::StrCat("message has ", (n - 1) * 4,
                                               " bytes but the receive was posted for ", n * 4)));
            EXPECT_TRUE((*c)->Wait(t).ok()) << n;
            EXPECT_EQ(got, right) << n;
            {
              auto cancelled = ch.Irecv(got.data(), n, DataType::kInt32, 0, 21);
              if (!cancelled.ok()) return cancelled.status();
            }  // destroyed before rank 0 sends
            if (absl::Status w = ch.Barrier(); !w.ok()) return w;
            std::fill(got.begin(), got.end(), 0);
            std::vector<int32_t> got_first(count, 0);
            auto d = ch.Irecv(got_first.data(), n, DataType::kInt32, 0, 21);
            auto e = ch.Irecv(got.data(), n, DataType::kInt32, 0, 21);
            if (!d.ok() || !e.ok()) return absl::InternalError("Irecv failed");
            EXPECT_TRUE((*d)->Wait(t).ok()) << n;
            EXPECT_TRUE((*e)->Wait(t).ok()) << n;
            EXPECT_EQ(got_first, first) << n;
            EXPECT_EQ(got, right) << n;
          }
        }
        return ch.Barrier();
      });
  EXPECT_TRUE(s.ok()) << s;
}

TEST(UcxChannel, CountsCollectivesForProgress) {
  testing::CheckCountsCollectivesForProgress(Factory);
}
TEST(UcxChannel, JobsWithDifferentPrefixesShareOneStore) {
  testing::CheckJobsWithDifferentPrefixesShareOneStore(Factory);
}
TEST(UcxChannel, SilentRankTimesOutNamingIt) { testing::CheckSilentRankTimesOutNamingIt(Factory); }
TEST(UcxChannel, RejectsBadRank) { testing::CheckRejectsBadRank(Factory); }
TEST(UcxChannel, RanksThatNeverJoinAreNamed) { testing::CheckRanksThatNeverJoinAreNamed(Factory); }
TEST(UcxChannel, PeerThatNeverPostsThenTeardownAndNextChannel) {
  testing::CheckPeerThatNeverPostsThenTeardownAndNextChannel(Factory);
}
TEST(UcxChannel, PeerChannelDestroyedFailsTheSurvivor) {
  testing::CheckPeerChannelDestroyedFailsTheSurvivor(Factory);
}
// Run only as the child of PeerProcessKilledFailsTheSurvivor and
// PeerProcessKilledMidTransferFailsTheSurvivor: rank 1, connects, then (transfers and)
// waits to be killed.
TEST(UcxChannelChild, DISABLED_RankOneWaitsToBeKilled) { testing::RunAsKilledChild(Factory); }
TEST(UcxChannel, PeerProcessKilledFailsTheSurvivor) {
  testing::CheckPeerProcessKilledFailsTheSurvivor(
      Factory, "UcxChannelChild.DISABLED_RankOneWaitsToBeKilled");
}
// The peer killed during large transfers: the survivor's error names it; no abort.
TEST(UcxChannel, PeerProcessKilledMidTransferFailsTheSurvivor) {
  testing::CheckPeerProcessKilledMidTransferFailsTheSurvivor(
      Factory, "UcxChannelChild.DISABLED_RankOneWaitsToBeKilled");
}
TEST(UcxChannel, MessagesSentBeforeCloseArrive) {
  testing::CheckMessagesSentBeforeCloseArrive(Factory);
}
// The same with UCX on TCP only (as between hosts): a send completes when UCX has copied
// it, so a rank that closed forcibly at once lost its last messages (the receiver failed
// "Endpoint timeout"); the closing handshake delivers them.
TEST(UcxChannel, MessagesSentBeforeCloseArriveOverTcp) {
  const char* before = std::getenv("UCX_TLS");
  const std::string saved = before == nullptr ? "" : before;
  setenv("UCX_TLS", "tcp,self", 1);
  testing::CheckMessagesSentBeforeCloseArrive(Factory);
  if (before == nullptr) {
    unsetenv("UCX_TLS");
  } else {
    setenv("UCX_TLS", saved.c_str(), 1);
  }
}
// The data address picks the interface when it is an IP address; one this machine does
// not have is refused naming it, a host name leaves the choice to UCX.
TEST(UcxChannel, DataAddressPicksTheInterface) {
  InMemoryRendezvousStore store;
  UcxChannelOptions foreign = Options(absl::Seconds(5));
  foreign.address = "198.18.0.77";
  auto refused = CreateUcxChannel(store, "job/foreign", 0, 1, foreign);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("data address 198.18.0.77"));
  UcxChannelOptions named = Options(absl::Seconds(30));
  named.address = "localhost";
  auto one = CreateUcxChannel(store, "job/named-one", 0, 1, named);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_TRUE((*one)->Barrier().ok());
  // Any address of the loopback subnet is the loopback interface's (127.0.0.2 is answered
  // on lo although lo's own address is 127.0.0.1): the daemon tests' data addresses.
  UcxChannelOptions alias = Options(absl::Seconds(30));
  alias.address = "127.0.0.2";
  auto on_lo = CreateUcxChannel(store, "job/alias-one", 0, 1, alias);
  ASSERT_TRUE(on_lo.ok()) << on_lo.status();
  EXPECT_TRUE((*on_lo)->Barrier().ok());
}

}  // namespace
}  // namespace rackrun::comm
