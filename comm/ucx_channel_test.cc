// The data-channel contract on the UCX backend: ranks as threads of this process (UCX's
// shared-memory and loopback transports) with the in-memory rendezvous store (1, 2 and 4
// ranks), AllReduce bit-identical to the in-process backend, and the failures a worker daemon lives through: ranks that
// never join, a peer that never posts, a peer whose channel is destroyed, a peer process
// killed with SIGKILL; after each the channel is destroyed and a new one works.
#include "comm/ucx_channel.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/channel_checks.h"
#include "comm/inprocess_channel.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::comm {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

UcxChannelOptions Options(absl::Duration timeout) {
  UcxChannelOptions options;
  options.channel.timeout = timeout;
  options.address = "127.0.0.1";  // UCX's network transports on the loopback interface only
  return options;
}

// Creates an n-rank UCX channel with one thread per rank, runs body(channel) on each,
// and destroys the channels only after every thread is done (so a rank that finishes
// early does not close connections others still use). First error in rank order.
absl::Status RunUcxRanks(RendezvousStore& store, const std::string& prefix, int ranks,
                          absl::Duration timeout,
                          const std::function<absl::Status(DataChannel&)>& body) {
  std::vector<std::unique_ptr<DataChannel>> channels(static_cast<size_t>(ranks));
  std::vector<absl::Status> results(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<DataChannel>> channel =
          CreateUcxChannel(store, prefix, r, ranks, Options(timeout));
      if (!channel.ok()) {
        results[static_cast<size_t>(r)] = channel.status();
        return;
      }
      channels[static_cast<size_t>(r)] = *std::move(channel);
      results[static_cast<size_t>(r)] = body(*channels[static_cast<size_t>(r)]);
    });
  }
  for (std::thread& t : threads) t.join();
  channels.clear();
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

class UcxChannelTest : public ::testing::TestWithParam<int> {
 protected:
  void OnAllRanks(const std::function<void(DataChannel&)>& check) {
    InMemoryRendezvousStore store;
    absl::Status s =
        RunUcxRanks(store, "job/test", GetParam(), absl::Seconds(30), [&](DataChannel& channel) {
          EXPECT_EQ(channel.size(), GetParam());
          EXPECT_EQ(channel.backend(), "ucx");
          EXPECT_TRUE(channel.matches_by_tag());
          check(channel);
          return absl::OkStatus();
        });
    ASSERT_TRUE(s.ok()) << s;
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
TEST_P(UcxChannelTest, FanoutExecutor) {
  OnAllRanks([](DataChannel& c) { testing::CheckRelayFanout(c, FanoutPacing::kAuto); });
}

INSTANTIATE_TEST_SUITE_P(Ranks, UcxChannelTest, ::testing::Values(1, 2, 4),
                         [](const auto& param_info) {
                           return std::to_string(param_info.param) + "ranks";
                         });

// The same float32 sums on UCX and in-process, compared byte for byte.
TEST(UcxChannel, AllReduceEqualsInProcessBitForBit) {
  constexpr int kRanks = 3;
  constexpr int64_t kCount = 10007;
  auto input = [](int rank) {
    std::vector<float> x(kCount);
    uint64_t state = 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(rank + 1);
    for (float& v : x) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      v = static_cast<float>(static_cast<int64_t>(state >> 40) - (1 << 23)) * 1e-3f;
    }
    return x;
  };
  std::vector<std::vector<float>> ucx(kRanks), inprocess(kRanks);
  InMemoryRendezvousStore store;
  ASSERT_TRUE(RunUcxRanks(store, "job/bits", kRanks, absl::Seconds(30), [&](DataChannel& c) {
                std::vector<float> x = input(c.rank());
                absl::Status s = c.AllReduce(x.data(), x.data(), kCount, DataType::kFloat32,
                                             ReduceOp::kSum);
                ucx[static_cast<size_t>(c.rank())] = x;
                return s;
              }).ok());
  ChannelOptions options;
  options.timeout = absl::Seconds(30);
  ASSERT_TRUE(RunInProcessRanks(kRanks, options, [&](DataChannel& c) {
                std::vector<float> x = input(c.rank());
                absl::Status s = c.AllReduce(x.data(), x.data(), kCount, DataType::kFloat32,
                                             ReduceOp::kSum);
                inprocess[static_cast<size_t>(c.rank())] = x;
                return s;
              }).ok());
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(std::memcmp(ucx[r].data(), inprocess[r].data(), kCount * sizeof(float)), 0)
        << "rank " << r;
  }
}

// Between two ranks, on UCX's eager and rendezvous paths: a message larger or smaller than
// the posted receive fails that receive with InvalidArgument and is consumed, and the next
// message on the same (peer, tag) arrives intact. A receive destroyed before its message
// came is cancelled without consuming anything (MPI_Cancel's rule): the message goes to
// the next receive.
TEST(UcxChannel, WrongSizeAndCancelledReceivesKeepThePairInOrder) {
  InMemoryRendezvousStore store;
  absl::Status s = RunUcxRanks(store, "job/sizes", 2, absl::Seconds(30), [](DataChannel& ch) {
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
        EXPECT_EQ(too_large.code(), absl::StatusCode::kInvalidArgument) << n << ": " << too_large;
        EXPECT_THAT(too_large.message(),
                    HasSubstr(absl::StrCat("message has more than the ", n * 4,
                                           " bytes the receive was posted for")));
        absl::Status too_small = (*b)->Wait(t);
        EXPECT_EQ(too_small.code(), absl::StatusCode::kInvalidArgument) << n << ": " << too_small;
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
  InMemoryRendezvousStore store;
  absl::Status s = RunUcxRanks(store, "job/progress", 2, absl::Seconds(30), [](DataChannel& c) {
    int32_t x = c.rank();
    std::vector<int32_t> all(2);
    EXPECT_TRUE(c.Allgather(&x, all.data(), 1, DataType::kInt32).ok());
    EXPECT_TRUE(c.Barrier().ok());
    EXPECT_EQ(c.progress().collectives_entered, 2);
    EXPECT_EQ(c.progress().collectives_completed, 2);
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

TEST(UcxChannel, JobsWithDifferentPrefixesShareOneStore) {
  InMemoryRendezvousStore store;
  std::vector<std::thread> jobs;
  for (int job = 0; job < 2; ++job) {
    jobs.emplace_back([&store, job] {
      absl::Status s = RunUcxRanks(
          store, absl::StrCat("job/", job), 2, absl::Seconds(30), [job](DataChannel& c) {
            int32_t mine = 100 * job + c.rank();
            std::vector<int32_t> all(2);
            if (absl::Status g = c.Allgather(&mine, all.data(), 1, DataType::kInt32); !g.ok()) {
              return g;
            }
            EXPECT_EQ(all[0], 100 * job);
            EXPECT_EQ(all[1], 100 * job + 1);
            return absl::OkStatus();
          });
      EXPECT_TRUE(s.ok()) << s;
    });
  }
  for (std::thread& t : jobs) t.join();
}

TEST(UcxChannel, SilentRankTimesOutNamingIt) {
  for (int ranks : {2, 4}) {
    InMemoryRendezvousStore store;
    absl::Status s = RunUcxRanks(store, "job/silent", ranks, absl::Seconds(2),
                                  [&](DataChannel& channel) {
                                    testing::CheckSilentRankTimesOut(channel, ranks - 1);
                                    return absl::OkStatus();
                                  });
    EXPECT_TRUE(s.ok()) << s;
  }
}

TEST(UcxChannel, RejectsBadRank) {
  InMemoryRendezvousStore store;
  auto channel = CreateUcxChannel(store, "job/bad", 2, 2, Options(absl::Seconds(1)));
  ASSERT_FALSE(channel.ok());
  EXPECT_EQ(channel.status().code(), absl::StatusCode::kInvalidArgument);
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
}

TEST(UcxChannel, RanksThatNeverJoinAreNamed) {
  InMemoryRendezvousStore store;
  const absl::Duration timeout = absl::Seconds(1);
  std::vector<absl::Status> results(2);
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      results[static_cast<size_t>(r)] =
          CreateUcxChannel(store, "job/absent", r, 4, Options(timeout)).status();
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_LT(absl::Now() - start, timeout + absl::Seconds(10));
  for (const absl::Status& s : results) {
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(s.message(), HasSubstr("ranks 2, 3 did not join"));
  }
}

// Rank 1 builds its channel and never posts: rank 0 times out naming it, the channel
// stays broken, tears down at once, and the next channel in this process works.
TEST(UcxChannel, PeerThatNeverPostsThenTeardownAndNextChannel) {
  InMemoryRendezvousStore store;
  const absl::Duration timeout = absl::Seconds(2);
  std::unique_ptr<DataChannel> zero, one;
  std::thread peer([&] {
    auto c = CreateUcxChannel(store, "job/hung", 1, 2, Options(timeout));
    ASSERT_TRUE(c.ok()) << c.status();
    one = *std::move(c);
  });
  auto c = CreateUcxChannel(store, "job/hung", 0, 2, Options(timeout));
  peer.join();
  ASSERT_TRUE(c.ok()) << c.status();
  zero = *std::move(c);

  const absl::Time start = absl::Now();
  absl::Status barrier = zero->Barrier();
  EXPECT_LT(absl::Now() - start, timeout + absl::Seconds(10));
  EXPECT_EQ(barrier.code(), absl::StatusCode::kDeadlineExceeded) << barrier;
  EXPECT_THAT(barrier.message(), HasSubstr("Barrier on rank 0"));
  EXPECT_THAT(barrier.message(), HasSubstr("rank 1"));
  EXPECT_EQ(zero->progress().collectives_entered, 1);
  EXPECT_EQ(zero->progress().collectives_completed, 0);
  EXPECT_EQ(one->progress().collectives_entered, 0);
  int32_t x = 0;
  std::vector<int32_t> all(2);
  absl::Status after = zero->Allgather(&x, all.data(), 1, DataType::kInt32);
  EXPECT_EQ(after.code(), absl::StatusCode::kFailedPrecondition) << after;

  // Teardown does not wait for the hung peer (bounded well below the timeout's multiple
  // that a wait for it would take).
  const absl::Time teardown = absl::Now();
  zero.reset();
  EXPECT_LT(absl::Now() - teardown, timeout);
  one.reset();

  absl::Status next = RunUcxRanks(store, "job/next", 2, absl::Seconds(30), [](DataChannel& ch) {
    int32_t mine = ch.rank() + 7;
    std::vector<int32_t> got(2);
    if (absl::Status s = ch.Allgather(&mine, got.data(), 1, DataType::kInt32); !s.ok()) return s;
    EXPECT_EQ(got[0], 7);
    EXPECT_EQ(got[1], 8);
    return absl::OkStatus();
  });
  EXPECT_TRUE(next.ok()) << next;
}

// Rank 1's channel is destroyed: rank 0 fails naming it (the closed connection, or at
// the latest the timeout) and then builds a new channel.
TEST(UcxChannel, PeerChannelDestroyedFailsTheSurvivor) {
  InMemoryRendezvousStore store;
  const absl::Duration timeout = absl::Seconds(3);
  std::unique_ptr<DataChannel> zero;
  std::atomic<bool> zero_ready{false};
  std::thread peer([&] {
    auto c = CreateUcxChannel(store, "job/gone", 1, 2, Options(timeout));
    ASSERT_TRUE(c.ok()) << c.status();
    // Destroyed as soon as rank 0 has its channel too.
    while (!zero_ready.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  auto c = CreateUcxChannel(store, "job/gone", 0, 2, Options(timeout));
  zero_ready = true;
  peer.join();
  ASSERT_TRUE(c.ok()) << c.status();
  zero = *std::move(c);
  const absl::Time start = absl::Now();
  std::vector<float> x(1000, 1.0f);
  absl::Status s = zero->AllReduce(x.data(), x.data(), 1000, DataType::kFloat32, ReduceOp::kSum);
  EXPECT_LT(absl::Now() - start, timeout + absl::Seconds(10));
  EXPECT_THAT(s.code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded))
      << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1"));
  EXPECT_EQ(zero->Barrier().code(), absl::StatusCode::kFailedPrecondition);
  zero.reset();
  EXPECT_TRUE(RunUcxRanks(store, "job/after-gone", 2, absl::Seconds(30), [](DataChannel& ch) {
                return ch.Barrier();
              }).ok());
}

constexpr char kChildDirEnv[] = "RACKRUN_UCX_TEST_CHILD_DIR";

// Run only as the child of PeerProcessKilledFailsTheSurvivor: rank 1, connects, then
// waits to be killed.
TEST(UcxChannelChild, DISABLED_RankOneWaitsToBeKilled) {
  const char* dir = std::getenv(kChildDirEnv);
  if (dir == nullptr) GTEST_SKIP() << "child of PeerProcessKilledFailsTheSurvivor only";
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  DirectoryRendezvousStore store(dir);
  auto channel = CreateUcxChannel(store, "job/killed", 1, 2, Options(absl::Seconds(10)));
  ASSERT_TRUE(channel.ok()) << channel.status();
  // Bounded, in case the parent never kills it.
  std::this_thread::sleep_for(std::chrono::seconds(30));
}

TEST(UcxChannel, PeerProcessKilledFailsTheSurvivor) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("rackrun-ucx-" + std::to_string(getpid())))
          .string();
  std::filesystem::create_directories(dir);
  const pid_t child = fork();
  ASSERT_NE(child, -1) << std::strerror(errno);
  if (child == 0) {
    setenv(kChildDirEnv, dir.c_str(), 1);
    execl("/proc/self/exe", "ucx_child", "--gtest_also_run_disabled_tests",
          "--gtest_filter=UcxChannelChild.DISABLED_RankOneWaitsToBeKilled",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  DirectoryRendezvousStore store(dir);
  const absl::Duration timeout = absl::Seconds(10);
  auto channel = CreateUcxChannel(store, "job/killed", 0, 2, Options(timeout));
  if (!channel.ok()) {
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    FAIL() << channel.status();
  }
  // Kill the peer while this rank waits for it in a collective.
  std::thread killer([child] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    kill(child, SIGKILL);
  });
  const absl::Time start = absl::Now();
  std::vector<int64_t> x(4096, 1);
  absl::Status s =
      (*channel)->AllReduce(x.data(), x.data(), 4096, DataType::kInt64, ReduceOp::kSum);
  const absl::Duration took = absl::Now() - start;
  killer.join();
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
  // The closed connection is seen, not the timeout.
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("AllReduce"));
  EXPECT_THAT(s.message(), HasSubstr("on rank 0"));
  EXPECT_THAT(s.message(), HasSubstr("with rank 1"));
  EXPECT_EQ((*channel)->Barrier().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_LT(took, timeout);
  channel->reset();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace rackrun::comm
