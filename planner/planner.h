// The policy interface: every balancing policy (ultraep, greedy, eplb, none, ideal) turns the
// exact loads of one (microbatch, layer) into a Plan through this interface.
#ifndef RACKRUN_PLANNER_PLANNER_H_
#define RACKRUN_PLANNER_PLANNER_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/statusor.h"
#include "planner/fanout.h"
#include "planner/invariants.h"
#include "planner/plan.h"

namespace rackrun::planner {

// How the proportional part of a per-source split is rounded to whole tokens (both keep
// every (src, e) row and every instance's column exact; see QuotaSplit).
enum class SplitRounding {
  kLargestRemainder,  // docs/design.md 3.6: leftover tokens to the largest remainders
  kCumulative,        // floor of cumulative shares: no selection, about half the work
};

// Knobs of all policies. Fields a policy does not use are ignored by it.
struct PlannerOptions {
  // ultraep
  double eps = 0.01;                 // relative precision of the threshold search
  int64_t min_replica_tokens = 1;    // exports below this are skipped (floor lowered per expert)
  bool locality_aware_split = true;  // a source's tokens go to its local instance first
  SplitRounding split_rounding = SplitRounding::kLargestRemainder;
  bool allow_zero_master_quota = false;
  // Spend the slots the threshold search left free with greedy moves, and keep the better
  // of that and the greedy policy's plan (QuotaPlanner's header). Off: the search alone (3.2).
  bool refine = true;
  // eplb
  int eplb_window = 100;   // W: moving-average window, in microbatches
  int eplb_interval = 10;  // K: replan every K microbatches
  // Size of one expert's weights, for fan-out and re-placement byte counts.
  int64_t expert_bytes = 0;
  // How Plan::fanout is built (all policies with replicas).
  FanoutOptions fanout;
};

class Planner {
 public:
  virtual ~Planner() = default;
  virtual std::string_view name() const = 0;

  // Plans one (microbatch, layer). `loads` are this microbatch's exact loads. Policies
  // that plan from history (eplb) see the loads only after planning, to update it; they
  // keep separate history per `layer`. Returns InvalidArgument if `loads` does not match
  // the domain.
  virtual absl::StatusOr<Plan> Solve(const LoadMatrix& loads, int layer) = 0;

  // Same as Solve, but overwrites `*plan` and reuses its buffers, so a caller that keeps
  // one Plan per layer does not allocate per microbatch. On error `*plan` is unspecified.
  // The default calls Solve; the library's policies implement it directly.
  virtual absl::Status SolveInto(const LoadMatrix& loads, int layer, Plan* plan) {
    absl::StatusOr<Plan> solved = Solve(loads, layer);
    if (!solved.ok()) return solved.status();
    *plan = *std::move(solved);
    return absl::OkStatus();
  }

  // Bytes of expert weights the last Solve moved beyond the fan-out to replicas (eplb's
  // re-placement of masters); 0 for policies that keep masters home.
  virtual int64_t last_replacement_bytes() const { return 0; }

  // State carried from one microbatch to the next (eplb's load history and placement),
  // as bytes for checkpoints: a planner restored from it plans the following microbatches
  // exactly as the saved one would. Empty for policies that plan from the current loads
  // only. RestoreState accepts what SaveState of the same policy returned; a state saved
  // for another domain or other settings is FailedPrecondition (the planner is then
  // unchanged), malformed bytes DataLoss.
  virtual std::string SaveState() const { return {}; }
  virtual absl::Status RestoreState(std::string_view state);
};

// A job plans training and evaluation microbatches with two planners of one policy, so
// that evaluations never move the training history (runtime/plan_source.h, the
// coordinator's planning). A checkpoint holds both histories as one payload:
// SavePlannerStates returns the training planner's state alone while the evaluation
// planner's is empty (so payloads written before evaluation histories were kept read the
// same), and both framed otherwise. RestorePlannerStates reads either form (a training
// state alone leaves the evaluation planner fresh) with RestoreState's errors; on an error
// neither planner has changed.
std::string SavePlannerStates(const Planner& training, const Planner& evaluation);
absl::Status RestorePlannerStates(std::string_view state, Planner& training, Planner& evaluation);

// Creates a policy by name: "ultraep", "greedy", "eplb", "none", "ideal". InvalidArgument lists the
// valid names for anything else.
absl::StatusOr<std::unique_ptr<Planner>> MakePlanner(std::string_view policy, const Domain& domain,
                                                     const PlannerOptions& options);

// When a policy computes a new placement of replicas.
enum class Replanning {
  kEveryMicrobatch,  // from the exact loads of every (microbatch, layer)
  kEveryInterval,    // from past loads, every PlannerOptions::eplb_interval microbatches
};

// How a policy divides an expert's tokens among the expert's instances.
enum class TokenSplit {
  kMastersOnly,  // no replicas: every token goes to its expert's home rank (none)
  kQuotas,       // quotas from the current loads, a source's own tokens to a local
                 // instance first (ultraep, greedy, ideal)
  kEven,         // evenly over the expert's replicas, whatever the current loads (eplb)
};

// What the rest of the system needs to know about a policy, so that no caller outside the
// planner compares policy names: the job spec's choices and defaults, the runtime's and
// the coordinator's invariant checks, `rackrun plan`'s cost model. Tests hold each trait
// to the policy's planner (planner_test.cc).
struct PolicyTraits {
  std::string_view name;
  // Plans from a history of past loads that the planner carries from one microbatch to
  // the next (SaveState is not empty once it has planned): eplb.
  bool needs_load_history = false;
  Replanning replanning = Replanning::kEveryMicrobatch;
  TokenSplit split = TokenSplit::kQuotas;
  // Every master stays at its home rank; eplb re-places masters.
  bool masters_at_home = true;
  // A bound, not a deployable plan: replicas ignore the slot budget and the simulated
  // layer time charges no fan-out (ideal).
  bool bound = false;
  // Replicas stay where they are between replans and weights move only when the policy
  // replans (last_replacement_bytes), as in DeepSeek's deployment of EPLB; every other
  // policy fans replica weights out for every plan.
  bool resident_replicas = false;
  // The default of balancer.shared_slots: one set of replica slots for all MoE layers
  // (UltraEP's design), or slots per layer for resident replicas.
  bool shared_slots = true;
  // A choice of balancer.policy for training jobs; greedy and ideal are baselines for
  // `rackrun plan` only.
  bool for_training = true;

  // The invariants every plan of this policy satisfies (CheckPlanInvariants).
  InvariantOptions invariants() const {
    InvariantOptions o;
    o.masters_at_home = masters_at_home;
    o.enforce_slot_budget = !bound;
    return o;
  }
};

// Every policy MakePlanner knows, in the order its error lists them.
std::span<const PolicyTraits> Policies();
// The traits of the policy named `name`; null when there is none.
const PolicyTraits* FindPolicy(std::string_view name);
// The names of Policies() joined by ", " (MakePlanner's error: "ultraep, greedy, ...").
std::string PolicyNames();

}  // namespace rackrun::planner

#endif  // RACKRUN_PLANNER_PLANNER_H_
