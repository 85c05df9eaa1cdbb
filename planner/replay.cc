#include "planner/replay.h"

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "planner/fanout.h"
#include "planner/invariants.h"

namespace rackrun::planner {

struct Replay::Run {
  const PolicyTraits* traits = nullptr;
  std::unique_ptr<Planner> planner;
  std::map<int, Plan> plans;  // one reusable Plan per layer
};

Replay::Replay(ReplayOptions options) : options_(std::move(options)) {
  direct_.mode = FanoutMode::kDirect;
  relay_.mode = FanoutMode::kRelay;
}

Replay::~Replay() = default;
Replay::Replay(Replay&&) noexcept = default;
Replay& Replay::operator=(Replay&&) noexcept = default;

absl::Status Replay::Start(const TraceEntry& entry) {
  started_ = true;
  domain_.ranks = entry.loads.ranks;
  domain_.masters_per_rank = entry.loads.experts / entry.loads.ranks;
  domain_.slots_per_rank = options_.slots;
  if (absl::Status s = domain_.Validate(); !s.ok()) return s;
  for (const std::string& name : options_.policies) {
    absl::StatusOr<std::unique_ptr<Planner>> planner = MakePlanner(name, domain_, options_.planner);
    if (!planner.ok()) return planner.status();
    Run run;
    run.traits = FindPolicy(name);
    if (run.traits == nullptr) {
      return absl::InternalError(absl::StrCat("policy '", name, "' has a planner but no traits"));
    }
    run.planner = *std::move(planner);
    runs_.push_back(std::move(run));
    PolicyReplay result;
    result.policy = name;
    results_.push_back(std::move(result));
  }
  return absl::OkStatus();
}

absl::Status Replay::Add(const TraceEntry& entry) {
  if (!started_) {
    if (absl::Status s = Start(entry); !s.ok()) return s;
  }
  const LoadMatrix& loads = entry.loads;
  microbatches_.insert(entry.microbatch);
  const bool measured = static_cast<int64_t>(microbatches_.size()) > options_.warmup;
  if (measured) {
    ++entries_;
    measured_microbatches_.insert(entry.microbatch);
    layers_.insert(entry.layer);
  }
  const HardwareModel& hw = options_.hardware;
  const int64_t expert_bytes = options_.planner.expert_bytes;
  const double before = Imbalance(HomeRankLoads(domain_, loads));
  const LayerTime ideal = SimulateForceBalanced(loads, hw);
  last_.measured = measured;
  last_.ideal = ideal;
  last_.policies.assign(runs_.size(), LayerTime{});

  for (size_t i = 0; i < runs_.size(); ++i) {
    Run& run = runs_[i];
    PolicyReplay& r = results_[i];
    Plan& plan = run.plans[entry.layer];
    const auto start = std::chrono::steady_clock::now();
    absl::Status solved = run.planner->SolveInto(loads, entry.layer, &plan);
    const auto stop = std::chrono::steady_clock::now();
    const std::string where = absl::StrCat("policy ", r.policy, ", microbatch ", entry.microbatch,
                                           ", layer ", entry.layer);
    if (!solved.ok())
      return absl::Status(solved.code(), absl::StrCat(where, ": ", solved.message()));
    if (absl::Status ok = CheckPlanInvariants(domain_, loads, plan, run.traits->invariants());
        !ok.ok()) {
      return absl::Status(ok.code(),
                          absl::StrCat(where, ": plan violates an invariant: ", ok.message()));
    }
    r.solve_us.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
    r.plan_hash = PlanFingerprint(plan, r.plan_hash);
    if (!measured) continue;
    r.before.push_back(before);
    r.after.push_back(Imbalance(plan.RankLoads()));
    r.replicas.push_back(plan.num_replicas());

    // Weights moved now: replicas that are not resident are fanned out for this plan.
    const bool fans_out = !run.traits->resident_replicas;
    FanoutCost relay;
    if (fans_out && plan.num_replicas() > 0) {
      const FanoutCost direct =
          EstimateFanout(PlanFanout(plan, direct_), domain_.ranks, expert_bytes, hw.fanout);
      relay = EstimateFanout(PlanFanout(plan, relay_), domain_.ranks, expert_bytes, hw.fanout);
      r.fanout_bytes.push_back(static_cast<double>(direct.bytes));
      r.direct_ms.push_back(direct.seconds * 1e3);
      r.relay_ms.push_back(relay.seconds * 1e3);
    } else {
      r.fanout_bytes.push_back(0);
      r.direct_ms.push_back(0);
      r.relay_ms.push_back(0);
    }
    const int64_t replaced = run.planner->last_replacement_bytes();
    r.replacement_bytes += replaced;
    const LayerTime t =
        SimulateLayer(plan, loads, hw, run.traits->bound || !fans_out ? FanoutCost{} : relay,
                      options_.replacement_exposed ? replaced : 0);
    last_.policies[i] = t;
    r.layer_s += t.total_s;
    r.parts.dispatch_s += t.dispatch_s;
    r.parts.exposed_fanout_s += t.exposed_fanout_s;
    r.parts.compute_s += t.compute_s;
    r.parts.combine_s += t.combine_s;
    r.parts.replacement_s += t.replacement_s;
    r.ideal_s += ideal.total_s;
    r.percent.push_back(PercentOfIdeal(ideal, t));
  }
  return absl::OkStatus();
}

}  // namespace rackrun::planner
