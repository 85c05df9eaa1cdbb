#include "comm/testing/store_channel_checks.h"

#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <latch>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/inprocess_channel.h"
#include "comm/testing/channel_checks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::comm::testing {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr char kChildDirEnv[] = "RACKRUN_CHANNEL_TEST_CHILD_DIR";
// What the child rank does until it is killed: "idle" (nothing) or "transfer" (large
// all-reduces with rank 0).
constexpr char kChildModeEnv[] = "RACKRUN_CHANNEL_TEST_CHILD_MODE";
// The mid-transfer check's all-reduces alternate between 1 Mi int64 (8 MiB, past every
// eager limit: UCX's rendezvous path) and 16 Ki int64 (128 KiB: UCX's multi-segment eager
// path), so the kill lands in either.
constexpr int64_t kLargeCount = int64_t{1} << 20;
int64_t TransferCount(int round) { return round % 2 == 0 ? kLargeCount : kLargeCount / 64; }

// Forks and execs this test binary as rank 1 running `child_test` in `mode`, with its
// store in `dir`; -1 on failure.
pid_t StartChildRank(const std::string& dir, const std::string& child_test, const char* mode) {
  const pid_t child = fork();
  if (child == 0) {
    setenv(kChildDirEnv, dir.c_str(), 1);
    setenv(kChildModeEnv, mode, 1);
    const std::string filter = "--gtest_filter=" + child_test;
    execl("/proc/self/exe", "channel_child", "--gtest_also_run_disabled_tests", filter.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  return child;
}

}  // namespace

absl::Status RunStoreRanks(const StoreChannelFactory& factory, RendezvousStore& store,
                           const std::string& prefix, int ranks, absl::Duration timeout,
                           const std::function<absl::Status(DataChannel&)>& body) {
  std::vector<absl::Status> results(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  std::latch bodies_done(ranks);
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<DataChannel>> channel =
          factory(store, prefix, r, ranks, timeout);
      if (!channel.ok()) {
        results[static_cast<size_t>(r)] = channel.status();
        bodies_done.count_down();
        return;
      }
      results[static_cast<size_t>(r)] = body(**channel);
      // Every rank closes its own channel, all together (a closing channel may wait for
      // its peers to close theirs: UCX's closing handshake).
      bodies_done.arrive_and_wait();
      channel->reset();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

void CheckOnRanks(const StoreChannelFactory& factory, int ranks, absl::string_view backend,
                  const std::function<void(DataChannel&)>& check) {
  InMemoryRendezvousStore store;
  absl::Status s = RunStoreRanks(factory, store, "job/test", ranks, absl::Seconds(30),
                                 [&](DataChannel& channel) {
                                   EXPECT_EQ(channel.size(), ranks);
                                   EXPECT_EQ(channel.backend(), backend);
                                   EXPECT_TRUE(channel.matches_by_tag());
                                   check(channel);
                                   return absl::OkStatus();
                                 });
  ASSERT_TRUE(s.ok()) << s;
}

void CheckAllReduceEqualsInProcessBitForBit(const StoreChannelFactory& factory) {
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
  std::vector<std::vector<float>> tested(kRanks), inprocess(kRanks);
  InMemoryRendezvousStore store;
  ASSERT_TRUE(
      RunStoreRanks(factory, store, "job/bits", kRanks, absl::Seconds(30), [&](DataChannel& c) {
        std::vector<float> x = input(c.rank());
        absl::Status s =
            c.AllReduce(x.data(), x.data(), kCount, DataType::kFloat32, ReduceOp::kSum);
        tested[static_cast<size_t>(c.rank())] = x;
        return s;
      }).ok());
  ChannelOptions options;
  options.timeout = absl::Seconds(30);
  ASSERT_TRUE(RunInProcessRanks(kRanks, options, [&](DataChannel& c) {
                std::vector<float> x = input(c.rank());
                absl::Status s =
                    c.AllReduce(x.data(), x.data(), kCount, DataType::kFloat32, ReduceOp::kSum);
                inprocess[static_cast<size_t>(c.rank())] = x;
                return s;
              }).ok());
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(std::memcmp(tested[r].data(), inprocess[r].data(), kCount * sizeof(float)), 0)
        << "rank " << r;
  }
}

// Between two ranks, on UCX's eager and rendezvous paths: a message larger or smaller than
// the posted receive fails that receive with InvalidArgument and is consumed, and the next
void CheckCountsCollectivesForProgress(const StoreChannelFactory& factory) {
  InMemoryRendezvousStore store;
  absl::Status s =
      RunStoreRanks(factory, store, "job/progress", 2, absl::Seconds(30), [](DataChannel& c) {
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

void CheckJobsWithDifferentPrefixesShareOneStore(const StoreChannelFactory& factory) {
  InMemoryRendezvousStore store;
  std::vector<std::thread> jobs;
  for (int job = 0; job < 2; ++job) {
    jobs.emplace_back([&factory, &store, job] {
      absl::Status s = RunStoreRanks(
          factory, store, absl::StrCat("job/", job), 2, absl::Seconds(30), [job](DataChannel& c) {
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

void CheckSilentRankTimesOutNamingIt(const StoreChannelFactory& factory) {
  for (int ranks : {2, 4}) {
    InMemoryRendezvousStore store;
    absl::Status s = RunStoreRanks(factory, store, "job/silent", ranks, absl::Seconds(2),
                                   [&](DataChannel& channel) {
                                     testing::CheckSilentRankTimesOut(channel, ranks - 1);
                                     return absl::OkStatus();
                                   });
    EXPECT_TRUE(s.ok()) << s;
  }
}

void CheckRejectsBadRank(const StoreChannelFactory& factory) {
  InMemoryRendezvousStore store;
  auto channel = factory(store, "job/bad", 2, 2, absl::Seconds(1));
  ASSERT_FALSE(channel.ok());
  EXPECT_EQ(channel.status().code(), absl::StatusCode::kInvalidArgument);
}

void CheckRanksThatNeverJoinAreNamed(const StoreChannelFactory& factory) {
  InMemoryRendezvousStore store;
  const absl::Duration timeout = absl::Seconds(1);
  std::vector<absl::Status> results(2);
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      results[static_cast<size_t>(r)] = factory(store, "job/absent", r, 4, timeout).status();
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_LT(absl::Now() - start, timeout + absl::Seconds(10));
  for (const absl::Status& s : results) {
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(s.message(), HasSubstr("ranks 2, 3 did not join"));
  }
}

void CheckPeerThatNeverPostsThenTeardownAndNextChannel(const StoreChannelFactory& factory) {
  InMemoryRendezvousStore store;
  const absl::Duration timeout = absl::Seconds(2);
  std::unique_ptr<DataChannel> zero, one;
  std::thread peer([&] {
    auto c = factory(store, "job/hung", 1, 2, timeout);
    ASSERT_TRUE(c.ok()) << c.status();
    one = *std::move(c);
  });
  auto c = factory(store, "job/hung", 0, 2, timeout);
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

  absl::Status next =
      RunStoreRanks(factory, store, "job/next", 2, absl::Seconds(30), [](DataChannel& ch) {
        int32_t mine = ch.rank() + 7;
        std::vector<int32_t> got(2);
        if (absl::Status s = ch.Allgather(&mine, got.data(), 1, DataType::kInt32); !s.ok())
          return s;
        EXPECT_EQ(got[0], 7);
        EXPECT_EQ(got[1], 8);
        return absl::OkStatus();
      });
  EXPECT_TRUE(next.ok()) << next;
}

void CheckPeerChannelDestroyedFailsTheSurvivor(const StoreChannelFactory& factory) {
  InMemoryRendezvousStore store;
  const absl::Duration timeout = absl::Seconds(3);
  std::unique_ptr<DataChannel> zero;
  std::atomic<bool> zero_ready{false};
  std::thread peer([&] {
    auto c = factory(store, "job/gone", 1, 2, timeout);
    ASSERT_TRUE(c.ok()) << c.status();
    // Destroyed as soon as rank 0 has its channel too.
    while (!zero_ready.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  auto c = factory(store, "job/gone", 0, 2, timeout);
  zero_ready = true;
  if (!c.ok()) peer.join();
  ASSERT_TRUE(c.ok()) << c.status();
  zero = *std::move(c);
  const absl::Time start = absl::Now();
  std::vector<float> x(1000, 1.0f);
  // Rank 1 closes its channel meanwhile (it may wait for this rank to close: joined below).
  absl::Status s = zero->AllReduce(x.data(), x.data(), 1000, DataType::kFloat32, ReduceOp::kSum);
  EXPECT_LT(absl::Now() - start, timeout + absl::Seconds(10));
  EXPECT_THAT(s.code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded))
      << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1"));
  EXPECT_EQ(zero->Barrier().code(), absl::StatusCode::kFailedPrecondition);
  zero.reset();
  peer.join();
  EXPECT_TRUE(
      RunStoreRanks(factory, store, "job/after-gone", 2, absl::Seconds(30), [](DataChannel& ch) {
        return ch.Barrier();
      }).ok());
}

// Rank 0's side of a killed-peer check: a fresh folder (removed by the caller) holds the
// rendezvous of rank 0 (this process) and rank 1 (a child running child_test in `mode`).
struct ChildPeer {
  std::string dir;
  pid_t child = -1;
  std::unique_ptr<DirectoryRendezvousStore> store;
  absl::StatusOr<std::unique_ptr<DataChannel>> channel;
};

// Starts the child and connects to it; on a failed connect the child is killed and reaped
// (channel holds the error). child == -1: fork failed (errno says why).
ChildPeer ConnectToChildRank(const StoreChannelFactory& factory, const std::string& folder,
                             const std::string& child_test, const char* mode,
                             absl::Duration timeout) {
  ChildPeer p;
  p.dir =
      (std::filesystem::temp_directory_path() / (folder + "-" + std::to_string(getpid()))).string();
  std::filesystem::create_directories(p.dir);
  p.child = StartChildRank(p.dir, child_test, mode);
  if (p.child == -1) return p;
  p.store = std::make_unique<DirectoryRendezvousStore>(p.dir);
  p.channel = factory(*p.store, "job/killed", 0, 2, timeout);
  if (!p.channel.ok()) {
    kill(p.child, SIGKILL);
    waitpid(p.child, nullptr, 0);
  }
  return p;
}

// Reaps the killed child and checks the survivor's error: the closed connection seen (not
// the timeout), naming both ranks, and the collective where `names_collective`.
void ExpectKilledPeerNamed(pid_t child, const absl::Status& s, const std::string& context,
                           bool names_collective) {
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s << context;
  if (names_collective) {
    EXPECT_THAT(s.message(), HasSubstr("AllReduce"));
  }
  EXPECT_THAT(s.message(), HasSubstr("on rank 0"));
  EXPECT_THAT(s.message(), HasSubstr("with rank 1"));
}

void CheckPeerProcessKilledFailsTheSurvivor(const StoreChannelFactory& factory,
                                            const std::string& child_test) {
  const absl::Duration timeout = absl::Seconds(10);
  ChildPeer peer = ConnectToChildRank(factory, "rackrun-killed", child_test, "idle", timeout);
  ASSERT_NE(peer.child, -1) << std::strerror(errno);
  const pid_t child = peer.child;
  auto& channel = peer.channel;
  ASSERT_TRUE(channel.ok()) << channel.status();
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
  ExpectKilledPeerNamed(child, s, "", /*names_collective=*/true);
  EXPECT_EQ((*channel)->Barrier().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_LT(took, timeout);
  channel->reset();
  std::filesystem::remove_all(peer.dir);
}

void RunAsKilledChild(const StoreChannelFactory& factory) {
  const char* dir = std::getenv(kChildDirEnv);
  if (dir == nullptr) GTEST_SKIP() << "child of CheckPeerProcessKilledFailsTheSurvivor only";
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  DirectoryRendezvousStore store(dir);
  auto channel = factory(store, "job/killed", 1, 2, absl::Seconds(10));
  ASSERT_TRUE(channel.ok()) << channel.status();
  const char* mode = std::getenv(kChildModeEnv);
  if (mode != nullptr && std::string(mode) == "transfer") {
    // Large all-reduces with rank 0 until killed (bounded, and ended by rank 0's error).
    std::vector<int64_t> x(static_cast<size_t>(kLargeCount), 1);
    const absl::Time until = absl::Now() + absl::Seconds(30);
    for (int round = 0; absl::Now() < until; ++round) {
      const int64_t count = TransferCount(round);
      std::fill(x.begin(), x.end(), 1);
      if (!(*channel)
               ->AllReduce(x.data(), x.data(), count, DataType::kInt64, ReduceOp::kSum)
               .ok()) {
        break;
      }
    }
  }
  // Bounded, in case the parent never kills it.
  std::this_thread::sleep_for(std::chrono::seconds(30));
}

void CheckPeerProcessKilledMidTransferFailsTheSurvivor(
    const StoreChannelFactory& factory, const std::string& child_test,
    bool receive_in_flight_waits_for_the_timeout) {
  const absl::Duration timeout = absl::Seconds(10);
  ChildPeer peer =
      ConnectToChildRank(factory, "rackrun-killed-mid", child_test, "transfer", timeout);
  ASSERT_NE(peer.child, -1) << std::strerror(errno);
  const pid_t child = peer.child;
  auto& channel = peer.channel;
  ASSERT_TRUE(channel.ok()) << channel.status();
  std::vector<int64_t> x(static_cast<size_t>(kLargeCount), 1);
  // One all-reduce completes first: both ranks are in the loop of large transfers.
  absl::Status s =
      (*channel)->AllReduce(x.data(), x.data(), kLargeCount, DataType::kInt64, ReduceOp::kSum);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(x[0], 2);
  // Killed while the transfers go on back to back: almost surely in the middle of one.
  std::thread killer([child] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    kill(child, SIGKILL);
  });
  const absl::Time start = absl::Now();
  int rounds = 1;  // round 0 was the all-reduce above
  while (s.ok() && absl::Now() - start < timeout) {
    std::fill(x.begin(), x.end(), 1);
    s = (*channel)->AllReduce(x.data(), x.data(), TransferCount(rounds), DataType::kInt64,
                              ReduceOp::kSum);
    ++rounds;
  }
  const absl::Duration took = absl::Now() - start;
  killer.join();
  // This process is still here (no abort in the transport), and the error names the peer.
  // Not always the collective: under ThreadSanitizer Gloo's error named the Recv inside the
  // all-reduce ("Recv on rank 0 of 2 with rank 1 ...") instead of the AllReduce.
  if (receive_in_flight_waits_for_the_timeout && s.code() == absl::StatusCode::kDeadlineExceeded) {
    int status = 0;
    waitpid(child, &status, 0);
    EXPECT_THAT(s.message(), HasSubstr("on rank 0 of 2"));
    EXPECT_THAT(s.message(), HasSubstr("waiting for rank 1"));
    EXPECT_LT(took, timeout + absl::Seconds(2));
  } else {
    ExpectKilledPeerNamed(child, s, absl::StrCat(" after ", rounds, " rounds"),
                          /*names_collective=*/false);
    EXPECT_LT(took, timeout);
  }
  const absl::Time teardown = absl::Now();
  channel->reset();
  EXPECT_LT(absl::Now() - teardown, timeout);
  std::filesystem::remove_all(peer.dir);
}

void CheckMessagesSentBeforeCloseArrive(const StoreChannelFactory& factory) {
  InMemoryRendezvousStore store;
  const absl::Duration timeout = absl::Seconds(30);
  // Small (eager) messages, then large ones (rendezvous, many fragments), on two tags.
  std::vector<int64_t> counts;
  for (int i = 0; i < 64; ++i) counts.push_back(2);
  for (int i = 0; i < 4; ++i) counts.push_back(int64_t{1} << 20);
  auto message = [](size_t index, int64_t count) {
    std::vector<int32_t> m(static_cast<size_t>(count));
    for (size_t i = 0; i < m.size(); ++i) m[i] = static_cast<int32_t>(index * 7919 + i);
    return m;
  };
  std::atomic<bool> sender_closed{false};
  absl::Status sent;
  std::thread sender([&] {
    auto c = factory(store, "job/close", 1, 2, timeout);
    if (!c.ok()) {
      sent = c.status();
      return;
    }
    std::vector<std::vector<int32_t>> messages;
    for (size_t i = 0; i < counts.size(); ++i) messages.push_back(message(i, counts[i]));
    std::vector<std::unique_ptr<Request>> requests;
    for (size_t i = 0; i < counts.size(); ++i) {
      auto r =
          (*c)->Isend(messages[i].data(), counts[i], DataType::kInt32, 0, static_cast<int>(i % 2));
      if (!r.ok()) {
        sent = r.status();
        return;
      }
      requests.push_back(*std::move(r));
    }
    sent = WaitAll(requests, absl::Now() + timeout, "sending");
    requests.clear();
    c->reset();  // at once: this rank is done
    sender_closed = true;
  });
  auto c = factory(store, "job/close", 0, 2, timeout);
  if (!c.ok()) sender.join();
  ASSERT_TRUE(c.ok()) << c.status();
  // The receives come late: the sender may have completed (some) sends and be closing.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  std::vector<std::vector<int32_t>> got;
  for (int64_t count : counts) got.emplace_back(static_cast<size_t>(count), -1);
  std::vector<std::unique_ptr<Request>> requests;
  for (size_t i = 0; i < counts.size(); ++i) {
    auto r = (*c)->Irecv(got[i].data(), counts[i], DataType::kInt32, 1, static_cast<int>(i % 2));
    ASSERT_TRUE(r.ok()) << r.status();
    requests.push_back(*std::move(r));
  }
  absl::Status received = WaitAll(requests, absl::Now() + timeout, "receiving");
  requests.clear();
  EXPECT_TRUE(received.ok()) << received;
  for (size_t i = 0; received.ok() && i < counts.size(); ++i) {
    EXPECT_EQ(got[i], message(i, counts[i])) << "message " << i;
  }
  c->reset();
  sender.join();
  EXPECT_TRUE(sent.ok()) << sent;
  EXPECT_TRUE(sender_closed.load());
}

}  // namespace rackrun::comm::testing
