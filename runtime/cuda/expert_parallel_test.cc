// Expert parallelism on GPUs, host-staged (runtime/cuda/expert_instances.h and GpuMoe's
// executor): 2 and 4 in-process ranks share one GPU, each holding its shard of a skewed MoE
// layer in device memory (GpuMoe + DeviceExpertInstances under an ExpertParallelGroup over
// the in-process channel), and run 3 microbatches of their rows. Against the unsharded CPU
// layer on all rows: every rank's outputs and input gradients, the sums of the norm and
// router gradients over the ranks and every master's expert gradients (replica gradients
// added), fp32 within 1e-4 of each array's scale; the balancer really replicated and moved work
// (ultraep, eplb; the check runtime/expert_parallel_test.cc makes on CPU ranks, shared through
// runtime/expert_parallel_testing.h). The routing margin of these inputs is checked without a GPU,
// so that a failure here is a GPU bug, not a rounding tie. A master read for the fan-out waits
// for the last optimizer step and not for the work issued after it. Over a channel that takes
// device buffers (testing::DeviceBufferChannel, as NCCL's), the token rows, replica weights and
// replica gradients stay on the device and every result is the host-staged run's, bit for bit.
#include "runtime/expert_parallel.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/inprocess_channel.h"
#include "gtest/gtest.h"
#include "runtime/cuda/expert_instances.h"
#include "runtime/cuda/moe.h"
#include "runtime/cuda/test_util.h"
#include "runtime/expert_parallel_testing.h"
#include "runtime/layers/moe.h"

namespace rackrun::runtime::cuda {
namespace {

using ep_testing::Result;
using testing::Download;
using testing::Upload;

constexpr int kWidth = 64;
constexpr int kExperts = 8;
constexpr int kTopK = 2;
constexpr int kHidden = 96;
constexpr int kTokens = 320;  // global rows per microbatch
constexpr int kPasses = 3;

MoeLayerConfig Config(int ranks, int rank) {
  MoeLayerConfig c;
  c.width = kWidth;
  c.experts = kExperts;
  c.top_k = kTopK;
  c.expert_hidden = kHidden;
  c.aux_loss_coef = 0.01;  // its gradient uses the counts over all ranks
  c.local_experts = ranks == 1 ? 0 : kExperts / ranks;
  c.expert_first = ranks == 1 ? 0 : rank * (kExperts / ranks);
  return c;
}

// The same weights on every shard; a router that favours experts 0 and 1 (rank 0's).
void InitSkewed(MoeLayer<float>& layer) {
  NormalInit rng(11);
  layer.Init(rng, 0.2, 0.05);
  ParamRef<float> router = layer.Parameters()[1];  // [C x E]
  for (int i = 0; i < kWidth; ++i) {
    router.value[i * kExperts + 0] += 0.05f;
    router.value[i * kExperts + 1] += 0.03f;
  }
}

std::vector<float> Input(int pass) { return testing::RandomVector(kTokens * kWidth, 300 + pass); }
std::vector<float> Upstream(int pass) {
  return testing::RandomVector(kTokens * kWidth, 400 + pass);
}

float GradScale(int rows) { return 0.5f * static_cast<float>(rows) / kTokens; }

// The microbatches every test here runs (ep_testing::RunPasses).
const ep_testing::Passes& TestPasses() {
  static const ep_testing::Passes* const p =
      new ep_testing::Passes{kTokens, kWidth, kPasses, &Input, &Upstream};
  return *p;
}

Result Reference() {
  MoeLayer<float> layer(Config(1, 0), "m");
  InitSkewed(layer);
  Result r;
  ep_testing::RunPasses(TestPasses(), layer, 0, kTokens, nullptr, r);
  return r;
}

// One rank: its shard on GPU 0, kPasses microbatches of its rows. With `device_rows`, over a
// channel that takes device buffers, so that the rows and weights stay on the device (checked).
absl::Status RunGpuRankOn(comm::DataChannel& in_process, const ExpertParallelOptions& options,
                          bool device_rows, Result& r) {
  std::optional<testing::DeviceBufferChannel> device_channel;
  if (device_rows) device_channel.emplace(in_process);
  comm::DataChannel& channel = device_rows ? *device_channel : in_process;
  const int ranks = channel.size(), rank = channel.rank();
  absl::StatusOr<std::unique_ptr<Device>> dev = Device::Open(0);
  if (!dev.ok()) return dev.status();
  Device* d = dev->get();
  const MoeLayerConfig config = Config(ranks, rank);
  MoeLayer<float> cpu(config, "m");  // the shard's initial values
  InitSkewed(cpu);
  std::vector<DeviceTensor<float>> values, grads;
  testing::UploadParameters(d, cpu.Parameters(), &values, &grads);
  DeviceTensor<float> bias = Upload(d, "bias", std::vector<float>(kExperts, 0.0f));
  const MoeWeights w = testing::MoeWeightsOf(values, grads, bias.data());
  MatMul matmul(d, GemmPrecision::kFp32);
  absl::StatusOr<std::unique_ptr<GpuMoe>> gpu = GpuMoe::Create(d, &matmul, config, "m", w);
  if (!gpu.ok()) return gpu.status();
  GpuMoe* layer = gpu->get();
  std::vector<ExpertParallelGroup::Layer> layers;
  bool installed_device_rows = false;
  layers.push_back({config,
                    std::make_unique<DeviceExpertInstances>(d, &matmul, layer->shard(), "m"),
                    [layer, &installed_device_rows](std::unique_ptr<ExpertExecutor<float>> e) {
                      installed_device_rows = e->device_rows();
                      layer->SetExecutor(std::move(e));
                    }});
  absl::StatusOr<std::unique_ptr<ExpertParallelGroup>> group =
      ExpertParallelGroup::Create(channel, std::move(layers), options);
  if (!group.ok()) return group.status();
  if (installed_device_rows != device_rows) {
    return absl::InternalError(absl::StrCat("the executor keeps its rows on the ",
                                            installed_device_rows ? "device" : "host"));
  }
  const int rows = kTokens / ranks;
  DeviceTensor<float> out_d(d, "out"), du_d(d, "du");
  for (absl::Status s : {out_d.Resize({rows, kWidth}), du_d.Resize({rows, kWidth})}) {
    if (!s.ok()) return s;
  }
  for (int pass = 0; pass < kPasses; ++pass) {
    const std::vector<float> u = Input(pass), dout = Upstream(pass);
    const auto mine = [&](const std::vector<float>& v) {
      return std::vector<float>(v.begin() + rank * rows * kWidth,
                                v.begin() + (rank + 1) * rows * kWidth);
    };
    DeviceTensor<float> u_d = Upload(d, "u", mine(u)), dout_d = Upload(d, "dout", mine(dout));
    (*group)->BeginMicrobatch(pass, /*training=*/true);
    if (absl::Status s = layer->Forward(u_d.data(), rows, out_d.data()); !s.ok()) return s;
    if (absl::Status s = layer->Backward(dout_d.data(), GradScale(rows), du_d.data()); !s.ok()) {
      return s;
    }
    const std::vector<float> out = Download(out_d), du = Download(du_d);
    r.out.insert(r.out.end(), out.begin(), out.end());
    r.du.insert(r.du.end(), du.begin(), du.end());
  }
  if (absl::Status s = (*group)->FinishMicrobatch(); !s.ok()) return s;
  if (absl::Status s = d->Synchronize(); !s.ok()) return s;
  for (const DeviceTensor<float>& g : grads) r.grads.push_back(Download(g));
  r.stats = (*group)->stats();
  return absl::OkStatus();
}

absl::Status RunGpuRank(comm::DataChannel& channel, const ExpertParallelOptions& options,
                        Result& r) {
  return RunGpuRankOn(channel, options, /*device_rows=*/false, r);
}
absl::Status RunGpuRankDeviceBuffers(comm::DataChannel& channel,
                                     const ExpertParallelOptions& options, Result& r) {
  return RunGpuRankOn(channel, options, /*device_rows=*/true, r);
}

// The same rank on the CPU engine (a MoeLayer<float> shard, HostExpertInstances): runs
// without a GPU, and shows the setup makes the balancer replicate.
absl::Status RunCpuRank(comm::DataChannel& channel, const ExpertParallelOptions& options,
                        Result& r) {
  const int ranks = channel.size(), rank = channel.rank();
  MoeLayer<float> layer(Config(ranks, rank), "m");
  InitSkewed(layer);
  absl::StatusOr<std::unique_ptr<ExpertParallelGroup>> group =
      ExpertParallelGroup::Create(channel, {&layer}, options);
  if (!group.ok()) return group.status();
  const int rows = kTokens / ranks;
  ep_testing::RunPasses(TestPasses(), layer, rank * rows, rows, group->get(), r);
  r.stats = (*group)->stats();
  return r.status;
}

// `ranks` in-process ranks, each running `rank_body`; every rank's result.
std::vector<Result> RunRanks(int ranks, const ExpertParallelOptions& options,
                             absl::Status (*rank_body)(comm::DataChannel&,
                                                       const ExpertParallelOptions&, Result&)) {
  std::vector<Result> results(static_cast<size_t>(ranks));
  comm::ChannelOptions channel_options;
  channel_options.timeout = absl::Seconds(60);
  (void)comm::RunInProcessRanks(ranks, channel_options, [&](comm::DataChannel& channel) {
    omp_set_num_threads(1);
    Result& r = results[static_cast<size_t>(channel.rank())];
    r.status = rank_body(channel, options, r);
    return r.status;
  });
  return results;
}

// Runs without a GPU: the comparisons below rely on it.
TEST(GpuExpertParallelTest, RoutingMarginsExceedRounding) {
  MoeLayer<float> layer(Config(1, 0), "m");
  InitSkewed(layer);
  for (int pass = 0; pass < kPasses; ++pass) {
    EXPECT_GT(testing::RoutingMargin(layer, Input(pass), kTokens, {}), 1e-5) << "pass " << pass;
  }
}

using ep_testing::OptionsFor;

class GpuExpertParallelTest : public ::testing::TestWithParam<ep_testing::RanksPolicySlots> {};

// Runs without a GPU: the setup itself, on the CPU engine.
TEST_P(GpuExpertParallelTest, CpuRanksMatchTheUnshardedLayer) {
  const auto [ranks, policy, shared_slots] = GetParam();
  ep_testing::ExpectRanksMatchReference(
      TestPasses(), RunRanks(ranks, OptionsFor(policy, shared_slots), &RunCpuRank), Reference(),
      policy, 1e-5);
}

TEST_P(GpuExpertParallelTest, RanksSharingOneGpuMatchTheUnshardedLayer) {
  if (absl::Status avail = GpuAvailable(); !avail.ok()) GTEST_SKIP() << avail.message();
  const auto [ranks, policy, shared_slots] = GetParam();
  ep_testing::ExpectRanksMatchReference(
      TestPasses(), RunRanks(ranks, OptionsFor(policy, shared_slots), &RunGpuRank), Reference(),
      policy, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(RanksAndPolicies, GpuExpertParallelTest,
                         ep_testing::RanksPolicySlotsValues(), ep_testing::RanksPolicySlotsName);

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Rows, replica weights and replica gradients kept on the device (dispatched and combined there,
// runtime/cuda/device_rows.h; fanned out and reduced from device memory) compute what the
// host-staged run computes, bit for bit: every transfer moves bytes as they are, and the batches,
// their GEMMs and the gradients' order are the same. The host-staged run is checked against the
// unsharded layer by the test above, so this one is too.
class GpuDeviceBuffersTest : public GpuExpertParallelTest {};

TEST_P(GpuDeviceBuffersTest, DeviceBuffersGiveTheHostStagedBits) {
  if (absl::Status avail = GpuAvailable(); !avail.ok()) GTEST_SKIP() << avail.message();
  const auto [ranks, policy, shared_slots] = GetParam();
  const ExpertParallelOptions options = OptionsFor(policy, shared_slots);
  const std::vector<Result> device = RunRanks(ranks, options, &RunGpuRankDeviceBuffers);
  const std::vector<Result> host = RunRanks(ranks, options, &RunGpuRank);
  int64_t replicas = 0;
  for (int r = 0; r < ranks; ++r) {
    const Result &d = device[static_cast<size_t>(r)], &h = host[static_cast<size_t>(r)];
    ASSERT_TRUE(d.status.ok()) << "rank " << r << ": " << d.status;
    ASSERT_TRUE(h.status.ok()) << "rank " << r << ": " << h.status;
    EXPECT_TRUE(SameBits(d.out, h.out)) << "rank " << r;
    EXPECT_TRUE(SameBits(d.du, h.du)) << "rank " << r;
    ASSERT_EQ(d.grads.size(), h.grads.size());
    for (size_t i = 0; i < d.grads.size(); ++i) {
      EXPECT_TRUE(SameBits(d.grads[i], h.grads[i])) << "rank " << r << ", parameter " << i;
    }
    EXPECT_EQ(d.stats.expert_rows, h.stats.expert_rows) << "rank " << r;
    replicas += d.stats.layers[0].replicas;
  }
  if (policy != "none") {
    EXPECT_GT(replicas, 0) << "the balancer should have replicated";
  }
}

INSTANTIATE_TEST_SUITE_P(RanksAndPolicies, GpuDeviceBuffersTest,
                         ::testing::Values(ep_testing::RanksPolicySlots{2, "none", true},
                                           ep_testing::RanksPolicySlots{2, "ultraep", true},
                                           ep_testing::RanksPolicySlots{4, "ultraep", true},
                                           ep_testing::RanksPolicySlots{4, "eplb", false}),
                         ep_testing::RanksPolicySlotsName);

// A shard without an expert-parallel group is refused, naming what it needs.
TEST(GpuExpertParallelTest, AShardWithoutAGroupIsRefused) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  const MoeLayerConfig config = Config(2, 1);
  MoeLayer<float> cpu(config, "m");
  InitSkewed(cpu);
  std::vector<DeviceTensor<float>> values, grads;
  testing::UploadParameters(dev.get(), cpu.Parameters(), &values, &grads);
  DeviceTensor<float> bias = Upload(dev.get(), "bias", std::vector<float>(kExperts, 0.0f));
  const MoeWeights w = testing::MoeWeightsOf(values, grads, bias.data());
  MatMul matmul(dev.get(), GemmPrecision::kFp32);
  absl::StatusOr<std::unique_ptr<GpuMoe>> gpu = GpuMoe::Create(dev.get(), &matmul, config, "m", w);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_TRUE((*gpu)->sharded());
  EXPECT_EQ((*gpu)->shard().first, kExperts / 2);
  DeviceTensor<float> u = Upload(dev.get(), "u", Input(0)), out(dev.get(), "out");
  ASSERT_TRUE(out.Resize({kTokens, kWidth}).ok());
  const absl::Status s = (*gpu)->Forward(u.data(), kTokens, out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("expert-parallel group"), std::string::npos) << s;
}

// After WeightsChanged, a master is read as the last optimizer step left it (issued, not waited
// for by the host) and without waiting for the compute stream's later work: a fan-out does not
// stall the routing and dispatch issued before it. The second half is checked on the simulator
// only, where queued work runs only when waited for (on a GPU the later work may have run).
TEST(GpuExpertParallelTest, ReadMasterWaitsForTheLastStepOnly) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  const int64_t n13 = 2 * kWidth * kHidden, n2 = int64_t{kHidden} * kWidth;
  DeviceTensor<float> w13 = Upload(dev.get(), "w13", std::vector<float>(n13, 1.0f));
  DeviceTensor<float> w2 = Upload(dev.get(), "w2", std::vector<float>(n2, 2.0f));
  DeviceTensor<float> dw13 = Upload(dev.get(), "dw13", std::vector<float>(n13, 0.0f));
  DeviceTensor<float> dw2 = Upload(dev.get(), "dw2", std::vector<float>(n2, 0.0f));
  MatMul matmul(dev.get(), GemmPrecision::kFp32);
  DeviceExpertInstances experts(dev.get(), &matmul,
                                {.first = 0,
                                 .count = 1,
                                 .width = kWidth,
                                 .hidden = kHidden,
                                 .w13 = w13.data(),
                                 .w2 = w2.data(),
                                 .dw13 = dw13.data(),
                                 .dw2 = dw2.data()},
                                "m");
  ASSERT_TRUE(dev->Synchronize().ok());
  // The "optimizer step": new weights, queued on the compute stream.
  const std::vector<float> new13 = testing::RandomVector(n13, 5);
  const std::vector<float> new2 = testing::RandomVector(n2, 6);
  ASSERT_TRUE(w13.CopyFrom(new13).ok());
  ASSERT_TRUE(w2.CopyFrom(new2).ok());
  ASSERT_TRUE(experts.WeightsChanged().ok());
  // Later work: a marker copied to pinned memory.
  absl::StatusOr<PinnedBuffer<float>> marker = PinnedBuffer<float>::Allocate(1, "marker");
  ASSERT_TRUE(marker.ok()) << marker.status();
  marker->data()[0] = 0.0f;
  ASSERT_EQ(cudaMemcpyAsync(marker->data(), w2.data(), sizeof(float), cudaMemcpyDeviceToHost,
                            dev->stream()),
            cudaSuccess);
  std::vector<float> read(static_cast<size_t>(n13 + n2));
  ASSERT_TRUE(experts.ReadMaster(0, read.data()).ok());
  EXPECT_EQ(std::vector<float>(read.begin(), read.begin() + n13), new13);
  EXPECT_EQ(std::vector<float>(read.begin() + n13, read.end()), new2);
#ifdef RACKRUN_CUDA_SIM
  EXPECT_EQ(marker->data()[0], 0.0f) << "ReadMaster waited for the work issued after the step";
#endif
  ASSERT_TRUE(dev->Synchronize().ok());
  EXPECT_EQ(marker->data()[0], new2[0]);
}

}  // namespace
}  // namespace rackrun::runtime::cuda
