// The device probe on whatever machine runs it: on a machine without a usable GPU (the
// development VMs, CI) every check reports the cause; on a GPU machine the GPU is
// described and the bad indices are refused. Labeled gpu: tools/gpu-check runs it there.
#include "runtime/cuda/device_probe.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#if RACKRUN_HAVE_CUDA
#include "runtime/cuda/device.h"
#endif

namespace rackrun::runtime::cuda {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

jobspec::DeviceSpec Cuda(int index) {
  jobspec::DeviceSpec d;
  d.kind = jobspec::DeviceSpec::Kind::kCuda;
  d.index = index;
  return d;
}

TEST(DeviceProbeTest, BuildInfoDescribesTheBuild) {
  const CudaBuildInfo b = BuildInfo();
#if RACKRUN_HAVE_CUDA
  EXPECT_TRUE(b.built);
  EXPECT_GE(b.runtime_version, 13000);
  EXPECT_EQ(b.min_compute, 90);
  EXPECT_EQ(b.architectures, "sm_90a sm_100a compute_90");
#else
  EXPECT_FALSE(b.built);
#endif
  EXPECT_EQ(CudaVersionString(13000), "13.0");
  EXPECT_EQ(CudaVersionString(12080), "12.8");
}

// Without a usable GPU every check names the cause; with one, the probe and GpuAvailable
// agree (this test never skips: tools/gpu-check counts a skip on the GPU machine as a FAIL).
TEST(DeviceProbeTest, NoUsableGpuIsAClearError) {
  absl::StatusOr<std::vector<GpuInfo>> gpus = VisibleGpus();
  if (gpus.ok()) {
    EXPECT_FALSE(gpus->empty());
#if RACKRUN_HAVE_CUDA
    EXPECT_TRUE(GpuAvailable().ok());
#endif
    return;
  }
  EXPECT_EQ(gpus.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string m(gpus.status().message());
  EXPECT_THAT(m, StartsWith("resources.device: "));
#if RACKRUN_HAVE_CUDA
  // No driver, an old driver, or no device: each names cudaGetDeviceCount's own error.
  EXPECT_TRUE(m.find("no CUDA device") != std::string::npos ||
              m.find("older than the CUDA") != std::string::npos)
      << m;
  EXPECT_THAT(m, HasSubstr("cudaGetDeviceCount"));
  const absl::Status available = GpuAvailable();
  EXPECT_FALSE(available.ok());
  EXPECT_THAT(std::string(available.message()), StartsWith("no CUDA device: "));
#else
  EXPECT_THAT(m, HasSubstr("this build has no GPU engine"));
#endif
  // CheckDevice reports the same cause for every form.
  for (int index : {-1, 0, 3}) {
    absl::StatusOr<GpuInfo> g = CheckDevice(Cuda(index), 0, 1);
    ASSERT_FALSE(g.ok());
    EXPECT_EQ(g.status().message(), gpus.status().message());
  }
}

TEST(DeviceProbeTest, CpuIsNotAGpu) {
  absl::StatusOr<GpuInfo> g = CheckDevice(jobspec::DeviceSpec{}, 0, 1);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DeviceProbeTest, AVisibleGpuIsDescribedAndBadIndicesAreRefused) {
  absl::StatusOr<std::vector<GpuInfo>> gpus = VisibleGpus();
  if (!gpus.ok()) GTEST_SKIP() << gpus.status().message();
  const int count = static_cast<int>(gpus->size());
  for (const GpuInfo& g : *gpus) {
    EXPECT_FALSE(g.name.empty());
    EXPECT_GT(g.total_bytes, int64_t{1} << 30);
    EXPECT_GT(g.multiprocessors, 0);
    EXPECT_GE(g.driver_version, BuildInfo().runtime_version);
  }
  absl::StatusOr<GpuInfo> first = CheckDevice(Cuda(0), 0, 1);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_GT(first->free_bytes, 0);
  // "cuda" is the local rank's GPU: local rank r uses GPU r.
  absl::StatusOr<GpuInfo> local = CheckDevice(Cuda(-1), count - 1, count);
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_EQ(local->index, count - 1);
  absl::StatusOr<GpuInfo> beyond = CheckDevice(Cuda(count), 0, 1);
  ASSERT_FALSE(beyond.ok());
  EXPECT_THAT(std::string(beyond.status().message()),
              HasSubstr("choose an index below " + std::to_string(count)));
  absl::StatusOr<GpuInfo> crowded = CheckDevice(Cuda(-1), 0, count + 1);
  ASSERT_FALSE(crowded.ok());
  EXPECT_THAT(std::string(crowded.status().message()), HasSubstr("run at most one rank per GPU"));
#if RACKRUN_HAVE_CUDA
  // The device opens: stream, allocator, cuBLASLt.
  absl::StatusOr<std::unique_ptr<Device>> dev = Device::Open(0);
  ASSERT_TRUE(dev.ok()) << dev.status();
  EXPECT_GT((*dev)->allocator().stats().reserved_bytes, 0);  // the cuBLASLt workspace
#endif
}

}  // namespace
}  // namespace rackrun::runtime::cuda
