#include "planner/fanout.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "planner/plan.h"

namespace rackrun::planner {

int FanoutScheduler::RelaysFor(int destinations) const {
  if (options_.mode != FanoutMode::kRelay) return 0;
  const int n = destinations;
  if (n < std::max(options_.min_destinations_for_relay, 2)) return 0;
  int r = static_cast<int>(std::sqrt(static_cast<double>(n)));
  // Guard the floating-point square root against off-by-one at perfect squares.
  while (static_cast<int64_t>(r + 1) * (r + 1) <= n) ++r;
  while (r > 0 && static_cast<int64_t>(r) * r > n) --r;
  r = std::min({r, options_.max_relays, n - 1});
  if (r <= 0) return 0;
  const int leaves_per_relay = (n - r + r - 1) / r;
  const int gain = n - std::max(r, leaves_per_relay);
  return gain >= options_.min_gain ? r : 0;
}

void FanoutScheduler::Schedule(const Plan& plan, FanoutSchedule* schedule) {
  std::vector<WeightTransfer>& out = schedule->transfers;
  out.clear();
  const int experts = plan.experts;
  if (static_cast<int>(plan.first.size()) != experts + 1) return;
  sends_.assign(static_cast<size_t>(std::max(plan.ranks, 0)), 0);
  relaying_.assign(static_cast<size_t>(std::max(plan.ranks, 0)), 0);
  order_.clear();
  for (int e = 0; e < experts; ++e) {
    if (plan.first[e + 1] - plan.first[e] > 1) order_.push_back(e);
  }
  if (order_.empty()) return;
  std::sort(order_.begin(), order_.end(), [&plan](int32_t a, int32_t b) {
    const int na = plan.first[a + 1] - plan.first[a];
    const int nb = plan.first[b + 1] - plan.first[b];
    return na != nb ? na > nb : a < b;
  });
  for (const int32_t e : order_) {
    const int begin = plan.first[e];
    const int end = plan.first[e + 1];
    const int32_t source = plan.instances[static_cast<size_t>(begin)].rank;
    dests_.clear();
    for (int i = begin + 1; i < end; ++i)
      dests_.push_back(plan.instances[static_cast<size_t>(i)].rank);
    const int n = static_cast<int>(dests_.size());
    const int r = RelaysFor(n);
    if (r == 0) {
      for (const int32_t d : dests_) out.push_back(WeightTransfer{e, source, d, 0});
      sends_[static_cast<size_t>(source)] += n;
      continue;
    }
    // Relays: destinations not yet relaying first, then lowest projected sends, then id.
    std::sort(dests_.begin(), dests_.end(), [this](int32_t a, int32_t b) {
      const uint8_t ra = relaying_[static_cast<size_t>(a)];
      const uint8_t rb = relaying_[static_cast<size_t>(b)];
      if (ra != rb) return ra < rb;
      const int32_t sa = sends_[static_cast<size_t>(a)];
      const int32_t sb = sends_[static_cast<size_t>(b)];
      return sa != sb ? sa < sb : a < b;
    });
    // dests_[0, r) are the relays in chosen order; the leaves go in ascending rank.
    std::sort(dests_.begin() + r, dests_.end());
    for (int j = 0; j < r; ++j) {
      const int32_t relay = dests_[static_cast<size_t>(j)];
      relaying_[static_cast<size_t>(relay)] = 1;
      out.push_back(WeightTransfer{e, source, relay, 0});
    }
    sends_[static_cast<size_t>(source)] += r;
    for (int leaf = r; leaf < n; ++leaf) {
      int pick = 0;
      if (leaf - r < r) {
        pick = leaf - r;  // the first r leaves go one per relay
      } else {
        for (int j = 1; j < r; ++j) {
          if (sends_[static_cast<size_t>(dests_[static_cast<size_t>(j)])] <
              sends_[static_cast<size_t>(dests_[static_cast<size_t>(pick)])]) {
            pick = j;
          }
        }
      }
      const int32_t relay = dests_[static_cast<size_t>(pick)];
      ++sends_[static_cast<size_t>(relay)];
      out.push_back(WeightTransfer{e, relay, dests_[static_cast<size_t>(leaf)], 1});
    }
  }
}

FanoutSchedule PlanFanout(const Plan& plan, const FanoutOptions& options) {
  FanoutSchedule schedule;
  FanoutScheduler(options).Schedule(plan, &schedule);
  return schedule;
}

FanoutCost EstimateFanout(const FanoutSchedule& schedule, int ranks, int64_t expert_bytes,
                          const FanoutCostModel& model) {
  FanoutCost cost;
  const auto& transfers = schedule.transfers;
  const int num_transfers = static_cast<int>(transfers.size());
  if (num_transfers == 0 || expert_bytes <= 0 || ranks <= 0) return cost;

  std::vector<int64_t> sent_per_rank(static_cast<size_t>(ranks), 0);
  for (const WeightTransfer& t : transfers) {
    if (t.src_rank >= 0 && t.src_rank < ranks) ++sent_per_rank[static_cast<size_t>(t.src_rank)];
  }
  cost.bytes = static_cast<int64_t>(num_transfers) * expert_bytes;
  cost.max_rank_bytes =
      *std::max_element(sent_per_rank.begin(), sent_per_rank.end()) * expert_bytes;
  if (model.egress_bytes_per_s <= 0) {
    cost.seconds = std::numeric_limits<double>::infinity();
    return cost;
  }

  const int64_t chunk_bytes = model.chunk_bytes > 0 ? model.chunk_bytes : expert_bytes;
  const int chunks = static_cast<int>((expert_bytes + chunk_bytes - 1) / chunk_bytes);
  const int64_t last_chunk = expert_bytes - static_cast<int64_t>(chunks - 1) * chunk_bytes;

  // A transfer forwarded by a relay waits, chunk by chunk, for the transfer that brought
  // the same expert to that relay.
  constexpr double kNever = std::numeric_limits<double>::infinity();
  // -1: the sender has the weights; -2: a forward whose relay never receives the expert.
  std::vector<int> depends_on(static_cast<size_t>(num_transfers), -1);
  for (int t = 0; t < num_transfers; ++t) {
    const WeightTransfer& tr = transfers[static_cast<size_t>(t)];
    if (tr.stage == 0) continue;
    depends_on[static_cast<size_t>(t)] = -2;
    for (int u = 0; u < num_transfers; ++u) {
      const WeightTransfer& in = transfers[static_cast<size_t>(u)];
      if (u != t && in.expert == tr.expert && in.dst_rank == tr.src_rank) {
        depends_on[static_cast<size_t>(t)] = u;
        break;
      }
    }
  }

  std::vector<double> arrival(static_cast<size_t>(num_transfers) * chunks, kNever);
  std::vector<int> next_chunk(static_cast<size_t>(num_transfers), 0);
  std::vector<double> free_at(static_cast<size_t>(ranks), 0.0);
  std::vector<std::vector<int>> by_rank(static_cast<size_t>(ranks));
  for (int t = 0; t < num_transfers; ++t) {
    const int src = transfers[static_cast<size_t>(t)].src_rank;
    if (src >= 0 && src < ranks) by_rank[static_cast<size_t>(src)].push_back(t);
  }
  auto ready_time = [&](int t) {
    const int c = next_chunk[static_cast<size_t>(t)];
    const int dep = depends_on[static_cast<size_t>(t)];
    if (dep == -2) return kNever;
    return dep < 0 ? 0.0 : arrival[static_cast<size_t>(dep) * chunks + c];
  };

  // Event simulation in global time order: the rank whose next send can start earliest
  // sends one chunk; among its jobs ready by then it takes the lowest chunk index, then
  // the earliest transfer (round-robin over its transfers, chunk by chunk).
  int64_t remaining = static_cast<int64_t>(num_transfers) * chunks;
  double finish = 0;
  while (remaining > 0) {
    int best_rank = -1;
    double best_start = kNever;
    for (int r = 0; r < ranks; ++r) {
      double earliest = kNever;
      for (const int t : by_rank[static_cast<size_t>(r)]) {
        if (next_chunk[static_cast<size_t>(t)] < chunks)
          earliest = std::min(earliest, ready_time(t));
      }
      if (earliest == kNever) continue;
      const double start = std::max(free_at[static_cast<size_t>(r)], earliest);
      if (start < best_start) {
        best_start = start;
        best_rank = r;
      }
    }
    if (best_rank < 0) {
      cost.seconds = kNever;  // a forwarded transfer whose relay never receives the expert
      return cost;
    }
    int job = -1;
    for (const int t : by_rank[static_cast<size_t>(best_rank)]) {
      const int c = next_chunk[static_cast<size_t>(t)];
      if (c >= chunks || ready_time(t) > best_start) continue;
      if (job < 0 || c < next_chunk[static_cast<size_t>(job)]) job = t;
    }
    const int c = next_chunk[static_cast<size_t>(job)]++;
    const double bytes = static_cast<double>(c == chunks - 1 ? last_chunk : chunk_bytes);
    const double done = best_start + bytes / model.egress_bytes_per_s;
    free_at[static_cast<size_t>(best_rank)] = done;
    const double arrive = done + model.latency_s;
    arrival[static_cast<size_t>(job) * chunks + c] = arrive;
    finish = std::max(finish, arrive);
    --remaining;
  }
  cost.seconds = finish;
  return cost;
}

}  // namespace rackrun::planner
