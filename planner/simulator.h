// Step-time simulator for one MoE layer's forward pass under a balancing plan, and the
// force-balanced ideal it is compared with.
//
// What the model counts, per (microbatch, layer), on G ranks:
//  1. Dispatch all-to-all: every (src, instance) split entry whose instance lives on another
//     rank moves split tokens x token_bytes from src to that rank. A rank's phase time is
//     max(bytes it sends, bytes it receives) / a2a bandwidth; the phase takes the slowest
//     rank plus one a2a latency. Tokens are counted per (token, expert) pair: a token bound
//     for two experts on one rank is counted twice (DeepEP sends it once), so dispatch is
//     an upper bound that is the same for every policy's routing.
//  2. Replica weight fan-out (FanoutCost from planner/fanout.h, relay or direct) starts
//     with the dispatch, as soon as the plan is known, and overlaps it. Both share the
//     senders' egress, so the overlapped phase is
//       max(dispatch, fanout, (busiest dispatch sender + busiest fan-out sender) bytes / bw)
//     (the last term is a contention bound: it adds the two busiest senders as if they were
//     one rank). exposed fan-out = that phase - dispatch.
//  3. Expert compute on the busiest rank: max_r tokens_r x flops_per_token / gemm rate.
//     Experts on a rank run back to back (grouped GEMM); nothing overlaps compute.
//  4. Combine all-to-all: the reverse of dispatch, same bytes, same time.
//  5. Re-placement (EPLB moves masters when it replans): bytes spread evenly over all
//     ranks' egress, fully exposed (it must finish before the layer runs).
// total = dispatch + exposed fan-out + compute + combine + re-placement.
//
// The force-balanced ideal is the faster of two balanced layers in which no weights move:
//  - balanced routing (the UltraEP paper's): every source's tokens spread evenly over all
//    ranks and every rank computes the mean load;
//  - the `ideal` policy's plan (baseline_planners.h): every rank computes floor or ceil of
//    the mean, masters keep what fits, and the locality-first split keeps a source's tokens
//    on its own rank where it can. When routing favours the source's own rank's experts
//    (real traces do), this sends less than even spreading, so balanced routing alone was
//    not a bound: on a 2000-rank trace the `ideal` policy reported 102.7% of it.
// Taking the faster makes the `ideal` policy at most 100% by construction. It is not a lower
// bound for every plan: a slot-limited plan may still keep more tokens local than both.
// % of ideal = ideal total / plan total x 100 (a throughput ratio).
//
// Not modelled: backward pass and replica-gradient reduction, attention, kernel launch and
// GEMM efficiency that varies with batch size, topology beyond one flat NVLink domain.
// cluster.h composes these layers into a training step over D such domains (backward,
// dense part, data-parallel gradient all-reduce over a scale-out network).
#ifndef RACKRUN_PLANNER_SIMULATOR_H_
#define RACKRUN_PLANNER_SIMULATOR_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/fanout.h"
#include "planner/plan.h"

namespace rackrun::planner {

struct HardwareModel {
  std::string name;
  // Expert shape: a SwiGLU MLP of `matrices_per_expert` hidden x intermediate matrices.
  int64_t hidden = 0;
  int64_t expert_intermediate = 0;
  int64_t matrices_per_expert = 3;
  int64_t bytes_per_element = 2;
  // Achieved (not peak) rates per GPU.
  double gemm_flops_per_s = 0;
  double a2a_bytes_per_s = 0;  // per direction, per GPU, during all-to-all
  double a2a_latency_s = 0;    // fixed cost of one all-to-all phase
  FanoutCostModel fanout;      // per-rank egress and per-message latency for weight fan-out

  int64_t expert_bytes() const {
    return matrices_per_expert * hidden * expert_intermediate * bytes_per_element;
  }
  int64_t token_bytes() const { return hidden * bytes_per_element; }
  // Forward FLOPs for one token through one expert (a multiply-add is 2 FLOPs).
  double flops_per_token() const {
    return 2.0 * static_cast<double>(matrices_per_expert * hidden * expert_intermediate);
  }

  // InvalidArgument naming the first non-positive field.
  absl::Status Validate() const;
};

// "h200-nvl72": H200 GPUs in an NVL72-like flat NVLink 5 domain (a rack-scale node as in
// the UltraEP paper), DeepSeek-V3 expert shape. Each number's source is in simulator.cc.
// InvalidArgument listing the known presets for any other name.
absl::StatusOr<HardwareModel> HardwarePreset(std::string_view name);
std::vector<std::string> HardwarePresetNames();

struct LayerTime {
  double dispatch_s = 0;
  double fanout_s = 0;          // the fan-out schedule's own completion time
  double exposed_fanout_s = 0;  // the part of it (with contention) not hidden by dispatch
  double compute_s = 0;
  double combine_s = 0;
  double replacement_s = 0;
  double total_s = 0;
  int64_t max_rank_tokens = 0;
};

// Layer time under `plan`, solved from `loads`. `fanout` is the cost of the weights this
// plan must move now (a default FanoutCost when none); `replacement_bytes` are master
// re-placement bytes.
LayerTime SimulateLayer(const Plan& plan, const LoadMatrix& loads, const HardwareModel& hw,
                        const FanoutCost& fanout, int64_t replacement_bytes = 0);

// The force-balanced ideal for the same loads (see the header comment): the faster of
// SimulateBalancedRouting and the `ideal` policy's plan under default PlannerOptions (the
// split rules `rackrun plan` uses). Loads whose experts are not a multiple of the ranks
// have no `ideal` plan and get balanced routing alone.
LayerTime SimulateForceBalanced(const LoadMatrix& loads, const HardwareModel& hw);

// Balanced routing alone: every source spreads its tokens evenly over all ranks.
LayerTime SimulateBalancedRouting(const LoadMatrix& loads, const HardwareModel& hw);

// ideal.total_s / actual.total_s x 100; 100 when both are zero.
double PercentOfIdeal(const LayerTime& ideal, const LayerTime& actual);

}  // namespace rackrun::planner

#endif  // RACKRUN_PLANNER_SIMULATOR_H_
