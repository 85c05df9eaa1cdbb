// planner::Plan <-> rackrun.v1.PlanMessage: how a plan travels from the coordinator to
// the ranks in coordinator mode. Lossless: FromMessage(ToMessage(p)) == p, so the
// fingerprint a rank computes equals the coordinator's.
#ifndef RACKRUN_COORDINATOR_PLAN_CODEC_H_
#define RACKRUN_COORDINATOR_PLAN_CODEC_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/plan.h"
#include "rackrun/v1/rack_control.pb.h"

namespace rackrun::coordinator {

void PlanToMessage(const planner::Plan& plan, rackrun::v1::PlanMessage* message);

// InvalidArgument naming the field when the message's sizes are inconsistent (instance
// arrays of different lengths, first not experts + 1 long, split not ranks x instances,
// transfer arrays of different lengths). Values are not checked against a domain: run
// planner::CheckPlanInvariants for that.
absl::Status PlanFromMessage(const rackrun::v1::PlanMessage& message, planner::Plan* plan);

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_PLAN_CODEC_H_
