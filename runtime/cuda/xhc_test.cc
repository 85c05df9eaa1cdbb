// XhcStreams (the xhc residual streams on the GPU) against the CPU engine's
// ResidualStreams<float> in modes xhc, xhc_flash, xhc_flash4, hc and mhc, through the same
// calls:
// forward (body inputs, the mappings of every token, the collapsed state), backward
// (body-output gradients, the state gradient, every parameter's gradient). Every parameter is
// random so every path is live (routing, H_pre, the Sinkhorn mixing, H_post, the
// convolutions and Gram-Schmidt of MLP sublayers; in the flash modes the reads from the
// group's bases and the sublayers that do not mix; in hc and mhc the full-state maps, mhc's
// Sinkhorn, the mixing and write-back), and segments start mid-batch so the causal convolutions are
// cut. Tolerances, relative to each array's largest magnitude: fp32 states 1e-4 (the CPU's
// arithmetic in another summation order, expf/sqrtf against libm); bf16 states 3e-2 for
// the forward and 5e-2 for gradients (the state and the saved rows rounded to 8 mantissa
// bits; the CPU oracle starts from the same rounded state). The Sinkhorn device function is
// checked alone against SinkhornProjection<float>.
#include "runtime/cuda/xhc.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "runtime/cuda/test_util.h"
#include "runtime/residual/sinkhorn.h"

namespace rackrun::runtime::cuda {
namespace {

using testing::Download;
using testing::RandomVector;
using testing::Upload;

// Random values for every CPU parameter, at scales that keep each mapping away from
// saturation: projection weights ~N(0, 0.05), gating scalars 0.5..1.5, biases ~N(0, 0.3),
// convolution taps ~N(0, 0.2).
void RandomizeParameters(ResidualStreams<float>& cpu, uint64_t seed) {
  uint64_t s = seed;
  for (const ParamRef<float>& p : cpu.Parameters()) {
    const std::string last = p.name.substr(p.name.rfind('.') + 1);
    float scale = 0.05f, shift = 0.0f;
    if (last.starts_with("a_")) {
      scale = 0.3f;
      shift = 1.0f;
    } else if (last.starts_with("b_")) {
      scale = 0.3f;
    } else if (last.starts_with("conv")) {
      scale = 0.2f;
    } else if (last == "s_a" || last == "s_b") {  // hc's tanh gates
      scale = 0.3f;
      shift = 0.5f;
    } else if (last == "b0") {  // hc's B0
      scale = 0.3f;
      shift = 1.0f;
    }
    if (last == "a_r0") shift = 0.25f;  // hc's A_r0: rows summing to about 1
    const std::vector<float> v = RandomVector(p.size, ++s, scale);
    for (int64_t i = 0; i < p.size; ++i) p.value[i] = v[static_cast<size_t>(i)] + shift;
  }
}

float RoundBf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

struct Tolerances {
  double forward, gradient;
};

template <typename S>
void CompareWithCpu(const ResidualConfig& config, int tokens, std::vector<int32_t> segments,
                    Tolerances tol) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  const int N = config.streams, C = config.width, L = static_cast<int>(config.sublayers.size());
  absl::StatusOr<ResidualStreams<float>> cpu = ResidualStreams<float>::Create(config, 3);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  RandomizeParameters(*cpu, 100);
  if constexpr (!std::is_same_v<S, float>) {
    // Parameters that bf16 holds exactly: the GPU's bf16 GEMMs (the router's among them) then
    // see the CPU's values, so a comparison measures the engine's rounding of what it
    // computes, and a near tie between two streams' router scores does not flip on the
    // rounding of the inputs.
    for (const ParamRef<float>& p : cpu->Parameters())
      for (int64_t i = 0; i < p.size; ++i) p.value[i] = RoundBf16(p.value[i]);
  }
  absl::StatusOr<std::unique_ptr<XhcStreams<S>>> gpu = XhcStreams<S>::Create(dev.get(), config, 3);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ASSERT_TRUE((*gpu)->CopyParametersFrom(*cpu).ok());

  std::vector<float> state = RandomVector(int64_t{tokens} * N * C, 7);
  if constexpr (!std::is_same_v<S, float>) {
    for (float& v : state) v = RoundBf16(v);
  }
  std::vector<std::vector<float>> outs, dus;
  for (int l = 0; l < L; ++l) {
    outs.push_back(RandomVector(int64_t{tokens} * C, 200 + l));
    dus.push_back(RandomVector(int64_t{tokens} * C, 300 + l));
  }
  const std::vector<float> dy = RandomVector(int64_t{tokens} * C, 400);

  // CPU.
  std::vector<std::vector<float>> cpu_u(L, std::vector<float>(tokens * C)),
      cpu_dout(L, std::vector<float>(tokens * C));
  std::vector<float> cpu_y(tokens * C), cpu_dstate(state.size());
  std::vector<std::vector<SublayerMaps<float>>> cpu_maps(L);
  ASSERT_TRUE(cpu->BeginBatch(tokens, segments).ok());
  ASSERT_TRUE(cpu->SetState(state).ok());
  for (int l = 0; l < L; ++l) {
    ASSERT_TRUE(cpu->ReadInput(l, cpu_u[l]).ok());
    for (int t = 0; t < tokens; ++t) cpu_maps[l].push_back(*cpu->Maps(l, t));
    ASSERT_TRUE(cpu->WriteOutput(l, outs[l]).ok());
  }
  ASSERT_TRUE(cpu->Collapse(cpu_y).ok());
  ASSERT_TRUE(cpu->CollapseBackward(dy).ok());
  for (int l = L - 1; l >= 0; --l) {
    ASSERT_TRUE(cpu->WriteOutputBackward(l, cpu_dout[l]).ok());
    ASSERT_TRUE(cpu->ReadInputBackward(l, dus[l]).ok());
  }
  ASSERT_TRUE(cpu->StateBackward(cpu_dstate).ok());

  // GPU.
  XhcStreams<S>& g = **gpu;
  DeviceTensor<float> u(dev.get(), "u"), y(dev.get(), "y"), dout(dev.get(), "d_out");
  ASSERT_TRUE(u.Resize({tokens, C}).ok());
  ASSERT_TRUE(y.Resize({tokens, C}).ok());
  ASSERT_TRUE(dout.Resize({tokens, C}).ok());
  std::vector<DeviceTensor<float>> gout, gdu;
  for (int l = 0; l < L; ++l) {
    gout.push_back(Upload(dev.get(), "out", outs[l]));
    gdu.push_back(Upload(dev.get(), "du", dus[l]));
  }
  DeviceTensor<float> gdy = Upload(dev.get(), "dy", dy);
  ASSERT_TRUE(g.BeginBatch(tokens, segments).ok());
  ASSERT_TRUE(g.SetState(state).ok());
  for (int l = 0; l < L; ++l) {
    SCOPED_TRACE(absl::StrCat("sublayer ", l, " forward"));
    absl::Status s = g.ReadInput(l, u.data());
    ASSERT_TRUE(s.ok()) << s;
    RACKRUN_EXPECT_CLOSE(Download(u), cpu_u[l], tol.forward);
    absl::StatusOr<std::vector<SublayerMaps<float>>> maps = g.Maps(l);
    ASSERT_TRUE(maps.ok()) << maps.status();
    for (int t = 0; t < tokens; ++t) {
      const SublayerMaps<float>& a = (*maps)[t];
      const SublayerMaps<float>& b = cpu_maps[l][t];
      ASSERT_EQ(a.active, b.active) << "token " << t;
      RACKRUN_EXPECT_CLOSE(a.gates, b.gates, tol.forward);
      RACKRUN_EXPECT_CLOSE(a.h_pre, b.h_pre, tol.forward);
      RACKRUN_EXPECT_CLOSE(a.h_res, b.h_res, tol.forward);
      RACKRUN_EXPECT_CLOSE(a.h_post, b.h_post, tol.forward);
    }
    s = g.WriteOutput(l, gout[l].data());
    ASSERT_TRUE(s.ok()) << s;
  }
  ASSERT_TRUE(g.Collapse(y.data()).ok());
  RACKRUN_EXPECT_CLOSE(Download(y), cpu_y, tol.forward);
  ASSERT_TRUE(g.CollapseBackward(gdy.data()).ok());
  for (int l = L - 1; l >= 0; --l) {
    SCOPED_TRACE(absl::StrCat("sublayer ", l, " backward"));
    absl::Status s = g.WriteOutputBackward(l, dout.data());
    ASSERT_TRUE(s.ok()) << s;
    RACKRUN_EXPECT_CLOSE(Download(dout), cpu_dout[l], tol.gradient);
    s = g.ReadInputBackward(l, gdu[l].data());
    ASSERT_TRUE(s.ok()) << s;
  }
  std::vector<float> dstate;
  ASSERT_TRUE(g.StateGradToHost(&dstate).ok());
  RACKRUN_EXPECT_CLOSE(dstate, cpu_dstate, tol.gradient);
  std::vector<float> grads;
  ASSERT_TRUE(g.GradientsToHost(&grads).ok());
  // A parameter's gradient is compared on its own scale, but never on one below 1e-3 of the
  // largest gradient (1e-2 with a bf16 state): the last sublayer's H_res parameters get a
  // gradient that is zero by construction (H_res's columns sum to one and the collapse sums
  // the streams), which both engines compute as rounding noise (about 1e-7 here), and a
  // scalar whose gradient is a cancelling sum (mhc's a_post: 0.04 against a largest of 120)
  // carries bf16's rounding of the state on the scale of the terms it sums.
  const double floor = std::is_same_v<S, float> ? 1e-3 : 1e-2;
  const double largest = testing::LargestGradient(cpu->Parameters());
  size_t at = 0;
  for (const ParamRef<float>& p : cpu->Parameters()) {
    SCOPED_TRACE(p.name);
    const std::vector<float> want(p.grad, p.grad + p.size);
    const std::vector<float> got(grads.begin() + at, grads.begin() + at + p.size);
    EXPECT_LE(::rackrun::runtime::cuda::testing::RelativeError(got, want, floor * largest),
              tol.gradient);
    at += static_cast<size_t>(p.size);
  }
}

ResidualConfig Config(int width, std::vector<SublayerKind> sublayers,
                      ResidualMode mode = ResidualMode::kXhc) {
  return ResidualConfig::ForMode(mode, width, std::move(sublayers));
}

TEST(GpuXhcTest, Fp32AttentionAndMlpSublayersMatchTheCpu) {
  CompareWithCpu<float>(Config(64, ResidualConfig::Transformer(1)), 40, {0, 17}, {1e-4, 1e-4});
}

TEST(GpuXhcTest, Fp32WideSublayersMatchTheCpu) {
  // C = 1536 takes the 8-elements-per-thread kernels.
  CompareWithCpu<float>(Config(1536, ResidualConfig::Transformer(1)), 12, {0, 5}, {1e-4, 1e-4});
}

TEST(GpuXhcTest, Bf16StateMatchesTheCpuWithinBf16Rounding) {
  CompareWithCpu<bf16>(Config(64, {SublayerKind::kMlp}), 40, {0, 17}, {3e-2, 5e-2});
  CompareWithCpu<bf16>(Config(64, {SublayerKind::kAttention}), 40, {0}, {3e-2, 5e-2});
}

TEST(GpuXhcTest, FlashFp32AttentionAndMlpGroupsMatchTheCpu) {
  // Two xhc_flash groups (attention + MLP each), then one xhc_flash4 group of four.
  CompareWithCpu<float>(Config(64, ResidualConfig::Transformer(2), ResidualMode::kXhcFlash), 40,
                        {0, 17}, {1e-4, 1e-4});
  CompareWithCpu<float>(Config(64, ResidualConfig::Transformer(2), ResidualMode::kXhcFlash4), 40,
                        {0, 17}, {1e-4, 1e-4});
}

TEST(GpuXhcTest, FlashFp32WideSublayersMatchTheCpu) {
  CompareWithCpu<float>(Config(1536, ResidualConfig::Transformer(1), ResidualMode::kXhcFlash), 12,
                        {0, 5}, {1e-4, 1e-4});
}

TEST(GpuXhcTest, FlashBf16StateMatchesTheCpuWithinBf16Rounding) {
  CompareWithCpu<bf16>(Config(64, ResidualConfig::Transformer(1), ResidualMode::kXhcFlash), 40,
                       {0, 17}, {3e-2, 5e-2});
  CompareWithCpu<bf16>(Config(64, ResidualConfig::Transformer(2), ResidualMode::kXhcFlash4), 40,
                       {0, 17}, {3e-2, 5e-2});
}

// Config(...) with N streams.
ResidualConfig WithStreams(ResidualConfig c, int streams) {
  c.streams = streams;
  return c;
}

TEST(GpuXhcTest, MhcMatchesTheCpu) {
  // N = 4 streams, every sublayer reading, mixing and writing the whole state.
  CompareWithCpu<float>(Config(64, ResidualConfig::Transformer(2), ResidualMode::kMhc), 40, {0, 17},
                        {1e-4, 1e-4});
  CompareWithCpu<float>(Config(1536, ResidualConfig::Transformer(1), ResidualMode::kMhc), 12,
                        {0, 5}, {1e-4, 1e-4});
  CompareWithCpu<bf16>(Config(64, ResidualConfig::Transformer(1), ResidualMode::kMhc), 40, {0},
                       {3e-2, 5e-2});
}

// hc and mhc with each of `streams` in fp32 (width C, `tokens` tokens, segments starting at
// `starts`), then the last of them with a bf16 state (width 64, one segment).
void CompareDenseModesWithCpu(std::vector<int> streams, int width, int tokens,
                              const std::vector<int32_t>& starts) {
  for (ResidualMode mode : {ResidualMode::kHc, ResidualMode::kMhc}) {
    for (int n : streams) {
      SCOPED_TRACE(absl::StrCat(mode == ResidualMode::kHc ? "hc" : "mhc", " N = ", n));
      CompareWithCpu<float>(WithStreams(Config(width, ResidualConfig::Transformer(1), mode), n),
                            tokens, starts, {1e-4, 1e-4});
    }
    CompareWithCpu<bf16>(
        WithStreams(Config(64, ResidualConfig::Transformer(1), mode), streams.back()), tokens, {0},
        {3e-2, 5e-2});
  }
}

// Above 4 streams the kernels hold a token's streams in arrays of 8: N = 8 fills them, N = 6
// leaves two slots unused; Sinkhorn on 8 x 8 (its largest on one thread).
TEST(GpuXhcTest, HcAndMhcUpToEightStreamsMatchTheCpu) {
  CompareDenseModesWithCpu({6, 8}, 64, 24, {0, 11});
}

// Above 8 streams a warp computes the maps (a lane per stream; mhc's Sinkhorn a lane per row,
// its backward rebuilding each iteration's matrix from the stored sums) and the write's
// backward goes through shared-memory tiles of 32 columns: N = 12 leaves lanes and array
// slots idle and C = 72 ends on a partial tile; N = 16 is xhc's width and the CPU's most.
TEST(GpuXhcTest, HcAndMhcAboveEightStreamsMatchTheCpu) {
  CompareDenseModesWithCpu({12, 16}, 72, 12, {0, 5});
}

TEST(GpuXhcTest, HcMatchesTheCpu) {
  // N = 4 streams, every sublayer reading, mixing and writing the whole state.
  CompareWithCpu<float>(Config(64, ResidualConfig::Transformer(2), ResidualMode::kHc), 40, {0, 17},
                        {1e-4, 1e-4});
  CompareWithCpu<float>(Config(1536, ResidualConfig::Transformer(1), ResidualMode::kHc), 12, {0, 5},
                        {1e-4, 1e-4});
  CompareWithCpu<bf16>(Config(64, ResidualConfig::Transformer(1), ResidualMode::kHc), 40, {0},
                       {3e-2, 5e-2});
}

// The bytes per token per sublayer, in units of C fp32 elements (4 C bytes), of the forward
// and of the backward over the sublayers of `blocks` transformer blocks in `mode`, the state
// in S; each kernel's share printed. At issue 35's c1024 width (the per-token maps, which do
// not grow with C, weigh 1 C more at C = 256, the width counted before 2026-12-08).
struct Traffic {
  double forward = 0, backward = 0;
};

template <typename S>
Traffic StreamTraffic(Device* dev, ResidualMode mode, int blocks) {
  const int C = 1024, T = 16;
  const ResidualConfig config = Config(C, ResidualConfig::Transformer(blocks), mode);
  const int L = 2 * blocks;
  absl::StatusOr<std::unique_ptr<XhcStreams<S>>> g = XhcStreams<S>::Create(dev, config, 3);
  EXPECT_TRUE(g.ok()) << g.status();
  if (!g.ok()) return {};
  DeviceTensor<float> u(dev, "u"), y(dev, "y");
  for (DeviceTensor<float>* t : {&u, &y}) {
    EXPECT_TRUE(t->Resize({T, C}).ok());
    EXPECT_TRUE(t->Zero().ok());
  }
  const std::vector<int32_t> starts = {0};
  EXPECT_TRUE((*g)->BeginBatch(T, starts).ok());
  EXPECT_TRUE((*g)->SetState(RandomVector(int64_t{T} * 16 * C, 1)).ok());
  const double unit = 4.0 * C * T * L;
  const std::string name(ResidualModeName(mode));
  const char* state = sizeof(S) == 4 ? "fp32" : "bf16";
  // Prints the kernels counted since the last call; their bytes per token and sublayer.
  auto take = [&](const char* pass) {
    for (const KernelTraffic& k : (*g)->traffic())
      std::printf("%-55s read %8.2f C  written %8.2f C\n", k.name.c_str(),
                  static_cast<double>(k.read) / unit, static_cast<double>(k.written) / unit);
    const double per = static_cast<double>((*g)->TrafficBytes()) / unit;
    std::printf("%s %s state, %s traffic: %.2f C per token per sublayer\n", name.c_str(), state,
                pass, per);
    (*g)->ResetTraffic();
    return per;
  };
  Traffic t;
  for (int l = 0; l < L; ++l) {
    EXPECT_TRUE((*g)->ReadInput(l, u.data()).ok());
    EXPECT_TRUE((*g)->WriteOutput(l, u.data()).ok());
  }
  t.forward = take("forward");
  EXPECT_TRUE((*g)->Collapse(y.data()).ok());
  EXPECT_TRUE((*g)->CollapseBackward(y.data()).ok());
  (*g)->ResetTraffic();  // once a step, not per sublayer (and not counted)
  for (int l = L - 1; l >= 0; --l) {
    EXPECT_TRUE((*g)->WriteOutputBackward(l, u.data()).ok());
    EXPECT_TRUE((*g)->ReadInputBackward(l, u.data()).ok());
  }
  t.backward = take("backward");
  return t;
}

TEST(GpuXhcTest, CountsTheBytesOfEachKernel) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  // The paper's accounting (docs/design.md section 5.8): 73.5 C for xhc, 52.5 C and 42 C for
  // our flash schedules; the fused kernels must move less, and at least the state's two full
  // reads per group (mapping generation, dense read) and the active rows' round trip. The
  // backward reads the state at least twice per group too (the dense read's backward and
  // the GEMM dX += c1 W1) and writes its gradient once.
  Traffic t = StreamTraffic<float>(dev.get(), ResidualMode::kXhc, 1);
  EXPECT_LT(t.forward, 73.5);
  EXPECT_GT(t.forward, 2 * 16 + 2 * 4);
  EXPECT_GT(t.backward, 3 * 16);
  t = StreamTraffic<float>(dev.get(), ResidualMode::kXhcFlash, 1);
  EXPECT_LT(t.forward, 52.5);
  EXPECT_GT(t.forward, 2 * 16 / 2.0 + 2 * 4);
  EXPECT_GT(t.backward, 3 * 16 / 2.0);
  t = StreamTraffic<float>(dev.get(), ResidualMode::kXhcFlash4, 2);
  EXPECT_LT(t.forward, 42.0);
  EXPECT_GT(t.forward, 2 * 16 / 4.0 + 2 * 4);
  EXPECT_GT(t.backward, 3 * 16 / 4.0);
  // A bf16 state halves the state's share.
  const Traffic half = StreamTraffic<bf16>(dev.get(), ResidualMode::kXhc, 1);
  EXPECT_LT(half.forward, StreamTraffic<float>(dev.get(), ResidualMode::kXhc, 1).forward);
  EXPECT_GT(half.backward, 0);
}

TEST(GpuXhcTest, SinkhornMatchesTheCpuProjection) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  // Up to 8 a thread per matrix; above, a warp (12: lanes left idle).
  for (int n : {2, 4, 8, 12, 16}) {
    const int count = 37, iters = 20;
    const std::vector<float> z = RandomVector(int64_t{count} * n * n, 70 + n, 2.0f);
    const std::vector<float> dh = RandomVector(int64_t{count} * n * n, 80 + n);
    SinkhornProjection<float> sk(n, iters);
    std::vector<float> h(z.size()), dz(z.size()), tape(static_cast<size_t>(sk.tape_size()));
    for (int i = 0; i < count; ++i) {
      sk.Forward(z.data() + i * n * n, h.data() + i * n * n, tape.data());
      sk.Backward(z.data() + i * n * n, tape.data(), dh.data() + i * n * n, dz.data() + i * n * n);
    }
    DeviceTensor<float> gz = Upload(dev.get(), "z", z), gdh = Upload(dev.get(), "dh", dh),
                        gh(dev.get(), "h"), gdz(dev.get(), "dz"), gt(dev.get(), "tape");
    ASSERT_TRUE(gh.Resize({gz.size()}).ok());
    ASSERT_TRUE(gdz.Resize({gz.size()}).ok());
    ASSERT_TRUE(gt.Resize({count * xhc::SinkhornTapeFloats(n, iters)}).ok());
    ASSERT_EQ(xhc::SinkhornBatch(count, n, iters, gz.data(), gh.data(), gdh.data(), gdz.data(),
                                 gt.data(), dev->stream()),
              cudaSuccess);
    SCOPED_TRACE(absl::StrCat("n ", n));
    RACKRUN_EXPECT_CLOSE(Download(gh), h, 1e-5);
    RACKRUN_EXPECT_CLOSE(Download(gdz), dz, 1e-4);
  }
}

// Configuration errors come before any device work, so they are checked without a GPU.
TEST(GpuXhcTest, UnsupportedConfigurationsAreErrors) {
  // hc and mhc on the GPU: at most 16 streams, as on the CPU (whose check names the field),
  // and C <= 4096 (the error names model.width).
  for (ResidualMode mode : {ResidualMode::kHc, ResidualMode::kMhc}) {
    ResidualConfig dense = ResidualConfig::ForMode(mode, 64, ResidualConfig::Transformer(1));
    dense.streams = 17;
    absl::StatusOr<std::unique_ptr<XhcStreams<float>>> g =
        XhcStreams<float>::Create(nullptr, dense, 1);
    ASSERT_FALSE(g.ok());
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(g.status().message().find("streams = 17"), std::string::npos) << g.status();
    dense.streams = 16;
    dense.width = 2 * xhc::kMaxWidth;
    g = XhcStreams<float>::Create(nullptr, dense, 1);
    ASSERT_FALSE(g.ok());
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(g.status().message().find("model.width"), std::string::npos) << g.status();
  }
  // The vanilla stream is the model's own (GpuModel), not XhcStreams'.
  absl::StatusOr<std::unique_ptr<XhcStreams<float>>> g = XhcStreams<float>::Create(
      nullptr, ResidualConfig::ForMode(ResidualMode::kVanilla, 64, ResidualConfig::Transformer(1)),
      1);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kUnimplemented);
  // A flash group must end in an MLP sublayer (the CPU's Validate, naming the field).
  ResidualConfig flash =
      Config(64, {SublayerKind::kMlp, SublayerKind::kAttention}, ResidualMode::kXhcFlash);
  g = XhcStreams<float>::Create(nullptr, flash, 1);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument) << g.status();
  ResidualConfig wide = Config(64, ResidualConfig::Transformer(1));
  wide.active = 6;
  g = XhcStreams<float>::Create(nullptr, wide, 1);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  ResidualConfig huge = Config(8192, ResidualConfig::Transformer(1));
  EXPECT_FALSE(XhcStreams<float>::Create(nullptr, huge, 1).ok());
  EXPECT_FALSE(XhcStreams<float>::Create(nullptr, Config(64, ResidualConfig::Transformer(1)), 1,
                                         GemmPrecision::kBf16)
                   .ok());
}

}  // namespace
}  // namespace rackrun::runtime::cuda
