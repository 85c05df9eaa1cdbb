#include "runtime/cuda/expert_permutation.h"

#include "absl/strings/str_cat.h"

namespace rackrun::runtime::cuda {

absl::StatusOr<std::vector<ExpertBatch>> PlanBatches(const planner::Plan& plan,
                                                     const planner::LoadMatrix& loads, int rank) {
  if (absl::Status s = planner::ValidateSplitShape(plan); !s.ok()) return s;
  if (loads.ranks != plan.ranks || loads.experts != plan.experts ||
      loads.counts.size() != static_cast<size_t>(plan.ranks) * plan.experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert permutation: loads are ", loads.ranks, " x ", loads.experts,
                     " but the plan is for ", plan.ranks, " ranks x ", plan.experts,
                     " experts; pass the loads the plan was solved from"));
  }
  if (rank < 0 || rank >= plan.ranks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert permutation: rank ", rank, " is outside the plan's ", plan.ranks, " ranks"));
  }
  std::vector<ExpertBatch> batches;
  int64_t offset = 0;
  for (int i = 0; i < plan.num_instances(); ++i) {
    const planner::ExpertInstance& inst = plan.instances[static_cast<size_t>(i)];
    if (inst.rank != rank) continue;
    int64_t rows = 0;
    for (int src = 0; src < plan.ranks; ++src) {
      const int64_t n = plan.split_at(loads, src, i);
      if (n < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("plan.split(src ", src, ", instance ", i, ") = ", n, " is negative"));
      }
      rows += n;
    }
    batches.push_back({i, inst.expert, inst.master, offset, rows});
    offset += rows;
  }
  return batches;
}

absl::StatusOr<ExpertPermutation> PermuteByPlan(const planner::Plan& plan,
                                                const planner::LoadMatrix& loads,
                                                std::span<const int32_t> selected) {
  if (plan.ranks != 1) {
    return absl::UnimplementedError(
        absl::StrCat("expert permutation: the plan spans ", plan.ranks,
                     " ranks; expert parallelism across GPUs (tokens sent to other GPUs) is not "
                     "built yet: one rank per GPU job"));
  }
  absl::StatusOr<std::vector<ExpertBatch>> batches = PlanBatches(plan, loads, 0);
  if (!batches.ok()) return batches.status();
  const int experts = plan.experts;
  // This rank's choices grouped by expert, in ascending choice order.
  std::vector<int64_t> first(static_cast<size_t>(experts) + 1, 0);
  for (size_t c = 0; c < selected.size(); ++c) {
    const int32_t e = selected[c];
    if (e < 0 || e >= experts) {
      return absl::InvalidArgumentError(absl::StrCat("expert permutation: choice ", c,
                                                     " routes to expert ", e, " outside [0, ",
                                                     experts, ")"));
    }
    ++first[static_cast<size_t>(e) + 1];
  }
  for (int e = 0; e < experts; ++e) {
    if (first[static_cast<size_t>(e) + 1] != loads.at(0, e)) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert permutation: the routing sends ", first[static_cast<size_t>(e) + 1],
                       " choices to expert ", e, " but the plan was solved for ", loads.at(0, e),
                       "; plan from this microbatch's exact loads"));
    }
    first[static_cast<size_t>(e) + 1] += first[static_cast<size_t>(e)];
  }
  std::vector<int64_t> by_expert(selected.size());
  {
    std::vector<int64_t> cursor(first.begin(), first.end() - 1);
    for (size_t c = 0; c < selected.size(); ++c) {
      by_expert[static_cast<size_t>(cursor[static_cast<size_t>(selected[c])]++)] =
          static_cast<int64_t>(c);
    }
  }
  std::vector<int64_t> batch_offset(static_cast<size_t>(plan.num_instances()), -1);
  for (const ExpertBatch& b : *batches) batch_offset[static_cast<size_t>(b.instance)] = b.offset;
  ExpertPermutation p;
  p.row_of_choice.assign(selected.size(), -1);
  p.choice_of_row.assign(selected.size(), -1);
  for (int e = 0; e < experts; ++e) {
    int64_t split = 0;
    for (int i = plan.first[static_cast<size_t>(e)]; i < plan.first[static_cast<size_t>(e) + 1];
         ++i) {
      split += plan.split_at(loads, 0, i);
    }
    if (split != loads.at(0, e)) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert permutation: the plan's split gives expert ", e, " ", split,
                       " choices but its load is ", loads.at(0, e)));
    }
    int64_t pos = first[static_cast<size_t>(e)];
    for (int i = plan.first[static_cast<size_t>(e)]; i < plan.first[static_cast<size_t>(e) + 1];
         ++i) {
      const int64_t n = plan.split_at(loads, 0, i);
      for (int64_t q = 0; q < n; ++q) {
        const int64_t choice = by_expert[static_cast<size_t>(pos++)];
        const int64_t row = batch_offset[static_cast<size_t>(i)] + q;
        p.row_of_choice[static_cast<size_t>(choice)] = row;
        p.choice_of_row[static_cast<size_t>(row)] = choice;
      }
    }
  }
  p.batches = *std::move(batches);
  return p;
}

}  // namespace rackrun::runtime::cuda
