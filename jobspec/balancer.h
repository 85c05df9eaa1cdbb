// A job's balancer, from its spec: the one mapping from JobSpec's balancer and model
// sections to what plans a job's microbatches (the expert-parallel domain, the policy, its
// planner options, the invariants its plans are checked against).
//
// The trainer (in-band: every rank solves the plan) and the coordinator (balancer.mode:
// coordinator) both build their planners from the BalancerSetup of the same spec; that is
// why their plans are bit-identical (coordinator/planning_test.cc, tests/daemons).
#ifndef RACKRUN_JOBSPEC_BALANCER_H_
#define RACKRUN_JOBSPEC_BALANCER_H_

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
