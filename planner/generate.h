// Synthetic load traces: Zipf-skewed expert popularity calibrated to a target initial rank
// imbalance, top-k routing without replacement, per-rank token counts that vary, and
// non-stationary popularity (slow drift or sudden jumps).
//
// Model, per layer l and microbatch t:
//  - Popularity (kZipf, the default). A random permutation gives every expert a popularity
//    rank i (0 = hottest), so hot experts land on random ranks. Its weight is
//    w = (1 + i)^-s (Zipf, exponent s).
//  - Popularity (kLognormal). Every expert draws z ~ N(0, 1) (Box-Muller) and its weight is
//    w = exp(sigma * z): heavy-tailed popularity with `lognormal_sigma` fixed (1 to 2 are
//    typical); there is no calibration and `imbalance` is not used. Under kDrift z blends
//    as ((1 - b) z_a + b z_b) / sqrt((1 - b)^2 + b^2), which keeps it N(0, 1).
//  - Spikes (spike_experts > 0). In each microbatch, with probability `spike_rate`, 1 to
//    spike_experts distinct random experts have their weight multiplied by a factor drawn
//    uniformly in [spike_min, spike_max] for that microbatch only (after calibration: a
//    sudden spike lifts the imbalance above the target); each (microbatch, layer) draws
//    its own.
//    Under kDrift the log-weight moves linearly from one permutation's Zipf profile to the
//    next one's over `shift_every` microbatches (every expert heats or cools gradually);
//    under kJump the permutation is redrawn every `shift_every` microbatches.
//  - Inclusion probabilities. A token picks `topk` distinct experts; expert e is picked
//    with probability p_e = min(1, c * w_e), with c such that sum_e p_e = topk.
//  - Calibration. s is found (grid scan, then bisection) so that the EXPECTED home-placement
//    rank imbalance max_r sum_{e homed on r} p_e / mean_r(...) equals `imbalance`. It is
//    recalibrated every microbatch, so drift/jump move the hot experts while the expected
//    initial imbalance stays at the target. Realised traces deviate by sampling noise
//    (about 1% at EP64, 8k tokens per rank, top-8).
//  - Routing. Each token's k distinct experts come from systematic (Madow) sampling over a
//    per-source random order of the experts: with cumulative sums C of p in that order and
//    one uniform u, the token takes the experts whose interval [C_j, C_j+1) holds u, u+1,
//    ..., u+k-1. That is k distinct experts with inclusion probability exactly p_e (which
//    is what makes the calibration exact), at one uniform and one binary search per token.
//  - Tokens. Source rank src sends n_src tokens in microbatch t, n_src uniform in
//    tokens_per_rank * [1 - token_jitter, 1 + token_jitter] (same for every layer of t).
//    loads[src][e] counts the tokens of src that picked e, so row src sums to n_src * topk.
//
// Deterministic: every entry is a pure function of (options, microbatch, layer), built from
// splitmix64/xoshiro256** and our own uniform mapping (no std:: distributions, whose output
// differs between standard libraries).
#ifndef RACKRUN_PLANNER_GENERATE_H_
#define RACKRUN_PLANNER_GENERATE_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/plan.h"
#include "planner/trace.h"

namespace rackrun::planner {

enum class LoadShift {
  kNone,   // stationary: one popularity permutation per layer
  kDrift,  // hot experts change gradually (log-linear blend between permutations)
  kJump,   // hot experts change all at once every `shift_every` microbatches
};

enum class PopularityModel {
  kZipf,       // calibrated to `imbalance`
  kLognormal,  // exp(sigma * N(0, 1)), uncalibrated
};

// "zipf", "lognormal"; InvalidArgument listing them otherwise.
absl::StatusOr<PopularityModel> ParsePopularityModel(std::string_view name);
std::string_view PopularityModelName(PopularityModel model);

// "none", "drift", "jump"; InvalidArgument listing them otherwise.
absl::StatusOr<LoadShift> ParseLoadShift(std::string_view name);
std::string_view LoadShiftName(LoadShift shift);

struct GeneratorOptions {
  int ranks = 64;
  int experts = 256;               // a multiple of ranks; expert e is homed on e / (experts/ranks)
  int topk = 8;                    // distinct experts per token, 1..experts
  int64_t tokens_per_rank = 8192;  // mean tokens per source rank per microbatch
  double token_jitter = 0.0;       // in [0, 1): +-fraction of tokens_per_rank per source
  double imbalance = 2.0;          // target expected home-placement max/mean rank load, >= 1
  int64_t microbatches = 1;
  int layers = 1;
  LoadShift shift = LoadShift::kNone;
  int shift_every = 10;  // J, in microbatches (kDrift: blend period; kJump: period)
  PopularityModel popularity = PopularityModel::kZipf;
  double lognormal_sigma = 1.5;  // kLognormal: in (0, 8]
  int spike_experts = 0;         // 0: no spikes; else 1..spike_experts experts per spike
  double spike_min = 5;          // spike factor range, 1 <= spike_min <= spike_max <= 1e6
  double spike_max = 20;
  double spike_rate = 0.25;  // probability that a (microbatch, layer) has a spike
  uint64_t seed = 1;

  // InvalidArgument naming the field and its valid range.
  absl::Status Validate() const;
};

class LoadGenerator {
 public:
  // Validates the options and checks that the target imbalance is reachable for every
  // layer's first popularity profile (InvalidArgument with the largest reachable value if
  // not, e.g. top-8 over 8 ranks with 4 experts each cannot concentrate much load).
  static absl::StatusOr<LoadGenerator> Create(const GeneratorOptions& options);

  const GeneratorOptions& options() const { return options_; }

  // The loads of one (microbatch, layer). Thread-safe; any order. InvalidArgument when a
  // later popularity profile cannot reach the target imbalance (kDrift/kJump only).
  absl::StatusOr<TraceEntry> Generate(int64_t microbatch, int layer) const;

  // Every entry of options().microbatches x layers, microbatch-major and layer-minor as a
  // training run produces them; Generate's first error. For small runs (tests): a large
  // one is better streamed entry by entry.
  absl::StatusOr<std::vector<TraceEntry>> GenerateAll() const;

  // The model behind Generate: calibrated Zipf exponent and per-expert inclusion
  // probabilities (sum = topk) for one (microbatch, layer).
  struct Popularity {
    double exponent = 0;
    std::vector<double> inclusion;
  };
  absl::StatusOr<Popularity> ExpectedPopularity(int64_t microbatch, int layer) const;

 private:
  explicit LoadGenerator(const GeneratorOptions& options) : options_(options) {}
  GeneratorOptions options_;
};

}  // namespace rackrun::planner

#endif  // RACKRUN_PLANNER_GENERATE_H_
