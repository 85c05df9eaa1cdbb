// GpuAttention (runtime/cuda/attention.h) against the CPU layer it mirrors,
// runtime/layers/attention.h's Attention<float>, on the same weights and inputs: output, input
// gradient and every parameter gradient, for each head dim the kernels are built for, rows
// that span several query blocks (seq 100 and 150 with 64 rows per block) and documents that
// start mid-row. Tolerances relative to each array's largest magnitude: fp32 1e-4 (online
// softmax and sums over a row in another order), TF32 1e-2, bf16 4e-2 (its core on tensor
// cores). The tensor-core kernels are also checked alone against the fp32 kernels on inputs
// already rounded to bf16, where only the rounding of the probabilities and of dS remains.
#include "runtime/cuda/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "runtime/cuda/attention_kernels.h"
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
  // The core on tensor cores in the job's precision, for every head dim.
  for (const auto& [precision, tol] :
       {std::pair{GemmPrecision::kTf32, 1e-2}, std::pair{GemmPrecision::kBf16, 4e-2}}) {
    for (const Case& k :
         {Case{64, 4, 2, 100, precision, tol}, Case{128, 4, 2, 150, precision, tol},
          Case{128, 2, 3, 100, precision, tol}, Case{256, 2, 2, 70, precision, tol}}) {
      CheckAgainstCpu(dev.get(), k);
    }
  }
}

// Round to nearest even at bf16 (8 significant bits), as __float2bfloat16 does.
float RoundBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  bits &= 0xffff0000u;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Round to TF32 (10 mantissa bits): to nearest, ties away from zero, as cvt.rna does.
float RoundTf32(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits = (bits + 0x1000u) & 0xffffe000u;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

std::vector<float> Rounded(std::vector<float> v, float (*round)(float)) {
  for (float& x : v) x = round(x);
  return v;
}

// The tensor-core kernels against the fp32 kernels on q, k, v and dO that are values of the
// operand type already: the products' operands are then exact but for P and dS, which the
// tensor-core kernels round (bf16: relative 2^-9; TF32: 2^-11). Tolerances, of each array's
// scale: bf16 attn 5e-3, dq/dk/dv 1e-2; TF32 5e-4 and 2e-3 (the simulator measured at most
// 8e-4, 3e-3 and 1.2e-4, 3.6e-4); the log-sum-exp 1e-5 (fp32 sums in another order; 3e-7
// measured). Several query and
// key tiles (seq 150 with 64-row tiles), documents starting mid-row, every head dim.
struct CoresCase {
  attention::Cores cores;
  float (*round)(float);
  double attn_tol, grad_tol;
};

// The fp32 kernels (run 0) and cc's tensor-core kernels (run 1) on the same inputs.
void CompareTensorCoreKernels(Device* device, const CoresCase& cc, int head_dim) {
  const int heads = 2, batch = 2, seq = 150, width = heads * head_dim;
  const int64_t tokens = int64_t{batch} * seq;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  DeviceTensor<float> qkv =
      Upload(device, "qkv", Rounded(RandomVector(tokens * 3 * width, 21, 1.5f), cc.round));
  DeviceTensor<float> dattn =
      Upload(device, "dattn", Rounded(RandomVector(tokens * width, 22), cc.round));
  DeviceTensor<int32_t> ds = Upload(device, "doc_start", DocStarts(batch, seq));
  std::vector<float> attn[2], lse[2], dqkv[2];
  for (int v = 0; v < 2; ++v) {
    const attention::Cores cores = v == 0 ? attention::Cores::kFp32 : cc.cores;
    DeviceTensor<float> a(device, "attn"), l(device, "lse"), delta(device, "delta"),
        d(device, "dqkv");
    ASSERT_TRUE(a.Resize({tokens, width}).ok());
    ASSERT_TRUE(l.Resize({int64_t{batch} * heads, seq}).ok());
    ASSERT_TRUE(delta.Resize({int64_t{batch} * heads, seq}).ok());
    ASSERT_TRUE(d.Resize({tokens, 3 * width}).ok());
    ASSERT_EQ(attention::Forward(batch, seq, heads, head_dim, scale, qkv.data(), ds.data(),
                                 a.data(), l.data(), cores, device->stream()),
              cudaSuccess);
    ASSERT_EQ(attention::Backward(batch, seq, heads, head_dim, scale, qkv.data(), ds.data(),
                                  a.data(), l.data(), dattn.data(), delta.data(), d.data(), cores,
                                  device->stream()),
              cudaSuccess);
    attn[v] = Download(a);
    lse[v] = Download(l);
    dqkv[v] = Download(d);
  }
  // The errors are printed (results.md quotes them), then checked.
  const double attn_err = testing::RelativeError(attn[1], attn[0]);
  const double lse_err = testing::RelativeError(lse[1], lse[0]);
  EXPECT_LE(attn_err, cc.attn_tol) << "attn";
  EXPECT_LE(lse_err, 1e-5) << "lse";
  std::string line = absl::StrCat("head dim ", head_dim, ": attn ", attn_err, ", lse ", lse_err);
  for (int part = 0; part < 3; ++part) {  // dq, dk, dv
    std::vector<float> got, want;
    for (int64_t t = 0; t < tokens; ++t) {
      const size_t at = static_cast<size_t>(t * 3 * width + part * width);
      got.insert(got.end(), dqkv[1].begin() + at, dqkv[1].begin() + at + width);
      want.insert(want.end(), dqkv[0].begin() + at, dqkv[0].begin() + at + width);
    }
    const double err = testing::RelativeError(got, want);
    EXPECT_LE(err, cc.grad_tol) << "d"
                                << "qkv"[part];
    absl::StrAppend(&line, ", d", std::string(1, "qkv"[part]), " ", err);
  }
  std::printf("%s %s\n", cc.cores == attention::Cores::kTensorBf16 ? "bf16" : "tf32", line.c_str());
}

TEST(GpuAttentionTest, TensorCoreKernelsFollowTheFp32Kernels) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  for (const CoresCase& cc : {CoresCase{attention::Cores::kTensorBf16, RoundBf16, 5e-3, 1e-2},
                              CoresCase{attention::Cores::kTensorTf32, RoundTf32, 5e-4, 2e-3}}) {
    for (int head_dim : {16, 32, 64, 128}) {
      SCOPED_TRACE(absl::StrCat(cc.cores == attention::Cores::kTensorBf16 ? "bf16" : "tf32",
                                " head dim ", head_dim));
      CompareTensorCoreKernels(dev.get(), cc, head_dim);
    }
  }
}

// Forward and backward twice on the same inputs: the same bits.
void ExpectRepeatsBitForBit(Device* device, GemmPrecision precision) {
  const int c = 128, heads = 4, batch = 2, seq = 130;
  const int64_t tokens = int64_t{batch} * seq;
  std::vector<DeviceTensor<float>> p;
  for (int64_t n : {int64_t{c}, int64_t{c} * 3 * c, int64_t{c} * c}) {
    p.push_back(Upload(device, "w", RandomVector(n, 5 + n, 0.05f)));
  }
  DeviceTensor<float> dn(device, "dn"), dqkv(device, "dqkv"), dwo(device, "dwo");
  ASSERT_TRUE(dn.Resize({c}).ok());
  ASSERT_TRUE(dqkv.Resize({c, 3 * c}).ok());
  ASSERT_TRUE(dwo.Resize({c, c}).ok());
  MatMul matmul(device, precision);
  auto gpu = GpuAttention::Create(
      device, &matmul, c, heads, seq, 10000.0, "attn",
      {p[0].data(), p[1].data(), p[2].data(), dn.data(), dqkv.data(), dwo.data()});
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  DeviceTensor<float> u = Upload(device, "u", RandomVector(tokens * c, 1));
  DeviceTensor<float> dout = Upload(device, "dout", RandomVector(tokens * c, 2));
  DeviceTensor<int32_t> ds = Upload(device, "ds", DocStarts(batch, seq));
  DeviceTensor<float> out(device, "out"), du(device, "du");
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

// Fixed reduction orders, no atomics: two runs give the same bits, on CUDA cores (fp32) and
// tensor cores (TF32, bf16).
TEST(GpuAttentionTest, RepeatsBitForBit) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  for (GemmPrecision precision :
       {GemmPrecision::kFp32, GemmPrecision::kTf32, GemmPrecision::kBf16}) {
    SCOPED_TRACE(GemmPrecisionName(precision));
    ExpectRepeatsBitForBit(dev.get(), precision);
  }
}

// More (sequence, head) pairs than a grid's y dimension takes (65535): the kernels put them
// on x. Every pair's outputs equal those of the same kernels run on the last three
// sequences alone (a grid of three pairs; the other tests check those against the CPU),
// bit for bit: the same arithmetic, found where the pair's index says. Short rows (seq 2,
// head dim 16, one head) keep it to 65537 blocks of 64 threads. The fp32 kernels only: the
// tensor-core kernels take the same grid (LaunchTensorCore) and cost the simulator 17 times
// as long (70 s).
TEST(GpuAttentionTest, MoreSequencesAndHeadsThanAGridsYDimension) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  const int batch = 65537, seq = 2, heads = 1, head_dim = 16, width = heads * head_dim, tail = 3;
  const int64_t tokens = int64_t{batch} * seq;
  const float scale = 0.25f;
  DeviceTensor<float> qkv = Upload(dev.get(), "qkv", RandomVector(tokens * 3 * width, 31));
  DeviceTensor<float> dattn = Upload(dev.get(), "dattn", RandomVector(tokens * width, 32));
  DeviceTensor<int32_t> ds = Upload(dev.get(), "doc_start", DocStarts(batch, seq));
  std::vector<float> attn[2], lse[2], dqkv[2];
  for (int run = 0; run < 2; ++run) {  // all sequences, then the last `tail` alone
    const int b = run == 0 ? batch : tail;
    const int64_t skip = run == 0 ? 0 : int64_t{batch - tail} * seq;  // tokens
    DeviceTensor<float> a(dev.get(), "attn"), l(dev.get(), "lse"), delta(dev.get(), "delta"),
        d(dev.get(), "dqkv");
    ASSERT_TRUE(a.Resize({int64_t{b} * seq, width}).ok());
    ASSERT_TRUE(l.Resize({int64_t{b} * heads, seq}).ok());
    ASSERT_TRUE(delta.Resize({int64_t{b} * heads, seq}).ok());
    ASSERT_TRUE(d.Resize({int64_t{b} * seq, 3 * width}).ok());
    ASSERT_EQ(attention::Forward(b, seq, heads, head_dim, scale, qkv.data() + skip * 3 * width,
                                 ds.data() + skip, a.data(), l.data(), attention::Cores::kFp32,
                                 dev->stream()),
              cudaSuccess);
    ASSERT_EQ(attention::Backward(b, seq, heads, head_dim, scale, qkv.data() + skip * 3 * width,
                                  ds.data() + skip, a.data(), l.data(), dattn.data() + skip * width,
                                  delta.data(), d.data(), attention::Cores::kFp32, dev->stream()),
              cudaSuccess);
    attn[run] = Download(a);
    lse[run] = Download(l);
    dqkv[run] = Download(d);
  }
  for (const std::vector<float>* pair : {attn, lse, dqkv}) {
    const std::vector<float>& all = pair[0];
    const std::vector<float>& last = pair[1];
    ASSERT_GE(all.size(), last.size());
    EXPECT_EQ(std::vector<float>(all.end() - static_cast<int64_t>(last.size()), all.end()), last);
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
