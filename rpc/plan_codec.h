// planner::Plan <-> rackrun.v1.PlanMessage: how a plan travels from the coordinator to
// the ranks in coordinator mode, with the loads it was solved from (an unreplicated
// expert's split is its column of the loads, planner/plan.h). Lossless:
// FromMessage(ToMessage(p, l)) == (p, l), so the fingerprint a rank computes equals the
// coordinator's.
//
// Also the chunking of a planner's state (eplb's history) on the Plans stream
// (LoadRow.restore_state, PlanReply.planner_state): gRPC messages are bounded (4 MiB by
// default), a state grows with window x experts x layers, so it travels in chunks.
#ifndef RACKRUN_RPC_PLAN_CODEC_H_
#define RACKRUN_RPC_PLAN_CODEC_H_

#include <cstddef>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/plan.h"
#include "rackrun/v1/rack_control.pb.h"

namespace rackrun::rpc {

// `loads` must be ranks x experts of `plan`.
void PlanToMessage(const planner::Plan& plan, const planner::LoadMatrix& loads,
                   rackrun::v1::PlanMessage* message);

// InvalidArgument naming the field when the message's sizes are inconsistent (instance
// arrays of different lengths, first not experts + 1 entries ascending from 0 to the
// instance count, replicated_split not ranks x the instances of replicated experts, loads
// not ranks x experts, transfer arrays of different lengths); *plan and *loads are then
// unspecified. Values are not checked against a domain: run planner::CheckPlanInvariants
// for that.
absl::Status PlanFromMessage(const rackrun::v1::PlanMessage& message, planner::Plan* plan,
                             planner::LoadMatrix* loads);

// The most bytes of planner state one LoadRow or PlanReply carries.
inline constexpr size_t kPlannerStateChunkBytes = size_t{1} << 20;

// `state` cut into chunks of at most kPlannerStateChunkBytes, in order; one empty chunk
// for an empty state (so the receiver always sees a last chunk). Views into `state`.
std::vector<std::string_view> PlannerStateChunks(std::string_view state);

}  // namespace rackrun::rpc

#endif  // RACKRUN_RPC_PLAN_CODEC_H_
