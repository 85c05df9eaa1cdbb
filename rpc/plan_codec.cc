#include "rpc/plan_codec.h"

#include "absl/strings/str_cat.h"

namespace rackrun::rpc {

void PlanToMessage(const planner::Plan& plan, const planner::LoadMatrix& loads,
                   rackrun::v1::PlanMessage* m) {
  m->Clear();
  m->set_ranks(plan.ranks);
  m->set_experts(plan.experts);
  for (const planner::ExpertInstance& i : plan.instances) {
    m->add_instance_expert(i.expert);
    m->add_instance_rank(i.rank);
    m->add_instance_master(i.master);
  }
  m->mutable_first()->Add(plan.first.begin(), plan.first.end());
  m->mutable_quota()->Add(plan.quota.begin(), plan.quota.end());
  m->mutable_replicated_split()->Add(plan.split.begin(), plan.split.end());
  m->mutable_loads()->Add(loads.counts.begin(), loads.counts.end());
  for (const planner::WeightTransfer& t : plan.fanout.transfers) {
    m->add_transfer_expert(t.expert);
    m->add_transfer_src(t.src_rank);
    m->add_transfer_dst(t.dst_rank);
    m->add_transfer_stage(t.stage);
  }
}

absl::Status PlanFromMessage(const rackrun::v1::PlanMessage& m, planner::Plan* plan,
                             planner::LoadMatrix* loads) {
  const int n = m.instance_expert_size();
  if (m.ranks() <= 0 || m.experts() <= 0) {
    return absl::InvalidArgumentError("plan.ranks and plan.experts: must be positive");
  }
  if (m.instance_rank_size() != n || m.instance_master_size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan.instance_rank / instance_master: ", m.instance_rank_size(), " / ",
                     m.instance_master_size(), " entries for ", n, " instances"));
  }
  if (m.first_size() != m.experts() + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan.first: ", m.first_size(), " entries, expected experts + 1 = ", m.experts() + 1));
  }
  if (m.quota_size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan.quota: ", m.quota_size(), " entries for ", n, " instances"));
  }
  // first must be sound before the split's columns can be counted from it.
  if (m.first(0) != 0 || m.first(m.experts()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("plan.first: runs from ", m.first(0), " to ",
                                                   m.first(m.experts()), ", expected 0 to ", n,
                                                   " (the instance count)"));
  }
  int64_t columns = 0;
  for (int e = 0; e < m.experts(); ++e) {
    const int64_t k = static_cast<int64_t>(m.first(e + 1)) - m.first(e);
    if (k < 0) {
      return absl::InvalidArgumentError(absl::StrCat("plan.first: descends at expert ", e, " (",
                                                     m.first(e), " > ", m.first(e + 1), ")"));
    }
    if (k > 1) columns += k;
  }
  if (static_cast<int64_t>(m.replicated_split_size()) !=
      static_cast<int64_t>(m.ranks()) * columns) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan.replicated_split: ", m.replicated_split_size(),
                     " entries, expected ranks x instances of replicated experts = ", m.ranks(),
                     " x ", columns));
  }
  if (static_cast<int64_t>(m.loads_size()) !=
      static_cast<int64_t>(m.ranks()) * static_cast<int64_t>(m.experts())) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan.loads: ", m.loads_size(),
                     " entries, expected ranks x experts = ", m.ranks(), " x ", m.experts()));
  }
  const int t = m.transfer_expert_size();
  if (m.transfer_src_size() != t || m.transfer_dst_size() != t || m.transfer_stage_size() != t) {
    return absl::InvalidArgumentError("plan.transfer_*: the four transfer arrays differ in length");
  }
  plan->ranks = m.ranks();
  plan->experts = m.experts();
  plan->instances.resize(n);
  for (int i = 0; i < n; ++i) {
    plan->instances[i] = {m.instance_expert(i), m.instance_rank(i), m.instance_master(i)};
  }
  plan->first.assign(m.first().begin(), m.first().end());
  plan->quota.assign(m.quota().begin(), m.quota().end());
  planner::IndexSplitColumns(plan);
  plan->split.assign(m.replicated_split().begin(), m.replicated_split().end());
  *loads = planner::LoadMatrix(m.ranks(), m.experts());
  loads->counts.assign(m.loads().begin(), m.loads().end());
  plan->fanout.transfers.resize(t);
  for (int i = 0; i < t; ++i) {
    plan->fanout.transfers[i] = {m.transfer_expert(i), m.transfer_src(i), m.transfer_dst(i),
                                 m.transfer_stage(i)};
  }
  return absl::OkStatus();
}

std::vector<std::string_view> PlannerStateChunks(std::string_view state) {
  std::vector<std::string_view> chunks;
  for (size_t at = 0; at < state.size(); at += kPlannerStateChunkBytes) {
    chunks.push_back(state.substr(at, kPlannerStateChunkBytes));
  }
  if (chunks.empty()) chunks.emplace_back();
  return chunks;
}

}  // namespace rackrun::rpc
