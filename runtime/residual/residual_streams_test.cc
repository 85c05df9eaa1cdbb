#include "runtime/residual/residual_streams.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "runtime/residual/sinkhorn.h"

namespace rackrun::runtime {
namespace {

using ::testing::HasSubstr;

// A small deterministic model around ResidualStreams: sublayer bodies F_l(u) = tanh(M_l u)
// per token (so gradients flow through F), loss = sum(R * Collapse(...)).
template <typename T>
struct Harness {
  ResidualConfig config;
  int tokens = 10;
  std::vector<int32_t> segments = {0, 6};
  std::vector<std::vector<double>> M;  // per sublayer, C x C
  std::vector<double> R;               // tokens x C
  std::vector<double> start;           // tokens x N x C (SetState) or tokens x C (Expand)
  bool use_expand = false;

  Harness(ResidualConfig c, uint64_t seed, bool expand = false, int ntokens = 10)
      : config(std::move(c)) {
    use_expand = expand;
    tokens = ntokens;
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    const int C = config.width;
    const int N = config.streams;
    for (size_t l = 0; l < config.sublayers.size(); ++l) {
      std::vector<double> m(static_cast<size_t>(C * C));
      for (double& v : m) v = normal(rng) / std::sqrt(static_cast<double>(C));
      M.push_back(m);
    }
    R.resize(static_cast<size_t>(tokens * C));
    for (double& v : R) v = normal(rng);
    start.resize(static_cast<size_t>(tokens) * (expand ? 1 : N) * C);
    for (double& v : start) v = normal(rng);
  }

  std::vector<T> Body(int l, const std::vector<T>& u) const {
    const int C = config.width;
    std::vector<T> y(u.size());
    for (int t = 0; t < tokens; ++t)
      for (int i = 0; i < C; ++i) {
        double s = 0;
        for (int j = 0; j < C; ++j) s += M[static_cast<size_t>(l)][i * C + j] * u[t * C + j];
        y[t * C + i] = static_cast<T>(std::tanh(s));
      }
    return y;
  }

  // Runs the forward; keeps body outputs for the backward. Returns the loss.
  double Forward(ResidualStreams<T>& rs, std::vector<std::vector<T>>* outs = nullptr,
                 std::vector<T>* collapsed = nullptr) const {
    const int C = config.width;
    EXPECT_TRUE(rs.BeginBatch(tokens, segments).ok());
    std::vector<T> s(start.begin(), start.end());
    if (use_expand) {
      EXPECT_TRUE(rs.Expand(s).ok());
    } else {
      EXPECT_TRUE(rs.SetState(s).ok());
    }
    std::vector<T> u(static_cast<size_t>(tokens * C));
    for (int l = 0; l < static_cast<int>(config.sublayers.size()); ++l) {
      EXPECT_TRUE(rs.ReadInput(l, u).ok());
      std::vector<T> y = Body(l, u);
      EXPECT_TRUE(rs.WriteOutput(l, y).ok());
      if (outs != nullptr) outs->push_back(y);
    }
    std::vector<T> out(static_cast<size_t>(tokens * C));
    EXPECT_TRUE(rs.Collapse(out).ok());
    double loss = 0;
    for (size_t i = 0; i < out.size(); ++i) loss += R[i] * static_cast<double>(out[i]);
    if (collapsed != nullptr) *collapsed = out;
    return loss;
  }

  // Forward + backward; returns the gradient w.r.t. the start (state or embedding).
  std::vector<T> Gradient(ResidualStreams<T>& rs) const {
    const int C = config.width;
    std::vector<std::vector<T>> outs;
    Forward(rs, &outs);
    std::vector<T> dy(R.begin(), R.end());
    EXPECT_TRUE(rs.CollapseBackward(dy).ok());
    std::vector<T> d_out(static_cast<size_t>(tokens * C)), d_u(d_out.size());
    for (int l = static_cast<int>(config.sublayers.size()) - 1; l >= 0; --l) {
      EXPECT_TRUE(rs.WriteOutputBackward(l, d_out).ok());
      // Through F: y = tanh(M u) -> du = M^T (dy * (1 - y^2)).
      const std::vector<T>& y = outs[static_cast<size_t>(l)];
      std::fill(d_u.begin(), d_u.end(), T(0));
      for (int t = 0; t < tokens; ++t)
        for (int i = 0; i < C; ++i) {
          const double g = d_out[t * C + i] * (1.0 - y[t * C + i] * y[t * C + i]);
          for (int j = 0; j < C; ++j)
            d_u[t * C + j] += static_cast<T>(M[static_cast<size_t>(l)][i * C + j] * g);
        }
      EXPECT_TRUE(rs.ReadInputBackward(l, d_u).ok());
    }
    std::vector<T> d_start(start.size());
    if (use_expand) {
      EXPECT_TRUE(rs.ExpandBackward(d_start).ok());
    } else {
      EXPECT_TRUE(rs.StateBackward(d_start).ok());
    }
    return d_start;
  }
};

ResidualConfig SmallConfig(ResidualMode mode) {
  std::vector<SublayerKind> sub = ResidualConfig::Transformer(2);
  ResidualConfig c = ResidualConfig::ForMode(mode, 12, sub);
  if (mode == ResidualMode::kXhc || mode == ResidualMode::kXhcFlash ||
      mode == ResidualMode::kXhcFlash4) {
    c.streams = 8;
    c.active = 4;
    c.fixed = 1;
    c.conv_widths = {2, 4, 7};
  }
  return c;
}

// Random parameter values of moderate size, so every path (weights, biases, gates,
// convolutions) is exercised; router weights large so TopK margins dwarf the step.
template <typename T>
void Randomize(ResidualStreams<T>& rs, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (ParamRef<T>& p : rs.Parameters()) {
    double scale = 0.3;
    if (p.name.find("w_router") != std::string::npos) scale = 1.0;
    if (p.name.find(".a_") != std::string::npos || p.name.find(".s_") != std::string::npos)
      scale = 0.8;
    if (p.name.find("conv") != std::string::npos) scale = 0.5;
    for (int64_t i = 0; i < p.size; ++i) p.value[i] = static_cast<T>(scale * normal(rng));
  }
}

// Central differences on the loss for sampled entries of every parameter and the start.
void CheckGradients(ResidualMode mode, bool expand) {
  const ResidualConfig config = SmallConfig(mode);
  Harness<double> h(config, 7, expand);
  auto made = ResidualStreams<double>::Create(config, 3);
  ASSERT_TRUE(made.ok()) << made.status();
  ResidualStreams<double>& rs = *made;
  Randomize(rs, 21);
  rs.ZeroGrad();
  const std::vector<double> d_start = h.Gradient(rs);
  const double step = 1e-6;
  std::mt19937_64 rng(5);
  auto check = [&](const std::string& what, double* value, double analytic) {
    const double saved = *value;
    *value = saved + step;
    const double lp = h.Forward(rs);
    *value = saved - step;
    const double lm = h.Forward(rs);
    *value = saved;
    const double numeric = (lp - lm) / (2 * step);
    EXPECT_NEAR(analytic, numeric, 2e-6 + 2e-5 * std::abs(numeric)) << what;
  };
  std::vector<ParamRef<double>> params = rs.Parameters();
  int checked_groups = 0;
  for (ParamRef<double>& p : params) {
    // The largest-gradient entry plus a few random ones.
    int64_t best = 0;
    for (int64_t i = 1; i < p.size; ++i)
      if (std::abs(p.grad[i]) > std::abs(p.grad[best])) best = i;
    std::vector<int64_t> picks = {best};
    for (int s = 0; s < 3 && p.size > 1; ++s)
      picks.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(p.size)));
    for (int64_t i : picks) check(p.name + "[" + std::to_string(i) + "]", p.value + i, p.grad[i]);
    ++checked_groups;
  }
  EXPECT_EQ(checked_groups, static_cast<int>(params.size()));
  // The start (state or embedding).
  for (int s = 0; s < 12; ++s) {
    const size_t i = rng() % h.start.size();
    double* v = &h.start[i];
    const double saved = *v;
    *v = saved + step;
    const double lp = h.Forward(rs);
    *v = saved - step;
    const double lm = h.Forward(rs);
    *v = saved;
    EXPECT_NEAR(d_start[i], (lp - lm) / (2 * step), 2e-6 + 2e-5 * std::abs(d_start[i]))
        << "start[" << i << "]";
  }
}

class GradientTest : public ::testing::TestWithParam<ResidualMode> {};

TEST_P(GradientTest, StateAndEveryParameterGroupMatchCentralDifferences) {
  CheckGradients(GetParam(), false);
}

TEST_P(GradientTest, EmbeddingGradientMatchesCentralDifferences) {
  CheckGradients(GetParam(), true);
}

INSTANTIATE_TEST_SUITE_P(AllModes, GradientTest,
                         ::testing::Values(ResidualMode::kVanilla, ResidualMode::kHc,
                                           ResidualMode::kMhc, ResidualMode::kXhc,
                                           ResidualMode::kXhcFlash, ResidualMode::kXhcFlash4),
                         [](const ::testing::TestParamInfo<ResidualMode>& param_info) {
                           return std::string(ResidualModeName(param_info.param));
                         });

TEST(ResidualStreamsTest, ParametersCoverEveryGroupOfTheMode) {
  auto names = [](ResidualMode mode) {
    auto rs = ResidualStreams<double>::Create(SmallConfig(mode), 1);
    EXPECT_TRUE(rs.ok());
    std::vector<std::string> n;
    for (const auto& p : rs->Parameters()) n.push_back(p.name);
    return n;
  };
  EXPECT_TRUE(names(ResidualMode::kVanilla).empty());
  EXPECT_THAT(names(ResidualMode::kMhc),
              ::testing::IsSupersetOf({"sublayer0.w", "sublayer0.a_pre", "sublayer0.a_post",
                                       "sublayer0.a_res", "sublayer0.b_pre", "sublayer0.b_post",
                                       "sublayer0.b_res"}));
  EXPECT_THAT(names(ResidualMode::kHc),
              ::testing::IsSupersetOf({"sublayer1.w", "sublayer1.s_a", "sublayer1.s_b",
                                       "sublayer1.a_m0", "sublayer1.a_r0", "sublayer1.b0"}));
  EXPECT_THAT(names(ResidualMode::kXhc),
              ::testing::IsSupersetOf({"sublayer0.w_router", "sublayer0.w_pre", "sublayer0.a_pre",
                                       "sublayer0.b_pre", "sublayer0.w_res", "sublayer0.a_res",
                                       "sublayer0.b_res", "sublayer0.w_post", "sublayer0.a_post",
                                       "sublayer0.b_post", "sublayer1.conv0", "sublayer1.conv1",
                                       "sublayer1.conv2"}));
  const auto flash = names(ResidualMode::kXhcFlash);
  EXPECT_THAT(flash, ::testing::IsSupersetOf({"group0.w_router", "group1.w_router",
                                              "sublayer1.w_res", "sublayer0.w_post"}));
  // No mixing inside a flash group except in its last sublayer.
  EXPECT_THAT(flash, ::testing::Not(::testing::Contains("sublayer0.w_res")));
}

// ---------------------------------------------------------------------------------------
// Properties.

TEST(ResidualStreamsTest, InactiveStreamsPassThroughBitUnchanged) {
  for (ResidualMode mode : {ResidualMode::kXhc, ResidualMode::kXhcFlash}) {
    ResidualConfig config = SmallConfig(mode);
    Harness<float> h(config, 3);
    auto rs = ResidualStreams<float>::Create(config, 4);
    ASSERT_TRUE(rs.ok());
    Randomize(*rs, 8);
    const int C = config.width, N = config.streams, T = h.tokens;
    ASSERT_TRUE(rs->BeginBatch(T, h.segments).ok());
    std::vector<float> s(h.start.begin(), h.start.end());
    ASSERT_TRUE(rs->SetState(s).ok());
    std::vector<float> u(static_cast<size_t>(T * C));
    for (int l = 0; l < static_cast<int>(config.sublayers.size()); ++l) {
      const std::vector<float> before(rs->state().begin(), rs->state().end());
      ASSERT_TRUE(rs->ReadInput(l, u).ok());
      ASSERT_TRUE(rs->WriteOutput(l, h.Body(l, u)).ok());
      for (int t = 0; t < T; ++t) {
        auto maps = rs->Maps(l, t);
        ASSERT_TRUE(maps.ok());
        for (int i = 0; i < N; ++i) {
          const bool active =
              std::find(maps->active.begin(), maps->active.end(), i) != maps->active.end();
          const int64_t off = (static_cast<int64_t>(t) * N + i) * C;
          const bool same =
              std::memcmp(before.data() + off, rs->state().data() + off, sizeof(float) * C) == 0;
          if (active) {
            EXPECT_FALSE(same) << "active stream did not change";
          } else {
            EXPECT_TRUE(same) << ResidualModeName(mode) << " l=" << l << " t=" << t;
          }
        }
      }
    }
  }
}

TEST(ResidualStreamsTest, ActiveSetIsFixedStreamsThenTopKAscendingAndMixingRowsAtMostOne) {
  ResidualConfig config = SmallConfig(ResidualMode::kXhc);
  Harness<double> h(config, 12);
  auto rs = ResidualStreams<double>::Create(config, 4);
  ASSERT_TRUE(rs.ok());
  Randomize(*rs, 9);
  // Large mixing logits stress the Sinkhorn output.
  for (auto& p : rs->Parameters())
    if (p.name.find("b_res") != std::string::npos)
      for (int64_t i = 0; i < p.size; ++i) p.value[i] *= 20;
  std::vector<std::vector<double>> outs;
  h.Forward(*rs, &outs);
  for (int l = 0; l < 4; ++l)
    for (int t = 0; t < h.tokens; ++t) {
      auto m = rs->Maps(l, t);
      ASSERT_TRUE(m.ok());
      ASSERT_EQ(m->active.size(), 4u);
      EXPECT_EQ(m->active[0], 0);  // m = 1 fixed stream
      EXPECT_TRUE(std::is_sorted(m->active.begin(), m->active.end()));
      EXPECT_EQ(m->gates[0], 1.0);
      for (int j = 1; j < 4; ++j) EXPECT_GT(m->gates[static_cast<size_t>(j)], 0.0);
      for (int j = 0; j < 4; ++j) {
        double row = 0;
        for (int i = 0; i < 4; ++i) row += m->h_res[static_cast<size_t>(j * 4 + i)];
        EXPECT_LE(row, 1.0);
        EXPECT_NEAR(row, 1.0, 1e-5);
      }
    }
}

// RMSNorm without gain or eps (exactly scale invariant), as the bodies' own pre-norm.
std::vector<double> RmsNormRows(const std::vector<double>& x, int C) {
  std::vector<double> y(x.size());
  for (size_t t = 0; t < x.size() / static_cast<size_t>(C); ++t) {
    double ss = 0;
    for (int i = 0; i < C; ++i) ss += x[t * C + i] * x[t * C + i];
    const double r = std::sqrt(ss / C);
    for (int i = 0; i < C; ++i) y[t * C + i] = x[t * C + i] / r;
  }
  return y;
}

// A Pre-Norm transformer with bodies F_l(u) = M_l RMSNorm(u), final RMSNorm.
std::vector<double> PreNormReference(const Harness<double>& h) {
  const int C = h.config.width;
  std::vector<double> x = h.start;
  for (size_t l = 0; l < h.config.sublayers.size(); ++l) {
    const std::vector<double> n = RmsNormRows(x, C);
    for (int t = 0; t < h.tokens; ++t)
      for (int i = 0; i < C; ++i) {
        double s = 0;
        for (int j = 0; j < C; ++j) s += h.M[l][i * C + j] * n[t * C + j];
        x[t * C + i] += s;
      }
  }
  return RmsNormRows(x, C);
}

std::vector<double> RunWithPreNormBodies(ResidualStreams<double>& rs, const Harness<double>& h) {
  const int C = h.config.width;
  EXPECT_TRUE(rs.BeginBatch(h.tokens, h.segments).ok());
  EXPECT_TRUE(rs.Expand(h.start).ok());
  std::vector<double> u(static_cast<size_t>(h.tokens * C)), y(u.size());
  for (size_t l = 0; l < h.config.sublayers.size(); ++l) {
    EXPECT_TRUE(rs.ReadInput(static_cast<int>(l), u).ok());
    const std::vector<double> n = RmsNormRows(u, C);
    for (int t = 0; t < h.tokens; ++t)
      for (int i = 0; i < C; ++i) {
        double s = 0;
        for (int j = 0; j < C; ++j) s += h.M[l][i * C + j] * n[t * C + j];
        y[t * C + i] = s;
      }
    EXPECT_TRUE(rs.WriteOutput(static_cast<int>(l), y).ok());
  }
  std::vector<double> out(u.size());
  EXPECT_TRUE(rs.Collapse(out).ok());
  return RmsNormRows(out, C);
}

TEST(ResidualStreamsTest, MhcAndHcAtInitComputeThePreNormTransformer) {
  for (ResidualMode mode : {ResidualMode::kMhc, ResidualMode::kHc}) {
    ResidualConfig config = ResidualConfig::ForMode(mode, 16, ResidualConfig::Transformer(3));
    Harness<double> h(config, 31, /*expand=*/true);
    auto rs = ResidualStreams<double>::Create(config, 1);
    ASSERT_TRUE(rs.ok());
    const std::vector<double> got = RunWithPreNormBodies(*rs, h);
    const std::vector<double> want = PreNormReference(h);
    // mhc's Sinkhorn rows sum to 1 - O(1e-6), so the streams shrink by that per sublayer.
    const double tol = mode == ResidualMode::kMhc ? 1e-5 : 1e-12;
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_NEAR(got[i], want[i], tol) << ResidualModeName(mode) << " i=" << i;
  }
}

TEST(ResidualStreamsTest, XhcAtInitMatchesItsClosedForm) {
  // Biases 0, W_pre/W_res/W_post 0, conv 0: H_pre = 1/2 everywhere, H_res = Sinkhorn(0),
  // H_post = 1, O = [out, 0, 0, 0]; the router is sigma(LayerNorm(vec X) W_r) with TopK.
  ResidualConfig config = ResidualConfig::ForMode(ResidualMode::kXhc, 8,
                                                  {SublayerKind::kAttention, SublayerKind::kMlp});
  Harness<double> h(config, 17);
  auto rs = ResidualStreams<double>::Create(config, 99);
  ASSERT_TRUE(rs.ok());
  const int C = 8, N = 16, k = 4, m = 2, T = h.tokens;
  std::vector<double> w_router[2];
  for (auto& p : rs->Parameters()) {
    if (p.name == "sublayer0.w_router") w_router[0].assign(p.value, p.value + p.size);
    if (p.name == "sublayer1.w_router") w_router[1].assign(p.value, p.value + p.size);
  }
  SinkhornProjection<double> sk(k, 20);
  std::vector<double> zeros(k * k, 0.0), h0(k * k);
  sk.Forward(zeros.data(), h0.data(), nullptr);
  ASSERT_TRUE(rs->BeginBatch(T, h.segments).ok());
  ASSERT_TRUE(rs->SetState(h.start).ok());
  std::vector<double> x = h.start;
  std::vector<double> u(static_cast<size_t>(T * C));
  for (int l = 0; l < 2; ++l) {
    ASSERT_TRUE(rs->ReadInput(l, u).ok());
    const std::vector<double> out = h.Body(l, u);
    std::vector<double> next = x;
    for (int t = 0; t < T; ++t) {
      const double* xt = x.data() + static_cast<int64_t>(t) * N * C;
      double mean = 0, var = 0;
      for (int e = 0; e < N * C; ++e) mean += xt[e];
      mean /= N * C;
      for (int e = 0; e < N * C; ++e) var += (xt[e] - mean) * (xt[e] - mean);
      var /= N * C;
      std::vector<double> score(N);
      for (int p = 0; p < N; ++p) {
        double z = 0;
        for (int e = 0; e < N * C; ++e)
          z += (xt[e] - mean) / std::sqrt(var + 1e-6) * w_router[l][p * N * C + e];
        score[p] = 1 / (1 + std::exp(-z));
      }
      std::vector<int> order;
      for (int p = m; p < N; ++p) order.push_back(p);
      std::stable_sort(order.begin(), order.end(),
                       [&](int a, int b) { return score[a] > score[b]; });
      std::vector<int> active = {0, 1, order[0], order[1]};
      std::sort(active.begin() + 2, active.end());
      auto maps = rs->Maps(l, t);
      ASSERT_TRUE(maps.ok());
      ASSERT_EQ(maps->active, active) << "t=" << t;
      for (int i = 0; i < C; ++i) {
        double want_u = 0;
        for (int s = 0; s < N; ++s) want_u += 0.5 * xt[s * C + i];
        ASSERT_NEAR(u[t * C + i], want_u, 1e-12);
      }
      for (int j = 0; j < k; ++j) {
        const double p = j < m ? 1.0 : score[active[j]];
        ASSERT_NEAR(maps->gates[j], p, 1e-12);
        for (int i = 0; i < C; ++i) {
          double v = p * out[t * C + i];
          for (int q = 0; q < k; ++q) v += h0[j * k + q] * xt[active[q] * C + i];
          next[(static_cast<int64_t>(t) * N + active[j]) * C + i] = v;
        }
      }
    }
    ASSERT_TRUE(rs->WriteOutput(l, out).ok());
    x = next;
    for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(rs->state()[i], x[i], 1e-12) << "l=" << l;
  }
}

// Copies xhc's parameters into the flash model by name (the group router from the first
// sublayer's router).
void CopyByName(ResidualStreams<double>& from, ResidualStreams<double>& to) {
  std::map<std::string, ParamRef<double>> src;
  for (auto& p : from.Parameters()) src[p.name] = p;
  for (auto& p : to.Parameters()) {
    std::string name = p.name;
    if (name.rfind("group", 0) == 0) name = "sublayer" + name.substr(5);  // group0.w_router
    auto it = src.find(name);
    ASSERT_NE(it, src.end()) << p.name;
    ASSERT_EQ(it->second.size, p.size) << p.name;
    std::copy(it->second.value, it->second.value + p.size, p.value);
  }
}

TEST(ResidualStreamsTest, XhcFlashEqualsXhcUnderTheExactnessConditionsOnly) {
  const std::vector<SublayerKind> sub = {SublayerKind::kAttention, SublayerKind::kMlp};
  ResidualConfig xc = ResidualConfig::ForMode(ResidualMode::kXhc, 8, sub);
  xc.streams = 8;
  ResidualConfig fc = xc;
  fc.mode = ResidualMode::kXhcFlash;
  Harness<double> h(xc, 23);
  auto run = [&](bool conditions) {
    auto x = ResidualStreams<double>::Create(xc, 5);
    auto f = ResidualStreams<double>::Create(fc, 5);
    EXPECT_TRUE(x.ok() && f.ok());
    Randomize(*x, 77);
    for (auto& p : x->Parameters()) {
      // Shared routing: constant router (all scores 1/2, ties to the lower index) in both.
      if (p.name.find("w_router") != std::string::npos) std::fill(p.value, p.value + p.size, 0.0);
      // No mixing inside the group: H_res(attention) = I (up to Sinkhorn's eps).
      if (p.name == "sublayer0.w_res") std::fill(p.value, p.value + p.size, 0.0);
      if (p.name == "sublayer0.b_res")
        for (int i = 0; i < 16; ++i) p.value[i] = i % 5 == 0 ? 40.0 : -40.0;
      // Pre-mapping of the MLP frozen at block entry: no dependence on the state.
      if (conditions && p.name == "sublayer1.w_pre") std::fill(p.value, p.value + p.size, 0.0);
    }
    CopyByName(*x, *f);
    std::vector<double> ox, of;
    h.Forward(*x, nullptr, &ox);
    h.Forward(*f, nullptr, &of);
    double diff = 0, scale = 0;
    for (size_t i = 0; i < ox.size(); ++i) {
      diff = std::max(diff, std::abs(ox[i] - of[i]));
      scale = std::max(scale, std::abs(ox[i]));
    }
    return diff / scale;
  };
  EXPECT_LT(run(true), 1e-5);
  EXPECT_GT(run(false), 1e-3);
}

TEST(ResidualStreamsTest, ConvolutionsNeverCrossSegmentStarts) {
  ResidualConfig config = SmallConfig(ResidualMode::kXhc);
  config.sublayers = {SublayerKind::kMlp};
  Harness<double> h(config, 2);
  auto rs = ResidualStreams<double>::Create(config, 4);
  ASSERT_TRUE(rs.ok());
  Randomize(*rs, 6);
  const int C = config.width;
  auto run = [&](double bump) {
    EXPECT_TRUE(rs->BeginBatch(h.tokens, h.segments).ok());
    EXPECT_TRUE(rs->SetState(h.start).ok());
    std::vector<double> u(static_cast<size_t>(h.tokens * C));
    EXPECT_TRUE(rs->ReadInput(0, u).ok());
    std::vector<double> out = h.Body(0, u);
    for (int i = 0; i < C; ++i) out[5 * C + i] += bump;  // last token of segment [0, 6)
    EXPECT_TRUE(rs->WriteOutput(0, out).ok());
    return std::vector<double>(rs->state().begin(), rs->state().end());
  };
  const std::vector<double> a = run(0.0), b = run(0.5);
  const int64_t per_token = static_cast<int64_t>(config.streams) * C;
  for (int t = 0; t < h.tokens; ++t) {
    const bool same = std::equal(a.begin() + t * per_token, a.begin() + (t + 1) * per_token,
                                 b.begin() + t * per_token);
    EXPECT_EQ(same, t != 5) << "token " << t;
  }
}

TEST(ResidualStreamsTest, FloatMatchesDoubleAndRunsAreDeterministic) {
  for (ResidualMode mode :
       {ResidualMode::kHc, ResidualMode::kMhc, ResidualMode::kXhc, ResidualMode::kXhcFlash4}) {
    ResidualConfig config = SmallConfig(mode);
    Harness<double> hd(config, 41);
    Harness<float> hf(config, 41);
    auto d = ResidualStreams<double>::Create(config, 2);
    auto f = ResidualStreams<float>::Create(config, 2);
    ASSERT_TRUE(d.ok() && f.ok());
    Randomize(*d, 3);
    Randomize(*f, 3);
    std::vector<double> od;
    std::vector<float> of, of2;
    hd.Forward(*d, nullptr, &od);
    hf.Forward(*f, nullptr, &of);
    for (size_t i = 0; i < od.size(); ++i)
      ASSERT_NEAR(of[i], od[i], 2e-4 * (1 + std::abs(od[i]))) << ResidualModeName(mode);
    f->ZeroGrad();
    const std::vector<float> g1 = hf.Gradient(*f);
    std::vector<float> p1;
    for (auto& p : f->Parameters()) p1.insert(p1.end(), p.grad, p.grad + p.size);
    f->ZeroGrad();
    const std::vector<float> g2 = hf.Gradient(*f);
    std::vector<float> p2;
    for (auto& p : f->Parameters()) p2.insert(p2.end(), p.grad, p.grad + p.size);
    EXPECT_EQ(g1, g2);
    EXPECT_EQ(p1, p2);
  }
}

// A batch large enough for the multi-threaded path (tokens x N x C >= 2^15: the all-token
// projections split in token blocks over the threads, the backward's BatchGemm calls)
// against the same tokens run as small serial batches. Segments start every 10 tokens, so
// the 8 batches of 10 are the same computation up to float reassociation (the projection
// tiles group rows differently, the backward GEMMs split differently): the forward must
// agree to 1e-5 relative, the state gradient to 1e-4 relative, the parameter gradients
// (sums over tokens) to 1e-4 of their largest entry; two runs of the large batch must be
// bit-identical.
TEST(ResidualStreamsTest, ParallelSizedBatchMatchesSerialBatchesAndIsDeterministic) {
  for (ResidualMode mode :
       {ResidualMode::kXhc, ResidualMode::kXhcFlash, ResidualMode::kXhcFlash4}) {
    ResidualConfig config = ResidualConfig::ForMode(mode, 32, ResidualConfig::Transformer(2));
    config.conv_widths = {2, 4};
    constexpr int kChunk = 10, kChunks = 8;  // 80 x 16 x 32 = 40960 elements
    Harness<float> big(config, 43, false, kChunk * kChunks);
    big.segments.clear();
    for (int c = 0; c < kChunks; ++c) {
      big.segments.push_back(c * kChunk);
      big.segments.push_back(c * kChunk + 6);
    }
    auto a = ResidualStreams<float>::Create(config, 2);
    auto b = ResidualStreams<float>::Create(config, 2);
    ASSERT_TRUE(a.ok() && b.ok());
    Randomize(*a, 5);
    Randomize(*b, 5);
    auto run_big = [&](std::vector<float>* y, std::vector<float>* params) {
      a->ZeroGrad();
      big.Forward(*a, nullptr, y);
      std::vector<float> g = big.Gradient(*a);
      params->clear();
      for (auto& p : a->Parameters()) params->insert(params->end(), p.grad, p.grad + p.size);
      return g;
    };
    std::vector<float> y1, y2, p1, p2;
    const std::vector<float> g1 = run_big(&y1, &p1);
    const std::vector<float> g2 = run_big(&y2, &p2);
    EXPECT_EQ(y1, y2) << ResidualModeName(mode);
    EXPECT_EQ(g1, g2) << ResidualModeName(mode);
    EXPECT_EQ(p1, p2) << ResidualModeName(mode);
    // The same tokens, 10 at a time (serial path); parameter gradients accumulate.
    const int C = config.width, N = config.streams;
    std::vector<float> ys, gs;
    b->ZeroGrad();
    for (int c = 0; c < kChunks; ++c) {
      Harness<float> small(config, 43, false, kChunk);
      small.R.assign(big.R.begin() + c * kChunk * C, big.R.begin() + (c + 1) * kChunk * C);
      small.start.assign(big.start.begin() + static_cast<int64_t>(c) * kChunk * N * C,
                         big.start.begin() + static_cast<int64_t>(c + 1) * kChunk * N * C);
      std::vector<float> y;
      small.Forward(*b, nullptr, &y);
      ys.insert(ys.end(), y.begin(), y.end());
      const std::vector<float> g = small.Gradient(*b);
      gs.insert(gs.end(), g.begin(), g.end());
    }
    std::vector<float> ps;
    for (auto& p : b->Parameters()) ps.insert(ps.end(), p.grad, p.grad + p.size);
    ASSERT_EQ(ys.size(), y1.size());
    for (size_t i = 0; i < ys.size(); ++i)
      ASSERT_NEAR(y1[i], ys[i], 1e-5 * (1 + std::abs(ys[i]))) << ResidualModeName(mode) << i;
    ASSERT_EQ(gs.size(), g1.size());
    for (size_t i = 0; i < gs.size(); ++i)
      ASSERT_NEAR(g1[i], gs[i], 1e-4 * (1 + std::abs(gs[i]))) << ResidualModeName(mode) << i;
    double scale = 0;
    for (float v : ps) scale = std::max(scale, static_cast<double>(std::abs(v)));
    ASSERT_EQ(ps.size(), p1.size());
    for (size_t i = 0; i < ps.size(); ++i)
      ASSERT_NEAR(p1[i], ps[i], 1e-4 * scale) << ResidualModeName(mode) << " parameter " << i;
  }
}

// ---------------------------------------------------------------------------------------
// Memory-traffic accounting (docs/design.md section 5.8).

double PaperTraffic(ResidualConfig config, double* fused) {
  const int T = 8;
  auto rs = ResidualStreams<float>::Create(config, 1);
  EXPECT_TRUE(rs.ok()) << rs.status();
  const int C = config.width;
  std::vector<float> e(static_cast<size_t>(T * C), 1.0f), u(e.size()), y(e.size());
  EXPECT_TRUE(rs->BeginBatch(T, {}, /*save_for_backward=*/false).ok());
  EXPECT_TRUE(rs->Expand(e).ok());
  for (int l = 0; l < static_cast<int>(config.sublayers.size()); ++l) {
    EXPECT_TRUE(rs->ReadInput(l, u).ok());
    EXPECT_TRUE(rs->WriteOutput(l, u).ok());
  }
  EXPECT_TRUE(rs->Collapse(y).ok());
  *fused = rs->traffic().FusedPerSublayer(C);
  std::printf("%-11s", std::string(ResidualModeName(config.mode)).c_str());
  for (const TrafficStep& s : rs->traffic().steps)
    std::printf(" | %s %.1f/%.1f", s.name.c_str(),
                static_cast<double>(s.paper_read) / (T * C * config.sublayers.size()),
                static_cast<double>(s.paper_written) / (T * C * config.sublayers.size()));
  std::printf("\n            paper %.2fC  fused %.2fC per sublayer\n",
              rs->traffic().PaperPerSublayer(C), *fused);
  return rs->traffic().PaperPerSublayer(C);
}

TEST(ResidualStreamsTest, TrafficCountersReproduceThePapersAccounting) {
  const auto sub = ResidualConfig::Transformer(2);
  double fused = 0;
  EXPECT_DOUBLE_EQ(PaperTraffic(ResidualConfig::ForMode(ResidualMode::kVanilla, 64, sub), &fused),
                   3.0);
  EXPECT_DOUBLE_EQ(PaperTraffic(ResidualConfig::ForMode(ResidualMode::kMhc, 64, sub), &fused),
                   34.0);
  EXPECT_LT(fused, 34.0);
  EXPECT_DOUBLE_EQ(PaperTraffic(ResidualConfig::ForMode(ResidualMode::kHc, 64, sub), &fused), 34.0);
  EXPECT_DOUBLE_EQ(PaperTraffic(ResidualConfig::ForMode(ResidualMode::kXhc, 64, sub), &fused),
                   73.5);
  EXPECT_LT(fused, 73.5);
  // Our schedules in the paper's row-by-row style, next to the paper's 51C and 40C.
  const double flash =
      PaperTraffic(ResidualConfig::ForMode(ResidualMode::kXhcFlash, 64, sub), &fused);
  std::printf("xhc_flash: ours %.2fC (paper-style rows), fused %.2fC; paper 51C\n", flash, fused);
  EXPECT_DOUBLE_EQ(flash, 52.5);
  const double flash4 =
      PaperTraffic(ResidualConfig::ForMode(ResidualMode::kXhcFlash4, 64, sub), &fused);
  std::printf("xhc_flash4: ours %.2fC (paper-style rows), fused %.2fC; paper 40C\n", flash4, fused);
  EXPECT_DOUBLE_EQ(flash4, 42.0);
}

// ---------------------------------------------------------------------------------------
// Bad input.

TEST(ResidualStreamsTest, BadConfigsAreClearErrors) {
  auto err = [](ResidualConfig c) {
    auto rs = ResidualStreams<float>::Create(c, 1);
    EXPECT_FALSE(rs.ok());
    return std::string(rs.status().message());
  };
  const auto sub = ResidualConfig::Transformer(1);
  ResidualConfig c = ResidualConfig::ForMode(ResidualMode::kXhc, 16, sub);
  c.active = 20;
  EXPECT_THAT(err(c), HasSubstr("residual.active"));
  c = ResidualConfig::ForMode(ResidualMode::kXhc, 16, sub);
  c.fixed = 5;
  EXPECT_THAT(err(c), HasSubstr("residual.fixed"));
  c = ResidualConfig::ForMode(ResidualMode::kXhc, 0, sub);
  EXPECT_THAT(err(c), HasSubstr("residual.width"));
  c = ResidualConfig::ForMode(ResidualMode::kMhc, -3, sub);
  EXPECT_THAT(err(c), HasSubstr("residual.width"));
  c = ResidualConfig::ForMode(ResidualMode::kXhc, 16, sub);
  c.conv_widths = {4, 0};
  EXPECT_THAT(err(c), HasSubstr("residual.conv_widths[1]"));
  c = ResidualConfig::ForMode(ResidualMode::kXhcFlash, 16,
                              {SublayerKind::kMlp, SublayerKind::kAttention});
  EXPECT_THAT(err(c), HasSubstr("must be an MLP"));
  c = ResidualConfig::ForMode(ResidualMode::kXhcFlash4, 16, sub);
  EXPECT_THAT(err(c), HasSubstr("multiple of 4"));
  c = ResidualConfig::ForMode(ResidualMode::kVanilla, 16, sub);
  c.streams = 4;
  EXPECT_THAT(err(c), HasSubstr("residual.streams"));
  c = ResidualConfig::ForMode(ResidualMode::kMhc, 16, {});
  EXPECT_THAT(err(c), HasSubstr("residual.sublayers"));
  c = ResidualConfig::ForMode(ResidualMode::kMhc, 16, sub);
  c.sinkhorn_iters = 0;
  EXPECT_THAT(err(c), HasSubstr("residual.sinkhorn_iters"));
  auto mode = ParseResidualMode("xhc-flash");
  ASSERT_FALSE(mode.ok());
  EXPECT_THAT(std::string(mode.status().message()), HasSubstr("xhc_flash"));
  for (std::string_view n : {"vanilla", "hc", "mhc", "xhc", "xhc_flash", "xhc_flash4"}) {
    auto p = ParseResidualMode(n);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(ResidualModeName(*p), n);
  }
}

TEST(ResidualStreamsTest, BadShapesAndOrderAreErrorsNotCrashes) {
  ResidualConfig config = SmallConfig(ResidualMode::kXhc);
  auto rs = ResidualStreams<float>::Create(config, 1);
  ASSERT_TRUE(rs.ok());
  const int C = config.width;
  std::vector<float> e(static_cast<size_t>(10 * C)), wrong(7);
  EXPECT_EQ(rs->Expand(e).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(rs->BeginBatch(0, {}).code(), absl::StatusCode::kInvalidArgument);
  const std::vector<int32_t> bad_starts = {0, 5, 3};
  EXPECT_EQ(rs->BeginBatch(10, bad_starts).code(), absl::StatusCode::kInvalidArgument);
  const std::vector<int32_t> out_of_range = {12};
  EXPECT_EQ(rs->BeginBatch(10, out_of_range).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(rs->BeginBatch(10, {}).ok());
  EXPECT_THAT(std::string(rs->Expand(wrong).message()), HasSubstr("embedding has 7 elements"));
  ASSERT_TRUE(rs->Expand(e).ok());
  EXPECT_EQ(rs->WriteOutput(0, e).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(rs->ReadInput(1, e).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(rs->ReadInput(9, e).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(rs->ReadInput(0, wrong).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(rs->Maps(0, 0).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(rs->Collapse(e).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(rs->CollapseBackward(e).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(rs->ReadInput(0, e).ok());
  EXPECT_EQ(rs->WriteOutputBackward(0, e).code(), absl::StatusCode::kFailedPrecondition);
  // Forward-only batches refuse the backward.
  ASSERT_TRUE(rs->BeginBatch(10, {}, /*save_for_backward=*/false).ok());
  ASSERT_TRUE(rs->Expand(e).ok());
  for (int l = 0; l < 4; ++l) {
    ASSERT_TRUE(rs->ReadInput(l, e).ok());
    ASSERT_TRUE(rs->WriteOutput(l, e).ok());
  }
  ASSERT_TRUE(rs->Collapse(e).ok());
  EXPECT_EQ(rs->CollapseBackward(e).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace rackrun::runtime
