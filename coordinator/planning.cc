#include "coordinator/planning.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "jobspec/spec.h"
#include "planner/invariants.h"
#include "rpc/plan_codec.h"

namespace rackrun::coordinator {

absl::Status Planning::Open(const std::string& job_id, int attempt,
                            const rackrun::v1::JobSpec& spec, int ranks) {
  absl::StatusOr<jobspec::ExpertParallelLayout> layout =
      jobspec::ExpertParallelLayoutOf(spec, ranks);
  if (!layout.ok()) return layout.status();
  // Every domain plans G ranks, as each domain's expert-parallel group does in-band.
  absl::StatusOr<jobspec::BalancerSetup> setup =
      jobspec::BalancerSetupOf(spec, layout->expert_parallel);
  if (!setup.ok()) return setup.status();
  Session s;
  s.setup = *std::move(setup);
  s.expert_parallel = layout->expert_parallel;
  s.domains.resize(static_cast<size_t>(layout->data_parallel));
  for (DomainPlanning& d : s.domains) {
    for (auto* p : {&d.train, &d.eval}) {
      absl::StatusOr<std::unique_ptr<planner::Planner>> made =
          planner::MakePlanner(s.setup.policy->name, s.setup.domain, s.setup.planner);
      if (!made.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("balancer.policy: ", made.status().message()));
      }
      *p = *std::move(made);
    }
  }
  s.outbox.resize(static_cast<size_t>(layout->ranks));
  s.restoring.resize(static_cast<size_t>(layout->ranks));
  Lock lock(mu_);
  sessions_.try_emplace({job_id, attempt}, std::move(s));  // an open session is kept
  return absl::OkStatus();
}

void Planning::Close(const std::string& job_id, int attempt) {
  Lock lock(mu_);
  sessions_.erase({job_id, attempt});
  cv_.notify_all();
}

absl::Status Planning::AddRow(const rackrun::v1::LoadRow& row) {
  const auto arrived = std::chrono::steady_clock::now();
  Lock lock(mu_);
  auto it = sessions_.find({row.job_id(), row.attempt()});
  if (it == sessions_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("attempt ", row.attempt(), " of job '", row.job_id(),
                     "' is not planned by the coordinator (not running, "
                     "or balancer.mode is not coordinator)"));
  }
  Session& s = it->second;
  const planner::Domain& d = s.setup.domain;  // one domain: G ranks
  const int ranks = static_cast<int>(s.outbox.size());
  if (row.rank() < 0 || row.rank() >= ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", row.rank(), " is not in [0, ", ranks, ")"));
  }
  const int domain = row.rank() / s.expert_parallel;
  if (row.domain() != domain) {
    return absl::InvalidArgumentError(absl::StrCat(
        "domain: rank ", row.rank(), " is in expert-parallel domain ", domain, " (",
        s.expert_parallel,
        " ranks per domain, parallelism.expert_parallel) but its row names domain ", row.domain(),
        "; the worker and the coordinator disagree on the job's layout"));
  }
  const bool restore = row.restore_state_last() || !row.restore_state().empty();
  if (row.state_request() || restore) {
    if (row.state_request() && restore) {
      return absl::InvalidArgumentError(
          "state_request: a row asks for the planner state or restores one, not both");
    }
    if (row.loads_size() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("loads: a ", row.state_request() ? "state_request" : "restore_state",
                       " row carries no loads, this one has ", row.loads_size()));
    }
    return StateRowLocked(s, domain, row);
  }
  if (row.loads_size() != d.experts()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loads: ", row.loads_size(), " entries, expected one per expert (", d.experts(), ")"));
  }
  DomainPlanning& dp = s.domains[static_cast<size_t>(domain)];
  const int local = row.rank() % s.expert_parallel;
  const auto key = std::make_tuple(row.microbatch(), row.layer(), row.training());
  Pending& p = dp.pending[key];
  if (p.got.empty()) {
    p.loads = planner::LoadMatrix(d.ranks, d.experts());
    p.got.assign(static_cast<size_t>(d.ranks), false);
  }
  if (p.got[static_cast<size_t>(local)]) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", row.rank(), " sent microbatch ",
                                                   row.microbatch(), " layer ", row.layer(),
                                                   " twice"));
  }
  p.got[static_cast<size_t>(local)] = true;
  for (int e = 0; e < d.experts(); ++e) p.loads.at(local, e) = row.loads(e);
  if (++p.count < d.ranks) return absl::OkStatus();

  rackrun::v1::PlanReply reply;
  reply.set_microbatch(row.microbatch());
  reply.set_layer(row.layer());
  reply.set_domain(domain);
  planner::Planner& planner = row.training() ? *dp.train : *dp.eval;
  dp.planned = true;
  absl::Status st = planner.SolveInto(p.loads, row.layer(), &dp.plan);
  if (st.ok()) st = planner::CheckPlanInvariants(d, p.loads, dp.plan, s.setup.invariants);
  if (st.ok()) {
    rpc::PlanToMessage(dp.plan, p.loads, reply.mutable_plan());
    reply.set_fingerprint(planner::PlanFingerprint(dp.plan));
  } else {
    reply.set_error(absl::StrCat("plan of microbatch ", row.microbatch(), " layer ", row.layer(),
                                 s.domains.size() > 1 ? absl::StrCat(" domain ", domain) : "", ": ",
                                 st.message()));
  }
  reply.set_solve_s(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - arrived).count());
  if (solve_observer_) solve_observer_(row.job_id(), domain, reply.solve_s());
  dp.pending.erase(key);
  const size_t first = static_cast<size_t>(domain * s.expert_parallel);
  for (size_t r = first; r < first + static_cast<size_t>(s.expert_parallel); ++r) {
    s.outbox[r].push_back(reply);
  }
  cv_.notify_all();
  return absl::OkStatus();
}

absl::Status Planning::StateRowLocked(Session& s, int domain, const rackrun::v1::LoadRow& row) {
  DomainPlanning& dp = s.domains[static_cast<size_t>(domain)];
  std::deque<rackrun::v1::PlanReply>& outbox = s.outbox[static_cast<size_t>(row.rank())];
  const auto reply_to = [&] {
    rackrun::v1::PlanReply& r = outbox.emplace_back();
    r.set_microbatch(row.microbatch());
    r.set_layer(row.layer());
    r.set_domain(domain);
    return &r;
  };
  if (row.state_request()) {
    const std::string state = planner::SavePlannerStates(*dp.train, *dp.eval);
    const std::vector<std::string_view> chunks = rpc::PlannerStateChunks(state);
    for (size_t i = 0; i < chunks.size(); ++i) {
      rackrun::v1::PlanReply* r = reply_to();
      r->set_planner_state(chunks[i].data(), chunks[i].size());
      r->set_planner_state_last(i + 1 == chunks.size());
    }
    cv_.notify_all();
    return absl::OkStatus();
  }
  std::string& buffer = s.restoring[static_cast<size_t>(row.rank())];
  if (row.restore_state().size() > rpc::kPlannerStateChunkBytes ||
      buffer.size() + row.restore_state().size() > kMaxPlannerStateBytes) {
    absl::Status refused = absl::InvalidArgumentError(absl::StrCat(
        "restore_state: chunks of at most ", rpc::kPlannerStateChunkBytes,
        " bytes and a state of at most ", kMaxPlannerStateBytes, " bytes, rank ", row.rank(),
        " sent a chunk of ", row.restore_state().size(), " after ", buffer.size(), " bytes"));
    buffer.clear();
    return refused;
  }
  buffer.append(row.restore_state());
  if (!row.restore_state_last()) return absl::OkStatus();
  const std::string state = std::move(buffer);
  buffer.clear();
  const std::string where = s.domains.size() > 1 ? absl::StrCat(" of domain ", domain) : "";
  absl::Status st;
  if (dp.planned) {
    st = absl::FailedPreconditionError(absl::StrCat(
        "the planners", where, " have already planned; restore their state before the first row"));
  } else if (dp.restored.has_value()) {
    if (*dp.restored != state) {
      st = absl::DataLossError(absl::StrCat(
          "rank ", row.rank(), " restores a planner state", where, " of ", state.size(),
          " bytes that differs from the ", dp.restored->size(),
          " bytes another rank of it restored; its ranks resumed from different checkpoints"));
    }
  } else {
    st = planner::RestorePlannerStates(state, *dp.train, *dp.eval);
    if (st.ok()) dp.restored = state;
  }
  rackrun::v1::PlanReply* r = reply_to();
  if (st.ok()) {
    r->set_state_restored(true);
  } else {
    r->set_error(absl::StrCat("restoring the planner state", where, ": ", st.message()));
    r->set_error_code(static_cast<int>(st.code()));
  }
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<std::optional<rackrun::v1::PlanReply>> Planning::NextReply(const std::string& job_id,
                                                                          int attempt, int rank,
                                                                          absl::Duration max_wait) {
  Lock lock(mu_);
  const absl::Time deadline = absl::Now() + max_wait;
  while (true) {
    if (shutdown_) return absl::CancelledError("the coordinator is shutting down");
    auto it = sessions_.find({job_id, attempt});
    if (it == sessions_.end()) {
      return absl::CancelledError(
          absl::StrCat("attempt ", attempt, " of job '", job_id, "' is not planning"));
    }
    if (rank < 0 || rank >= static_cast<int>(it->second.outbox.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank: ", rank, " is not a rank of the attempt"));
    }
    auto& q = it->second.outbox[static_cast<size_t>(rank)];
    if (!q.empty()) {
      rackrun::v1::PlanReply r = std::move(q.front());
      q.pop_front();
      return std::optional<rackrun::v1::PlanReply>(std::move(r));
    }
    if (WaitUntil(cv_, lock, deadline)) return std::optional<rackrun::v1::PlanReply>();
  }
}

void Planning::SetSolveObserver(SolveObserver observer) {
  Lock lock(mu_);
  solve_observer_ = std::move(observer);
}

void Planning::Shutdown() {
  Lock lock(mu_);
  shutdown_ = true;
  cv_.notify_all();
}

}  // namespace rackrun::coordinator
