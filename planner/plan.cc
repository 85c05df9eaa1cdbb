#include "planner/plan.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace rackrun::planner {

absl::Status Domain::Validate() const {
  if (ranks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("domain.ranks must be > 0, got ", ranks, "; give the number of ranks"));
  }
  if (masters_per_rank <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "domain.masters_per_rank must be > 0, got ", masters_per_rank,
        "; every rank is home of at least one expert (experts must divide evenly by ranks)"));
  }
  if (slots_per_rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat("domain.slots_per_rank must be >= 0, got ",
                                                   slots_per_rank, "; use 0 for no replicas"));
  }
  if (static_cast<int64_t>(ranks) * masters_per_rank > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "domain.ranks * domain.masters_per_rank = ", static_cast<int64_t>(ranks) * masters_per_rank,
        " experts is too large (limit 2^30)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateLoads(const Domain& domain, const LoadMatrix& loads) {
  if (absl::Status status = domain.Validate(); !status.ok()) return status;
  if (loads.ranks != domain.ranks) {
    return absl::InvalidArgumentError(absl::StrCat("loads.ranks is ", loads.ranks,
                                                   " but domain.ranks is ", domain.ranks,
                                                   "; the load matrix needs one row per rank"));
  }
  if (loads.experts != domain.experts()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loads.experts is ", loads.experts, " but the domain has ", domain.experts(),
        " experts (ranks * masters_per_rank); the load matrix needs one column per expert"));
  }
  const size_t expected = static_cast<size_t>(loads.ranks) * static_cast<size_t>(loads.experts);
  if (loads.counts.size() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("loads.counts has ", loads.counts.size(),
                     " entries, expected ranks * experts = ", expected));
  }
  for (size_t i = 0; i < loads.counts.size(); ++i) {
    if (loads.counts[i] < 0 || loads.counts[i] > (int64_t{1} << 40)) {
      return absl::InvalidArgumentError(
          absl::StrCat("loads[", i / static_cast<size_t>(loads.experts), "][",
                       i % static_cast<size_t>(loads.experts), "] = ", loads.counts[i],
                       " is out of range; token counts must be in [0, 2^40]"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidatedExpertTotals(const Domain& domain, const LoadMatrix& loads,
                                   std::vector<int64_t>* totals) {
  if (absl::Status status = domain.Validate(); !status.ok()) return status;
  const int ranks = domain.ranks;
  const int experts = domain.experts();
  if (loads.ranks != ranks || loads.experts != experts ||
      loads.counts.size() != static_cast<size_t>(ranks) * static_cast<size_t>(experts)) {
    return ValidateLoads(domain, loads);
  }
  // Any negative count or one of 2^40 or more sets a bit at or above 40 in the OR of all
  // counts; then ValidateLoads decides (2^40 itself is allowed). Sums are taken modulo 2^64
  // (unsigned), so bad counts cannot overflow; valid ones sum exactly (below 2^63).
  totals->resize(static_cast<size_t>(experts));
  uint64_t bits = 0;
  // (Reading an int64_t through uint64_t is allowed: the unsigned type of the same width.)
  uint64_t* __restrict sums = reinterpret_cast<uint64_t*>(totals->data());
  std::fill(sums, sums + experts, uint64_t{0});
  // Four rows per sweep of the totals: a quarter of the totals' loads and stores.
  int s = 0;
  for (; s + 4 <= ranks; s += 4) {
    const uint64_t* __restrict row0 = reinterpret_cast<const uint64_t*>(loads.row(s));
    const uint64_t* __restrict row1 = reinterpret_cast<const uint64_t*>(loads.row(s + 1));
    const uint64_t* __restrict row2 = reinterpret_cast<const uint64_t*>(loads.row(s + 2));
    const uint64_t* __restrict row3 = reinterpret_cast<const uint64_t*>(loads.row(s + 3));
    for (int e = 0; e < experts; ++e) {
      const uint64_t a = row0[e], b = row1[e], c = row2[e], d = row3[e];
      sums[e] += (a + b) + (c + d);
      bits |= a | b | c | d;
    }
  }
  for (; s < ranks; ++s) {
    const uint64_t* __restrict row = reinterpret_cast<const uint64_t*>(loads.row(s));
    for (int e = 0; e < experts; ++e) {
      sums[e] += row[e];
      bits |= row[e];
    }
  }
  if ((bits >> 40) != 0) return ValidateLoads(domain, loads);
  return absl::OkStatus();
}

std::vector<int64_t> LoadMatrix::ExpertTotals() const {
  std::vector<int64_t> totals(static_cast<size_t>(std::max(experts, 0)), 0);
  for (int src = 0; src < ranks; ++src) {
    const int64_t* r = row(src);
    for (int e = 0; e < experts; ++e) totals[static_cast<size_t>(e)] += r[e];
  }
  return totals;
}

int64_t LoadMatrix::Total() const {
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  return total;
}

std::vector<int64_t> HomeRankLoads(const Domain& domain, const LoadMatrix& loads) {
  std::vector<int64_t> rank_loads(static_cast<size_t>(std::max(domain.ranks, 0)), 0);
  if (domain.masters_per_rank <= 0) return rank_loads;
  const std::vector<int64_t> totals = loads.ExpertTotals();
  for (int e = 0; e < static_cast<int>(totals.size()); ++e) {
    const int home = domain.home_rank(e);
    if (home >= 0 && home < domain.ranks) rank_loads[static_cast<size_t>(home)] += totals[e];
  }
  return rank_loads;
}

std::vector<int64_t> Plan::RankLoads() const {
  std::vector<int64_t> rank_loads(static_cast<size_t>(std::max(ranks, 0)), 0);
  for (size_t i = 0; i < instances.size() && i < quota.size(); ++i) {
    const int r = instances[i].rank;
    if (r >= 0 && r < ranks) rank_loads[static_cast<size_t>(r)] += quota[i];
  }
  return rank_loads;
}

int Plan::num_replicas() const {
  int replicas = 0;
  for (const ExpertInstance& instance : instances) replicas += instance.master ? 0 : 1;
  return replicas;
}

int IndexSplitColumns(Plan* plan) {
  const size_t n = plan->instances.size();
  plan->split_column.resize(n);
  int columns = 0;
  for (int e = 0; e < plan->experts; ++e) {
    const int begin = plan->first[static_cast<size_t>(e)];
    const int end = plan->first[static_cast<size_t>(e) + 1];
    for (int i = begin; i < end; ++i) {
      plan->split_column[static_cast<size_t>(i)] = end - begin > 1 ? columns++ : -1;
    }
  }
  plan->split.resize(static_cast<size_t>(std::max(plan->ranks, 0)) * static_cast<size_t>(columns));
  return columns;
}

absl::Status ValidateSplitShape(const Plan& plan) {
  const size_t n = plan.instances.size();
  if (plan.ranks < 1 || plan.experts < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan.ranks = ", plan.ranks, ", plan.experts = ", plan.experts, "; both must be positive"));
  }
  if (plan.first.size() != static_cast<size_t>(plan.experts) + 1 || plan.first.front() != 0 ||
      plan.first.back() != static_cast<int64_t>(n)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan.first has ", plan.first.size(), " entries; it needs experts + 1 = ", plan.experts + 1,
        " running from 0 to instances.size() = ", n));
  }
  if (plan.split_column.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan.split_column has ", plan.split_column.size(), " entries for ", n, " instances"));
  }
  for (int e = 0; e < plan.experts; ++e) {
    const int begin = plan.first[static_cast<size_t>(e)];
    const int end = plan.first[static_cast<size_t>(e) + 1];
    if (begin > end) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan.first is not ascending at expert ", e, " (", begin, " > ", end, ")"));
    }
  }
  int64_t columns = 0;
  for (int e = 0; e < plan.experts; ++e) {
    const int begin = plan.first[static_cast<size_t>(e)];
    const int end = plan.first[static_cast<size_t>(e) + 1];
    for (int i = begin; i < end; ++i) {
      const int64_t want = end - begin > 1 ? columns++ : -1;
      if (plan.split_column[static_cast<size_t>(i)] != want) {
        return absl::InvalidArgumentError(
            absl::StrCat("plan.split_column[", i, "] = ", plan.split_column[static_cast<size_t>(i)],
                         " but expert ", e, " with ", end - begin, " instance(s) gives ", want,
                         " (columns follow the instances of replicated experts, -1 otherwise)"));
      }
    }
  }
  if (static_cast<int64_t>(plan.split.size()) != columns * plan.ranks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan.split has ", plan.split.size(), " entries; it needs ranks x columns = ", plan.ranks,
        " x ", columns, " (one column per instance of a replicated expert)"));
  }
  return absl::OkStatus();
}

std::vector<int64_t> DenseSplit(const Plan& plan, const LoadMatrix& loads) {
  const size_t n = plan.instances.size();
  std::vector<int64_t> dense(static_cast<size_t>(std::max(plan.ranks, 0)) * n, 0);
  for (int src = 0; src < plan.ranks; ++src) {
    for (size_t i = 0; i < n; ++i) {
      dense[static_cast<size_t>(src) * n + i] = plan.split_at(loads, src, static_cast<int>(i));
    }
  }
  return dense;
}

uint64_t PlanFingerprint(const Plan& plan, uint64_t seed) {
  uint64_t h = seed;
  const auto mix = [&h](int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint64_t>(v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ULL;
    }
  };
  mix(plan.ranks);
  mix(plan.experts);
  mix(static_cast<int64_t>(plan.instances.size()));
  for (const ExpertInstance& i : plan.instances) {
    mix(i.expert);
    mix(i.rank);
    mix(i.master ? 1 : 0);
  }
  for (const int32_t f : plan.first) mix(f);
  for (const int64_t q : plan.quota) mix(q);
  mix(static_cast<int64_t>(plan.split_column.size()));
  for (const int32_t c : plan.split_column) mix(c);
  mix(static_cast<int64_t>(plan.split.size()));
  for (const int64_t v : plan.split) mix(v);
  mix(static_cast<int64_t>(plan.fanout.transfers.size()));
  for (const WeightTransfer& t : plan.fanout.transfers) {
    mix(t.expert);
    mix(t.src_rank);
    mix(t.dst_rank);
    mix(t.stage);
  }
  return h;
}

double Imbalance(const std::vector<int64_t>& rank_loads) {
  if (rank_loads.empty()) return 1.0;
  int64_t total = 0;
  int64_t max_load = 0;
  for (int64_t load : rank_loads) {
    total += load;
    max_load = std::max(max_load, load);
  }
  if (total <= 0) return 1.0;
  const double mean = static_cast<double>(total) / static_cast<double>(rank_loads.size());
  return static_cast<double>(max_load) / mean;
}

}  // namespace rackrun::planner
