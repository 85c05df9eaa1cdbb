// GpuAttention (runtime/cuda/attention.h) against the CPU layer it mirrors,
// runtime/layers/attention.h's Attention<float>, on the same weights and inputs: output, input
// gradient and every parameter gradient, for each head dim the kernels are built for, rows
// that span several query blocks (seq 100 and 150 with 64 rows per block) and documents that
// start mid-row. Tolerances relative to each array's largest magnitude: fp32 1e-4 (online
// softmax and sums over a row in another order), TF32 1e-2, bf16 4e-2.
#include "runtime/cuda/attention.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "runtime/cuda/test_util.h"
#include "runtime/layers/attention.h"

namespace rackrun::runtime::cuda {
namespace {

using testing::Download;
using testing::RandomVector;
using testing::Upload;

struct Case {
  int width, heads, batch, seq;
  GemmPrecision precision;
  double tol;
};

// doc_start per token (index within the row of its document's first token): row b has
// documents starting at 0 and, for odd b, also at seq / 3 and seq / 2.
std::vector<int32_t> DocStarts(int batch, int seq) {
  std::vector<int32_t> ds(static_cast<size_t>(batch) * seq);
  for (int b = 0; b < batch; ++b) {
    int32_t start = 0;
    for (int i = 0; i < seq; ++i) {
      if (b % 2 == 1 && (i == seq / 3 || i == seq / 2)) start = i;
      ds[static_cast<size_t>(b) * seq + i] = start;
    }
  }
  return ds;
}

void CheckAgainstCpu(Device* dev, const Case& k) {
  SCOPED_TRACE(absl::StrCat("width ", k.width, " heads ", k.heads, " batch ", k.batch, " seq ",
                            k.seq, " ", GemmPrecisionName(k.precision)));
  const int c = k.width;
  const int64_t tokens = int64_t{k.batch} * k.seq;
  Attention<float> cpu(c, k.heads, k.seq, 10000.0, "attn");
  NormalInit rng(7);
  cpu.Init(rng, 0.05, 0.05);
  std::vector<ParamRef<float>> params = cpu.Parameters();  // norm, wqkv, wo
  const std::vector<float> gain = RandomVector(c, 3, 0.2f);
  for (int i = 0; i < c; ++i) params[0].value[i] = 1.0f + gain[static_cast<size_t>(i)];
  const std::vector<float> u = RandomVector(tokens * c, 11);
  const std::vector<float> dout = RandomVector(tokens * c, 12);
  const std::vector<int32_t> ds = DocStarts(k.batch, k.seq);
  std::vector<float> out(u.size()), du(u.size());
  cpu.Forward(u.data(), k.batch, k.seq, ds.data(), out.data());
  cpu.Backward(dout.data(), du.data());

  std::vector<DeviceTensor<float>> values, grads;
  testing::UploadParameters(dev, params, &values, &grads);
  AttentionWeights w{values[0].data(), values[1].data(), values[2].data(),
                     grads[0].data(),  grads[1].data(),  grads[2].data()};
  MatMul matmul(dev, k.precision);
  absl::StatusOr<std::unique_ptr<GpuAttention>> gpu =
      GpuAttention::Create(dev, &matmul, c, k.heads, k.seq, 10000.0, "attn", w);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  DeviceTensor<float> u_d = Upload(dev, "u", u), dout_d = Upload(dev, "dout", dout);
  DeviceTensor<int32_t> ds_d = Upload(dev, "doc_start", ds);
  DeviceTensor<float> out_d(dev, "out"), du_d(dev, "du");
  ASSERT_TRUE(out_d.Resize({tokens, c}).ok());
  ASSERT_TRUE(du_d.Resize({tokens, c}).ok());
  ASSERT_TRUE((*gpu)->Forward(u_d.data(), k.batch, k.seq, ds_d.data(), out_d.data()).ok());
  ASSERT_TRUE((*gpu)->Backward(dout_d.data(), du_d.data()).ok());
  RACKRUN_EXPECT_CLOSE(Download(out_d), out, k.tol);
  RACKRUN_EXPECT_CLOSE(Download(du_d), du, k.tol);
  for (size_t i = 0; i < params.size(); ++i) {
    SCOPED_TRACE(params[i].name);
    const std::vector<float> cpu_grad(params[i].grad, params[i].grad + params[i].size);
    RACKRUN_EXPECT_CLOSE(Download(grads[i]), cpu_grad, k.tol);
  }
}

TEST(GpuAttentionTest, Fp32MatchesTheCpuLayerForEveryHeadDim) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  for (const Case& k : {Case{64, 4, 2, 100, GemmPrecision::kFp32, 1e-4},     // head dim 16
                        Case{128, 4, 2, 150, GemmPrecision::kFp32, 1e-4},    // 32 (demo)
                        Case{128, 2, 3, 100, GemmPrecision::kFp32, 1e-4},    // 64 (c1024)
                        Case{256, 2, 2, 70, GemmPrecision::kFp32, 1e-4}}) {  // 128
    CheckAgainstCpu(dev.get(), k);
  }
}

TEST(GpuAttentionTest, Tf32AndBf16StayWithinTheirRounding) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  CheckAgainstCpu(dev.get(), {128, 4, 2, 150, GemmPrecision::kTf32, 1e-2});
  CheckAgainstCpu(dev.get(), {128, 4, 2, 150, GemmPrecision::kBf16, 4e-2});
}

// Fixed reduction orders, no atomics: two runs give the same bits.
TEST(GpuAttentionTest, RepeatsBitForBit) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  const int c = 128, heads = 4, batch = 2, seq = 130;
  const int64_t tokens = int64_t{batch} * seq;
  std::vector<DeviceTensor<float>> p;
  for (int64_t n : {int64_t{c}, int64_t{c} * 3 * c, int64_t{c} * c}) {
    p.push_back(Upload(dev.get(), "w", RandomVector(n, 5 + n, 0.05f)));
  }
  DeviceTensor<float> dn(dev.get(), "dn"), dqkv(dev.get(), "dqkv"), dwo(dev.get(), "dwo");
  ASSERT_TRUE(dn.Resize({c}).ok());
  ASSERT_TRUE(dqkv.Resize({c, 3 * c}).ok());
  ASSERT_TRUE(dwo.Resize({c, c}).ok());
  MatMul matmul(dev.get(), GemmPrecision::kFp32);
  auto gpu = GpuAttention::Create(
      dev.get(), &matmul, c, heads, seq, 10000.0, "attn",
      {p[0].data(), p[1].data(), p[2].data(), dn.data(), dqkv.data(), dwo.data()});
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  DeviceTensor<float> u = Upload(dev.get(), "u", RandomVector(tokens * c, 1));
  DeviceTensor<float> dout = Upload(dev.get(), "dout", RandomVector(tokens * c, 2));
  DeviceTensor<int32_t> ds = Upload(dev.get(), "ds", DocStarts(batch, seq));
  DeviceTensor<float> out(dev.get(), "out"), du(dev.get(), "du");
  ASSERT_TRUE(out.Resize({tokens, c}).ok());
  ASSERT_TRUE(du.Resize({tokens, c}).ok());
  std::vector<float> first_out, first_du;
  for (int run = 0; run < 2; ++run) {
    ASSERT_TRUE((*gpu)->Forward(u.data(), batch, seq, ds.data(), out.data()).ok());
    ASSERT_TRUE((*gpu)->Backward(dout.data(), du.data()).ok());
    if (run == 0) {
      first_out = Download(out);
      first_du = Download(du);
    } else {
      EXPECT_EQ(Download(out), first_out);
      EXPECT_EQ(Download(du), first_du);
    }
  }
}

// Runs without a GPU: the head-dim check comes before any device work.
TEST(GpuAttentionTest, UnsupportedHeadDimIsAnErrorNamingTheFields) {
  absl::StatusOr<std::unique_ptr<GpuAttention>> a =
      GpuAttention::Create(nullptr, nullptr, 96, 4, 64, 10000.0, "blocks.0.attn", {});
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(a.status().message().find("model.width / model.heads = 96 / 4"), std::string::npos)
      << a.status();
}

}  // namespace
}  // namespace rackrun::runtime::cuda
