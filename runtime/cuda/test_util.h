// Shared by the gpu tests (runtime/cuda/*_test.cc): the skip without a GPU, device buffers
// from host vectors, and the comparison with the CPU oracle.
#ifndef RACKRUN_RUNTIME_CUDA_TEST_UTIL_H_
#define RACKRUN_RUNTIME_CUDA_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/cuda/device.h"
#include "runtime/residual/residual_streams.h"

namespace rackrun::runtime::cuda::testing {

// Skips the test, naming the cause, when no GPU is usable; otherwise opens GPU 0 into
// `dev` (a std::unique_ptr<Device>).
#define RACKRUN_OPEN_GPU_OR_SKIP(dev)                                                 \
  std::unique_ptr<::rackrun::runtime::cuda::Device> dev;                              \
  do {                                                                                \
    if (absl::Status avail = ::rackrun::runtime::cuda::GpuAvailable(); !avail.ok()) { \
      GTEST_SKIP() << avail.message();                                                \
    }                                                                                 \
    absl::StatusOr<std::unique_ptr<::rackrun::runtime::cuda::Device>> opened =        \
        ::rackrun::runtime::cuda::Device::Open(0);                                    \
    ASSERT_TRUE(opened.ok()) << opened.status();                                      \
    dev = std::move(*opened);                                                         \
  } while (0)

inline std::vector<float> RandomVector(int64_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

// A device copy of `host`.
template <typename T>
DeviceTensor<T> Upload(Device* dev, const std::string& name, std::span<const T> host) {
  DeviceTensor<T> t(dev, name);
  absl::Status s = t.Resize({static_cast<int64_t>(host.size())});
  EXPECT_TRUE(s.ok()) << s;
  s = t.CopyFrom(host);
  EXPECT_TRUE(s.ok()) << s;
  return t;
}
template <typename T>
DeviceTensor<T> Upload(Device* dev, const std::string& name, const std::vector<T>& host) {
  return Upload<T>(dev, name, std::span<const T>(host));
}

template <typename T>
std::vector<T> Download(const DeviceTensor<T>& t) {
  std::vector<T> host;
  absl::Status s = t.CopyTo(&host);
  EXPECT_TRUE(s.ok()) << s;
  return host;
}

// A CPU layer's parameters on the device: `values` their copies, `grads` zeroed tensors of
// the same sizes (appended in the parameters' order).
inline void UploadParameters(Device* dev, const std::vector<ParamRef<float>>& params,
                             std::vector<DeviceTensor<float>>* values,
                             std::vector<DeviceTensor<float>>* grads) {
  for (const ParamRef<float>& p : params) {
    values->push_back(Upload(dev, p.name, std::span<const float>(p.value, p.size)));
    DeviceTensor<float> g(dev, p.name + " grad");
    EXPECT_TRUE(g.Resize({p.size}).ok());
    EXPECT_TRUE(g.Zero().ok());
    grads->push_back(std::move(g));
  }
}

// Largest |gpu - cpu| over the largest |cpu| (1 when cpu is all zeros): the error relative
// to the array's scale, so tiny elements do not dominate.
inline double RelativeError(std::span<const float> gpu, std::span<const float> cpu) {
  EXPECT_EQ(gpu.size(), cpu.size());
  double scale = 0, err = 0;
  for (size_t i = 0; i < std::min(gpu.size(), cpu.size()); ++i) {
    scale = std::max(scale, std::fabs(static_cast<double>(cpu[i])));
    const double d = std::fabs(static_cast<double>(gpu[i]) - cpu[i]);
    err = std::isnan(d) ? INFINITY : std::max(err, d);
  }
  return err / std::max(scale, 1e-30);
}

#define RACKRUN_EXPECT_CLOSE(gpu, cpu, tol)                                  \
  do {                                                                       \
    const double rel_err = ::rackrun::runtime::cuda::testing::RelativeError( \
        std::span<const float>(gpu), std::span<const float>(cpu));           \
    EXPECT_LE(rel_err, tol) << #gpu " vs " #cpu;                             \
  } while (0)

}  // namespace rackrun::runtime::cuda::testing

#endif  // RACKRUN_RUNTIME_CUDA_TEST_UTIL_H_
