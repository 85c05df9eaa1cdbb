// Shared by the gpu tests (runtime/cuda/*_test.cc): the skip without a GPU, device buffers
// from host vectors, the comparison with the CPU oracle, and an in-process channel that takes
// device buffers (for ranks sharing one GPU, as NCCL's does for ranks on several).
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

#include "comm/data_channel.h"
#include "comm/forwarding_channel.h"
#include "gtest/gtest.h"
#include "runtime/cuda/device.h"
#include "runtime/cuda/moe.h"
#include "runtime/layers/moe.h"
#include "runtime/residual/residual_streams.h"

namespace rackrun::runtime::cuda::testing {

// A receive into device memory through a host buffer: complete once the bytes are on the device.
class DeviceReceive final : public comm::Request {
 public:
  DeviceReceive(std::unique_ptr<comm::Request> inner, std::unique_ptr<std::vector<char>> host,
                void* device)
      : Request(inner->info()), inner_(std::move(inner)), host_(std::move(host)), device_(device) {}
  absl::StatusOr<bool> Test() override {
    if (copied_) return true;
    absl::StatusOr<bool> done = inner_->Test();
    if (!done.ok() || !*done) return done;
    if (absl::Status s = ::rackrun::runtime::cuda::CudaCheck(
            cudaMemcpy(device_, host_->data(), host_->size(), cudaMemcpyHostToDevice),
            "Irecv: received bytes to the device");
        !s.ok()) {
      return s;
    }
    copied_ = true;
    return true;
  }

 private:
  std::unique_ptr<comm::Request> inner_;
  std::unique_ptr<std::vector<char>> host_;
  void* device_;
  bool copied_ = false;
};

// An in-process rank's channel whose AllToAllV, AllReduce, Isend and Irecv also take device
// buffers (takes_device_buffers), staging them through host memory: on one GPU, what NCCL is to
// ranks on separate GPUs (it refuses two ranks on one). Its sub-channels (Split) take them too.
// Every other call goes to the in-process channel as it is.
class DeviceBufferChannel final : public comm::ForwardingChannel {
 public:
  explicit DeviceBufferChannel(comm::DataChannel& inner) : ForwardingChannel(inner) {}
  explicit DeviceBufferChannel(std::unique_ptr<comm::DataChannel> owned)
      : ForwardingChannel(std::move(owned)) {}

  absl::StatusOr<std::unique_ptr<comm::DataChannel>> Split(int color, int key) override {
    return SplitInto<DeviceBufferChannel>(color, key);
  }
  absl::Status AllReduce(const void* send, void* recv, int64_t count, comm::DataType type,
                         comm::ReduceOp op) override {
    const bool send_dev = OnDevice(send), recv_dev = OnDevice(recv);
    if (!send_dev && !recv_dev) return inner().AllReduce(send, recv, count, type, op);
    std::vector<char> host(static_cast<size_t>(count) * comm::DataTypeSize(type));
    if (send_dev) {
      if (cudaError_t e = cudaMemcpy(host.data(), send, host.size(), cudaMemcpyDeviceToHost);
          e != cudaSuccess) {
        return ::rackrun::runtime::cuda::CudaCheck(e, "AllReduce: device values to the host");
      }
    }
    if (absl::Status s = inner().AllReduce(send_dev ? host.data() : send,
                                           recv_dev ? host.data() : recv, count, type, op);
        !s.ok() || !recv_dev) {
      return s;
    }
    return ::rackrun::runtime::cuda::CudaCheck(
        cudaMemcpy(recv, host.data(), host.size(), cudaMemcpyHostToDevice),
        "AllReduce: the sums to the device");
  }

  bool takes_device_buffers() const override { return true; }
  absl::Status AllToAllV(const void* send, std::span<const int64_t> send_counts,
                         std::span<const int64_t> send_displs, void* recv,
                         std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                         comm::DataType type) override {
    const auto elem = static_cast<int64_t>(comm::DataTypeSize(type));
    int64_t send_bytes = 0, recv_bytes = 0;
    for (int p = 0; p < size(); ++p) {
      send_bytes = std::max(send_bytes, (send_displs[p] + send_counts[p]) * elem);
      recv_bytes = std::max(recv_bytes, (recv_displs[p] + recv_counts[p]) * elem);
    }
    std::vector<char> send_host, recv_host;
    const bool send_dev = OnDevice(send), recv_dev = OnDevice(recv);
    if (send_dev) {
      send_host.resize(static_cast<size_t>(send_bytes));
      if (cudaError_t e =
              cudaMemcpy(send_host.data(), send, send_host.size(), cudaMemcpyDeviceToHost);
          e != cudaSuccess) {
        return ::rackrun::runtime::cuda::CudaCheck(e, "AllToAllV: device rows to the host");
      }
    }
    if (recv_dev) recv_host.resize(static_cast<size_t>(recv_bytes));
    if (absl::Status s =
            inner().AllToAllV(send_dev ? send_host.data() : send, send_counts, send_displs,
                              recv_dev ? recv_host.data() : recv, recv_counts, recv_displs, type);
        !s.ok() || !recv_dev) {
      return s;
    }
    return ::rackrun::runtime::cuda::CudaCheck(
        cudaMemcpy(recv, recv_host.data(), recv_host.size(), cudaMemcpyHostToDevice),
        "AllToAllV: received rows to the device");
  }
  // The in-process channel copies a send's bytes when it is posted.
  absl::StatusOr<std::unique_ptr<comm::Request>> Isend(const void* buf, int64_t count,
                                                       comm::DataType type, int peer,
                                                       int tag) override {
    if (!OnDevice(buf)) return inner().Isend(buf, count, type, peer, tag);
    std::vector<char> host(static_cast<size_t>(count) * comm::DataTypeSize(type));
    if (cudaError_t e = cudaMemcpy(host.data(), buf, host.size(), cudaMemcpyDeviceToHost);
        e != cudaSuccess) {
      return ::rackrun::runtime::cuda::CudaCheck(e, "Isend: device bytes to the host");
    }
    return inner().Isend(host.data(), count, type, peer, tag);
  }
  absl::StatusOr<std::unique_ptr<comm::Request>> Irecv(void* buf, int64_t count,
                                                       comm::DataType type, int peer,
                                                       int tag) override {
    if (!OnDevice(buf)) return inner().Irecv(buf, count, type, peer, tag);
    auto host =
        std::make_unique<std::vector<char>>(static_cast<size_t>(count) * comm::DataTypeSize(type));
    absl::StatusOr<std::unique_ptr<comm::Request>> posted =
        inner().Irecv(host->data(), count, type, peer, tag);
    if (!posted.ok()) return posted.status();
    return std::make_unique<DeviceReceive>(*std::move(posted), std::move(host), buf);
  }

 private:
  static bool OnDevice(const void* p) {
    cudaPointerAttributes a{};
    return p != nullptr && cudaPointerGetAttributes(&a, p) == cudaSuccess &&
           a.type == cudaMemoryTypeDevice;
  }
};

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

// Largest |gpu - cpu| over the largest |cpu|, or over `min_scale` where that is larger: the
// error relative to the array's scale, so tiny elements do not dominate. `min_scale` is for
// an array that is zero by construction, whose two sides are rounding noise.
inline double RelativeError(std::span<const float> gpu, std::span<const float> cpu,
                            double min_scale = 0) {
  EXPECT_EQ(gpu.size(), cpu.size());
  double scale = 0, err = 0;
  for (size_t i = 0; i < std::min(gpu.size(), cpu.size()); ++i) {
    scale = std::max(scale, std::fabs(static_cast<double>(cpu[i])));
    const double d = std::fabs(static_cast<double>(gpu[i]) - cpu[i]);
    err = std::isnan(d) ? INFINITY : std::max(err, d);
  }
  return err / std::max({scale, min_scale, 1e-30});
}

// The largest |gradient| over `params`: the scale RelativeError's `min_scale` is a fraction
// of when some parameters' gradients are zero by construction.
inline double LargestGradient(std::span<const ParamRef<float>> params) {
  double largest = 0;
  for (const ParamRef<float>& p : params)
    for (int64_t i = 0; i < p.size; ++i) largest = std::max(largest, std::fabs(double{p.grad[i]}));
  return largest;
}

// The smallest gap, over the `tokens` rows of u, between the k-th and (k+1)-th largest biased
// router score of `layer` (its norm gain and router, computed in double): when it exceeds the
// engines' rounding, the GPU and the CPU route every token alike (checked without a GPU).
inline double RoutingMargin(MoeLayer<float>& layer, std::span<const float> u, int64_t tokens,
                            std::span<const float> bias) {
  const int c = layer.config().width, ne = layer.config().experts, k = layer.config().top_k;
  std::vector<ParamRef<float>> p = layer.Parameters();  // norm, router, ...
  double margin = INFINITY;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* x = u.data() + t * c;
    double ss = 0;
    for (int i = 0; i < c; ++i) ss += double{x[i]} * x[i];
    const double inv = 1.0 / std::sqrt(ss / c + 1e-6);
    std::vector<double> logit(static_cast<size_t>(ne), 0.0);
    for (int e = 0; e < ne; ++e) {
      for (int i = 0; i < c; ++i) logit[e] += p[0].value[i] * x[i] * inv * p[1].value[i * ne + e];
    }
    double mx = -INFINITY;
    for (int e = 0; e < ne; ++e) mx = std::max(mx, logit[static_cast<size_t>(e)]);
    double sum = 0;
    for (double& l : logit) sum += (l = std::exp(l - mx));
    std::vector<double> biased;
    for (int e = 0; e < ne; ++e) biased.push_back(logit[e] / sum + (bias.empty() ? 0.0 : bias[e]));
    std::sort(biased.rbegin(), biased.rend());
    margin = std::min(margin, biased[k - 1] - biased[k]);
  }
  return margin;
}

// A GpuMoe's weights from a MoeLayer<float>'s uploaded parameters (UploadParameters: norm,
// router, experts.w13, experts.w2, then shared.w13, shared.w2 when there are six) and `bias`.
inline MoeWeights MoeWeightsOf(std::vector<DeviceTensor<float>>& values,
                               std::vector<DeviceTensor<float>>& grads, float* bias) {
  MoeWeights w;
  w.norm = values[0].data();
  w.router = values[1].data();
  w.w13 = values[2].data();
  w.w2 = values[3].data();
  w.dnorm = grads[0].data();
  w.drouter = grads[1].data();
  w.dw13 = grads[2].data();
  w.dw2 = grads[3].data();
  if (values.size() >= 6) {
    w.shared_w13 = values[4].data();
    w.shared_w2 = values[5].data();
    w.dshared_w13 = grads[4].data();
    w.dshared_w2 = grads[5].data();
  }
  w.bias = bias;
  return w;
}

#define RACKRUN_EXPECT_CLOSE(gpu, cpu, tol)                                  \
  do {                                                                       \
    const double rel_err = ::rackrun::runtime::cuda::testing::RelativeError( \
        std::span<const float>(gpu), std::span<const float>(cpu));           \
    EXPECT_LE(rel_err, tol) << #gpu " vs " #cpu;                             \
  } while (0)

}  // namespace rackrun::runtime::cuda::testing

#endif  // RACKRUN_RUNTIME_CUDA_TEST_UTIL_H_
