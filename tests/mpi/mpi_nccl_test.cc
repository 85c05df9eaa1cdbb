// The NCCL backend, bootstrapped over MPI with one GPU per rank (rank r uses device
// r % devices). Run by tools/gpu-check on a GPU machine; skips where no GPU is visible
// (CI). NCCL refuses two ranks of one communicator on one GPU, so with 1 GPU this runs 1
// rank (self send/recv, every collective, dispatch and fan-out code paths).
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <cstdio>
#include <memory>
#include <vector>

#include "comm/mpi_channel.h"
#include "comm/nccl_channel.h"
#include "comm/testing/channel_checks.h"
#include "gtest/gtest.h"

namespace rackrun::comm {
namespace {

std::unique_ptr<DataChannel> g_mpi;
std::unique_ptr<DataChannel> g_host;    // NCCL, host buffers staged through the device
std::unique_ptr<DataChannel> g_device;  // NCCL, device buffers
std::string g_skip;

class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!g_skip.empty()) GTEST_SKIP() << g_skip;
  }
};

TEST_F(NcclTest, Allgather) { testing::CheckAllgather(*g_host); }
TEST_F(NcclTest, AllToAllV) { testing::CheckAllToAllV(*g_host); }
TEST_F(NcclTest, Broadcast) { testing::CheckBroadcast(*g_host); }
TEST_F(NcclTest, Barrier) { testing::CheckBarrier(*g_host); }
TEST_F(NcclTest, AllReduceIsRepeatable) {
  testing::CheckAllReduce(*g_host, /*fixed_order=*/g_host->size() == 1);
}
TEST_F(NcclTest, SendRecvInGroups) { testing::CheckSendRecv(*g_host); }
TEST_F(NcclTest, BadArguments) { testing::CheckBadArguments(*g_host); }
TEST_F(NcclTest, TokenDispatchMatchesHome) {
  for (uint64_t seed : {1u, 2u}) testing::CheckTokenDispatch(*g_host, seed, false);
  testing::CheckTokenDispatch(*g_host, 11, true);
}
TEST_F(NcclTest, RelayFanoutInRounds) { testing::CheckRelayFanout(*g_host, FanoutPacing::kAuto); }

// Device buffers: AllReduce and grouped send/recv on cudaMalloc'd memory.
TEST_F(NcclTest, DeviceBuffers) {
  const int n = g_device->size();
  const int me = g_device->rank();
  constexpr int64_t kCount = 1 << 20;
  std::vector<float> host(kCount);
  for (int64_t i = 0; i < kCount; ++i) host[i] = static_cast<float>((me + 1) * (i % 97));
  void* dev = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, kCount * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, host.data(), kCount * sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_TRUE(g_device->AllReduce(dev, dev, kCount, DataType::kFloat32, ReduceOp::kSum).ok());
  ASSERT_EQ(cudaMemcpy(host.data(), dev, kCount * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (int64_t i = 0; i < kCount; ++i) {
    ASSERT_EQ(host[i], static_cast<float>(n * (n + 1) / 2 * (i % 97))) << i;
  }
  // Ring exchange of the reduced buffer into a second device buffer.
  void* dev2 = nullptr;
  ASSERT_EQ(cudaMalloc(&dev2, kCount * sizeof(float)), cudaSuccess);
  ASSERT_TRUE(g_device->GroupStart().ok());
  auto s = g_device->Isend(dev, kCount, DataType::kFloat32, (me + 1) % n, 0);
  auto r = g_device->Irecv(dev2, kCount, DataType::kFloat32, (me + n - 1) % n, 0);
  ASSERT_TRUE(g_device->GroupEnd().ok());
  ASSERT_TRUE(s.ok() && r.ok());
  ASSERT_TRUE((*s)->Wait(absl::Seconds(60)).ok());
  ASSERT_TRUE((*r)->Wait(absl::Seconds(60)).ok());
  std::vector<float> got(kCount);
  ASSERT_EQ(cudaMemcpy(got.data(), dev2, kCount * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(got, host);
  cudaFree(dev);
  cudaFree(dev2);
}

}  // namespace
}  // namespace rackrun::comm

int main(int argc, char** argv) {
  using namespace rackrun::comm;
  ::testing::InitGoogleTest(&argc, argv);
  ChannelOptions options;
  options.timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<DataChannel>> mpi = CreateMpiChannel(options);
  if (!mpi.ok()) {
    std::fprintf(stderr, "%s\n", std::string(mpi.status().message()).c_str());
    return 2;
  }
  g_mpi = *std::move(mpi);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  // Every rank must agree on skipping, or the others would wait in NCCL init.
  int32_t enough = devices >= 1 ? 1 : 0;
  int32_t all_enough = 0;
  if (!g_mpi->AllReduce(&enough, &all_enough, 1, DataType::kInt32, ReduceOp::kSum).ok()) return 2;
  if (all_enough != g_mpi->size()) {
    g_skip = "no CUDA device visible on every rank";
  } else {
    NcclChannelOptions nccl;
    nccl.channel = options;
    nccl.device = g_mpi->rank() % devices;
    nccl.host_buffers = true;
    absl::StatusOr<std::unique_ptr<DataChannel>> host = CreateNcclChannel(*g_mpi, nccl);
    nccl.host_buffers = false;
    absl::StatusOr<std::unique_ptr<DataChannel>> device =
        host.ok() ? CreateNcclChannel(*g_mpi, nccl) : host.status();
    if (!host.ok() || !device.ok()) {
      std::fprintf(stderr, "rank %d: NCCL channel: %s\n", g_mpi->rank(),
                   std::string((host.ok() ? device : host).status().message()).c_str());
      return 1;
    }
    g_host = *std::move(host);
    g_device = *std::move(device);
    std::printf("rank %d of %d: NCCL on CUDA device %d of %d\n", g_mpi->rank(), g_mpi->size(),
                nccl.device, devices);
  }
  const int result = RUN_ALL_TESTS();
  g_device.reset();
  g_host.reset();
  g_mpi.reset();
  return result;
}
