#include "planner/quota_planner.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/fanout.h"
#include "planner/plan.h"

namespace rackrun::planner {
namespace {

__extension__ typedef __int128 Int128;

// floor(a * b / d) and (a * b) mod d for 0 <= a, 0 <= b <= d, d > 0. `inv_d` = 1.0 / d
// gives an estimate that is corrected exactly, so the hot path has no integer division.
inline int64_t FloorMulDiv(int64_t a, int64_t b, int64_t d, double inv_d, int64_t* rem) {
  if ((a | b) < (int64_t{1} << 31)) {
    const int64_t p = a * b;
    int64_t f = static_cast<int64_t>(static_cast<double>(p) * inv_d);
    int64_t r = p - f * d;
    while (r < 0) {
      --f;
      r += d;
    }
    while (r >= d) {
      ++f;
      r -= d;
    }
    *rem = r;
    return f;
  }
  const Int128 p = static_cast<Int128>(a) * b;
  *rem = static_cast<int64_t>(p % d);
  return static_cast<int64_t>(p / d);
}

// Every split entry is an integer in [0, 2^49], held exactly in a double; adding 2^52 puts
// it in the mantissa's low bits, so the conversion to int64 is an add and a subtract, which
// vectorizes without AVX-512's cvtpd2qq.
constexpr double kMagic = 0x1p52;

inline int64_t ExactToInt(double x) {
  return std::bit_cast<int64_t>(x + kMagic) - std::bit_cast<int64_t>(kMagic);
}

}  // namespace

void QuotaSplit::CumulativeColumn(size_t g, int64_t q, int64_t left, int64_t* col) {
  double* __restrict remaining = remaining_.data();
  double* __restrict floors = floors_.data();  // floor(C_s * q / left), C_s cumulative r
  double cumulative = 0;
  for (size_t s = 0; s < g; ++s) {
    cumulative += remaining[s];
    floors[s] = cumulative;
  }
  const double qd = static_cast<double>(q);
  const double leftd = static_cast<double>(left);
  const double inv = 1.0 / leftd;
  if (left < (int64_t{1} << 26)) {
    // As in the largest-remainder path: C_s * q < 2^52 is exact, the quotient is < 2^26.
    for (size_t s = 0; s < g; ++s) {
      const double p = floors[s] * qd;
      double f = static_cast<double>(static_cast<int32_t>(p * inv));
      const double rem = p - f * leftd;
      f += static_cast<double>(static_cast<int32_t>((rem + 0.5) * inv + 1.0)) - 1.0;
      floors[s] = f;
    }
  } else {
    for (size_t s = 0; s < g; ++s) {
      int64_t rem = 0;
      floors[s] =
          static_cast<double>(FloorMulDiv(static_cast<int64_t>(floors[s]), q, left, inv, &rem));
    }
  }
  double previous = 0;
  for (size_t s = 0; s < g; ++s) {
    const double x = floors[s] - previous;
    previous = floors[s];
    col[s] = ExactToInt(x);  // the column's only write
    remaining[s] -= x;
  }
}

// Remainder buckets: 256 rather than 16 costs four more vectorized counting passes but
// leaves so few sources in the edge bucket that it is usually taken whole, which skips
// the scalar pass that lists it (EP256: -5% instructions, ~-15% time). Any monotone
// bucketing gives the same split: the edge bucket is resolved on exact remainders.
constexpr int kBuckets = 256;

// Largest remainders, first pass: col[s] = floor(r_s * q / left) for every source (the
// column's first write), r_s reduced by it, and each source's remainder bucket in bucket_
// (-1: no remainder). Returns the floors' sum.
int64_t QuotaSplit::FloorColumn(size_t g, int64_t q, int64_t left, double inv, double* remaining,
                                int64_t* col) {
  int32_t* bucket = bucket_.data();
  const double qd = static_cast<double>(q);
  const double leftd = static_cast<double>(left);
  const double to_bucket = static_cast<double>(kBuckets) * inv;
  int64_t floor_sum = 0;
  if (left < (int64_t{1} << 26)) {
    // floor(r * q / left) from a reciprocal estimate, corrected exactly (off by <= 1).
    int64_t* __restrict out_col = col;
    double* __restrict out_remaining = remaining;
    int32_t* __restrict out_bucket = bucket;
    int32_t small_sum = 0;  // <= q < 2^26
    for (size_t s = 0; s < g; ++s) {
      const double r = out_remaining[s];
      const double p = r * qd;
      // Truncation through int32 (exact: f <= r < 2^26) instead of std::floor, and no
      // comparisons, so the loop vectorizes.
      double f = static_cast<double>(static_cast<int32_t>(p * inv));
      double rem = p - f * leftd;  // exact; in [-left, 2 * left) as f is off by <= 1
      // fix = floor((rem + 0.5) / left) in {-1, 0, 1}: that value stays 1 / (2 * left)
      // away from every integer, far more than the rounding of the reciprocal.
      const double fix = static_cast<double>(static_cast<int32_t>((rem + 0.5) * inv + 1.0)) - 1.0;
      f += fix;
      rem -= fix * leftd;
      out_col[s] = ExactToInt(f);  // the column's first write
      out_remaining[s] = r - f;
      // Bucket of rem / left, monotone in rem; -1 for no remainder. Fused here (and the
      // floors' sum) so the column takes one pass instead of three. The remainders
      // themselves are not kept: the few sources in the edge bucket recompute theirs.
      const int b = static_cast<int>(std::min(static_cast<double>(kBuckets - 1), rem * to_bucket));
      out_bucket[s] = rem > 0 ? b : -1;
      small_sum += static_cast<int32_t>(f);  // an integer sum, so the loop still vectorizes
    }
    floor_sum = small_sum;
  } else {
    for (size_t s = 0; s < g; ++s) {
      int64_t rem = 0;
      const int64_t r = static_cast<int64_t>(remaining[s]);
      const int64_t f = FloorMulDiv(r, q, left, inv, &rem);
      col[s] = f;  // the column's first write
      remaining[s] = static_cast<double>(r - f);
      const double remd = static_cast<double>(rem);
      const int b = static_cast<int>(std::min(static_cast<double>(kBuckets - 1), remd * to_bucket));
      bucket[s] = rem > 0 ? b : -1;
      floor_sum += f;
    }
  }
  return floor_sum;
}

// Largest remainders, second pass: the `leftover` = q - sum(floor) tokens go one each to
// the sources with the largest remainders r_s * q mod left, ties to the lower source, found
// through the remainder buckets FloorColumn left in bucket_.
void QuotaSplit::GiveLeftover(size_t g, int64_t q, int64_t left, double inv, int64_t leftover,
                              double* remaining, int64_t* col) {
  const int32_t* bucket = bucket_.data();
  // The edge bucket: the largest b with at least `leftover` sources in buckets >= b,
  // by binary search over the kBuckets buckets with vectorized counting passes.
  const auto count_from = [bucket, g](int b) {
    int32_t count = 0;
    for (size_t s = 0; s < g; ++s) count += bucket[s] >= b ? 1 : 0;
    return static_cast<int64_t>(count);
  };
  int edge = 0;
  int beyond = kBuckets;     // count_from(edge) >= leftover > count_from(beyond)
  int64_t count_edge = -1;   // count_from(edge) once probed
  int64_t count_beyond = 0;  // count_from(beyond): 0 for kBuckets
  while (beyond - edge > 1) {
    const int mid = (edge + beyond) / 2;
    const int64_t count = count_from(mid);
    if (count >= leftover) {
      edge = mid;
      count_edge = count;
    } else {
      beyond = mid;
      count_beyond = count;
    }
  }
  if (count_edge < 0) count_edge = count_from(edge);
  // Every source in a bucket above `edge` (beyond == edge + 1 here) gets a token;
  // `take` of the sources in bucket `edge` do, the largest remainders first, ties to
  // the lower source.
  const int64_t above_edge = count_beyond;
  leftover -= above_edge;
  const int64_t take = leftover;
  // Sources in the edge bucket all take a token when `take` is all of them: then they
  // join the vectorized pass below and no list is built.
  const int64_t in_edge = count_edge - above_edge;
  const int from = take == in_edge ? edge : edge + 1;
  for (size_t s = 0; s < g; ++s) {
    const int32_t above = std::min(std::max(bucket[s] - from + 1, 0), 1);
    col[s] += above;
    remaining[s] -= static_cast<double>(above);
  }
  if (take > 0 && take < in_edge) {
    // The edge bucket holds a few sources (about g / kBuckets): find them eight at a
    // time (one vector compare per group; bucket_ is padded to a multiple of eight
    // with -2) and recompute their exact remainders, r * q mod left, from the floor
    // and the new remaining count (both untouched for them since the floor pass).
    TiedSource* tied = tied_.data();
    size_t num_tied = 0;
    for (size_t s0 = 0; s0 < g; s0 += 8) {
      int32_t hit = 0;
      for (size_t l = 0; l < 8; ++l) hit |= bucket[s0 + l] == edge ? 1 : 0;
      if (hit == 0) continue;
      for (size_t l = 0; l < 8; ++l) {
        const size_t s = s0 + l;
        if (bucket[s] != edge) continue;
        const int64_t f = col[s];
        int64_t rem = 0;
        FloorMulDiv(static_cast<int64_t>(remaining[s]) + f, q, left, inv, &rem);
        tied[num_tied++] = TiedSource{rem, static_cast<int32_t>(s)};
      }
    }
    // Only which sources are among the `take` largest matters, not their order.
    const auto larger = [](const TiedSource& a, const TiedSource& b) {
      return a.remainder != b.remainder ? a.remainder > b.remainder : a.source < b.source;
    };
    std::nth_element(tied, tied + (take - 1), tied + num_tied, larger);
    for (int64_t c = 0; c < take; ++c) {
      const size_t s = static_cast<size_t>(tied[c].source);
      col[s] += 1;
      remaining[s] -= 1;
    }
  }
}

void QuotaSplit::SplitExpert(const LoadMatrix& loads, int e, const double* loads_column,
                             Plan* out) {
  const Plan& plan = *out;
  // Token counts are integers below 2^53 (ValidateLoads caps each at 2^40, so an expert's
  // total is below 2^49 for any domain size), so doubles hold them exactly and the loops
  // below vectorize. Products r * q are exact only below 2^53: columns whose remaining
  // total is 2^26 or more take the exact 128-bit path.
  const size_t g = static_cast<size_t>(loads.ranks);
  const int i0 = plan.first[static_cast<size_t>(e)];
  const int k = plan.first[static_cast<size_t>(e) + 1] - i0;
  // The expert's k columns of the plan (contiguous, instance-major), written in place: each
  // column's first write assigns every entry, columns never written are zeroed at the end,
  // and the locality tokens (remembered in local_) are added last.
  int64_t* const dst =
      out->split.data() + static_cast<size_t>(plan.split_column[static_cast<size_t>(i0)]) * g;
  quota_left_.resize(static_cast<size_t>(k));
  for (int j = 0; j < k; ++j) {
    quota_left_[static_cast<size_t>(j)] = plan.quota[static_cast<size_t>(i0 + j)];
  }
  // This expert's column of the loads, gathered by Fill.
  double* remaining = remaining_.data();
  std::memcpy(remaining, loads_column, g * sizeof(double));
  local_.assign(static_cast<size_t>(k), 0);
  written_.assign(static_cast<size_t>(k), 0);

  // 1. Locality: a source's tokens go to the instance on its own rank first.
  for (int j = 0; j < k && locality_first_; ++j) {
    const size_t t = static_cast<size_t>(plan.instances[static_cast<size_t>(i0 + j)].rank);
    const int64_t x =
        std::min(static_cast<int64_t>(remaining[t]), quota_left_[static_cast<size_t>(j)]);
    local_[static_cast<size_t>(j)] = x;
    remaining[t] -= static_cast<double>(x);
    quota_left_[static_cast<size_t>(j)] -= x;
  }
  int64_t left = 0;
  for (int j = 0; j < k; ++j) left += quota_left_[static_cast<size_t>(j)];

  // 2. Proportional with largest remainders, one instance at a time; instance 0 (the
  // master) takes what is left.
  for (int j = 1; j < k && left > 0; ++j) {
    const int64_t q = quota_left_[static_cast<size_t>(j)];
    if (q == 0) continue;
    int64_t* col = dst + static_cast<size_t>(j) * g;
    written_[static_cast<size_t>(j)] = 1;
    if (q >= left) {
      for (size_t s = 0; s < g; ++s) {
        col[s] = ExactToInt(remaining[s]);
        remaining[s] = 0;
      }
      left = 0;
      break;
    }
    const double inv = 1.0 / static_cast<double>(left);
    if (rounding_ == SplitRounding::kCumulative) {
      CumulativeColumn(g, q, left, col);
      left -= q;
      continue;
    }
    const int64_t floor_sum = FloorColumn(g, q, left, inv, remaining, col);
    // Leftover = sum(rem) / left = (q * sum(r) - left * sum(floor)) / left = q - sum(floor),
    // as sum(r) = left: one token each to the sources with the largest remainders.
    if (const int64_t leftover = q - floor_sum; leftover > 0) {
      GiveLeftover(g, q, left, inv, leftover, remaining, col);
    }
    left -= q;
  }
  for (size_t s = 0; s < g; ++s) dst[s] = ExactToInt(remaining[s]);  // column 0's only write
  for (int j = 0; j < k; ++j) {
    int64_t* col = dst + static_cast<size_t>(j) * g;
    if (j > 0 && written_[static_cast<size_t>(j)] == 0) std::fill(col, col + g, int64_t{0});
    const size_t t = static_cast<size_t>(plan.instances[static_cast<size_t>(i0 + j)].rank);
    col[t] += local_[static_cast<size_t>(j)];
  }
}

void QuotaSplit::Fill(const LoadMatrix& loads, Plan* plan) {
  const int experts = loads.experts;
  const size_t g = static_cast<size_t>(loads.ranks);
  const int32_t* first = plan->first.data();
  plan->split_column.resize(plan->instances.size());
  int32_t* column = plan->split_column.data();

  // Only replicated experts get columns; the others' split is implied by the loads.
  replicated_.clear();
  int32_t columns = 0;
  for (int e = 0; e < experts; ++e) {
    const int k = first[e + 1] - first[e];
    if (k > 1) {
      replicated_.push_back(e);
      for (int j = 0; j < k; ++j) column[first[e] + j] = columns++;
    } else {
      column[first[e]] = -1;
    }
  }
  plan->split.resize(static_cast<size_t>(columns) * g);
  if (remaining_.size() < g) {
    remaining_.resize(g);
    floors_.resize(g);
    tied_.resize(g);
  }
  // Padded to a multiple of eight with -2 (no bucket) for SplitExpert's groups of eight.
  bucket_.assign((g + 7) / 8 * 8, -2);
  // The replicated experts' columns of the loads, gathered in one pass over the rows:
  // reading a column in place strides a whole row per entry (2 KB at 256 experts), which
  // cost more than the split itself at EP256.
  const size_t x_count = replicated_.size();
  if (columns_.size() < x_count * g) columns_.resize(x_count * g);
  double* gathered = columns_.data();
  const int32_t* which = replicated_.data();
  // Four rows at a time: one index load and one address per four entries.
  size_t s = 0;
  for (; s + 4 <= g; s += 4) {
    const int64_t* row0 = loads.row(static_cast<int>(s));
    const int64_t* row1 = loads.row(static_cast<int>(s + 1));
    const int64_t* row2 = loads.row(static_cast<int>(s + 2));
    const int64_t* row3 = loads.row(static_cast<int>(s + 3));
    for (size_t x = 0; x < x_count; ++x) {
      const int32_t e = which[x];
      double* out = gathered + x * g + s;
      out[0] = static_cast<double>(row0[e]);
      out[1] = static_cast<double>(row1[e]);
      out[2] = static_cast<double>(row2[e]);
      out[3] = static_cast<double>(row3[e]);
    }
  }
  for (; s < g; ++s) {
    const int64_t* row = loads.row(static_cast<int>(s));
    for (size_t x = 0; x < x_count; ++x) gathered[x * g + s] = static_cast<double>(row[which[x]]);
  }
  for (size_t x = 0; x < x_count; ++x) SplitExpert(loads, which[x], gathered + x * g, plan);
}

QuotaPlanner::QuotaPlanner(const Domain& domain, const PlannerOptions& options)
    : domain_(domain), options_(options), assembler_(options) {
  // The search's buffers depend on the domain only. Sized here, so that a solve whose search
  // runs for the first time (earlier solves kept the greedy candidate) does not allocate.
  if (!domain.Validate().ok()) return;  // SolveInto reports it
  const size_t ranks = static_cast<size_t>(domain.ranks);
  const size_t replicas = ranks * static_cast<size_t>(domain.slots_per_rank);
  rank_order_.reserve(ranks);
  expert_order_.reserve(static_cast<size_t>(domain.experts()));
  slack_.reserve(ranks);
  free_slots_.reserve(ranks);
  heap_.reserve(ranks);
  aside_.reserve(ranks);
  exports_.reserve(replicas);
  best_exports_.reserve(replicas);
  greedy_exports_.reserve(replicas);
}

absl::StatusOr<Plan> QuotaPlanner::Solve(const LoadMatrix& loads, int layer) {
  Plan plan;
  if (absl::Status status = SolveInto(loads, layer, &plan); !status.ok()) return status;
  return plan;
}

bool QuotaPlanner::Feasible(int64_t threshold, std::vector<Export>* exports) {
  ++last_oracle_calls_;
  exports->clear();
  const int ranks = domain_.ranks;
  int64_t excess = 0;
  int64_t slack = 0;
  heap_.clear();
  for (int r = 0; r < ranks; ++r) {
    const int64_t load = home_loads_[static_cast<size_t>(r)];
    const int64_t s = std::max<int64_t>(threshold - load, 0);
    excess += std::max<int64_t>(load - threshold, 0);
    slack += s;
    slack_[static_cast<size_t>(r)] = s;
    free_slots_[static_cast<size_t>(r)] = domain_.slots_per_rank;
    if (s > 0 && domain_.slots_per_rank > 0) heap_.push_back(r);
  }
  if (excess == 0) return true;
  if (excess > slack || heap_.empty()) return false;
  const auto lower = [this](int32_t a, int32_t b) {
    const int64_t sa = slack_[static_cast<size_t>(a)];
    const int64_t sb = slack_[static_cast<size_t>(b)];
    return sa != sb ? sa < sb : a > b;
  };
  std::make_heap(heap_.begin(), heap_.end(), lower);

  const int masters = domain_.masters_per_rank;
  const int64_t keep = options_.allow_zero_master_quota ? 0 : 1;
  for (const int32_t r : rank_order_) {
    const int64_t load = home_loads_[static_cast<size_t>(r)];
    if (load <= threshold) break;  // rank_order_ is heaviest first
    int64_t need = load - threshold;
    const int32_t* order = expert_order_.data() + static_cast<size_t>(r) * masters;
    for (int m = 0; m < masters && need > 0 && !heap_.empty(); ++m) {
      const int32_t e = order[m];
      const int64_t total = totals_[static_cast<size_t>(e)];
      int64_t exportable = total > 0 ? total - keep : 0;
      if (exportable <= 0) continue;
      const int64_t want = std::min(need, exportable);
      const int64_t targets = static_cast<int64_t>(heap_.size());
      const int64_t floor_tokens = std::min(options_.min_replica_tokens,
                                            std::max<int64_t>(1, (want + targets - 1) / targets));
      aside_.clear();
      while (need > 0 && exportable > 0 && !heap_.empty()) {
        const int32_t t = heap_.front();
        const int64_t q = std::min({need, slack_[static_cast<size_t>(t)], exportable});
        if (q < floor_tokens) break;  // the largest slack left cannot take a replica this big
        std::pop_heap(heap_.begin(), heap_.end(), lower);
        heap_.pop_back();
        exports->push_back(Export{e, t, q});
        slack_[static_cast<size_t>(t)] -= q;
        --free_slots_[static_cast<size_t>(t)];
        need -= q;
        exportable -= q;
        // A target now holds e: it sits out the rest of this expert.
        if (slack_[static_cast<size_t>(t)] > 0 && free_slots_[static_cast<size_t>(t)] > 0) {
          aside_.push_back(t);
        }
      }
      for (const int32_t t : aside_) {
        heap_.push_back(t);
        std::push_heap(heap_.begin(), heap_.end(), lower);
      }
    }
    if (need > 0) return false;
  }
  return true;
}

void PlanAssembler::Build(const Domain& domain, const LoadMatrix& loads,
                          const std::vector<int64_t>& totals,
                          const std::vector<ReplicaQuota>& replicas, Plan* plan) {
  const int experts = domain.experts();
  plan->ranks = domain.ranks;
  plan->experts = experts;
  replica_count_.assign(static_cast<size_t>(experts), 0);
  exported_.assign(static_cast<size_t>(experts), 0);
  for (const ReplicaQuota& x : replicas) {
    ++replica_count_[static_cast<size_t>(x.expert)];
    exported_[static_cast<size_t>(x.expert)] += x.tokens;
  }
  plan->first.resize(static_cast<size_t>(experts) + 1);
  plan->first[0] = 0;
  for (int e = 0; e < experts; ++e) {
    plan->first[static_cast<size_t>(e) + 1] =
        plan->first[static_cast<size_t>(e)] + 1 + replica_count_[static_cast<size_t>(e)];
  }
  const size_t n = static_cast<size_t>(plan->first[static_cast<size_t>(experts)]);
  plan->instances.resize(n);
  plan->quota.resize(n);
  for (int e = 0, home = 0, m = 0; e < experts; ++e) {
    const size_t i0 = static_cast<size_t>(plan->first[static_cast<size_t>(e)]);
    plan->instances[i0] = ExpertInstance{e, home, true};
    if (++m == domain.masters_per_rank) {  // home = e / masters_per_rank, without a division
      m = 0;
      ++home;
    }
    plan->quota[i0] = totals[static_cast<size_t>(e)] - exported_[static_cast<size_t>(e)];
    replica_count_[static_cast<size_t>(e)] = 0;  // reused as the fill cursor
  }
  for (const ReplicaQuota& x : replicas) {
    const size_t at = static_cast<size_t>(plan->first[static_cast<size_t>(x.expert)] + 1 +
                                          replica_count_[static_cast<size_t>(x.expert)]++);
    // Replicas in ascending rank: insertion into the expert's (short) sorted run.
    size_t i = at;
    const size_t lo = static_cast<size_t>(plan->first[static_cast<size_t>(x.expert)] + 1);
    while (i > lo && plan->instances[i - 1].rank > x.rank) {
      plan->instances[i] = plan->instances[i - 1];
      plan->quota[i] = plan->quota[i - 1];
      --i;
    }
    plan->instances[i] = ExpertInstance{x.expert, x.rank, false};
    plan->quota[i] = x.tokens;
  }
  split_.Fill(loads, plan);
  fanout_.Schedule(*plan, &plan->fanout);
}

int64_t GreedyRebalancer::Start(const Domain& domain, const std::vector<int64_t>& totals,
                                const std::vector<ReplicaQuota>& replicas) {
  const int ranks = domain.ranks;
  const int masters = domain.masters_per_rank;
  const int slots = domain.slots_per_rank;
  const int experts = domain.experts();
  const size_t g = static_cast<size_t>(ranks);
  load_.assign(g, 0);
  master_left_.assign(totals.begin(), totals.end());
  free_.assign(g, slots);
  on_rank_.resize(g * static_cast<size_t>(std::max(slots, 1)));
  head_.assign(static_cast<size_t>(experts), -1);
  next_.clear();
  stamp_.assign(g, -1);
  int64_t total = 0;
  for (int e = 0; e < experts; ++e) total += totals[static_cast<size_t>(e)];
  for (size_t j = 0; j < replicas.size(); ++j) {
    const ReplicaQuota& x = replicas[j];
    master_left_[static_cast<size_t>(x.expert)] -= x.tokens;
    load_[static_cast<size_t>(x.rank)] += x.tokens;
    const size_t r = static_cast<size_t>(x.rank);
    on_rank_[r * static_cast<size_t>(slots) + static_cast<size_t>(slots - free_[r])] =
        static_cast<int32_t>(j);
    --free_[r];
    next_.push_back(head_[static_cast<size_t>(x.expert)]);
    head_[static_cast<size_t>(x.expert)] = static_cast<int32_t>(j);
  }
  for (int r = 0, e = 0; r < ranks; ++r) {  // rank by rank: no division per expert
    for (int m = 0; m < masters; ++m, ++e) {
      load_[static_cast<size_t>(r)] += master_left_[static_cast<size_t>(e)];
    }
  }
  return total;
}

int64_t GreedyRebalancer::Heaviest() const {
  int64_t heaviest = 0;
  for (size_t r = 0; r < load_.size(); ++r) heaviest = std::max(heaviest, load_[r]);
  return heaviest;
}

bool GreedyRebalancer::HeavierTarget(int32_t a, int32_t b) const {
  const int64_t la = load_[static_cast<size_t>(a)];
  const int64_t lb = load_[static_cast<size_t>(b)];
  return la != lb ? la > lb : a > b;
}

void GreedyRebalancer::CollectCandidates(int32_t r, int masters, int slots, int64_t keep,
                                         const std::vector<ReplicaQuota>& replicas) {
  const size_t rs = static_cast<size_t>(r);
  candidates_.clear();
  for (int m = 0; m < masters; ++m) {
    const int32_t e = r * masters + m;
    const int64_t t = master_left_[static_cast<size_t>(e)];
    if (t > keep) candidates_.push_back(Candidate{t, e, -1});
  }
  for (int c = 0; c < slots - free_[rs]; ++c) {
    const int32_t j = on_rank_[rs * static_cast<size_t>(slots) + static_cast<size_t>(c)];
    const ReplicaQuota& x = replicas[static_cast<size_t>(j)];
    if (x.tokens > 1) candidates_.push_back(Candidate{x.tokens, x.expert, j});
  }
  // Insertion sort: a rank has masters_per_rank + slots_per_rank candidates at most, and
  // the order is total (no two instances of an expert on one rank), so any sort agrees.
  const auto before = [](const Candidate& a, const Candidate& b) {
    if (a.tokens != b.tokens) return a.tokens > b.tokens;
    if ((a.replica < 0) != (b.replica < 0)) return a.replica < 0;
    return a.expert < b.expert;
  };
  for (size_t i = 1; i < candidates_.size(); ++i) {
    const Candidate c = candidates_[i];
    size_t j = i;
    for (; j > 0 && before(c, candidates_[j - 1]); --j) candidates_[j] = candidates_[j - 1];
    candidates_[j] = c;
  }
}

bool GreedyRebalancer::MoveToTarget(const Domain& domain, const Candidate& c, size_t rs,
                                    const Level& level, int32_t move,
                                    std::vector<ReplicaQuota>* replicas) {
  const int64_t mean = level.mean;
  const int64_t keep = level.keep;
  const int64_t min_tokens = level.min_tokens;
  const int slots = level.slots;
  const auto heavier_target = [this](int32_t a, int32_t b) { return HeavierTarget(a, b); };
  bool moved = false;
  // Mark the ranks that hold c.expert, then take the lightest target not marked.
  const size_t e = static_cast<size_t>(c.expert);
  stamp_[static_cast<size_t>(domain.home_rank(c.expert))] = move;
  for (int32_t j = head_[e]; j >= 0; j = next_[static_cast<size_t>(j)]) {
    stamp_[static_cast<size_t>((*replicas)[static_cast<size_t>(j)].rank)] = move;
  }
  aside_.clear();
  int32_t t = -1;
  while (!targets_.empty()) {
    const int32_t candidate = targets_.front();
    std::pop_heap(targets_.begin(), targets_.end(), heavier_target);
    targets_.pop_back();
    if (stamp_[static_cast<size_t>(candidate)] == move) {
      aside_.push_back(candidate);
      continue;
    }
    t = candidate;
    break;
  }
  const size_t ts = static_cast<size_t>(std::max(t, 0));
  const int64_t give = c.replica < 0 ? c.tokens - keep : c.tokens - 1;
  const int64_t q = t < 0 ? 0 : std::min({load_[rs] - mean, mean - load_[ts], give});
  if (t >= 0 && q < min_tokens) aside_.push_back(t);  // too small a replica: not this one
  if (t >= 0 && q >= min_tokens) {
    if (c.replica < 0) {
      master_left_[e] -= q;
    } else {
      (*replicas)[static_cast<size_t>(c.replica)].tokens -= q;
    }
    const int32_t j = static_cast<int32_t>(replicas->size());
    replicas->push_back(ReplicaQuota{c.expert, t, q});
    next_.push_back(head_[e]);
    head_[e] = j;
    on_rank_[ts * static_cast<size_t>(slots) + static_cast<size_t>(slots - free_[ts])] = j;
    --free_[ts];
    load_[rs] -= q;
    load_[ts] += q;
    if (free_[ts] > 0 && load_[ts] < mean) aside_.push_back(t);
    moved = true;
  }
  for (const int32_t a : aside_) {
    targets_.push_back(a);
    std::push_heap(targets_.begin(), targets_.end(), heavier_target);
  }
  return moved;
}

int64_t GreedyRebalancer::Run(const Domain& domain, const std::vector<int64_t>& totals,
                              int64_t keep, int64_t min_tokens, int64_t level,
                              std::vector<ReplicaQuota>* replicas) {
  const int ranks = domain.ranks;
  const int masters = domain.masters_per_rank;
  const int slots = domain.slots_per_rank;
  const int64_t total = Start(domain, totals, *replicas);
  if (slots == 0 || ranks < 2) return Heaviest();
  const int64_t mean = std::max(level, (total + ranks - 1) / ranks);
  const Level limits{mean, keep, min_tokens, slots};

  // over_: heaviest first (ties: lower rank); targets_: lightest first (ties: lower rank).
  const auto lighter_over = [this](int32_t a, int32_t b) {
    const int64_t la = load_[static_cast<size_t>(a)];
    const int64_t lb = load_[static_cast<size_t>(b)];
    return la != lb ? la < lb : a > b;
  };
  const auto heavier_target = [this](int32_t a, int32_t b) { return HeavierTarget(a, b); };
  over_.clear();
  targets_.clear();
  for (int r = 0; r < ranks; ++r) {
    const int64_t l = load_[static_cast<size_t>(r)];
    if (l > mean) over_.push_back(r);
    if (l < mean && free_[static_cast<size_t>(r)] > 0) targets_.push_back(r);
  }
  std::make_heap(over_.begin(), over_.end(), lighter_over);
  std::make_heap(targets_.begin(), targets_.end(), heavier_target);

  int32_t move = 0;
  while (!over_.empty() && !targets_.empty()) {
    const int32_t r = over_.front();
    const size_t rs = static_cast<size_t>(r);
    CollectCandidates(r, masters, slots, keep, *replicas);
    bool moved = false;
    for (const Candidate& c : candidates_) {
      moved = MoveToTarget(domain, c, rs, limits, move, replicas);
      ++move;
      if (moved) break;
    }
    if (!moved) break;  // the heaviest rank cannot shed load: the maximum stays
    // r only got lighter: re-seat it (or drop it once it is at the mean).
    std::pop_heap(over_.begin(), over_.end(), lighter_over);
    over_.pop_back();
    if (load_[rs] > mean) {
      over_.push_back(r);
      std::push_heap(over_.begin(), over_.end(), lighter_over);
    }
  }
  return Heaviest();
}

void QuotaPlanner::SumHomeLoads(int64_t* total, int64_t* max_load) {
  const int ranks = domain_.ranks;
  const int masters = domain_.masters_per_rank;
  home_loads_.assign(static_cast<size_t>(ranks), 0);
  *total = 0;
  for (int r = 0, e = 0; r < ranks; ++r) {
    for (int m = 0; m < masters; ++m, ++e) {
      home_loads_[static_cast<size_t>(r)] += totals_[static_cast<size_t>(e)];
    }
  }
  *max_load = 0;
  for (int r = 0; r < ranks; ++r) {
    *total += home_loads_[static_cast<size_t>(r)];
    *max_load = std::max(*max_load, home_loads_[static_cast<size_t>(r)]);
  }
}

void QuotaPlanner::PrepareSearch(int64_t first_try) {
  const int ranks = domain_.ranks;
  const int masters = domain_.masters_per_rank;
  const int experts = domain_.experts();
  rank_order_.resize(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) rank_order_[static_cast<size_t>(r)] = r;
  std::sort(rank_order_.begin(), rank_order_.end(), [this](int32_t a, int32_t b) {
    const int64_t la = home_loads_[static_cast<size_t>(a)];
    const int64_t lb = home_loads_[static_cast<size_t>(b)];
    return la != lb ? la > lb : a < b;
  });
  expert_order_.resize(static_cast<size_t>(experts));
  for (int e = 0; e < experts; ++e) expert_order_[static_cast<size_t>(e)] = e;
  const auto heavier = [this](int32_t a, int32_t b) {
    const int64_t ta = totals_[static_cast<size_t>(a)];
    const int64_t tb = totals_[static_cast<size_t>(b)];
    return ta != tb ? ta > tb : a < b;
  };
  for (const int32_t r : rank_order_) {
    if (home_loads_[static_cast<size_t>(r)] <= first_try) break;
    auto begin = expert_order_.begin() + static_cast<ptrdiff_t>(r) * masters;
    std::sort(begin, begin + masters, heavier);
  }
  slack_.resize(static_cast<size_t>(ranks));
  free_slots_.resize(static_cast<size_t>(ranks));
  heap_.reserve(static_cast<size_t>(ranks));
  aside_.reserve(static_cast<size_t>(ranks));
  exports_.reserve(static_cast<size_t>(ranks) * domain_.slots_per_rank);
  best_exports_.reserve(static_cast<size_t>(ranks) * domain_.slots_per_rank);
}

void QuotaPlanner::Search(int64_t first_try, int64_t max_load) {
  if (Feasible(first_try, &best_exports_)) {
    last_threshold_ = first_try;
  } else {
    // Invariant: lo infeasible, hi feasible (max_load needs no exports).
    int64_t lo = first_try;
    int64_t hi = max_load;
    best_exports_.clear();
    last_threshold_ = max_load;
    const double precision = std::max(options_.eps, 0.0);
    while (hi - lo > 1 && static_cast<double>(hi - lo) > precision * static_cast<double>(lo)) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (Feasible(mid, &exports_)) {
        hi = mid;
        std::swap(exports_, best_exports_);
        last_threshold_ = mid;
      } else {
        lo = mid;
      }
    }
  }
}

void QuotaPlanner::Refine(int64_t keep, int64_t first_try, int64_t greedy_heaviest) {
  // Refinement: spend the free slots greedily, and compare with the greedy policy.
  const int64_t floor = options_.min_replica_tokens;
  // Three candidates, the lowest heaviest rank kept (ties: the earlier, fewer replicas):
  // (a) the search's replicas plus greedy moves up to the first threshold tried; (b) greedy
  // from masters alone up to that threshold (each replica carries more than when filling to
  // the mean, so slots last longer on heavy tails); (c) the greedy policy's plan (to the
  // mean), computed above.
  int64_t best = greedy_.Run(domain_, totals_, keep, floor, first_try, &best_exports_);
  exports_.clear();
  const int64_t heaviest = greedy_.Run(domain_, totals_, keep, floor, first_try, &exports_);
  if (heaviest < best) {
    best = heaviest;
    std::swap(best_exports_, exports_);
  }
  if (greedy_heaviest < best) std::swap(best_exports_, greedy_exports_);
}

absl::Status QuotaPlanner::SolveInto(const LoadMatrix& loads, int /*layer*/, Plan* plan) {
  const int ranks = domain_.ranks;
  last_oracle_calls_ = 0;
  last_threshold_ = 0;
  // Expert totals, with the loads' check folded into the same pass.
  if (absl::Status status = ValidatedExpertTotals(domain_, loads, &totals_); !status.ok()) {
    return status;
  }
  int64_t total = 0;
  int64_t max_load = 0;
  SumHomeLoads(&total, &max_load);

  const int64_t lower_bound = (total + ranks - 1) / ranks;
  const double mean = static_cast<double>(total) / ranks;
  int64_t first_try = static_cast<int64_t>(std::ceil(mean * (1.0 + std::max(options_.eps, 0.0))));
  first_try = std::max(first_try, lower_bound);
  best_exports_.clear();
  const bool balance = first_try < max_load && domain_.slots_per_rank > 0 && ranks > 1;
  const bool refine = balance && options_.refine;
  const int64_t keep = options_.allow_zero_master_quota ? 0 : 1;
  // Refinement's candidate (c), the greedy policy's plan, first: candidates (a) and (b) never
  // end below first_try (a rank above a GreedyRebalancer's level ends at or above it, and
  // the search leaves its heaviest rank at the threshold found, >= first_try), so when (c)
  // ends below first_try it is the strict winner, and neither the search nor (a) and (b)
  // can change the plan: they are skipped.
  int64_t greedy_heaviest = 0;
  if (refine) {
    greedy_exports_.clear();
    greedy_heaviest =
        greedy_.Run(domain_, totals_, keep, options_.min_replica_tokens, 0, &greedy_exports_);
  }
  const bool greedy_wins = refine && greedy_heaviest < first_try;
  if (balance && !greedy_wins) {
    PrepareSearch(first_try);
    Search(first_try, max_load);
  }
  if (refine && !greedy_wins) Refine(keep, first_try, greedy_heaviest);
  if (greedy_wins) std::swap(best_exports_, greedy_exports_);
  assembler_.Build(domain_, loads, totals_, best_exports_, plan);
  return absl::OkStatus();
}

}  // namespace rackrun::planner
