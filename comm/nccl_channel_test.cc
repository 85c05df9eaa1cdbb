// The NCCL backend with one rank per visible GPU as threads of this process (in-process
// channel as the bootstrap; at most 4 ranks). With one GPU that is one rank: NCCL refuses
// two ranks of one communicator on one GPU. Skips where no GPU is visible (CI); run for
// real by tools/gpu-check.
#include "comm/nccl_channel.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <functional>
#include <thread>
#include <vector>

#include "comm/inprocess_channel.h"
#include "comm/rendezvous_store.h"
#include "comm/testing/channel_checks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::comm {
namespace {

int VisibleDevices() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) return 0;
  return devices;
}

class NcclChannelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    devices_ = VisibleDevices();
    if (devices_ == 0) GTEST_SKIP() << "no CUDA device visible";
    ranks_ = std::min(devices_, 4);
  }

  // Runs `check` on every rank's NCCL channel (rank r on device r).
  void OnAllRanks(bool host_buffers, const std::function<void(DataChannel&)>& check) {
    ChannelOptions options;
    options.timeout = absl::Seconds(60);
    absl::Status s = RunInProcessRanks(ranks_, options, [&](DataChannel& bootstrap) {
      NcclChannelOptions nccl;
      nccl.channel = options;
      nccl.device = bootstrap.rank();
      nccl.host_buffers = host_buffers;
      absl::StatusOr<std::unique_ptr<DataChannel>> channel = CreateNcclChannel(bootstrap, nccl);
      if (!channel.ok()) return channel.status();
      EXPECT_EQ((*channel)->backend(), "nccl");
      EXPECT_FALSE((*channel)->matches_by_tag());
      check(**channel);
      return absl::OkStatus();
    });
    ASSERT_TRUE(s.ok()) << s;
  }

  int devices_ = 0;
  int ranks_ = 0;
};

TEST_F(NcclChannelTest, Allgather) { OnAllRanks(true, testing::CheckAllgather); }
TEST_F(NcclChannelTest, AllToAllV) { OnAllRanks(true, testing::CheckAllToAllV); }
TEST_F(NcclChannelTest, Broadcast) { OnAllRanks(true, testing::CheckBroadcast); }
TEST_F(NcclChannelTest, Barrier) { OnAllRanks(true, testing::CheckBarrier); }
TEST_F(NcclChannelTest, AllReduceIsRepeatable) {
  // One rank sums nothing, so it equals the rank-order reference exactly.
  const bool exact = ranks_ == 1;
  OnAllRanks(true, [exact](DataChannel& c) { testing::CheckAllReduce(c, exact); });
}
TEST_F(NcclChannelTest, SendRecvInGroups) { OnAllRanks(true, testing::CheckSendRecv); }
TEST_F(NcclChannelTest, SubChannels) {
  // ncclCommSplit: domains of every size that divides the ranks (one GPU: a domain of 1).
  const bool exact = ranks_ == 1;
  for (int group = 1; group <= ranks_; ++group) {
    if (ranks_ % group != 0) continue;
    OnAllRanks(true,
               [group, exact](DataChannel& c) { testing::CheckSubChannels(c, group, exact); });
  }
}
TEST_F(NcclChannelTest, BadArguments) { OnAllRanks(true, testing::CheckBadArguments); }
TEST_F(NcclChannelTest, TokenDispatchMatchesHome) {
  OnAllRanks(true, [](DataChannel& c) {
    testing::CheckTokenDispatch(c, 1, /*use_ultraep=*/false);
    testing::CheckTokenDispatch(c, 11, /*use_ultraep=*/true);
  });
}
TEST_F(NcclChannelTest, RelayFanoutInRounds) {
  OnAllRanks(true, [](DataChannel& c) { testing::CheckRelayFanout(c, FanoutPacing::kAuto); });
}

// Device buffers (the training path): AllReduce in place and a grouped ring exchange.
TEST_F(NcclChannelTest, DeviceBuffers) {
  OnAllRanks(false, [](DataChannel& c) {
    const int n = c.size();
    const int me = c.rank();
    constexpr int64_t kCount = 1 << 20;
    constexpr size_t kBytes = kCount * sizeof(float);
    std::vector<float> host(kCount);
    for (int64_t i = 0; i < kCount; ++i) host[i] = static_cast<float>((me + 1) * (i % 97));
    void* dev = nullptr;
    void* dev2 = nullptr;
    ASSERT_EQ(cudaMalloc(&dev, kBytes), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dev2, kBytes), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dev, host.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_TRUE(c.AllReduce(dev, dev, kCount, DataType::kFloat32, ReduceOp::kSum).ok());
    ASSERT_EQ(cudaMemcpy(host.data(), dev, kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int64_t i = 0; i < kCount; ++i) {
      ASSERT_EQ(host[i], static_cast<float>(n * (n + 1) / 2 * (i % 97))) << i;
    }
    ASSERT_TRUE(c.GroupStart().ok());
    auto s = c.Isend(dev, kCount, DataType::kFloat32, (me + 1) % n, 0);
    auto r = c.Irecv(dev2, kCount, DataType::kFloat32, (me + n - 1) % n, 0);
    ASSERT_TRUE(c.GroupEnd().ok());
    ASSERT_TRUE(s.ok() && r.ok());
    ASSERT_TRUE((*s)->Wait(absl::Seconds(60)).ok());
    ASSERT_TRUE((*r)->Wait(absl::Seconds(60)).ok());
    std::vector<float> got(kCount);
    ASSERT_EQ(cudaMemcpy(got.data(), dev2, kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(got, host);
    cudaFree(dev);
    cudaFree(dev2);
  });
}

// Host-buffer mode stages host buffers only: AllToAllV, AllReduce, Isend and Irecv also take
// device buffers of the rank's GPU as they are (takes_device_buffers, what expert parallelism's
// device rows and weights and the trainer's device gradients use), in any mix with host buffers.
TEST_F(NcclChannelTest, TakesDeviceBuffersInHostBufferMode) {
  OnAllRanks(true, [](DataChannel& c) {
    EXPECT_TRUE(c.takes_device_buffers());
    const int n = c.size(), me = c.rank();
    // Rank s sends 3 + d + s floats to rank d: s * 1000 + d * 100 + i.
    std::vector<int64_t> send_counts(n), send_displs(n), recv_counts(n), recv_displs(n);
    int64_t sends = 0, recvs = 0;
    for (int p = 0; p < n; ++p) {
      send_counts[p] = 3 + p + me;
      send_displs[p] = sends;
      sends += send_counts[p];
      recv_counts[p] = 3 + me + p;
      recv_displs[p] = recvs;
      recvs += recv_counts[p];
    }
    std::vector<float> send(sends), want(recvs);
    for (int p = 0; p < n; ++p) {
      for (int64_t i = 0; i < send_counts[p]; ++i)
        send[send_displs[p] + i] = me * 1000 + p * 100 + i;
      for (int64_t i = 0; i < recv_counts[p]; ++i)
        want[recv_displs[p] + i] = p * 1000 + me * 100 + i;
    }
    void* d_send = nullptr;
    void* d_recv = nullptr;
    ASSERT_EQ(cudaMalloc(&d_send, sends * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_recv, recvs * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_send, send.data(), sends * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    for (const bool device_send : {true, false}) {
      for (const bool device_recv : {true, false}) {
        ASSERT_EQ(cudaMemset(d_recv, 0, recvs * sizeof(float)), cudaSuccess);
        std::vector<float> got(recvs, 0.0f);
        ASSERT_TRUE(c.AllToAllV(device_send ? d_send : send.data(), send_counts, send_displs,
                                device_recv ? d_recv : got.data(), recv_counts, recv_displs,
                                DataType::kFloat32)
                        .ok());
        if (device_recv) {
          ASSERT_EQ(cudaMemcpy(got.data(), d_recv, recvs * sizeof(float), cudaMemcpyDeviceToHost),
                    cudaSuccess);
        }
        EXPECT_EQ(got, want) << "send on the " << (device_send ? "device" : "host")
                             << ", receive on the " << (device_recv ? "device" : "host");
      }
    }
    // AllReduce: every mix, and in place on the device (the trainer's packed gradients), of
    // 3n floats (every rank's buffers hold more). Rank r contributes r + i to element i: the
    // sum is n * i + n * (n - 1) / 2.
    const int64_t k = 3 * n;
    std::vector<float> mine(k), sum(k);
    for (int64_t i = 0; i < k; ++i) {
      mine[i] = static_cast<float>(me + i);
      sum[i] = static_cast<float>(n * i + n * (n - 1) / 2);
    }
    for (const int mix : {0, 1, 2, 3, 4}) {
      const bool device_send = mix == 0 || mix == 1 || mix == 4, device_recv = mix == 0 || mix == 2;
      ASSERT_EQ(cudaMemcpy(d_send, mine.data(), k * sizeof(float), cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemset(d_recv, 0, k * sizeof(float)), cudaSuccess);
      std::vector<float> host_send = mine, got(k, 0.0f);
      void* out = mix == 4 ? d_send : device_recv ? d_recv : got.data();
      ASSERT_TRUE(c.AllReduce(device_send ? d_send : host_send.data(), out, k, DataType::kFloat32,
                              ReduceOp::kSum)
                      .ok());
      if (out != got.data()) {
        ASSERT_EQ(cudaMemcpy(got.data(), out, k * sizeof(float), cudaMemcpyDeviceToHost),
                  cudaSuccess);
      }
      const char* where = mix == 4 ? "in place" : device_recv ? "on the device" : "on the host";
      EXPECT_EQ(got, sum) << "AllReduce, send on the " << (device_send ? "device" : "host")
                          << ", receive " << where;
      EXPECT_EQ(host_send, mine) << "a host send buffer was written";
    }
    // Point to point around the ring: a device send into a host receive, then a host send
    // into a device receive.
    constexpr int64_t n0 = 3;  // the first floats of block 0: rank * 1000 + i
    for (const bool device_send : {true, false}) {
      ASSERT_EQ(cudaMemset(d_recv, 0, recvs * sizeof(float)), cudaSuccess);
      std::vector<float> got(n0, 0.0f);
      ASSERT_TRUE(c.GroupStart().ok());
      auto sent =
          c.Isend(device_send ? d_send : send.data(), n0, DataType::kFloat32, (me + 1) % n, 0);
      auto received = c.Irecv(device_send ? static_cast<void*>(got.data()) : d_recv, n0,
                              DataType::kFloat32, (me + n - 1) % n, 0);
      ASSERT_TRUE(c.GroupEnd().ok());
      ASSERT_TRUE(sent.ok() && received.ok());
      ASSERT_TRUE((*sent)->Wait(absl::Seconds(60)).ok());
      ASSERT_TRUE((*received)->Wait(absl::Seconds(60)).ok());
      if (!device_send) {
        ASSERT_EQ(cudaMemcpy(got.data(), d_recv, n0 * sizeof(float), cudaMemcpyDeviceToHost),
                  cudaSuccess);
      }
      for (int64_t i = 0; i < n0; ++i) {
        EXPECT_EQ(got[i], ((me + n - 1) % n) * 1000 + i)
            << (device_send ? "device" : "host") << " send, element " << i;
      }
    }
    cudaFree(d_send);
    cudaFree(d_recv);
  });
}

// The worker daemons' path: the unique id travels through a rendezvous store (rank r on
// device r, one thread each), and progress() counts NCCL's collectives.
TEST_F(NcclChannelTest, BootstrapFromRendezvousStore) {
  InMemoryRendezvousStore store;
  std::vector<absl::Status> results(static_cast<size_t>(ranks_));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks_; ++r) {
    threads.emplace_back([&, r] {
      NcclChannelOptions nccl;
      nccl.channel.timeout = absl::Seconds(60);
      nccl.device = r;
      nccl.host_buffers = true;
      absl::StatusOr<std::unique_ptr<DataChannel>> channel =
          CreateNcclChannel(store, "job/nccl", r, ranks_, nccl);
      if (!channel.ok()) {
        results[static_cast<size_t>(r)] = channel.status();
        return;
      }
      EXPECT_EQ((*channel)->rank(), r);
      EXPECT_EQ((*channel)->size(), ranks_);
      testing::CheckAllgather(**channel);
      testing::CheckBarrier(**channel);
      const ChannelProgress progress = (*channel)->progress();
      EXPECT_GT(progress.collectives_entered, 0);
      EXPECT_EQ(progress.collectives_entered, progress.collectives_completed);
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
}

// Argument checks come before any CUDA call, so these run without a GPU too.
TEST(NcclChannelFromStore, RejectsBadRank) {
  InMemoryRendezvousStore store;
  absl::StatusOr<std::unique_ptr<DataChannel>> channel =
      CreateNcclChannel(store, "job/bad", 3, 2, NcclChannelOptions{});
  ASSERT_FALSE(channel.ok());
  EXPECT_EQ(channel.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(channel.status().message(), ::testing::HasSubstr("rank 3 of size 2"));
}

}  // namespace
}  // namespace rackrun::comm
