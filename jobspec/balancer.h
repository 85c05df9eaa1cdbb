// A job's balancer, from its spec: the one mapping from JobSpec's balancer and model
// sections to what plans a job's microbatches (the expert-parallel domain, the policy, its
// planner options, the invariants its plans are checked against), and where the plans are
// solved (balancer.mode: the modes' one table, as planner::PolicyTraits is the policies').
//
// The trainer (in-band: every rank solves the plan) and the coordinator (balancer.mode:
// coordinator) both build their planners from the BalancerSetup of the same spec; that is
// why their plans are bit-identical (coordinator/planning_test.cc, tests/daemons).
#ifndef RACKRUN_JOBSPEC_BALANCER_H_
#define RACKRUN_JOBSPEC_BALANCER_H_

#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "planner/invariants.h"
#include "planner/plan.h"
#include "planner/planner.h"
#include "rackrun/v1/job_spec.pb.h"

namespace rackrun::jobspec {

// balancer.policy of a spec that names none: no balancing.
inline constexpr std::string_view kDefaultBalancerPolicy = "none";

// The policies a training job may choose (PolicyTraits::for_training), the default first,
// as a spec error lists them: "none, ultraep or eplb".
std::string TrainingPolicyChoices();

// balancer.mode: where a job's plans are solved. Adding a mode: a value here, its row in
// BalancerModes() (balancer.cc), and what it needs where the plans come from (the
// trainer's plan source, runtime/trainer.cc; the coordinator's planning, coordinator/rack.cc).
enum class BalancerMode {
  // Every rank solves the same plan from an allgather of the loads (runtime/plan_source.h).
  kInBand,
  // The rack coordinator solves each plan and streams it to the ranks
  // (coordinator/planning.h, worker/coordinator_plan_source.h): only under the daemons.
  kCoordinator,
};

struct BalancerModeTraits {
  BalancerMode mode;
  std::string_view name;  // the spec's spelling
};

// Every mode, the default (kDefaultBalancerMode) first, in the order a spec error lists them.
std::span<const BalancerModeTraits> BalancerModes();
// The traits of the mode named `name`; null when there is none (also for "").
const BalancerModeTraits* FindBalancerMode(std::string_view name);
// balancer.mode of a spec that names none.
inline constexpr std::string_view kDefaultBalancerMode = "inband";
// The modes as a spec error lists them: "inband or coordinator".
std::string BalancerModeChoices();

// The mode of `spec` (balancer.mode, "" = the default). For a spec that passed
// ValidateJobSpec; a name that is no mode reads as the default.
BalancerMode BalancerModeOf(const rackrun::v1::JobSpec& spec);
// Whether the rack coordinator solves this job's plans (BalancerMode::kCoordinator): it
// opens a planning session per attempt and each rank takes its plans from it.
bool PlannedByCoordinator(const rackrun::v1::JobSpec& spec);

struct BalancerSetup {
  // `ranks` x (model.moe.experts / ranks masters + balancer.slots slots).
  planner::Domain domain;
  // balancer.policy; never null. Points into the planner's static table.
  const planner::PolicyTraits* policy = nullptr;
  // The balancer's knobs, and expert_bytes from the model: one expert's weights.
  planner::PlannerOptions planner;
  // What every plan is checked against before it runs: policy->invariants().
  planner::InvariantOptions invariants;
  // balancer.shared_slots: one set of replica slots for all MoE layers, or per layer.
  bool shared_slots = true;
};

// The setup of a spec that passed ValidateJobSpec (defaults applied) on `ranks` ranks.
// InvalidArgument naming the field when the experts cannot be sharded over the ranks, the
// domain is invalid or the policy unknown.
absl::StatusOr<BalancerSetup> BalancerSetupOf(const rackrun::v1::JobSpec& spec, int ranks);

}  // namespace rackrun::jobspec

#endif  // RACKRUN_JOBSPEC_BALANCER_H_
