#include "planner/quota_planner.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
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

}  // namespace

void QuotaSplit::Fill(const LoadMatrix& loads, Plan* plan) {
  const int ranks = loads.ranks;
  const int experts = loads.experts;
  const size_t n = plan->instances.size();
  plan->split.resize(static_cast<size_t>(ranks) * n);
  int64_t* split = plan->split.data();
  const int32_t* first = plan->first.data();

  // Every expert's tokens to its first instance; replicated experts are redone below.
  for (int s = 0; s < ranks; ++s) {
    int64_t* out = split + static_cast<size_t>(s) * n;
    const int64_t* row = loads.row(s);
    for (int e = 0; e < experts; ++e) out[first[e]] = row[e];
  }

  remaining_.resize(static_cast<size_t>(ranks));
  candidates_.reserve(static_cast<size_t>(ranks));
  remainder_.resize(static_cast<size_t>(ranks));
  for (int e = 0; e < experts; ++e) {
    const int i0 = first[e];
    const int k = first[e + 1] - i0;
    if (k <= 1) continue;
    quota_left_.resize(static_cast<size_t>(k));
    for (int j = 0; j < k; ++j)
      quota_left_[static_cast<size_t>(j)] = plan->quota[static_cast<size_t>(i0 + j)];
    for (int s = 0; s < ranks; ++s) {
      remaining_[static_cast<size_t>(s)] = loads.at(s, e);
      int64_t* out = split + static_cast<size_t>(s) * n + i0;
      for (int j = 0; j < k; ++j) out[j] = 0;
    }
    // 1. Locality: a source's tokens go to the instance on its own rank first.
    for (int j = 0; j < k; ++j) {
      const int t = plan->instances[static_cast<size_t>(i0 + j)].rank;
      const int64_t x =
          std::min(remaining_[static_cast<size_t>(t)], quota_left_[static_cast<size_t>(j)]);
      split[static_cast<size_t>(t) * n + i0 + j] += x;
      remaining_[static_cast<size_t>(t)] -= x;
      quota_left_[static_cast<size_t>(j)] -= x;
    }
    int64_t left = 0;
    for (int j = 0; j < k; ++j) left += quota_left_[static_cast<size_t>(j)];
    // 2. Proportional, one instance at a time; the first instance takes the rest.
    for (int j = 1; j < k && left > 0; ++j) {
      const int64_t q = quota_left_[static_cast<size_t>(j)];
      if (q == 0) continue;
      int64_t* col = split + i0 + j;
      if (q >= left) {
        for (int s = 0; s < ranks; ++s) {
          col[static_cast<size_t>(s) * n] += remaining_[static_cast<size_t>(s)];
          remaining_[static_cast<size_t>(s)] = 0;
        }
        left = 0;
        break;
      }
      const double inv = 1.0 / static_cast<double>(left);
      int64_t assigned = 0;
      candidates_.clear();
      for (int s = 0; s < ranks; ++s) {
        const int64_t r = remaining_[static_cast<size_t>(s)];
        if (r == 0) continue;
        int64_t rem = 0;
        const int64_t f = FloorMulDiv(r, q, left, inv, &rem);
        col[static_cast<size_t>(s) * n] += f;
        remaining_[static_cast<size_t>(s)] = r - f;
        assigned += f;
        if (rem > 0) {
          remainder_[static_cast<size_t>(s)] = rem;
          candidates_.push_back(s);
        }
      }
      const int64_t leftover = q - assigned;
      if (leftover > 0) {
        auto larger = [this](int32_t a, int32_t b) {
          const int64_t ra = remainder_[static_cast<size_t>(a)];
          const int64_t rb = remainder_[static_cast<size_t>(b)];
          return ra != rb ? ra > rb : a < b;
        };
        if (leftover < static_cast<int64_t>(candidates_.size())) {
          std::nth_element(candidates_.begin(), candidates_.begin() + (leftover - 1),
                           candidates_.end(), larger);
        }
        for (int64_t c = 0; c < leftover; ++c) {
          const int32_t s = candidates_[static_cast<size_t>(c)];
          col[static_cast<size_t>(s) * n] += 1;
          remaining_[static_cast<size_t>(s)] -= 1;
        }
      }
      left -= q;
    }
    int64_t* col0 = split + i0;
    for (int s = 0; s < ranks; ++s)
      col0[static_cast<size_t>(s) * n] += remaining_[static_cast<size_t>(s)];
  }
}

QuotaPlanner::QuotaPlanner(const Domain& domain, const PlannerOptions& options)
    : domain_(domain), options_(options), fanout_(options.fanout) {}

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

void QuotaPlanner::BuildPlan(const LoadMatrix& loads, const std::vector<Export>& exports,
                             Plan* plan) {
  const int experts = domain_.experts();
  plan->ranks = domain_.ranks;
  plan->experts = experts;
  replica_count_.assign(static_cast<size_t>(experts), 0);
  exported_.assign(static_cast<size_t>(experts), 0);
  for (const Export& x : exports) {
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
  for (int e = 0; e < experts; ++e) {
    const size_t i0 = static_cast<size_t>(plan->first[static_cast<size_t>(e)]);
    plan->instances[i0] = ExpertInstance{e, domain_.home_rank(e), true};
    plan->quota[i0] = totals_[static_cast<size_t>(e)] - exported_[static_cast<size_t>(e)];
    replica_count_[static_cast<size_t>(e)] = 0;  // reused as the fill cursor
  }
  for (const Export& x : exports) {
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

absl::Status QuotaPlanner::SolveInto(const LoadMatrix& loads, int /*layer*/, Plan* plan) {
  const int ranks = domain_.ranks;
  const int masters = domain_.masters_per_rank;
  const int experts = domain_.experts();
  last_oracle_calls_ = 0;
  last_threshold_ = 0;
  if (ranks <= 0 || masters <= 0 || domain_.slots_per_rank < 0 || loads.ranks != ranks ||
      loads.experts != experts ||
      loads.counts.size() != static_cast<size_t>(ranks) * static_cast<size_t>(experts)) {
    return ValidateLoads(domain_, loads);
  }
  // Expert totals, with a range check folded in: any negative count or one above 2^40
  // sets a bit at or above 40 in the OR of all counts.
  totals_.assign(static_cast<size_t>(experts), 0);
  uint64_t bits = 0;
  for (int s = 0; s < ranks; ++s) {
    const int64_t* row = loads.row(s);
    int64_t* totals = totals_.data();
    for (int e = 0; e < experts; ++e) {
      totals[e] += row[e];
      bits |= static_cast<uint64_t>(row[e]);
    }
  }
  if ((bits >> 40) != 0) {
    if (absl::Status status = ValidateLoads(domain_, loads); !status.ok()) return status;
  }
  home_loads_.assign(static_cast<size_t>(ranks), 0);
  int64_t total = 0;
  for (int e = 0; e < experts; ++e)
    home_loads_[static_cast<size_t>(e / masters)] += totals_[static_cast<size_t>(e)];
  int64_t max_load = 0;
  for (int r = 0; r < ranks; ++r) {
    total += home_loads_[static_cast<size_t>(r)];
    max_load = std::max(max_load, home_loads_[static_cast<size_t>(r)]);
  }

  const int64_t lower_bound = (total + ranks - 1) / ranks;
  const double mean = static_cast<double>(total) / ranks;
  int64_t first_try = static_cast<int64_t>(std::ceil(mean * (1.0 + std::max(options_.eps, 0.0))));
  first_try = std::max(first_try, lower_bound);
  best_exports_.clear();
  if (first_try < max_load && domain_.slots_per_rank > 0 && ranks > 1) {
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
  BuildPlan(loads, best_exports_, plan);
  return absl::OkStatus();
}

}  // namespace rackrun::planner
