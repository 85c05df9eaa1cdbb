// Every layer kernel of runtime/cuda/kernels.h against the CPU engine's function for the same
// operation (named in each test). Tolerances, relative to each array's largest magnitude:
// 1e-5 where the arithmetic is the CPU's up to summation order and expf vs the CPU's
// polynomial exp (relative error 2e-7); 1e-4 where fp32 sums over thousands of terms meet
// (the LM head's GEMMs); 1e-6 for AdamW (element-wise, the CPU's expression).
#include "runtime/cuda/kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "runtime/cuda/device_rows.h"
#include "runtime/cuda/gemm.h"
#include "runtime/cuda/grid.h"
#include "runtime/cuda/optimizer.h"
#include "runtime/cuda/span_copy.h"
#ifdef RACKRUN_CUDA_SIM
#include "runtime/cuda/sim/runtime.h"
#endif
#include "runtime/cuda/test_util.h"
#include "runtime/layers/lm_head.h"
#include "runtime/layers/moe.h"
#include "runtime/layers/rmsnorm.h"
#include "runtime/optimizer.h"

namespace rackrun::runtime::cuda {
namespace {

using testing::Download;
using testing::RandomVector;
using testing::Upload;

DeviceTensor<float> Zeros(Device* dev, const char* name, int64_t n) {
  DeviceTensor<float> t(dev, name);
  EXPECT_TRUE(t.Resize({n}).ok());
  EXPECT_TRUE(t.Zero().ok());
  return t;
}

// RmsNorm<float> (runtime/layers/rmsnorm.h): forward, dx, and the gain gradient over rows.
// Runs without a GPU. The launches' grid sizes (grid.h): one thread an item covers every
// item however many there are (the router's and the xhc maps' kernels; they were given the
// grid-stride count, capped at 65535 x 8 or x 16 blocks, and would have left the tokens past
// 33.5M or 134M out); a grid-stride loop's count stops at its cap.
TEST(GpuKernelsTest, GridSizesCoverEveryItem) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{255}, int64_t{256}, int64_t{257},
                    int64_t{65535} * 8 * 64 + 1, int64_t{1} << 36}) {
    for (int threads : {64, 128, 256}) {
      SCOPED_TRACE(absl::StrCat(n, " items, ", threads, " threads"));
      const int64_t blocks = BlocksFor(n, threads);
      EXPECT_GE(blocks * threads, n);
      EXPECT_LT((blocks - 1) * threads, std::max<int64_t>(n, 1));
      EXPECT_EQ(int64_t{GridStrideBlocks(n, threads)}, std::min(blocks, kGridStrideBlocks));
    }
  }
}

TEST(GpuKernelsTest, RmsNormMatchesTheCpuLayer) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  for (int width : {64, 1000, 4096}) {
    const int64_t rows = 300;
    RmsNorm<float> cpu(width, "norm");
    std::vector<float> gain = RandomVector(width, 5, 0.5f);
    for (float& g : gain) g += 1.0f;
    std::copy(gain.begin(), gain.end(), cpu.gain().value.data());
    const std::vector<float> x = RandomVector(rows * width, 6);
    const std::vector<float> dy = RandomVector(rows * width, 7);
    std::vector<float> y(x.size()), dx(x.size());
    cpu.Forward(x.data(), rows, y.data());
    cpu.Backward(x.data(), dy.data(), rows, dx.data());

    DeviceTensor<float> dx_d = Upload(dev.get(), "x", x), dg = Upload(dev.get(), "gain", gain),
                        ddy = Upload(dev.get(), "dy", dy);
    DeviceTensor<float> dyo = Zeros(dev.get(), "y", rows * width),
                        inv = Zeros(dev.get(), "inv", rows),
                        ddx = Zeros(dev.get(), "dx", rows * width),
                        dgain = Zeros(dev.get(), "dgain", width),
                        part =
                            Zeros(dev.get(), "partial", kernels::RmsNormPartialFloats(rows, width));
    ASSERT_EQ(kernels::RmsNormForward(rows, width, dx_d.data(), dg.data(), dyo.data(), inv.data(),
                                      dev->stream()),
              cudaSuccess);
    ASSERT_EQ(kernels::RmsNormBackward(rows, width, dx_d.data(), dg.data(), inv.data(), ddy.data(),
                                       ddx.data(), dgain.data(), part.data(), dev->stream()),
              cudaSuccess);
    SCOPED_TRACE(absl::StrCat("width ", width));
    RACKRUN_EXPECT_CLOSE(Download(dyo), y, 1e-5);
    RACKRUN_EXPECT_CLOSE(Download(ddx), dx, 1e-5);
    const std::vector<float> cpu_dgain(cpu.gain().grad.data(), cpu.gain().grad.data() + width);
    RACKRUN_EXPECT_CLOSE(Download(dgain), cpu_dgain, 1e-5);
  }
}

// SwigluForward / SwigluBackward (runtime/layers/moe.h): the expert as GEMMs + activation.
TEST(GpuKernelsTest, SwigluExpertMatchesTheCpuExpert) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  const int c = 96, f = 160;
  const int64_t rows = 77;
  const std::vector<float> w13 = RandomVector(int64_t{c} * 2 * f, 11, 0.1f);
  const std::vector<float> w2 = RandomVector(int64_t{f} * c, 12, 0.1f);
  const std::vector<float> x = RandomVector(rows * c, 13);
  const std::vector<float> dy = RandomVector(rows * c, 14);
  std::vector<float> h13(rows * 2 * f), act(rows * f), y(rows * c);
  std::vector<float> dw13(w13.size(), 0.0f), dw2(w2.size(), 0.0f), dh13(h13.size()),
      dact(act.size()), dx(x.size());
  SwigluForward<float>(c, f, w13.data(), w2.data(), rows, x.data(), h13.data(), act.data(),
                       y.data());
  SwigluBackward<float>(c, f, w13.data(), w2.data(), dw13.data(), dw2.data(), rows, x.data(),
                        h13.data(), act.data(), dy.data(), dh13.data(), dact.data(), dx.data());

  Gemm gemm(dev.get());
  DeviceTensor<float> g13 = Upload(dev.get(), "w13", w13), g2 = Upload(dev.get(), "w2", w2),
                      gx = Upload(dev.get(), "x", x), gdy = Upload(dev.get(), "dy", dy);
  DeviceTensor<float> gh = Zeros(dev.get(), "h13", rows * 2 * f),
                      ga = Zeros(dev.get(), "act", rows * f), gy = Zeros(dev.get(), "y", rows * c),
                      gdw13 = Zeros(dev.get(), "dw13", w13.size()),
                      gdw2 = Zeros(dev.get(), "dw2", w2.size()),
                      gdh = Zeros(dev.get(), "dh13", rows * 2 * f),
                      gda = Zeros(dev.get(), "dact", rows * f),
                      gdx = Zeros(dev.get(), "dx", rows * c);
  const int r = static_cast<int>(rows);
  ASSERT_TRUE(
      gemm.Run({false, false, r, 2 * f, c, c, 2 * f, 2 * f}, 1, gx.data(), g13.data(), 0, gh.data())
          .ok());
  ASSERT_EQ(kernels::SwigluActivation(rows, f, gh.data(), ga.data(), dev->stream()), cudaSuccess);
  ASSERT_TRUE(
      gemm.Run({false, false, r, c, f, f, c, c}, 1, ga.data(), g2.data(), 0, gy.data()).ok());
  // Backward, the CPU's order: dact = dy W2^T; dW2 += act^T dy; dh13; dW13 += x^T dh13;
  // dx = dh13 W13^T.
  ASSERT_TRUE(
      gemm.Run({false, true, r, f, c, c, c, f}, 1, gdy.data(), g2.data(), 0, gda.data()).ok());
  ASSERT_TRUE(
      gemm.Run({true, false, f, c, r, f, c, c}, 1, ga.data(), gdy.data(), 1, gdw2.data()).ok());
  ASSERT_EQ(
      kernels::SwigluActivationBackward(rows, f, gh.data(), gda.data(), gdh.data(), dev->stream()),
      cudaSuccess);
  ASSERT_TRUE(gemm.Run({true, false, c, 2 * f, r, c, 2 * f, 2 * f}, 1, gx.data(), gdh.data(), 1,
                       gdw13.data())
                  .ok());
  ASSERT_TRUE(gemm.Run({false, true, r, c, 2 * f, 2 * f, 2 * f, c}, 1, gdh.data(), g13.data(), 0,
                       gdx.data())
                  .ok());
  RACKRUN_EXPECT_CLOSE(Download(ga), act, 1e-5);
  RACKRUN_EXPECT_CLOSE(Download(gy), y, 1e-5);
  RACKRUN_EXPECT_CLOSE(Download(gdh), dh13, 1e-5);
  RACKRUN_EXPECT_CLOSE(Download(gdx), dx, 1e-5);
  RACKRUN_EXPECT_CLOSE(Download(gdw13), dw13, 1e-5);
  RACKRUN_EXPECT_CLOSE(Download(gdw2), dw2, 1e-5);
}

// RouteTopK / RouterBackward (runtime/layers/moe.h), the counts, the aux-loss-free bias step
// (MoeLayer::UpdateSelectionBias's rule), slot rows, dispatch and combine.
TEST(GpuKernelsTest, RoutingMatchesTheCpuRouter) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  const int64_t tokens = 500;
  const int experts = 16, k = 4, c = 40;
  const std::vector<float> logits = RandomVector(tokens * experts, 21, 2.0f);
  const std::vector<float> bias = RandomVector(experts, 22, 0.01f);
  std::vector<float> scores = logits, weights(tokens * k);
  std::vector<int32_t> sel(tokens * k);
  RouteTopK<float>(tokens, experts, k, bias.data(), scores.data(), sel.data(), weights.data());

  DeviceTensor<float> gs = Upload(dev.get(), "scores", logits),
                      gb = Upload(dev.get(), "bias", bias);
  DeviceTensor<int32_t> gsel(dev.get(), "selected");
  ASSERT_TRUE(gsel.Resize({tokens * k}).ok());
  DeviceTensor<float> gw = Zeros(dev.get(), "weights", tokens * k);
  ASSERT_EQ(kernels::RouterForward(tokens, experts, k, gs.data(), gb.data(), gsel.data(), gw.data(),
                                   dev->stream()),
            cudaSuccess);
  RACKRUN_EXPECT_CLOSE(Download(gs), scores, 1e-5);
  const std::vector<int32_t> got_sel = Download(gsel);
  // A different selection is allowed only at a near tie of the biased scores (expf against
  // the CPU's polynomial exp): none is expected at these scales; each is checked.
  int differing = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int j = 0; j < k; ++j) {
      if (got_sel[t * k + j] == sel[t * k + j]) continue;
      ++differing;
      const float a = scores[t * experts + got_sel[t * k + j]] + bias[got_sel[t * k + j]];
      const float b = scores[t * experts + sel[t * k + j]] + bias[sel[t * k + j]];
      EXPECT_LT(std::fabs(a - b), 1e-5f) << "token " << t << " slot " << j;
    }
  }
  EXPECT_LE(differing, 2);
  if (differing == 0) RACKRUN_EXPECT_CLOSE(Download(gw), weights, 1e-5);

  // Counts and the bias step.
  DeviceTensor<int32_t> gcounts(dev.get(), "counts");
  ASSERT_TRUE(gcounts.Resize({experts}).ok());
  ASSERT_EQ(kernels::ExpertCounts(tokens * k, experts, gsel.data(), gcounts.data(), dev->stream()),
            cudaSuccess);
  std::vector<int32_t> counts(experts, 0);
  for (int32_t e : got_sel) ++counts[static_cast<size_t>(e)];
  EXPECT_EQ(Download(gcounts), counts);
  ASSERT_EQ(kernels::SelectionBiasUpdate(experts, gcounts.data(), 1e-3, gb.data(), dev->stream()),
            cudaSuccess);
  std::vector<float> stepped = bias;
  const double mean = static_cast<double>(tokens * k) / experts;
  for (int e = 0; e < experts; ++e) {
    const double err = mean - counts[static_cast<size_t>(e)];
    stepped[static_cast<size_t>(e)] +=
        static_cast<float>(1e-3 * (err > 0 ? 1 : (err < 0 ? -1 : 0)));
  }
  EXPECT_EQ(Download(gb), stepped);

  // Backward, with and without the aux term, from the GPU's own selection.
  std::vector<float> cpu_scores = Download(gs), cpu_w = Download(gw);
  const std::vector<float> dweights = RandomVector(tokens * k, 23);
  const std::vector<float> aux = RandomVector(experts, 24, 0.1f);
  for (bool with_aux : {false, true}) {
    std::vector<float> dl(tokens * experts);
    RouterBackward<float>(tokens, experts, k, cpu_scores.data(), got_sel.data(), cpu_w.data(),
                          dweights.data(), with_aux ? aux.data() : nullptr, dl.data());
    DeviceTensor<float> gdw = Upload(dev.get(), "dweights", dweights),
                        gaux = Upload(dev.get(), "aux", aux),
                        gdl = Zeros(dev.get(), "dlogits", tokens * experts);
    ASSERT_EQ(
        kernels::RouterBackward(tokens, experts, k, gs.data(), gsel.data(), gw.data(), gdw.data(),
                                with_aux ? gaux.data() : nullptr, gdl.data(), dev->stream()),
        cudaSuccess);
    RACKRUN_EXPECT_CLOSE(Download(gdl), dl, 1e-5);
  }

  // Slot rows (stable counting sort), dispatch, combine and its backward.
  std::vector<int64_t> offsets(experts + 1, 0);
  for (int e = 0; e < experts; ++e) offsets[e + 1] = offsets[e] + counts[e];
  std::vector<int64_t> row(tokens * k);
  {
    std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
    for (int64_t i = 0; i < tokens * k; ++i) row[i] = cursor[got_sel[i]]++;
  }
  // The offsets on the device (ExpertOffsets) are the host's prefix sums; SlotRows takes them.
  DeviceTensor<int64_t> goff = Upload(dev.get(), "offsets", std::vector<int64_t>(experts + 1, -1));
  ASSERT_EQ(kernels::ExpertOffsets(experts, gcounts.data(), goff.data(), dev->stream()),
            cudaSuccess);
  EXPECT_EQ(Download(goff), offsets);
  DeviceTensor<int64_t> grow(dev.get(), "slot rows"), gscratch(dev.get(), "slot scratch");
  ASSERT_TRUE(grow.Resize({tokens * k}).ok());
  ASSERT_TRUE(gscratch.Resize({kernels::SlotRowsScratch(tokens, experts, k)}).ok());
  ASSERT_EQ(kernels::SlotRows(tokens, experts, k, gsel.data(), goff.data(), gscratch.data(),
                              grow.data(), dev->stream()),
            cudaSuccess);
  EXPECT_EQ(Download(grow), row);
  const std::vector<float> x = RandomVector(tokens * c, 25);
  DeviceTensor<float> gx = Upload(dev.get(), "x", x), gd = Zeros(dev.get(), "disp", tokens * k * c);
  ASSERT_EQ(kernels::DispatchRows(tokens, k, c, grow.data(), gx.data(), gd.data(), dev->stream()),
            cudaSuccess);
  std::vector<float> disp(tokens * k * c);
  for (int64_t i = 0; i < tokens * k; ++i)
    std::copy(x.begin() + (i / k) * c, x.begin() + (i / k + 1) * c, disp.begin() + row[i] * c);
  EXPECT_EQ(Download(gd), disp);
  const std::vector<float> eo = RandomVector(tokens * k * c, 26);
  const std::vector<float> dout = RandomVector(tokens * c, 27);
  std::vector<float> out(tokens * c, 0.0f), deo(tokens * k * c), dw(tokens * k);
  for (int64_t t = 0; t < tokens; ++t)
    for (int j = 0; j < k; ++j) {
      float acc = 0;
      for (int i = 0; i < c; ++i) {
        out[t * c + i] += cpu_w[t * k + j] * eo[row[t * k + j] * c + i];
        deo[row[t * k + j] * c + i] = cpu_w[t * k + j] * dout[t * c + i];
        acc += dout[t * c + i] * eo[row[t * k + j] * c + i];
      }
      dw[t * k + j] = acc;
    }
  DeviceTensor<float> geo = Upload(dev.get(), "expert out", eo),
                      gout = Zeros(dev.get(), "out", tokens * c),
                      gdout = Upload(dev.get(), "dout", dout),
                      gdeo = Zeros(dev.get(), "deo", tokens * k * c),
                      gdw2 = Zeros(dev.get(), "dw", tokens * k);
  ASSERT_EQ(kernels::CombineRows(tokens, k, c, grow.data(), gw.data(), geo.data(), false,
                                 gout.data(), dev->stream()),
            cudaSuccess);
  ASSERT_EQ(kernels::CombineRowsBackward(tokens, k, c, grow.data(), gw.data(), geo.data(),
                                         gdout.data(), gdeo.data(), gdw2.data(), dev->stream()),
            cudaSuccess);
  RACKRUN_EXPECT_CLOSE(Download(gout), out, 1e-5);
  RACKRUN_EXPECT_CLOSE(Download(gdeo), deo, 1e-6);
  RACKRUN_EXPECT_CLOSE(Download(gdw2), dw, 1e-5);
}

// SlotRows counts and numbers the slots in chunks of 512 per expert block of 64: many chunks
// (the last one partial), more than one expert block, experts without slots, and skewed
// loads give the host's stable counting sort exactly.
TEST(GpuKernelsTest, SlotRowsAreAStableSortOverChunksAndExpertBlocks) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  for (const auto& [tokens, experts, k] :
       {std::tuple<int64_t, int, int>{1, 3, 1}, {700, 130, 3}, {2049, 16, 4}, {512, 64, 1}}) {
    SCOPED_TRACE(absl::StrCat(tokens, " tokens, ", experts, " experts, top-", k));
    std::vector<int32_t> sel(static_cast<size_t>(tokens * k));
    for (int64_t i = 0; i < tokens * k; ++i) {
      // Every third expert left empty; half the slots on expert 1 (skew).
      const int64_t h = (i * 2654435761LL) >> 7;
      sel[static_cast<size_t>(i)] =
          i % 2 == 0 ? 1 % experts : static_cast<int32_t>((h % experts) / 3 * 3 % experts);
    }
    std::vector<int64_t> offsets(static_cast<size_t>(experts) + 1, 0);
    for (int32_t e : sel) ++offsets[static_cast<size_t>(e) + 1];
    for (int e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
    std::vector<int64_t> want(sel.size());
    std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
    for (size_t i = 0; i < sel.size(); ++i) want[i] = cursor[static_cast<size_t>(sel[i])]++;
    DeviceTensor<int32_t> gsel = Upload(dev.get(), "selected", sel);
    DeviceTensor<int64_t> goff = Upload(dev.get(), "offsets", offsets),
                          grow(dev.get(), "slot rows"), gscratch(dev.get(), "slot scratch");
    ASSERT_TRUE(grow.Resize({tokens * k}).ok());
    ASSERT_TRUE(gscratch.Resize({kernels::SlotRowsScratch(tokens, experts, k)}).ok());
    ASSERT_EQ(kernels::SlotRows(tokens, experts, k, gsel.data(), goff.data(), gscratch.data(),
                                grow.data(), dev->stream()),
              cudaSuccess);
    EXPECT_EQ(Download(grow), want);
  }
}

// LmHead<float> (runtime/layers/lm_head.h): logits GEMM + cross-entropy + its backward.
TEST(GpuKernelsTest, CrossEntropyMatchesTheCpuLmHead) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  const int width = 64, vocab = 3000;
  const int64_t rows = 120;
  LmHead<float> cpu(width, vocab, "head");
  const std::vector<float> w = RandomVector(int64_t{width} * vocab, 31, 0.05f);
  std::copy(w.begin(), w.end(), cpu.weight().value.data());
  const std::vector<float> x = RandomVector(rows * width, 32);
  std::vector<int32_t> targets(rows);
  for (int64_t r = 0; r < rows; ++r)
    targets[r] = r % 17 == 0 ? -1 : static_cast<int32_t>((r * 7919) % vocab);
  int64_t counted = 0;
  const double loss = cpu.Forward(x.data(), targets.data(), rows, &counted);
  std::vector<float> dx(rows * width);
  cpu.Backward(x.data(), 0.5f, dx.data());

  Gemm gemm(dev.get());
  DeviceTensor<float> gw = Upload(dev.get(), "w", w), gx = Upload(dev.get(), "x", x),
                      gl = Zeros(dev.get(), "logits", rows * vocab),
                      gdw = Zeros(dev.get(), "dw", int64_t{width} * vocab),
                      gdx = Zeros(dev.get(), "dx", rows * width);
  DeviceTensor<int32_t> gt = Upload(dev.get(), "targets", targets);
  DeviceTensor<double> row_loss(dev.get(), "row loss"), sum(dev.get(), "loss");
  ASSERT_TRUE(row_loss.Resize({rows}).ok());
  ASSERT_TRUE(sum.Resize({1}).ok());
  const int r = static_cast<int>(rows);
  ASSERT_TRUE(gemm.Run({false, false, r, vocab, width, width, vocab, vocab}, 1, gx.data(),
                       gw.data(), 0, gl.data())
                  .ok());
  ASSERT_EQ(kernels::CrossEntropyForward(rows, vocab, gl.data(), gt.data(), row_loss.data(),
                                         dev->stream()),
            cudaSuccess);
  ASSERT_EQ(kernels::SumRows(rows, row_loss.data(), sum.data(), dev->stream()), cudaSuccess);
  const double gpu_loss = Download(sum)[0] / static_cast<double>(counted);
  EXPECT_NEAR(gpu_loss, loss, 1e-5 * std::fabs(loss));
  ASSERT_EQ(kernels::CrossEntropyBackward(rows, vocab, gl.data(), gt.data(),
                                          0.5f / static_cast<float>(counted), dev->stream()),
            cudaSuccess);
  ASSERT_TRUE(gemm.Run({true, false, width, vocab, r, width, vocab, vocab}, 1, gx.data(), gl.data(),
                       1, gdw.data())
                  .ok());
  ASSERT_TRUE(gemm.Run({false, true, r, width, vocab, vocab, vocab, width}, 1, gl.data(), gw.data(),
                       0, gdx.data())
                  .ok());
  RACKRUN_EXPECT_CLOSE(Download(gdx), dx, 1e-4);
  const std::vector<float> cpu_dw(cpu.weight().grad.data(), cpu.weight().grad.data() + w.size());
  RACKRUN_EXPECT_CLOSE(Download(gdw), cpu_dw, 1e-4);
}

// AdamW + GlobalGradNorm + the trainer's clipping rule (runtime/optimizer.h): four steps of
// several tensors, one above the chunk size, with and without decay. The last step measures
// each tensor's squares (TensorSquares, against the host's sums in double) and takes the
// host's clipping factor (SetClipFactor), as several ranks keeping gradients on GPUs do.
TEST(GpuKernelsTest, AdamWAndClippingMatchTheCpuOptimizer) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  const std::vector<int64_t> sizes = {1, 4095, 4096, 10000, 37};
  std::vector<std::vector<float>> values, grads;
  std::vector<OptimizedTensor> cpu_tensors;
  std::vector<DeviceTensor<float>> gv, gg;
  std::vector<DeviceOptimizedTensor> gpu_tensors;
  for (size_t i = 0; i < sizes.size(); ++i) {
    values.push_back(RandomVector(sizes[i], 40 + i));
    grads.push_back(RandomVector(sizes[i], 50 + i, 3.0f));
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    const bool decay = i % 2 == 0;
    cpu_tensors.push_back(
        {absl::StrCat("t", i), values[i].data(), grads[i].data(), sizes[i], decay});
    gv.push_back(Upload(dev.get(), "value", values[i]));
    gg.push_back(Upload(dev.get(), "grad", grads[i]));
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    gpu_tensors.push_back({absl::StrCat("t", i), gv[i].data(), gg[i].data(), sizes[i], i % 2 == 0});
  }
  AdamWConfig config;
  AdamW cpu(config, cpu_tensors);
  absl::StatusOr<std::unique_ptr<DeviceAdamW>> gpu =
      DeviceAdamW::Create(dev.get(), config, gpu_tensors);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  for (int step = 0; step < 4; ++step) {
    const double clip = step == 1 ? 1e9 : 5.0;  // step 1 does not clip
    const double norm = GlobalGradNorm(cpu_tensors);
    const double scale = (clip > 0 && norm > clip) ? clip / norm : 1.0;
    if (step < 3) {
      double gpu_norm = 0;
      ASSERT_TRUE((*gpu)->GradNorm(clip, &gpu_norm).ok());
      EXPECT_NEAR(gpu_norm, norm, 1e-12 * norm);
    } else {
      std::vector<double> squares;
      ASSERT_TRUE((*gpu)->TensorSquares(&squares).ok());
      ASSERT_EQ(squares.size(), sizes.size());
      for (size_t i = 0; i < sizes.size(); ++i) {
        double want = 0;
        for (const float g : grads[i]) want += static_cast<double>(g) * g;
        EXPECT_NEAR(squares[i], want, 1e-12 * want) << "tensor " << i;
      }
      ASSERT_TRUE((*gpu)->SetClipFactor(scale).ok());
    }
    cpu.Step(1e-2 * (step + 1), scale);
    ASSERT_TRUE((*gpu)->Step(1e-2 * (step + 1), /*use_clip_factor=*/true).ok());
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("tensor ", i));
    RACKRUN_EXPECT_CLOSE(Download(gv[i]), values[i], 1e-6);
    std::vector<float> m, v;
    ASSERT_TRUE((*gpu)->MomentsToHost(i, &m, &v).ok());
    RACKRUN_EXPECT_CLOSE(m, cpu.first_moment(i), 1e-6);
    RACKRUN_EXPECT_CLOSE(v, cpu.second_moment(i), 1e-6);
  }
}

// The token dispatch's packing and unpacking on the device (device_rows.h) against the
// host's row copies (comm/token_dispatch.cc), bit for bit, negative zeros and NaNs included.
TEST(GpuKernelsTest, GatherAndScatterRowsMoveBytesAsTheyAre) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  constexpr int kWidth = 40, kRows = 30, kDivisor = 3;
  std::vector<float> x = RandomVector(kRows * kWidth, 61);
  x[5] = -0.0f;
  x[77] = std::nanf("");
  std::vector<int64_t> gather(2 * kRows), scatter(kRows);
  for (int q = 0; q < 2 * kRows; ++q) gather[q] = (q * 7) % (kRows * kDivisor);
  std::iota(scatter.begin(), scatter.end(), 0);
  std::reverse(scatter.begin(), scatter.end());
  std::swap(scatter[3], scatter[11]);
  DeviceTensor<float> src = Upload(dev.get(), "src", x);
  DeviceTensor<float> packed = Zeros(dev.get(), "packed", 2 * kRows * kWidth);
  DeviceTensor<float> unpacked = Zeros(dev.get(), "unpacked", kRows * kWidth);
  DeviceTensor<int64_t> g(dev.get(), "gather"), s(dev.get(), "scatter");
  ASSERT_TRUE(g.Resize({2 * kRows}).ok() && g.CopyFrom(gather).ok());
  ASSERT_TRUE(s.Resize({kRows}).ok() && s.CopyFrom(scatter).ok());
  ASSERT_EQ(kernels::GatherRows(2 * kRows, kDivisor, kWidth, g.data(), src.data(), packed.data(),
                                dev->stream()),
            cudaSuccess);
  ASSERT_EQ(
      kernels::DispatchRows(kRows, 1, kWidth, s.data(), src.data(), unpacked.data(), dev->stream()),
      cudaSuccess);
  std::vector<float> want_packed(2 * kRows * kWidth), want_unpacked(kRows * kWidth);
  for (int q = 0; q < 2 * kRows; ++q) {
    std::copy_n(x.begin() + gather[q] / kDivisor * kWidth, kWidth,
                want_packed.begin() + q * kWidth);
  }
  for (int q = 0; q < kRows; ++q) {
    std::copy_n(x.begin() + q * kWidth, kWidth, want_unpacked.begin() + scatter[q] * kWidth);
  }
  const std::vector<float> got_packed = Download(packed), got_unpacked = Download(unpacked);
  EXPECT_EQ(std::memcmp(got_packed.data(), want_packed.data(), want_packed.size() * 4), 0);
  EXPECT_EQ(std::memcmp(got_unpacked.data(), want_unpacked.data(), want_unpacked.size() * 4), 0);
}

// SpanCopy (span_copy.h; kernels::CopySpans): one launch moves every span's floats as they
// are (negative zeros and NaNs included), spans below, at and above a chunk, an empty one,
// and a destination that is a source of another copy run after it (pack, then unpack).
TEST(GpuKernelsTest, SpanCopyMovesEverySpanInOneLaunch) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  const std::vector<int64_t> sizes = {
      1, kernels::kChunk - 1, 0, kernels::kChunk, 2 * kernels::kChunk + 5, 17};
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  std::vector<float> x = RandomVector(total, 71);
  x[3] = -0.0f;
  x[static_cast<size_t>(total - 2)] = std::nanf("");
  DeviceTensor<float> tensors = Upload(dev.get(), "tensors", x);
  DeviceTensor<float> packed = Zeros(dev.get(), "packed", total);
  DeviceTensor<float> back = Zeros(dev.get(), "back", total);
  // Pack the tensors in reverse order; unpack into `back` at the tensors' own offsets.
  std::vector<kernels::CopySpan> pack, unpack;
  std::vector<int64_t> offset(sizes.size());
  std::exclusive_scan(sizes.begin(), sizes.end(), offset.begin(), int64_t{0});
  std::vector<float> want(static_cast<size_t>(total));
  int64_t at = 0;
  for (size_t i = sizes.size(); i-- > 0;) {
    pack.push_back({tensors.data() + offset[i], packed.data() + at, sizes[i]});
    unpack.push_back({packed.data() + at, back.data() + offset[i], sizes[i]});
    std::copy_n(x.begin() + offset[i], sizes[i], want.begin() + at);
    at += sizes[i];
  }
  absl::StatusOr<std::unique_ptr<SpanCopy>> p = SpanCopy::Create(dev.get(), "pack", pack);
  absl::StatusOr<std::unique_ptr<SpanCopy>> u = SpanCopy::Create(dev.get(), "unpack", unpack);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ((*p)->floats(), total);
#ifdef RACKRUN_CUDA_SIM
  sim::TakeCensus();
#endif
  ASSERT_TRUE((*p)->Run().ok());
#ifdef RACKRUN_CUDA_SIM
  const sim::Census run = sim::TakeCensus();  // one launch, no copy
  EXPECT_EQ(run.kernels, 1);
  EXPECT_EQ(run.copies_on_device + run.copies_to_device + run.copies_to_host, 0);
#endif
  ASSERT_TRUE((*u)->Run().ok());
  const std::vector<float> got_packed = Download(packed), got_back = Download(back);
  EXPECT_EQ(std::memcmp(got_packed.data(), want.data(), want.size() * 4), 0);
  EXPECT_EQ(std::memcmp(got_back.data(), x.data(), x.size() * 4), 0);
  // A negative size is refused, naming the copies.
  absl::StatusOr<std::unique_ptr<SpanCopy>> bad =
      SpanCopy::Create(dev.get(), "packing gradients", {{tensors.data(), packed.data(), -1}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("packing gradients: span 0"), std::string::npos)
      << bad.status();
}

// DeviceRows (device_rows.h), the dispatch's mover on a GPU: a dispatch and its combine give
// the host's row copies, and an index list equal to one of the last two uploaded goes up once
// (a dispatch's two lists serve its combine and the backward pass's dispatch and combine). A
// list changed in place (a new microbatch's, at the same host address) goes up again.
TEST(GpuKernelsTest, DeviceRowsUploadEachIndexListOnce) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  constexpr int64_t kWidth = 8, kRows = 6;
  const std::vector<float> x = RandomVector(kRows * kWidth, 62);
  DeviceTensor<float> src = Upload(dev.get(), "src", x);
  DeviceTensor<float> expert = Zeros(dev.get(), "expert rows", kRows * kWidth);
  DeviceTensor<float> back = Zeros(dev.get(), "combined rows", kRows * kWidth);
  DeviceRows rows(dev.get(), "test");
  absl::StatusOr<float*> send = rows.Buffer(0, kRows * kWidth);
  absl::StatusOr<float*> recv = rows.Buffer(1, kRows * kWidth);
  ASSERT_TRUE(send.ok() && recv.ok());
  std::vector<int64_t> gather = {5, 3, 1, 0, 2, 4};
  std::vector<int64_t> scatter = {1, 0, 3, 2, 5, 4};
  for (int pass = 0; pass < 2; ++pass) {  // forward, backward
    // Dispatch: pack by `gather`, (no exchange: one rank), unpack by `scatter`; the combine
    // the other way round.
    ASSERT_TRUE(rows.Gather(src.data(), gather, 1, kWidth, *send).ok());
    ASSERT_TRUE(rows.Scatter(*send, scatter, kWidth, expert.data()).ok());
    ASSERT_TRUE(rows.Gather(expert.data(), scatter, 1, kWidth, *recv).ok());
    ASSERT_TRUE(rows.Scatter(*recv, gather, kWidth, back.data()).ok());
    EXPECT_EQ(rows.uploads(), 2) << "pass " << pass;
    EXPECT_EQ(Download(back), x) << "pass " << pass;  // a permutation and its inverse
  }
  std::vector<float> want_expert(x.size());
  for (int64_t q = 0; q < kRows; ++q) {
    std::copy_n(x.begin() + gather[q] * kWidth, kWidth, want_expert.begin() + scatter[q] * kWidth);
  }
  EXPECT_EQ(Download(expert), want_expert);
  // The next microbatch's lists, at the same addresses.
  std::swap(gather[0], gather[5]);
  std::swap(scatter[1], scatter[2]);
  ASSERT_TRUE(rows.Gather(src.data(), gather, 1, kWidth, *send).ok());
  ASSERT_TRUE(rows.Scatter(*send, scatter, kWidth, expert.data()).ok());
  EXPECT_EQ(rows.uploads(), 4);
  for (int64_t q = 0; q < kRows; ++q) {
    std::copy_n(x.begin() + gather[q] * kWidth, kWidth, want_expert.begin() + scatter[q] * kWidth);
  }
  EXPECT_EQ(Download(expert), want_expert);
}

TEST(GpuKernelsTest, CopyKernelCopies) {
  RACKRUN_OPEN_GPU_OR_SKIP(dev);
  const std::vector<float> x = RandomVector(1 << 20, 60);
  DeviceTensor<float> a = Upload(dev.get(), "a", x), b = Zeros(dev.get(), "b", x.size());
  ASSERT_EQ(
      kernels::CopyBytes(static_cast<int64_t>(x.size()) * 4, a.data(), b.data(), dev->stream()),
      cudaSuccess);
  EXPECT_EQ(Download(b), x);
}

// RACKRUN_CUDA_POISON_ALLOCATIONS (device.h): without it a block the caching allocator hands
// back still holds the last tensor's numbers; with it every byte Resize did not keep reads as
// all-ones (-1 as int32), on a block from the cache and on a kept block grown again after a
// shrink. Any other value is refused, naming the variable.
TEST(GpuDeviceTensorTest, PoisoningFillsWhatResizeDidNotKeep) {
  if (absl::Status avail = GpuAvailable(); !avail.ok()) GTEST_SKIP() << avail.message();
  const char* before = std::getenv("RACKRUN_CUDA_POISON_ALLOCATIONS");
  const std::string saved = before == nullptr ? "" : before;
  std::vector<int32_t> values(64);
  std::iota(values.begin(), values.end(), 1);
  for (const bool poison : {false, true}) {
    SCOPED_TRACE(poison ? "poisoned" : "not poisoned");
    ASSERT_EQ(setenv("RACKRUN_CUDA_POISON_ALLOCATIONS", poison ? "1" : "0", 1), 0);
    absl::StatusOr<std::unique_ptr<Device>> dev = Device::Open(0);
    ASSERT_TRUE(dev.ok()) << dev.status();
    EXPECT_EQ((*dev)->poison_allocations(), poison);
    {
      DeviceTensor<int32_t> a(dev->get(), "a");
      ASSERT_TRUE(a.Resize({64}).ok());
      ASSERT_TRUE(a.CopyFrom(values).ok());
    }  // its block back to the cache
    DeviceTensor<int32_t> b(dev->get(), "b");
    ASSERT_TRUE(b.Resize({64}).ok());  // the same block again
    EXPECT_EQ(Download(b), poison ? std::vector<int32_t>(64, -1) : values);
    ASSERT_TRUE(b.CopyFrom(values).ok());
    ASSERT_TRUE(b.Resize({16}).ok());
    ASSERT_TRUE(b.Resize({48}).ok());  // the block kept: 16 values kept, 32 not
    std::vector<int32_t> want(values.begin(), values.begin() + 48);
    if (poison) std::fill(want.begin() + 16, want.end(), -1);
    EXPECT_EQ(Download(b), want);
  }
  ASSERT_EQ(setenv("RACKRUN_CUDA_POISON_ALLOCATIONS", "yes", 1), 0);
  absl::StatusOr<std::unique_ptr<Device>> refused = Device::Open(0);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("RACKRUN_CUDA_POISON_ALLOCATIONS=yes"),
            std::string::npos)
      << refused.status();
  if (saved.empty()) {
    ASSERT_EQ(unsetenv("RACKRUN_CUDA_POISON_ALLOCATIONS"), 0);
  } else {
    ASSERT_EQ(setenv("RACKRUN_CUDA_POISON_ALLOCATIONS", saved.c_str(), 1), 0);
  }
}

}  // namespace
}  // namespace rackrun::runtime::cuda
