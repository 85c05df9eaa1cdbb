// The data-channel contract on the Gloo backend (comm/testing/store_channel_checks.h: ranks as
// threads over 127.0.0.1, 1/2/4 ranks, absent, silent, destroyed and killed peers), and
// how Gloo's slots keep order after wrong sizes and cancelled receives. Each rank listens
// only on its own address (read back from /proc/net/tcp).
#include "comm/gloo_channel.h"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/data_address.h"
#include "comm/testing/channel_checks.h"
#include "comm/testing/store_channel_checks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/listening_sockets.h"

namespace rackrun::comm {
namespace {

using ::testing::HasSubstr;
using testing::RunStoreRanks;

GlooChannelOptions Options(absl::Duration timeout) {
  GlooChannelOptions options;
  options.channel.timeout = timeout;
  options.address = "127.0.0.1";
  return options;
}

absl::StatusOr<std::unique_ptr<DataChannel>> Factory(RendezvousStore& store,
                                                     const std::string& prefix, int rank, int size,
                                                     absl::Duration timeout) {
  return CreateGlooChannel(store, prefix, rank, size, Options(timeout));
}

class GlooChannelTest : public ::testing::TestWithParam<int> {
 protected:
  void OnAllRanks(const std::function<void(DataChannel&)>& check) {
    testing::CheckOnRanks(Factory, GetParam(), "gloo", check);
  }
};

TEST_P(GlooChannelTest, Allgather) { OnAllRanks(testing::CheckAllgather); }
TEST_P(GlooChannelTest, AllToAllV) { OnAllRanks(testing::CheckAllToAllV); }
TEST_P(GlooChannelTest, Broadcast) { OnAllRanks(testing::CheckBroadcast); }
TEST_P(GlooChannelTest, Barrier) { OnAllRanks(testing::CheckBarrier); }
TEST_P(GlooChannelTest, AllReduceIsBitIdenticalInRankOrder) {
  OnAllRanks([](DataChannel& c) { testing::CheckAllReduce(c, /*fixed_order=*/true); });
}
TEST_P(GlooChannelTest, SendRecv) { OnAllRanks(testing::CheckSendRecv); }
TEST_P(GlooChannelTest, BadArguments) { OnAllRanks(testing::CheckBadArguments); }
TEST_P(GlooChannelTest, TokenDispatchMatchesHome) {
  OnAllRanks([](DataChannel& c) {
    testing::CheckTokenDispatch(c, 1, /*use_ultraep=*/false);
    testing::CheckTokenDispatch(c, 11, /*use_ultraep=*/true);
  });
}
// Sub-groups over Gloo's transport: 4 ranks as 2 x 2, 2 ranks as 1 x 2 (the daemons'
// channel gets expert-parallel domains too).
TEST_P(GlooChannelTest, SubChannels) {
  OnAllRanks([](DataChannel& c) { testing::CheckSubChannels(c, c.size() >= 4 ? 2 : c.size()); });
}
TEST_P(GlooChannelTest, FanoutExecutor) {
  OnAllRanks([](DataChannel& c) { testing::CheckRelayFanout(c, FanoutPacing::kAuto); });
}

INSTANTIATE_TEST_SUITE_P(Ranks, GlooChannelTest, ::testing::Values(1, 2, 4),
                         [](const auto& param_info) {
                           return std::to_string(param_info.param) + "ranks";
                         });

TEST(GlooChannel, AllReduceEqualsInProcessBitForBit) {
  testing::CheckAllReduceEqualsInProcessBitForBit(Factory);
}

// Between two ranks (not to itself, which never touches Gloo): a message whose size
// differs from the posted receive fails that receive with InvalidArgument and is consumed,
// and so is a message whose receive was destroyed before it came; the next message on the
// same (peer, tag) arrives intact. Both paths of the transport: a payload carried inside
// the header (up to 1 KiB) and one that follows it (drained when unwanted).
TEST(GlooChannel, WrongSizeAndCancelledReceivesKeepTheSlotInOrder) {
  InMemoryRendezvousStore store;
  absl::Status s =
      RunStoreRanks(Factory, store, "job/sizes", 2, absl::Seconds(30), [](DataChannel& ch) {
        const absl::Duration t = absl::Seconds(20);
        for (const int64_t n : {int64_t{3}, int64_t{5000}}) {  // 12 bytes inline, 20000 not
          const auto count = static_cast<size_t>(n);
          std::vector<int32_t> wrong(count + 1, -1), right(count), dropped(count, -2);
          for (size_t i = 0; i < count; ++i) right[i] = static_cast<int32_t>(i * 3 + count);
          if (ch.rank() == 0) {
            auto a = ch.Isend(wrong.data(), n + 1, DataType::kInt32, 1, 20);
            auto b = ch.Isend(right.data(), n, DataType::kInt32, 1, 20);
            if (!a.ok() || !b.ok()) return absl::InternalError("Isend failed");
            if (absl::Status w = (*a)->Wait(t); !w.ok()) return w;
            if (absl::Status w = (*b)->Wait(t); !w.ok()) return w;
            if (absl::Status w = ch.Barrier(); !w.ok()) return w;  // rank 1 cancelled its receive
            auto c = ch.Isend(dropped.data(), n, DataType::kInt32, 1, 21);
            auto d = ch.Isend(right.data(), n, DataType::kInt32, 1, 21);
            if (!c.ok() || !d.ok()) return absl::InternalError("Isend failed");
            if (absl::Status w = (*c)->Wait(t); !w.ok()) return w;
            if (absl::Status w = (*d)->Wait(t); !w.ok()) return w;
          } else {
            std::vector<int32_t> got(count, 0);
            auto a = ch.Irecv(got.data(), n, DataType::kInt32, 0, 20);
            auto b = ch.Irecv(got.data(), n, DataType::kInt32, 0, 20);
            if (!a.ok() || !b.ok()) return absl::InternalError("Irecv failed");
            absl::Status mismatch = (*a)->Wait(t);
            EXPECT_EQ(mismatch.code(), absl::StatusCode::kInvalidArgument) << n << ": " << mismatch;
            EXPECT_THAT(mismatch.message(),
                        HasSubstr(absl::StrCat("message has ", (n + 1) * 4,
                                               " bytes but the receive was posted for ", n * 4)));
            EXPECT_TRUE((*b)->Wait(t).ok()) << n;
            EXPECT_EQ(got, right) << n;
            {
              auto cancelled = ch.Irecv(got.data(), n, DataType::kInt32, 0, 21);
              if (!cancelled.ok()) return cancelled.status();
            }  // destroyed before rank 0 sends
            if (absl::Status w = ch.Barrier(); !w.ok()) return w;
            std::fill(got.begin(), got.end(), 0);
            auto d = ch.Irecv(got.data(), n, DataType::kInt32, 0, 21);
            if (!d.ok()) return d.status();
            EXPECT_TRUE((*d)->Wait(t).ok()) << n;
            EXPECT_EQ(got, right) << n;
          }
        }
        return ch.Barrier();
      });
  EXPECT_TRUE(s.ok()) << s;
}

TEST(GlooChannel, CountsCollectivesForProgress) {
  testing::CheckCountsCollectivesForProgress(Factory);
}
TEST(GlooChannel, JobsWithDifferentPrefixesShareOneStore) {
  testing::CheckJobsWithDifferentPrefixesShareOneStore(Factory);
}

class ListenerSnapshotStore final : public RendezvousStore {
 public:
  ListenerSnapshotStore(std::string mesh_prefix, std::map<std::string, std::string> before)
      : mesh_prefix_(std::move(mesh_prefix)), before_(std::move(before)) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    // "<prefix>/gloo/mesh/<rank>": the rank's pair addresses ("rank_<r>" keys come later).
    if (key.rfind(mesh_prefix_, 0) == 0 &&
        key.find_first_not_of("0123456789", mesh_prefix_.size()) == std::string::npos) {
      std::set<std::string> addresses;
      for (const auto& [inode, at] : ::rackrun::testing::ListeningSockets()) {
        if (before_.count(inode) == 0) addresses.insert(::rackrun::testing::AddressOf(at));
      }
      std::lock_guard<std::mutex> lock(mu_);
      seen_[key.substr(mesh_prefix_.size())] = std::move(addresses);
    }
    return store_.Set(key, value);
  }
  absl::StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                               absl::Duration timeout) override {
    return store_.Get(keys, timeout);
  }
  // Mesh key (the rank) -> the new listening addresses when that rank published its own.
  std::map<std::string, std::set<std::string>> seen() {
    std::lock_guard<std::mutex> lock(mu_);
    return seen_;
  }

 private:
  const std::string mesh_prefix_;
  const std::map<std::string, std::string> before_;
  InMemoryRendezvousStore store_;
  std::mutex mu_;
  std::map<std::string, std::set<std::string>> seen_;
};

TEST(GlooChannel, ListensOnlyOnItsAddress) {
  for (const int ranks : {2, 4}) {
    const std::string prefix = absl::StrCat("job/bind", ranks);
    ListenerSnapshotStore store(prefix + "/gloo/mesh/", ::rackrun::testing::ListeningSockets());
    std::set<std::string> expected;
    for (int r = 0; r < ranks; ++r) expected.insert(absl::StrCat("127.0.0.", 10 + r));
    std::vector<std::unique_ptr<DataChannel>> channels(static_cast<size_t>(ranks));
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        GlooChannelOptions o = Options(absl::Seconds(30));
        o.address = absl::StrCat("127.0.0.", 10 + r);
        absl::StatusOr<std::unique_ptr<DataChannel>> c =
            CreateGlooChannel(store, prefix, r, ranks, o);
        ASSERT_TRUE(c.ok()) << c.status();
        channels[static_cast<size_t>(r)] = *std::move(c);
      });
    }
    for (std::thread& t : threads) t.join();
    const std::map<std::string, std::set<std::string>> seen = store.seen();
    ASSERT_EQ(seen.size(), static_cast<size_t>(ranks)) << "every rank published its addresses";
    for (const auto& [rank, addresses] : seen) {
      EXPECT_THAT(addresses, ::testing::Contains(absl::StrCat("127.0.0.", 10 + std::stoi(rank))))
          << "rank " << rank << " of " << ranks;
      for (const std::string& a : addresses) {
        EXPECT_EQ(expected.count(a), 1u) << a << " is not a data address (" << ranks << " ranks)";
      }
    }
    channels.clear();
  }
}

TEST(GlooChannel, RefusesAWildcardAddress) {
  for (const char* wildcard : {"0.0.0.0", "::", "[::]"}) {
    EXPECT_TRUE(IsWildcardAddress(wildcard)) << wildcard;
    InMemoryRendezvousStore store;
    GlooChannelOptions o = Options(absl::Seconds(1));
    o.address = wildcard;
    absl::StatusOr<std::unique_ptr<DataChannel>> c = CreateGlooChannel(store, "job/any", 0, 1, o);
    ASSERT_FALSE(c.ok()) << wildcard;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(c.status().message(), HasSubstr("every interface"));
  }
  for (const char* address : {"127.0.0.1", "::1", "node7", "198.18.0.2"}) {
    EXPECT_FALSE(IsWildcardAddress(address)) << address;
  }
}

TEST(GlooChannel, SilentRankTimesOutNamingIt) { testing::CheckSilentRankTimesOutNamingIt(Factory); }
TEST(GlooChannel, RejectsBadRank) { testing::CheckRejectsBadRank(Factory); }
TEST(GlooChannel, RanksThatNeverJoinAreNamed) { testing::CheckRanksThatNeverJoinAreNamed(Factory); }
TEST(GlooChannel, PeerThatNeverPostsThenTeardownAndNextChannel) {
  testing::CheckPeerThatNeverPostsThenTeardownAndNextChannel(Factory);
}
TEST(GlooChannel, PeerChannelDestroyedFailsTheSurvivor) {
  testing::CheckPeerChannelDestroyedFailsTheSurvivor(Factory);
}
// Run only as the child of PeerProcessKilledFailsTheSurvivor and
// PeerProcessKilledMidTransferFailsTheSurvivor: rank 1, connects, then (transfers and)
// waits to be killed.
TEST(GlooChannelChild, DISABLED_RankOneWaitsToBeKilled) { testing::RunAsKilledChild(Factory); }
TEST(GlooChannel, PeerProcessKilledFailsTheSurvivor) {
  testing::CheckPeerProcessKilledFailsTheSurvivor(
      Factory, "GlooChannelChild.DISABLED_RankOneWaitsToBeKilled");
}
// Killed while the ranks exchange 8 MiB all-reduces. Gloo's tcp pair (Pair::signalException
// in its source), when its connection breaks, fails the operations it has queued but not
// the receive whose message it is reading (that one has left the queue), so a survivor
// waiting on that receive fails at the channel's timeout (DeadlineExceeded naming rank 1)
// instead of at once: in 1 of 8 and 3 of 10 runs beside two busy loops (2026-12-03). The UCX
// channel, the daemons' default, fails at once (its variant holds it to that).
TEST(GlooChannel, PeerProcessKilledMidTransferFailsTheSurvivor) {
  testing::CheckPeerProcessKilledMidTransferFailsTheSurvivor(
      Factory, "GlooChannelChild.DISABLED_RankOneWaitsToBeKilled",
      /*receive_in_flight_waits_for_the_timeout=*/true);
}
TEST(GlooChannel, MessagesSentBeforeCloseArrive) {
  testing::CheckMessagesSentBeforeCloseArrive(Factory);
}

}  // namespace
}  // namespace rackrun::comm
