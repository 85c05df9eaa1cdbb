// The MoE layer's token permutation on a GPU rank, built on the host from the UltraEP plan
// (planner/plan.h) and the exact loads it was solved from: which rows of the expert-row
// buffer each of this rank's expert instances processes (its quota), and, for one rank, which
// row every routed choice goes to and back. Host code only (no CUDA): the GPU MoE layer
// (runtime/cuda/moe.h) takes the batches from here and computes the same permutation on the
// device (kernels::SlotRows) from the one device-to-host copy of the expert counts the
// planner needs anyway; the gpu tests compare the two.
//
// Assignment rule: comm/token_dispatch.h's (the CPU expert-parallel path's): an expert's
// choices, in ascending choice order, go to its instances in plan instance order, split by
// the plan's per-source split; the expert-row buffer holds one batch per instance on this
// rank, in plan instance order. On one rank every expert has one instance, so the
// permutation is the stable counting sort of the choices by expert.
#ifndef RACKRUN_RUNTIME_CUDA_EXPERT_PERMUTATION_H_
#define RACKRUN_RUNTIME_CUDA_EXPERT_PERMUTATION_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/plan.h"

namespace rackrun::runtime::cuda {

// Rows [offset, offset + rows) of the expert-row buffer: plan instance `instance` (of
// logical expert `expert`), which this rank runs.
struct ExpertBatch {
  int instance = -1;
  int expert = -1;
  bool master = false;
  int64_t offset = 0;
  int64_t rows = 0;

  friend bool operator==(const ExpertBatch&, const ExpertBatch&) = default;
};

struct ExpertPermutation {
  std::vector<ExpertBatch> batches;    // this rank's instances, in plan instance order
  std::vector<int64_t> row_of_choice;  // choice t * top_k + j -> its expert row
  std::vector<int64_t> choice_of_row;  // the inverse: expert row -> choice
};

// The batches of rank `rank`: every instance the plan places there, with the rows every
// source sends it (plan.split_at). InvalidArgument naming the field when the plan's shapes
// are inconsistent (planner::ValidateSplitShape), the loads do not match it, a split is
// negative or `rank` is outside the plan.
absl::StatusOr<std::vector<ExpertBatch>> PlanBatches(const planner::Plan& plan,
                                                     const planner::LoadMatrix& loads, int rank);

// The whole permutation of a one-rank plan from the routing (`selected`: the expert of every
// choice, tokens x top_k). InvalidArgument (naming the expert and both counts) when the
// routing's loads are not the plan's, or an expert id is out of range; Unimplemented for a
// plan of several ranks (tokens then travel to other GPUs: not built yet).
absl::StatusOr<ExpertPermutation> PermuteByPlan(const planner::Plan& plan,
                                                const planner::LoadMatrix& loads,
                                                std::span<const int32_t> selected);

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_EXPERT_PERMUTATION_H_
