#include "planner/eplb_planner.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <numeric>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "planner/plan.h"

namespace rackrun::planner {

EplbPlacement EplbRebalance(const std::vector<float>& weight, int num_physical, int num_gpus) {
  const int num_log = static_cast<int>(weight.size());
  EplbPlacement out;
  if (num_log == 0 || num_gpus <= 0 || num_physical < num_log || num_physical % num_gpus != 0) {
    return out;
  }

  // replicate_experts: physical experts 0..num_log-1 are the logical experts themselves;
  // each further one copies argmax(weight / count), first maximal index on ties.
  std::vector<int32_t> phy_to_log(static_cast<size_t>(num_physical));
  std::vector<int32_t> phy_rank(static_cast<size_t>(num_physical), 0);
  std::vector<int32_t> count(static_cast<size_t>(num_log), 1);
  for (int p = 0; p < num_log; ++p) phy_to_log[static_cast<size_t>(p)] = p;
  for (int p = num_log; p < num_physical; ++p) {
    int best = 0;
    float best_value = weight[0] / static_cast<float>(count[0]);
    for (int e = 1; e < num_log; ++e) {
      const float value =
          weight[static_cast<size_t>(e)] / static_cast<float>(count[static_cast<size_t>(e)]);
      if (value > best_value) {
        best_value = value;
        best = e;
      }
    }
    phy_to_log[static_cast<size_t>(p)] = best;
    phy_rank[static_cast<size_t>(p)] = count[static_cast<size_t>(best)]++;
  }

  // balanced_packing of the physical experts onto GPUs.
  const int per_gpu = num_physical / num_gpus;
  std::vector<int32_t> slot_of(static_cast<size_t>(num_physical));  // phy -> packed index
  if (per_gpu == 1) {
    std::iota(slot_of.begin(), slot_of.end(), 0);
  } else {
    std::vector<float> phy_weight(static_cast<size_t>(num_physical));
    for (int p = 0; p < num_physical; ++p) {
      const int e = phy_to_log[static_cast<size_t>(p)];
      phy_weight[static_cast<size_t>(p)] =
          weight[static_cast<size_t>(e)] / static_cast<float>(count[static_cast<size_t>(e)]);
    }
    // eplb.py sorts with torch's default (unstable) sort, which on CPU is libstdc++'s
    // std::sort over (value, index) pairs starting in index order with a descending
    // comparison of the values alone. std::sort's permutation depends only on the
    // comparison outcomes, so the same call here reproduces torch's order of equal weights.
    std::vector<std::pair<float, int32_t>> order(static_cast<size_t>(num_physical));
    for (int p = 0; p < num_physical; ++p) {
      order[static_cast<size_t>(p)] = {phy_weight[static_cast<size_t>(p)], p};
    }
    std::sort(order.begin(), order.end(),
              [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
                return a.first > b.first;
              });
    std::vector<float> pack_weight(static_cast<size_t>(num_gpus), 0.0f);
    std::vector<int32_t> pack_items(static_cast<size_t>(num_gpus), 0);
    for (const auto& item : order) {
      const int32_t p = item.second;
      int pack = -1;
      for (int g = 0; g < num_gpus; ++g) {
        if (pack_items[static_cast<size_t>(g)] >= per_gpu) continue;
        if (pack < 0 ||
            pack_weight[static_cast<size_t>(g)] < pack_weight[static_cast<size_t>(pack)])
          pack = g;
      }
      slot_of[static_cast<size_t>(p)] = pack * per_gpu + pack_items[static_cast<size_t>(pack)];
      pack_weight[static_cast<size_t>(pack)] += phy_weight[static_cast<size_t>(p)];
      ++pack_items[static_cast<size_t>(pack)];
    }
  }
  out.phy_to_log.resize(static_cast<size_t>(num_physical));
  out.phy_rank.resize(static_cast<size_t>(num_physical));
  for (int p = 0; p < num_physical; ++p) {
    const size_t slot = static_cast<size_t>(slot_of[static_cast<size_t>(p)]);
    out.phy_to_log[slot] = phy_to_log[static_cast<size_t>(p)];
    out.phy_rank[slot] = phy_rank[static_cast<size_t>(p)];
  }
  out.log_count = std::move(count);
  return out;
}

namespace {

// The home placement in eplb.py's terms: rank r's physical experts are its masters, its
// redundant slots hold nothing (-1).
EplbPlacement HomePlacement(const Domain& domain) {
  EplbPlacement home;
  const int per_rank = domain.capacity_per_rank();
  home.phy_to_log.assign(static_cast<size_t>(domain.ranks) * per_rank, -1);
  home.phy_rank.assign(home.phy_to_log.size(), 0);
  home.log_count.assign(static_cast<size_t>(domain.experts()), 1);
  for (int e = 0; e < domain.experts(); ++e) {
    const int r = domain.home_rank(e);
    home.phy_to_log[static_cast<size_t>(r) * per_rank + (e - r * domain.masters_per_rank)] = e;
  }
  return home;
}

// Sorted, de-duplicated (expert, rank) pairs of a placement.
std::vector<std::pair<int32_t, int32_t>> Instances(const EplbPlacement& placement, int per_rank) {
  std::vector<std::pair<int32_t, int32_t>> pairs;
  for (size_t p = 0; p < placement.phy_to_log.size(); ++p) {
    if (placement.phy_to_log[p] < 0) continue;
    pairs.emplace_back(placement.phy_to_log[p],
                       static_cast<int32_t>(p / static_cast<size_t>(per_rank)));
  }
  std::sort(pairs.begin(), pairs.end());
  pairs.erase(std::unique(pairs.begin(), pairs.end()), pairs.end());
  return pairs;
}

}  // namespace

EplbPlanner::EplbPlanner(const Domain& domain, const PlannerOptions& options)
    : domain_(domain),
      options_(options),
      fanout_(options.fanout),
      split_(options.locality_aware_split, options.split_rounding) {}

EplbPlanner::LayerState& EplbPlanner::StateFor(int layer) {
  auto [it, inserted] = layers_.try_emplace(layer);
  LayerState& state = it->second;
  if (inserted) {
    const int window = std::max(options_.eplb_window, 1);
    state.window.assign(static_cast<size_t>(window) * domain_.experts(), 0);
    state.window_sum.assign(static_cast<size_t>(domain_.experts()), 0);
    state.placement = HomePlacement(domain_);
  }
  return state;
}

namespace {

constexpr int64_t kStateMagic = 0x4550'4c42'5354'0001LL;  // "EPLBST", version 1

void Put(std::string& out, int64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); }
template <typename T>
void PutVector(std::string& out, const std::vector<T>& v) {
  Put(out, static_cast<int64_t>(v.size()));
  for (const T x : v) Put(out, static_cast<int64_t>(x));
}

// Reads int64 fields back; any overrun or impossible size marks the reader bad.
class StateReader {
 public:
  explicit StateReader(std::string_view bytes) : bytes_(bytes) {}
  int64_t Get() {
    int64_t v = 0;
    if (bytes_.size() - pos_ < sizeof(v) || pos_ > bytes_.size()) {
      ok_ = false;
      return 0;
    }
    std::memcpy(&v, bytes_.data() + pos_, sizeof(v));
    pos_ += sizeof(v);
    return v;
  }
  template <typename T>
  std::vector<T> GetVector(int64_t max_size) {
    const int64_t n = Get();
    if (n < 0 || n > max_size) {
      ok_ = false;
      return {};
    }
    std::vector<T> v(static_cast<size_t>(n));
    for (T& x : v) x = static_cast<T>(Get());
    return v;
  }
  bool ok() const { return ok_ && pos_ == bytes_.size(); }
  bool good() const { return ok_; }

 private:
  std::string_view bytes_;
  size_t pos_ = 0;
  bool ok_ = true;
};

}  // namespace

std::string EplbPlanner::SaveState() const {
  std::string out;
  for (const int64_t v :
       {kStateMagic, static_cast<int64_t>(domain_.ranks),
        static_cast<int64_t>(domain_.masters_per_rank),
        static_cast<int64_t>(domain_.slots_per_rank), static_cast<int64_t>(options_.eplb_window),
        static_cast<int64_t>(options_.eplb_interval), static_cast<int64_t>(layers_.size())}) {
    Put(out, v);
  }
  for (const auto& [layer, state] : layers_) {
    Put(out, layer);
    Put(out, state.microbatch);
    Put(out, state.window_count);
    PutVector(out, state.window);
    PutVector(out, state.window_sum);
    PutVector(out, state.placement.phy_to_log);
    PutVector(out, state.placement.phy_rank);
    PutVector(out, state.placement.log_count);
  }
  return out;
}

absl::Status EplbPlanner::RestoreState(std::string_view bytes) {
  StateReader in(bytes);
  const int64_t header[] = {in.Get(), in.Get(), in.Get(), in.Get(), in.Get(), in.Get()};
  const int64_t layers = in.Get();
  if (!in.good() || header[0] != kStateMagic) {
    return absl::DataLossError("eplb planner state: not an eplb state (bad magic or truncated)");
  }
  const int64_t mine[] = {
      kStateMagic,          domain_.ranks,         domain_.masters_per_rank, domain_.slots_per_rank,
      options_.eplb_window, options_.eplb_interval};
  if (!std::equal(std::begin(header), std::end(header), std::begin(mine))) {
    return absl::FailedPreconditionError(absl::StrCat(
        "eplb planner state was saved for ", header[1], " ranks x ", header[2], " masters + ",
        header[3], " slots, window ", header[4], ", interval ", header[5], "; this planner has ",
        domain_.ranks, " x ", domain_.masters_per_rank, " + ", domain_.slots_per_rank, ", window ",
        options_.eplb_window, ", interval ", options_.eplb_interval));
  }
  const int64_t experts = domain_.experts();
  const int64_t physical = static_cast<int64_t>(domain_.ranks) * domain_.capacity_per_rank();
  std::map<int, LayerState> restored;
  for (int64_t i = 0; i < layers && in.good(); ++i) {
    const int layer = static_cast<int>(in.Get());
    LayerState s;
    s.microbatch = in.Get();
    s.window_count = in.Get();
    s.window = in.GetVector<int64_t>(static_cast<int64_t>(options_.eplb_window) * experts);
    s.window_sum = in.GetVector<int64_t>(experts);
    s.placement.phy_to_log = in.GetVector<int32_t>(physical);
    s.placement.phy_rank = in.GetVector<int32_t>(physical);
    s.placement.log_count = in.GetVector<int32_t>(experts);
    if (s.window.size() != static_cast<size_t>(options_.eplb_window * experts) ||
        s.window_sum.size() != static_cast<size_t>(experts) ||
        s.placement.log_count.size() != static_cast<size_t>(experts) || s.window_count < 0 ||
        s.window_count > options_.eplb_window || s.microbatch < 0) {
      return absl::DataLossError(
          absl::StrCat("eplb planner state: layer ", layer, " has inconsistent sizes"));
    }
    restored[layer] = std::move(s);
  }
  if (!in.ok()) return absl::DataLossError("eplb planner state: truncated or trailing bytes");
  layers_ = std::move(restored);
  return absl::OkStatus();
}

absl::StatusOr<Plan> EplbPlanner::Solve(const LoadMatrix& loads, int layer) {
  Plan plan;
  if (absl::Status status = SolveInto(loads, layer, &plan); !status.ok()) return status;
  return plan;
}

absl::Status EplbPlanner::SolveInto(const LoadMatrix& loads, int layer, Plan* plan) {
  if (absl::Status status = ValidateLoads(domain_, loads); !status.ok()) return status;
  const int experts = domain_.experts();
  const int window = std::max(options_.eplb_window, 1);
  const int interval = std::max(options_.eplb_interval, 1);
  LayerState& state = StateFor(layer);

  last_replacement_bytes_ = 0;
  last_replanned_ = false;
  if (state.window_count > 0 && (state.microbatch - 1) % interval == 0) {
    std::vector<float> weight(static_cast<size_t>(experts));
    for (int e = 0; e < experts; ++e) {
      weight[static_cast<size_t>(e)] =
          static_cast<float>(static_cast<double>(state.window_sum[static_cast<size_t>(e)]) /
                             static_cast<double>(state.window_count));
    }
    EplbPlacement next =
        EplbRebalance(weight, domain_.ranks * domain_.capacity_per_rank(), domain_.ranks);
    const int per_rank = domain_.capacity_per_rank();
    const auto before = Instances(state.placement, per_rank);
    const auto after = Instances(next, per_rank);
    int64_t moved = 0;
    for (const auto& instance : after) {
      if (!std::binary_search(before.begin(), before.end(), instance)) ++moved;
    }
    last_replacement_bytes_ = moved * options_.expert_bytes;
    last_replanned_ = true;
    state.placement = std::move(next);
  }
  BuildPlan(loads, state.placement, plan);

  // The current loads join the history only now: EPLB plans from the past.
  totals_ = loads.ExpertTotals();
  int64_t* slot = state.window.data() + static_cast<size_t>(state.microbatch % window) * experts;
  if (state.window_count == window) {
    for (int e = 0; e < experts; ++e) state.window_sum[static_cast<size_t>(e)] -= slot[e];
  } else {
    ++state.window_count;
  }
  for (int e = 0; e < experts; ++e) {
    slot[e] = totals_[static_cast<size_t>(e)];
    state.window_sum[static_cast<size_t>(e)] += slot[e];
  }
  ++state.microbatch;
  return absl::OkStatus();
}

void EplbPlanner::BuildPlan(const LoadMatrix& loads, const EplbPlacement& placement, Plan* plan) {
  const int experts = domain_.experts();
  const int per_rank = domain_.capacity_per_rank();
  totals_ = loads.ExpertTotals();
  plan->ranks = domain_.ranks;
  plan->experts = experts;
  plan->instances.clear();
  plan->quota.clear();
  plan->first.assign(static_cast<size_t>(experts) + 1, 0);

  // Physical experts of each logical expert, in replica-rank order.
  std::vector<std::vector<std::pair<int32_t, int32_t>>> by_expert(static_cast<size_t>(experts));
  for (size_t p = 0; p < placement.phy_to_log.size(); ++p) {
    const int e = placement.phy_to_log[p];
    if (e < 0) continue;
    by_expert[static_cast<size_t>(e)].emplace_back(
        placement.phy_rank[p], static_cast<int32_t>(p / static_cast<size_t>(per_rank)));
  }
  for (int e = 0; e < experts; ++e) {
    auto& replicas = by_expert[static_cast<size_t>(e)];
    std::sort(replicas.begin(), replicas.end());
    const int64_t total = totals_[static_cast<size_t>(e)];
    const int64_t count = static_cast<int64_t>(replicas.size());
    const size_t begin = plan->instances.size();
    // The instance with replica 0 is the master; the others follow in ascending rank, a
    // rank holding several replicas of e carrying all their shares.
    for (int64_t j = 0; j < count; ++j) {
      const int32_t rank = replicas[static_cast<size_t>(j)].second;
      const int64_t share = total / count + (j < total % count ? 1 : 0);
      size_t at = plan->instances.size();
      for (size_t i = begin; i < plan->instances.size(); ++i) {
        if (plan->instances[i].rank == rank) at = i;
      }
      if (at == plan->instances.size()) {
        plan->instances.push_back(ExpertInstance{e, rank, j == 0});
        plan->quota.push_back(share);
      } else {
        plan->quota[at] += share;
      }
    }
    // Replicas (everything after the master) in ascending rank.
    for (size_t i = begin + 2; i < plan->instances.size(); ++i) {
      for (size_t k = i; k > begin + 1 && plan->instances[k - 1].rank > plan->instances[k].rank;
           --k) {
        std::swap(plan->instances[k - 1], plan->instances[k]);
        std::swap(plan->quota[k - 1], plan->quota[k]);
      }
    }
    plan->first[static_cast<size_t>(e) + 1] = static_cast<int32_t>(plan->instances.size());
  }
  split_.Fill(loads, plan);
  fanout_.Schedule(*plan, &plan->fanout);
}

}  // namespace rackrun::planner
