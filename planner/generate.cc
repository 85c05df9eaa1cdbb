#include "planner/generate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/random.h"
#include "base/string_view.h"

namespace rackrun::planner {
namespace {

using base::Xoshiro256;

// SplitMix64's finaliser: derives independent stream seeds.
uint64_t Mix64(uint64_t z) { return base::SplitMix64(z); }

// Independent streams, one per purpose and coordinates.
enum StreamTag : uint64_t { kPermutation = 1, kTokens = 2, kRouting = 3, kNormal = 4, kSpike = 5 };
Xoshiro256 Stream(uint64_t seed, StreamTag tag, uint64_t a, uint64_t b = 0, uint64_t c = 0) {
  uint64_t h = Mix64(seed ^ Mix64(tag));
  h = Mix64(h ^ a);
  h = Mix64(h ^ Mix64(b + 0x51));
  h = Mix64(h ^ Mix64(c + 0xa7));
  return Xoshiro256::FromSeedChained(h);
}

template <typename T>
void Shuffle(std::vector<T>& v, Xoshiro256& rng) {
  for (size_t i = v.size(); i > 1; --i) {
    std::swap(v[i - 1], v[rng.Below(i)]);
  }
}

// Popularity rank (0 = hottest) of every expert for one layer and epoch.
std::vector<int> PopularityRanks(const GeneratorOptions& o, int layer, int64_t epoch) {
  std::vector<int> order(static_cast<size_t>(o.experts));
  std::iota(order.begin(), order.end(), 0);
  Xoshiro256 rng =
      Stream(o.seed, kPermutation, static_cast<uint64_t>(layer), static_cast<uint64_t>(epoch));
  Shuffle(order, rng);
  std::vector<int> rank_of(order.size());
  for (size_t i = 0; i < order.size(); ++i)
    rank_of[static_cast<size_t>(order[i])] = static_cast<int>(i);
  return rank_of;
}

// Standard normal log-popularity of every expert for one layer and epoch (Box-Muller).
std::vector<double> NormalScores(const GeneratorOptions& o, int layer, int64_t epoch) {
  std::vector<double> z(static_cast<size_t>(o.experts));
  Xoshiro256 rng =
      Stream(o.seed, kNormal, static_cast<uint64_t>(layer), static_cast<uint64_t>(epoch));
  for (size_t e = 0; e < z.size(); e += 2) {
    const double u1 = 1.0 - rng.Uniform();  // (0, 1]
    const double u2 = rng.Uniform();
    const double radius = std::sqrt(-2.0 * std::log(u1));
    z[e] = radius * std::cos(2.0 * M_PI * u2);
    if (e + 1 < z.size()) z[e + 1] = radius * std::sin(2.0 * M_PI * u2);
  }
  return z;
}

// Inclusion probabilities for exponent s from log-weights `base` (<= 0, one per expert),
// capped at 1 and scaled to sum to topk. `by_weight` lists experts heaviest first.
void Inclusion(double s, const std::vector<double>& base, const std::vector<int>& by_weight,
               int topk, std::vector<double>& p) {
  const size_t n = base.size();
  p.assign(n, 1.0);
  if (static_cast<size_t>(topk) >= n) return;
  std::vector<double> w(n);
  for (size_t i = 0; i < n; ++i) w[i] = std::exp(s * base[static_cast<size_t>(by_weight[i])]);
  std::vector<double> suffix(n + 1, 0.0);
  for (size_t i = n; i > 0; --i) suffix[i - 1] = suffix[i] + w[i - 1];
  // The m heaviest experts are capped at 1; the rest share topk - m in proportion to w.
  // m = topk - 1 always satisfies the cap, so the loop ends by then.
  size_t m = 0;
  double c = 0;
  for (; m < static_cast<size_t>(topk); ++m) {
    c = (topk - static_cast<double>(m)) / suffix[m];
    if (c * w[m] <= 1.0) break;
  }
  for (size_t i = m; i < n; ++i) p[static_cast<size_t>(by_weight[i])] = std::min(1.0, c * w[i]);
}

double HomeImbalance(const std::vector<double>& p, int ranks, int topk) {
  const size_t per_rank = p.size() / static_cast<size_t>(ranks);
  double max_load = 0;
  for (size_t r = 0; r < static_cast<size_t>(ranks); ++r) {
    double sum = 0;
    for (size_t j = 0; j < per_rank; ++j) sum += p[r * per_rank + j];
    max_load = std::max(max_load, sum);
  }
  return max_load / (static_cast<double>(topk) / ranks);
}

int64_t TokensOf(const GeneratorOptions& o, int64_t microbatch, int src) {
  if (o.token_jitter == 0) return o.tokens_per_rank;
  Xoshiro256 rng =
      Stream(o.seed, kTokens, static_cast<uint64_t>(microbatch), static_cast<uint64_t>(src));
  const double f = 1.0 + o.token_jitter * (2.0 * rng.Uniform() - 1.0);
  return std::max<int64_t>(0, std::llround(static_cast<double>(o.tokens_per_rank) * f));
}

// Counts of `n` tokens from one source, each routed to topk distinct experts by systematic
// sampling over a random order of the experts, added into `row`.
void RouteSource(const std::vector<double>& p, int topk, int64_t n, Xoshiro256& rng, int64_t* row) {
  const size_t e_count = p.size();
  std::vector<int> order(e_count);
  std::iota(order.begin(), order.end(), 0);
  Shuffle(order, rng);
  std::vector<double> cum(e_count + 1, 0.0);
  for (size_t j = 0; j < e_count; ++j) cum[j + 1] = cum[j] + p[static_cast<size_t>(order[j])];
  cum[e_count] = topk;  // exact by construction; removes the rounding of the running sum

  // The chosen set only changes where u crosses the fractional part of a cumulative sum,
  // so tokens are bucketed into those intervals and each bucket's set is found once.
  std::vector<double> breaks;
  breaks.reserve(e_count + 1);
  breaks.push_back(0.0);
  for (size_t j = 1; j < e_count; ++j) breaks.push_back(cum[j] - std::floor(cum[j]));
  std::sort(breaks.begin(), breaks.end());
  std::vector<double> b;
  b.reserve(breaks.size() + 1);
  for (double x : breaks) {
    if (b.empty() || x - b.back() > 1e-12) b.push_back(x);
  }
  const size_t intervals = b.size();
  b.push_back(1.0);

  std::vector<int64_t> count(intervals, 0);
  for (int64_t t = 0; t < n; ++t) {
    const double u = rng.Uniform();
    const size_t i = static_cast<size_t>(std::upper_bound(b.begin(), b.end(), u) - b.begin()) - 1;
    ++count[std::min(i, intervals - 1)];
  }
  for (size_t i = 0; i < intervals; ++i) {
    if (count[i] == 0) continue;
    const double u = 0.5 * (b[i] + b[i + 1]);
    size_t prev = 0;
    for (int m = 0; m < topk; ++m) {
      const double x = u + m;
      size_t j = static_cast<size_t>(std::upper_bound(cum.begin(), cum.end(), x) - cum.begin());
      j = j == 0 ? 0 : j - 1;
      j = std::min(j, e_count - 1);
      // Only rounding could land two points in one interval; keep the k experts distinct.
      if (m > 0 && j <= prev) j = prev + 1;
      prev = j;
      row[order[std::min(j, e_count - 1)]] += count[i];
    }
  }
}

// Spikes (GeneratorOptions): recomputes out->inclusion from log-weights
// exponent * base + log(factor) when this (microbatch, layer) spikes.
void AddSpikes(const GeneratorOptions& o, int64_t microbatch, int layer,
               const std::vector<double>& base, LoadGenerator::Popularity* out) {
  if (o.spike_experts <= 0 || o.spike_rate <= 0) return;
  Xoshiro256 rng =
      Stream(o.seed, kSpike, static_cast<uint64_t>(microbatch), static_cast<uint64_t>(layer));
  if (rng.Uniform() >= o.spike_rate) return;
  std::vector<double> logw(base.size());
  for (size_t e = 0; e < base.size(); ++e) logw[e] = out->exponent * base[e];
  const uint64_t count = 1 + rng.Below(static_cast<uint64_t>(o.spike_experts));
  std::vector<char> spiked(base.size(), 0);
  for (uint64_t c = 0; c < count; ++c) {
    size_t e = static_cast<size_t>(rng.Below(base.size()));
    // Distinct experts: a repeat takes the next expert not yet spiked.
    while (spiked[e]) e = (e + 1) % base.size();
    spiked[e] = 1;
    const double factor = o.spike_min + (o.spike_max - o.spike_min) * rng.Uniform();
    logw[e] += std::log(factor);
  }
  std::vector<int> by_weight(base.size());
  std::iota(by_weight.begin(), by_weight.end(), 0);
  std::stable_sort(by_weight.begin(), by_weight.end(), [&](int a, int b) {
    return logw[static_cast<size_t>(a)] > logw[static_cast<size_t>(b)];
  });
  Inclusion(1.0, logw, by_weight, o.topk, out->inclusion);
}

}  // namespace

absl::StatusOr<LoadShift> ParseLoadShift(std::string_view name) {
  if (name == "none") return LoadShift::kNone;
  if (name == "drift") return LoadShift::kDrift;
  if (name == "jump") return LoadShift::kJump;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown load shift '", base::AsAbsl(name), "'; use none, drift or jump"));
}

absl::StatusOr<PopularityModel> ParsePopularityModel(std::string_view name) {
  if (name == "zipf") return PopularityModel::kZipf;
  if (name == "lognormal") return PopularityModel::kLognormal;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown popularity model '", base::AsAbsl(name), "'; use zipf or lognormal"));
}

std::string_view PopularityModelName(PopularityModel model) {
  return model == PopularityModel::kLognormal ? "lognormal" : "zipf";
}

std::string_view LoadShiftName(LoadShift shift) {
  switch (shift) {
    case LoadShift::kNone:
      return "none";
    case LoadShift::kDrift:
      return "drift";
    case LoadShift::kJump:
      return "jump";
  }
  return "none";
}

absl::Status GeneratorOptions::Validate() const {
  auto bad = [](const std::string& what) { return absl::InvalidArgumentError(what); };
  if (ranks < 1 || ranks > 65536) return bad(absl::StrCat("ranks is ", ranks, "; use 1..65536"));
  if (experts < 1 || experts % ranks != 0) {
    return bad(
        absl::StrCat("experts is ", experts, "; use a positive multiple of ranks (", ranks, ")"));
  }
  if (experts > (1 << 20)) return bad(absl::StrCat("experts is ", experts, "; use at most 2^20"));
  if (topk < 1 || topk > experts) {
    return bad(absl::StrCat("topk is ", topk, "; use 1..experts (", experts, ")"));
  }
  if (tokens_per_rank < 0 || tokens_per_rank > (int64_t{1} << 40)) {
    return bad(absl::StrCat("tokens_per_rank is ", tokens_per_rank, "; use 0..2^40"));
  }
  if (!(token_jitter >= 0 && token_jitter < 1)) {
    return bad(absl::StrCat("token_jitter is ", token_jitter, "; use a fraction in [0, 1)"));
  }
  if (!(imbalance >= 1 && std::isfinite(imbalance))) {
    return bad(
        absl::StrCat("imbalance is ", imbalance, "; use max/mean rank load >= 1 (e.g. 1.5, 2, 3)"));
  }
  if (microbatches < 1) return bad(absl::StrCat("microbatches is ", microbatches, "; use >= 1"));
  if (layers < 1) return bad(absl::StrCat("layers is ", layers, "; use >= 1"));
  if (shift_every < 1) return bad(absl::StrCat("shift_every is ", shift_every, "; use >= 1"));
  if (!(lognormal_sigma > 0 && lognormal_sigma <= 8)) {
    return bad(absl::StrCat("lognormal_sigma is ", lognormal_sigma, "; use (0, 8], e.g. 1 to 2"));
  }
  if (spike_experts < 0 || spike_experts > experts) {
    return bad(absl::StrCat("spike_experts is ", spike_experts, "; use 0..experts (", experts,
                            "), 0 for no spikes"));
  }
  if (!(spike_min >= 1 && spike_min <= spike_max && spike_max <= 1e6)) {
    return bad(absl::StrCat("spike factors are ", spike_min, "..", spike_max,
                            "; use 1 <= spike_min <= spike_max <= 1e6 (e.g. 5..20)"));
  }
  if (!(spike_rate >= 0 && spike_rate <= 1)) {
    return bad(absl::StrCat("spike_rate is ", spike_rate, "; use a probability in [0, 1]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LoadGenerator> LoadGenerator::Create(const GeneratorOptions& options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  LoadGenerator generator(options);
  for (int layer = 0; layer < options.layers; ++layer) {
    absl::StatusOr<Popularity> p = generator.ExpectedPopularity(0, layer);
    if (!p.ok()) return p.status();
  }
  return generator;
}

absl::StatusOr<LoadGenerator::Popularity> LoadGenerator::ExpectedPopularity(int64_t microbatch,
                                                                            int layer) const {
  const GeneratorOptions& o = options_;
  if (microbatch < 0 || layer < 0 || layer >= o.layers) {
    return absl::InvalidArgumentError(absl::StrCat("microbatch ", microbatch, " layer ", layer,
                                                   " is outside the generator's range"));
  }
  int64_t epoch = 0;
  double blend = 0;  // weight of the next epoch's profile (kDrift)
  if (o.shift != LoadShift::kNone) {
    epoch = microbatch / o.shift_every;
    if (o.shift == LoadShift::kDrift) {
      blend = static_cast<double>(microbatch % o.shift_every) / o.shift_every;
    }
  }
  std::vector<double> base(static_cast<size_t>(o.experts));
  if (o.popularity == PopularityModel::kLognormal) {
    const std::vector<double> z_a = NormalScores(o, layer, epoch);
    if (blend > 0) {
      const std::vector<double> z_b = NormalScores(o, layer, epoch + 1);
      const double norm = std::sqrt((1 - blend) * (1 - blend) + blend * blend);
      for (size_t e = 0; e < base.size(); ++e) {
        base[e] = ((1 - blend) * z_a[e] + blend * z_b[e]) / norm;
      }
    } else {
      base = z_a;
    }
  } else {
    const std::vector<int> rank_a = PopularityRanks(o, layer, epoch);
    if (blend > 0) {
      const std::vector<int> rank_b = PopularityRanks(o, layer, epoch + 1);
      for (size_t e = 0; e < base.size(); ++e) {
        base[e] = -((1 - blend) * std::log1p(rank_a[e]) + blend * std::log1p(rank_b[e]));
      }
    } else {
      for (size_t e = 0; e < base.size(); ++e) base[e] = -std::log1p(rank_a[e]);
    }
  }
  std::vector<int> by_weight(base.size());
  std::iota(by_weight.begin(), by_weight.end(), 0);
  std::stable_sort(by_weight.begin(), by_weight.end(), [&](int a, int b) {
    return base[static_cast<size_t>(a)] > base[static_cast<size_t>(b)];
  });

  Popularity out;
  auto imbalance_at = [&](double s) {
    Inclusion(s, base, by_weight, o.topk, out.inclusion);
    return HomeImbalance(out.inclusion, o.ranks, o.topk);
  };
  if (o.popularity == PopularityModel::kLognormal) {
    out.exponent = o.lognormal_sigma;
    imbalance_at(o.lognormal_sigma);
    AddSpikes(o, microbatch, layer, base, &out);
    return out;
  }
  // Scan s upward until the expected imbalance reaches the target, then bisect inside the
  // bracket. The scan (rather than bisection over the whole range) keeps this correct even
  // where the imbalance is not monotone in s: it returns the smallest crossing it sees.
  constexpr double kStep = 0.05;
  constexpr double kMaxExponent = 16.0;
  double lo = 0;
  double hi = -1;
  double best = imbalance_at(0);
  if (best >= o.imbalance - 1e-12) {
    out.exponent = 0;
    return out;
  }
  for (double s = kStep; s <= kMaxExponent + 1e-9; s += kStep) {
    const double f = imbalance_at(s);
    best = std::max(best, f);
    if (f >= o.imbalance) {
      hi = s;
      break;
    }
    lo = s;
  }
  if (hi < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "imbalance ", o.imbalance, " is unreachable for layer ", layer, " at microbatch ",
        microbatch, " with ", o.ranks, " ranks, ", o.experts, " experts, top-", o.topk,
        " (at most ", best, ": the hottest experts do not share a rank); lower --imbalance, ",
        "or change --seed or the domain"));
  }
  for (int iter = 0; iter < 60; ++iter) {
    const double mid = 0.5 * (lo + hi);
    if (imbalance_at(mid) >= o.imbalance) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  out.exponent = hi;
  imbalance_at(hi);
  AddSpikes(o, microbatch, layer, base, &out);
  return out;
}

absl::StatusOr<TraceEntry> LoadGenerator::Generate(int64_t microbatch, int layer) const {
  absl::StatusOr<Popularity> popularity = ExpectedPopularity(microbatch, layer);
  if (!popularity.ok()) return popularity.status();
  const GeneratorOptions& o = options_;
  TraceEntry entry;
  entry.microbatch = microbatch;
  entry.layer = layer;
  entry.loads = LoadMatrix(o.ranks, o.experts);
  for (int src = 0; src < o.ranks; ++src) {
    Xoshiro256 rng = Stream(o.seed, kRouting, static_cast<uint64_t>(microbatch),
                            static_cast<uint64_t>(layer), static_cast<uint64_t>(src));
    const int64_t n = TokensOf(o, microbatch, src);
    int64_t* row = entry.loads.counts.data() + static_cast<size_t>(src) * o.experts;
    RouteSource(popularity->inclusion, o.topk, n, rng, row);
  }
  return entry;
}

absl::StatusOr<std::vector<TraceEntry>> LoadGenerator::GenerateAll() const {
  std::vector<TraceEntry> entries;
  for (int64_t mb = 0; mb < options_.microbatches; ++mb) {
    for (int layer = 0; layer < options_.layers; ++layer) {
      absl::StatusOr<TraceEntry> entry = Generate(mb, layer);
      if (!entry.ok()) return entry.status();
      entries.push_back(*std::move(entry));
    }
  }
  return entries;
}

}  // namespace rackrun::planner
