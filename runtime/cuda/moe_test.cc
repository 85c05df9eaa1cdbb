// GpuMoe (runtime/cuda/moe.h) against the CPU layer it mirrors, MoeLayer<float>
// (runtime/layers/moe.h), on the same weights, inputs and selection bias: the output, the input
// gradient, every parameter gradient (router, experts, shared expert, norm), the exact
// counts, the auxiliary loss and the bias after its update. Tolerances relative to each
// array's largest magnitude: fp32 1e-4, bf16 4e-2. The routing must be the same on both
// engines: the inputs are chosen so that every token's k-th and (k+1)-th biased scores are
// further apart than rounding moves them (checked on the CPU, without a GPU, by
// RoutingMarginsExceedRounding). Both expert-GEMM paths (per_expert, grouped) are checked
// against the CPU layer and against each other; the forward's counts copy overlaps the
// dispatch and the shared expert, which these comparisons cover (same results either way).
#include "runtime/cuda/moe.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "runtime/cuda/kernels.h"
#include "runtime/cuda/test_util.h"
#include "runtime/layers/moe.h"

namespace rackrun::runtime::cuda {
namespace {

using testing::Download;
using testing::RandomVector;
using testing::Upload;

struct Setup {
  MoeLayerConfig config;
  int64_t tokens = 0;
  std::unique_ptr<MoeLayer<float>> cpu;
  std::vector<float> u, dout, bias;
};

// With `lean`, for bf16: each token leans on two experts (its input is noise plus the router
// columns of both, the first stronger), so that its top-2 stand further above the third than
// bf16's rounding of the router GEMM's inputs moves a score. Random inputs leave near ties
// that bf16 flips (fp32 does not).
Setup MakeSetup(bool shared, uint64_t seed, bool lean = false) {
  Setup s;
  s.config.width = 64;
  s.config.experts = 8;
  s.config.top_k = 2;
  s.config.expert_hidden = 96;
  s.config.shared_expert = shared;
  s.config.shared_hidden = shared ? 80 : 0;
  s.config.aux_loss_coef = 0.01;
  s.config.bias_update_rate = 0.001;
  s.tokens = 300;
  s.cpu = std::make_unique<MoeLayer<float>>(s.config, "moe");
  NormalInit rng(seed);
  s.cpu->Init(rng, 0.2, 0.05);
  s.bias = RandomVector(s.config.experts, seed + 1, 0.01f);
  std::copy(s.bias.begin(), s.bias.end(), s.cpu->Buffers()[0].value);
  s.u = RandomVector(s.tokens * s.config.width, seed + 2);
  s.dout = RandomVector(s.tokens * s.config.width, seed + 3);
  if (lean) {
    const int c = s.config.width, ne = s.config.experts;
    const float* router = s.cpu->Parameters()[1].value;  // c x ne
    std::vector<double> norm(static_cast<size_t>(ne), 0.0);
    for (int i = 0; i < c; ++i)
      for (int e = 0; e < ne; ++e) norm[e] += double{router[i * ne + e]} * router[i * ne + e];
    for (int64_t t = 0; t < s.tokens; ++t) {
      const int e1 = static_cast<int>(t % ne);
      const int e2 = static_cast<int>((e1 + 1 + (t / ne) % (ne - 1)) % ne);  // never e1
      for (int i = 0; i < c; ++i) {
        float& x = s.u[static_cast<size_t>(t * c + i)];
        // Router column / its squared norm: both experts' logits grow alike.
        const double mean = (std::sqrt(norm[e1]) + std::sqrt(norm[e2])) / 2;
        x = 0.5f * x +
            static_cast<float>(std::sqrt(c) * mean *
                               (router[i * ne + e1] / norm[e1] + router[i * ne + e2] / norm[e2]));
      }
    }
  }
  return s;
}

double RoutingMargin(const Setup& s) {
  return testing::RoutingMargin(*s.cpu, s.u, s.tokens, s.bias);
}

// Runs without a GPU: the comparisons below rely on it.
TEST(GpuMoeTest, RoutingMarginsExceedRounding) {
  for (bool shared : {false, true}) {
    EXPECT_GT(RoutingMargin(MakeSetup(shared, shared ? 21 : 20)), 1e-5) << "shared " << shared;
  }
  // bf16 rounds the router GEMM's inputs (2^-9 relative): scores move by about 1e-3.
  const double lean = RoutingMargin(MakeSetup(/*shared=*/true, 21, /*lean=*/true));
  EXPECT_GT(lean, 2e-2);
}

// One forward and backward of the GPU layer built from `s` (its CPU layer's weights; the bias
// `bias`), on `path`; the expert gradients start from `grad_init` (zeros when empty).
struct GpuResult {
  std::vector<float> out, du, bias;
  std::vector<std::vector<float>> grads;  // the CPU layer's parameter order
  std::vector<int64_t> counts;
  double aux_loss = 0;
  size_t batches = 0;
};

GpuResult RunGpu(Device* dev, const Setup& s, const std::vector<float>& bias_host,
                 GemmPrecision precision, ExpertGemmPath path,
                 const std::vector<std::vector<float>>& grad_init = {}) {
  GpuResult r;
  const int c = s.config.width;
  std::vector<ParamRef<float>> params = s.cpu->Parameters();
  std::vector<DeviceTensor<float>> values, grads;
  testing::UploadParameters(dev, params, &values, &grads);
  for (size_t i = 0; i < grad_init.size(); ++i) {
    if (!grad_init[i].empty()) {
      EXPECT_TRUE(grads[i].CopyFrom(grad_init[i]).ok());
    }
  }
  DeviceTensor<float> bias = Upload(dev, "bias", bias_host);
  const MoeWeights w = testing::MoeWeightsOf(values, grads, bias.data());
  MatMul matmul(dev, precision);
  absl::StatusOr<std::unique_ptr<GpuMoe>> gpu = GpuMoe::Create(dev, &matmul, s.config, "moe", w);
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  if (!gpu.ok()) return r;
  EXPECT_EQ((*gpu)->expert_gemm_path(), DefaultExpertGemmPath());
  (*gpu)->set_expert_gemm_path(path);
  DeviceTensor<float> u = Upload(dev, "u", s.u), dout = Upload(dev, "dout", s.dout);
  DeviceTensor<float> out_d(dev, "out"), du_d(dev, "du");
  EXPECT_TRUE(out_d.Resize({s.tokens, c}).ok());
  EXPECT_TRUE(du_d.Resize({s.tokens, c}).ok());
  absl::Status st = (*gpu)->Forward(u.data(), s.tokens, out_d.data());
  EXPECT_TRUE(st.ok()) << st;
  st = (*gpu)->Backward(dout.data(), 0.5f, du_d.data());
  EXPECT_TRUE(st.ok()) << st;
  st = (*gpu)->UpdateSelectionBias();
  EXPECT_TRUE(st.ok()) << st;
  r.out = Download(out_d);
  r.du = Download(du_d);
  r.bias = Download(bias);
  for (const DeviceTensor<float>& g : grads) r.grads.push_back(Download(g));
  r.counts = (*gpu)->counts();
  r.aux_loss = (*gpu)->aux_loss();
  r.batches = (*gpu)->batches().size();
  return r;
}

void CheckAgainstCpu(Device* dev, bool shared, GemmPrecision precision, double tol,
                     ExpertGemmPath path = ExpertGemmPath::kPerExpert) {
  SCOPED_TRACE(absl::StrCat("shared ", shared, " ", GemmPrecisionName(precision), " ",
                            ExpertGemmPathName(path)));
  Setup s = MakeSetup(shared, shared ? 21 : 20, /*lean=*/precision == GemmPrecision::kBf16);
  std::vector<float> out(s.u.size()), du(s.u.size());
  ASSERT_TRUE(s.cpu->Forward(s.u.data(), s.tokens, out.data()).ok());
  ASSERT_TRUE(s.cpu->Backward(s.dout.data(), 0.5f, du.data()).ok());
  s.cpu->UpdateSelectionBias();

  const GpuResult gpu = RunGpu(dev, s, s.bias, precision, path);
  EXPECT_EQ(gpu.counts, s.cpu->counts());
  EXPECT_NEAR(gpu.aux_loss, s.cpu->aux_loss(), 1e-5 * std::fabs(s.cpu->aux_loss()));
  ASSERT_EQ(gpu.batches, static_cast<size_t>(s.config.experts));
  RACKRUN_EXPECT_CLOSE(gpu.out, out, tol);
  RACKRUN_EXPECT_CLOSE(gpu.du, du, tol);
  std::vector<ParamRef<float>> params = s.cpu->Parameters();
  ASSERT_EQ(gpu.grads.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    SCOPED_TRACE(params[i].name);
    const std::vector<float> cpu_grad(params[i].grad, params[i].grad + params[i].size);
    RACKRUN_EXPECT_CLOSE(gpu.grads[i], cpu_grad, tol);
  }
  const ParamRef<float> cpu_bias = s.cpu->Buffers()[0];
  EXPECT_EQ(gpu.bias, std::vector<float>(cpu_bias.value, cpu_bias.value + cpu_bias.size));
}

TEST(GpuMoeTest, Fp32MatchesTheCpuLayer) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  CheckAgainstCpu(dev.get(), /*shared=*/false, GemmPrecision::kFp32, 1e-4);
  CheckAgainstCpu(dev.get(), /*shared=*/true, GemmPrecision::kFp32, 1e-4);
}

TEST(GpuMoeTest, Bf16StaysWithinItsRounding) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  CheckAgainstCpu(dev.get(), /*shared=*/true, GemmPrecision::kBf16, 4e-2);
}

TEST(GpuMoeTest, GroupedFp32MatchesTheCpuLayer) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  CheckAgainstCpu(dev.get(), /*shared=*/false, GemmPrecision::kFp32, 1e-4,
                  ExpertGemmPath::kGrouped);
  CheckAgainstCpu(dev.get(), /*shared=*/true, GemmPrecision::kFp32, 1e-4, ExpertGemmPath::kGrouped);
}

// Within tolerance whether cuBLAS ran the grouped bf16 GEMM or refused it (grouped_gemm.h: then
// per expert); which one it did is printed for tools/gpu-check's summary.
TEST(GpuMoeTest, GroupedBf16StaysWithinItsRounding) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  CheckAgainstCpu(dev.get(), /*shared=*/true, GemmPrecision::kBf16, 4e-2, ExpertGemmPath::kGrouped);
  const std::string refused = GroupedBf16Refusal();
  std::printf("gpu-check: cublasGemmGroupedBatchedEx with bf16 A and B and an fp32 C: %s\n",
              refused.empty() ? "accepted" : ("refused (" + refused + "); ran per expert").c_str());
}

// The two paths on the same GPU, with one expert never selected (its bias far below the
// others'): the same routing and counts, outputs and gradients within the precision's
// summation-order differences, and the empty expert's weight gradients exactly as they were
// before (both paths leave it out).
TEST(GpuMoeTest, GroupedMatchesPerExpert) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  for (auto [precision, tol] :
       {std::pair(GemmPrecision::kFp32, 1e-5), std::pair(GemmPrecision::kTf32, 5e-3),
        std::pair(GemmPrecision::kBf16, 2e-2)}) {
    SCOPED_TRACE(GemmPrecisionName(precision));
    ::rackrun::runtime::cuda::Setup s = MakeSetup(/*shared=*/true, 21);
    const int empty = 3;
    std::vector<float> bias = s.bias;
    bias[empty] = -10.0f;
    // Expert gradients start non-zero, so "untouched" is visible.
    std::vector<std::vector<float>> init(s.cpu->Parameters().size());
    init[2] = RandomVector(s.cpu->Parameters()[2].size, 31, 1e-3f);
    init[3] = RandomVector(s.cpu->Parameters()[3].size, 32, 1e-3f);
    const GpuResult per = RunGpu(dev.get(), s, bias, precision, ExpertGemmPath::kPerExpert, init);
    const GpuResult grouped = RunGpu(dev.get(), s, bias, precision, ExpertGemmPath::kGrouped, init);
    ASSERT_EQ(per.counts.size(), static_cast<size_t>(s.config.experts));
    EXPECT_EQ(per.counts[empty], 0);
    EXPECT_EQ(grouped.counts, per.counts);
    EXPECT_EQ(grouped.bias, per.bias);
    EXPECT_EQ(grouped.aux_loss, per.aux_loss);
    RACKRUN_EXPECT_CLOSE(grouped.out, per.out, tol);
    RACKRUN_EXPECT_CLOSE(grouped.du, per.du, tol);
    ASSERT_EQ(grouped.grads.size(), per.grads.size());
    for (size_t i = 0; i < per.grads.size(); ++i) {
      SCOPED_TRACE(s.cpu->Parameters()[i].name);
      RACKRUN_EXPECT_CLOSE(grouped.grads[i], per.grads[i], tol);
    }
    const int c = s.config.width, f = s.config.expert_hidden;
    for (auto [index, size] : {std::pair(2, int64_t{c} * 2 * f), std::pair(3, int64_t{f} * c)}) {
      const auto slice = [&](const std::vector<float>& v) {
        return std::vector<float>(v.begin() + empty * size, v.begin() + (empty + 1) * size);
      };
      EXPECT_EQ(slice(per.grads[static_cast<size_t>(index)]),
                slice(init[static_cast<size_t>(index)]));
      EXPECT_EQ(slice(grouped.grads[static_cast<size_t>(index)]),
                slice(init[static_cast<size_t>(index)]));
    }
  }
}

// The device's permutation (SlotRows from the counts' prefix sums) is the host's
// (expert_permutation.h) for the plan the layer solved.
#ifdef RACKRUN_CUDA_SIM
// A cuBLAS that refuses bf16 operands with an fp32 C in its grouped GEMM (the simulator's
// RACKRUN_CUDASIM_GROUPED_TYPES=matching, sim/README.md): the grouped path's bf16 expert GEMMs
// run per expert instead, giving the per-expert path's results bit for bit, and the refusal is
// recorded for the process; fp32 operands (C's type) still go grouped and record nothing.
TEST(GpuMoeTest, GroupedBf16RunsPerExpertWhereCublasRefusesIt) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  ForgetGroupedBf16RefusalForTesting();
  ::rackrun::runtime::cuda::Setup s = MakeSetup(/*shared=*/true, 21, /*lean=*/true);
  const GpuResult per =
      RunGpu(dev.get(), s, s.bias, GemmPrecision::kBf16, ExpertGemmPath::kPerExpert);
  ASSERT_EQ(setenv("RACKRUN_CUDASIM_GROUPED_TYPES", "matching", 1), 0);
  const GpuResult fp32 =
      RunGpu(dev.get(), s, s.bias, GemmPrecision::kFp32, ExpertGemmPath::kGrouped);
  EXPECT_EQ(GroupedBf16Refusal(), "");
  const GpuResult grouped =
      RunGpu(dev.get(), s, s.bias, GemmPrecision::kBf16, ExpertGemmPath::kGrouped);
  ASSERT_EQ(unsetenv("RACKRUN_CUDASIM_GROUPED_TYPES"), 0);
  EXPECT_EQ(GroupedBf16Refusal(), "CUBLAS_STATUS_NOT_SUPPORTED");
  ForgetGroupedBf16RefusalForTesting();
  EXPECT_FALSE(fp32.out.empty());
  EXPECT_EQ(grouped.counts, per.counts);
  EXPECT_EQ(grouped.out, per.out);
  EXPECT_EQ(grouped.du, per.du);
  EXPECT_EQ(grouped.grads, per.grads);
  EXPECT_EQ(grouped.bias, per.bias);
}
#endif

TEST(GpuMoeTest, DevicePermutationIsThePlansPermutation) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  const int experts = 16, top_k = 4;
  const int64_t tokens = 1000;
  std::vector<int32_t> sel;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int j = 0; j < top_k; ++j)
      sel.push_back(static_cast<int32_t>((t * 7 + j * 3 + t / 5) % experts));
  }
  planner::LoadMatrix loads(1, experts);
  for (int32_t e : sel) ++loads.at(0, e);
  auto planner = planner::MakePlanner("none", planner::Domain{1, experts, 0}, {});
  ASSERT_TRUE(planner.ok());
  absl::StatusOr<planner::Plan> plan = (*planner)->Solve(loads, 0);
  ASSERT_TRUE(plan.ok());
  absl::StatusOr<ExpertPermutation> want = PermuteByPlan(*plan, loads, sel);
  ASSERT_TRUE(want.ok()) << want.status();
  std::vector<int64_t> offsets(experts + 1, 0);
  for (int e = 0; e < experts; ++e) offsets[e + 1] = offsets[e] + loads.at(0, e);
  DeviceTensor<int32_t> sel_d = Upload(dev.get(), "selected", sel);
  DeviceTensor<int64_t> off_d = Upload(dev.get(), "offsets", offsets);
  DeviceTensor<int64_t> rows(dev.get(), "slot rows"), scratch(dev.get(), "slot scratch");
  ASSERT_TRUE(rows.Resize({tokens * top_k}).ok());
  ASSERT_TRUE(scratch.Resize({kernels::SlotRowsScratch(tokens, experts, top_k)}).ok());
  ASSERT_EQ(kernels::SlotRows(tokens, experts, top_k, sel_d.data(), off_d.data(), scratch.data(),
                              rows.data(), dev->stream()),
            cudaSuccess);
  EXPECT_EQ(Download(rows), want->row_of_choice);
}

}  // namespace
}  // namespace rackrun::runtime::cuda
