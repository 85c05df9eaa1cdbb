#include "runtime/model.h"

#include <omp.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <new>
#include <numeric>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/layers/gradient_check.h"

// Counts heap allocations so the steady-state test can assert that a training step
// allocates nothing once its workspaces exist.
namespace {
std::atomic<int64_t> g_allocations{0};
}  // namespace

void* operator new(size_t size) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
// GCC 12 at -O2 (the sanitizer builds) inlines these into `delete` sites and then warns
// that free() releases memory from operator new; the operator new above is malloc, so the
// pair matches.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

namespace rackrun::runtime {
namespace {

ModelConfig TinyConfig(const std::string& residual) {
  ModelConfig c;
  c.vocab = 11;
  c.width = 8;
  c.blocks = 2;
  c.heads = 2;
  c.seq_len = 6;
  c.residual = residual;
  if (residual.rfind("xhc", 0) == 0) {
    c.streams = 6;
    c.active = 3;
    c.fixed = 1;
  }
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 5;
  c.init_std = 0.3;  // large enough that every path carries a visible gradient
  return c;
}

struct Batch {
  std::vector<int32_t> inputs, targets, starts;
  int batch = 2;
};

Batch TinyBatch(int vocab, int batch, int seq) {
  Batch b;
  b.batch = batch;
  for (int i = 0; i < batch * seq; ++i) {
    b.inputs.push_back((i * 7 + 3) % vocab);
    b.targets.push_back((i * 5 + 1) % vocab);
  }
  b.starts = {seq + seq / 2};  // a document boundary inside row 1
  return b;
}

void WholeModelGradientCheck(ModelConfig config) {
  SCOPED_TRACE(config.residual);
  auto model_or = Model<double>::Create(config, 5);
  ASSERT_TRUE(model_or.ok()) << model_or.status();
  Model<double>& model = **model_or;
  const Batch b = TinyBatch(config.vocab, 2, config.seq_len);
  model.ZeroGrad();
  const double scale = 0.5;
  auto fb = model.ForwardBackward(b.inputs, b.targets, b.batch, b.starts, scale);
  ASSERT_TRUE(fb.ok()) << fb.status();
  auto loss = [&] {
    auto l = model.Evaluate(b.inputs, b.targets, b.batch, b.starts);
    EXPECT_TRUE(l.ok()) << l.status();
    return scale * (*l + model.aux_loss());
  };
  EXPECT_NEAR(loss(), scale * (*fb + model.aux_loss()), 1e-12);
  int nonzero = 0;
  for (const auto& p : model.Parameters()) {
    std::vector<double> grad(p.grad, p.grad + p.size);
    for (double g : grad) nonzero += g != 0;
    testing::ExpectGradientMatches(p.name, p.value, grad.data(), p.size, loss, 6, 1e-5, 1e-8, 1e-4);
  }
  EXPECT_GT(nonzero, 0);
}

TEST(ModelTest, WholeTinyModelGradientCheckFp64Vanilla) {
  WholeModelGradientCheck(TinyConfig("vanilla"));
}
TEST(ModelTest, WholeTinyModelGradientCheckFp64Hc) { WholeModelGradientCheck(TinyConfig("hc")); }
TEST(ModelTest, WholeTinyModelGradientCheckFp64Mhc) { WholeModelGradientCheck(TinyConfig("mhc")); }
TEST(ModelTest, WholeTinyModelGradientCheckFp64Xhc) { WholeModelGradientCheck(TinyConfig("xhc")); }
TEST(ModelTest, WholeTinyModelGradientCheckFp64XhcFlash4) {
  ModelConfig c = TinyConfig("xhc_flash4");
  WholeModelGradientCheck(c);
}
TEST(ModelTest, WholeTinyModelGradientCheckFp64SharedExpertAndAuxLoss) {
  ModelConfig c = TinyConfig("xhc_flash");
  c.moe.shared_expert = true;
  c.moe.shared_hidden = 3;
  c.moe.aux_loss_coef = 0.1;
  WholeModelGradientCheck(c);
}

TEST(ModelTest, ValidateNamesTheFieldAndTheFix) {
  ModelConfig c = TinyConfig("xhc");
  c.heads = 3;
  EXPECT_NE(c.Validate().message().find("model.heads"), std::string::npos) << c.Validate();
  c = TinyConfig("xhc");
  c.moe.top_k = 5;
  EXPECT_NE(c.Validate().message().find("model.moe.top_k"), std::string::npos);
  c = TinyConfig("xhc");
  c.residual = "highway";
  EXPECT_NE(c.Validate().message().find("model.residual"), std::string::npos);
  c = TinyConfig("xhc");
  c.active = 9;  // k > N
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  c = TinyConfig("vanilla");
  c.moe.shared_expert = true;
  EXPECT_NE(c.Validate().message().find("model.moe.shared_hidden"), std::string::npos);
  EXPECT_TRUE(TinyConfig("mhc").Validate().ok());
  EXPECT_FALSE(Model<float>::Create(c, 1).ok());
}

TEST(ModelTest, BadInputsAreInvalidArgument) {
  auto model = Model<float>::Create(TinyConfig("vanilla"), 1);
  ASSERT_TRUE(model.ok());
  Batch b = TinyBatch(11, 2, 6);
  auto r = (*model)->ForwardBackward(b.inputs, b.targets, 5, b.starts, 1.0f);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  b.inputs[3] = 11;
  r = (*model)->ForwardBackward(b.inputs, b.targets, 2, b.starts, 1.0f);
  EXPECT_NE(r.status().message().find("inputs[3]"), std::string::npos) << r.status();
  b = TinyBatch(11, 2, 6);
  b.starts = {12};
  r = (*model)->ForwardBackward(b.inputs, b.targets, 2, b.starts, 1.0f);
  EXPECT_NE(r.status().message().find("segment_starts"), std::string::npos) << r.status();
  b = TinyBatch(11, 4, 6);  // seq 6 ok; now rows longer than seq_len
  r = (*model)->ForwardBackward(b.inputs, b.targets, 2, {}, 1.0f);
  EXPECT_NE(r.status().message().find("seq_len"), std::string::npos) << r.status();
}

TEST(ModelTest, BitIdenticalRunToRun) {
  ModelConfig c = TinyConfig("xhc");
  c.width = 16;
  c.seq_len = 16;
  c.moe.bias_update_rate = 0.001;
  const Batch b = TinyBatch(c.vocab, 3, 16);
  std::vector<double> losses[2];
  std::vector<float> grads[2];
  for (int run = 0; run < 2; ++run) {
    auto model = Model<float>::Create(c, 42);
    ASSERT_TRUE(model.ok());
    auto params = (*model)->Parameters();
    for (int step = 0; step < 3; ++step) {
      (*model)->ZeroGrad();
      auto loss = (*model)->ForwardBackward(b.inputs, b.targets, b.batch, b.starts, 1.0f);
      ASSERT_TRUE(loss.ok()) << loss.status();
      losses[run].push_back(*loss);
      for (auto& p : params) {
        for (int64_t i = 0; i < p.size; ++i) p.value[i] -= 0.1f * p.grad[i];
      }
    }
    for (auto& p : params) grads[run].insert(grads[run].end(), p.grad, p.grad + p.size);
  }
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(grads[0], grads[1]);
}

TEST(ModelTest, SteadyStateStepAllocatesNothing) {
  for (const char* mode : {"vanilla", "mhc", "xhc", "xhc_flash4"}) {
    ModelConfig c = TinyConfig(mode);
    c.width = 16;
    c.seq_len = 16;
    c.moe.shared_expert = true;
    c.moe.shared_hidden = 8;
    c.moe.aux_loss_coef = 0.01;
    c.moe.bias_update_rate = 0.001;
    const Batch b = TinyBatch(c.vocab, 3, 16);
    auto model = Model<float>::Create(c, 42);
    ASSERT_TRUE(model.ok());
    for (int step = 0; step < 3; ++step) {
      (*model)->ZeroGrad();
      const int64_t before = g_allocations.load();
      auto loss = (*model)->ForwardBackward(b.inputs, b.targets, b.batch, b.starts, 1.0f);
      const int64_t allocated = g_allocations.load() - before;
      ASSERT_TRUE(loss.ok()) << loss.status();
      if (step > 0) {
        EXPECT_EQ(allocated, 0) << mode << " step " << step;
      }
      auto eval = (*model)->Evaluate(b.inputs, b.targets, b.batch, b.starts);
      ASSERT_TRUE(eval.ok());
    }
  }
}

TEST(ModelTest, LossesAgreeAcrossThreadCounts) {
  ModelConfig c = TinyConfig("xhc");
  c.width = 32;
  c.seq_len = 32;
  const Batch b = TinyBatch(c.vocab, 4, 32);
  std::vector<double> losses;
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    auto model = Model<float>::Create(c, 11);
    ASSERT_TRUE(model.ok());
    auto params = (*model)->Parameters();
    double last = 0;
    for (int step = 0; step < 3; ++step) {
      (*model)->ZeroGrad();
      auto loss = (*model)->ForwardBackward(b.inputs, b.targets, b.batch, b.starts, 1.0f);
      ASSERT_TRUE(loss.ok());
      last = *loss;
      for (auto& p : params) {
        for (int64_t i = 0; i < p.size; ++i) p.value[i] -= 0.1f * p.grad[i];
      }
    }
    losses.push_back(last);
  }
  omp_set_num_threads(saved);
  // Only float reassociation differs (GEMM splits, per-thread blocks): stated tolerance.
  EXPECT_NEAR(losses[1], losses[0], 1e-5 * losses[0]);
  EXPECT_NEAR(losses[2], losses[0], 1e-5 * losses[0]);
}

TEST(ModelTest, ExpertCountsAreExactPerLayer) {
  auto model = Model<float>::Create(TinyConfig("mhc"), 3);
  ASSERT_TRUE(model.ok());
  const Batch b = TinyBatch(11, 2, 6);
  ASSERT_TRUE((*model)->ForwardBackward(b.inputs, b.targets, 2, b.starts, 1.0f).ok());
  ASSERT_EQ((*model)->expert_counts().size(), 2u);
  for (const auto& counts : (*model)->expert_counts()) {
    EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), int64_t{0}), 12 * 2);
  }
}

TEST(ModelTest, OutputProjectionsAreScaledByStreams) {
  ModelConfig c = TinyConfig("xhc");
  c.width = 32;
  c.streams = 16;
  c.active = 4;
  c.fixed = 2;
  c.init_std = 0.02;
  auto xhc = Model<double>::Create(c, 9);
  c.residual = "vanilla";
  c.streams = c.active = c.fixed = 0;
  auto vanilla = Model<double>::Create(c, 9);
  ASSERT_TRUE(xhc.ok() && vanilla.ok()) << xhc.status() << vanilla.status();
  auto rms = [](Model<double>& m, const std::string& name) {
    for (const auto& p : m.Parameters()) {
      if (p.name != name) continue;
      double ss = 0;
      for (int64_t i = 0; i < p.size; ++i) ss += p.value[i] * p.value[i];
      return std::sqrt(ss / static_cast<double>(p.size));
    }
    return -1.0;
  };
  EXPECT_NEAR(rms(**vanilla, "blocks.0.attn.wo"), 0.02, 0.002);
  EXPECT_NEAR(rms(**xhc, "blocks.0.attn.wo"), 0.005, 0.0005);
  EXPECT_NEAR(rms(**xhc, "blocks.1.moe.experts.w2"), 0.005, 0.0005);
  EXPECT_NEAR(rms(**xhc, "blocks.1.attn.wqkv"), 0.02, 0.002);
}

TEST(ModelTest, TrainingReducesTheLoss) {
  ModelConfig c = TinyConfig("xhc");
  c.width = 16;
  c.seq_len = 16;
  c.init_std = 0.02;
  auto model = Model<float>::Create(c, 7);
  ASSERT_TRUE(model.ok());
  const Batch b = TinyBatch(c.vocab, 4, 16);
  double first = 0, last = 0;
  auto params = (*model)->Parameters();
  for (int step = 0; step < 60; ++step) {
    (*model)->ZeroGrad();
    auto loss = (*model)->ForwardBackward(b.inputs, b.targets, b.batch, b.starts, 1.0f);
    ASSERT_TRUE(loss.ok());
    if (step == 0) first = *loss;
    last = *loss;
    for (auto& p : params) {
      for (int64_t i = 0; i < p.size; ++i) p.value[i] -= 0.5f * p.grad[i];
    }
  }
  EXPECT_NEAR(first, std::log(11.0), 0.1);
  EXPECT_LT(last, 0.5 * first);
}

}  // namespace
}  // namespace rackrun::runtime
