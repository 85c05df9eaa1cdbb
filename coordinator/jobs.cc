#include "coordinator/jobs.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "jobspec/restart_policy.h"

namespace rackrun::coordinator {

namespace {
// The message of a checkpoint event ("checkpoint <path>"); Initialize replays them.
constexpr absl::string_view kCheckpointEventPrefix = "checkpoint ";
}  // namespace

using rackrun::v1::Attempt;
using rackrun::v1::AttemptResult;
using rackrun::v1::Failure;
using rackrun::v1::FailureKind;
using rackrun::v1::Job;
using rackrun::v1::JobEvent;
using rackrun::v1::JobSpec;
using rackrun::v1::JobState;

bool IsTerminal(JobState s) {
  return s == rackrun::v1::SUCCEEDED || s == rackrun::v1::FAILED || s == rackrun::v1::CANCELLED;
}

std::string DescribeFailure(const Failure& f) {
  std::string who = f.rank() >= 0 ? absl::StrCat("rank ", f.rank()) : std::string("no single rank");
  if (!f.worker_id().empty()) {
    absl::StrAppend(&who, " (worker ", f.worker_id(), " on ", f.host(), ", pid ", f.pid(), ")");
  }
  return absl::StrCat(jobspec::FailureKindName(f.kind()), ": ", who, " in phase ",
                      f.phase().empty() ? "?" : f.phase(), " at step ", f.step(),
                      f.message().empty() ? "" : ": ", f.message());
}

namespace {

// The seqs of the oldest progress events of `events` (followed by `added`) to drop so that
// at most `max` of both remain, never one followed by another kind of event: what a
// restart reads of the checkpoint step (the progress before each checkpoint event) stays.
// Nothing of `added` is dropped.
std::vector<int64_t> ProgressToDrop(const std::vector<JobEvent>& events,
                                    const std::vector<JobEvent>& added, int progress, int max) {
  std::vector<int64_t> out;
  const size_t n = events.size() + added.size();
  const auto at = [&](size_t i) -> const JobEvent& {
    return i < events.size() ? events[i] : added[i - events.size()];
  };
  for (size_t i = 0; i < events.size() && i + 1 < n && progress > max; ++i) {
    if (at(i).has_progress() && at(i + 1).has_progress()) {
      out.push_back(at(i).seq());
      --progress;
    }
  }
  return out;
}

int CountProgress(const std::vector<JobEvent>& events) {
  return static_cast<int>(std::count_if(events.begin(), events.end(),
                                        [](const JobEvent& ev) { return ev.has_progress(); }));
}

}  // namespace

Jobs::Jobs(JobStore* store, Clock clock, Options options)
    : store_(store), clock_(std::move(clock)), options_(options) {}

Jobs::Entry* Jobs::Find(const std::string& job_id) {
  return const_cast<Entry*>(std::as_const(*this).Find(job_id));
}
const Jobs::Entry* Jobs::Find(const std::string& job_id) const {
  const int64_t num = JobNumber(job_id);
  if (auto it = jobs_.find(num); it != jobs_.end()) return &it->second;
  if (num <= 0) return nullptr;
  // An ended job forgotten from memory (ForgetEnded) is read back from the store, and
  // forgotten again later: what callers see of it does not change.
  absl::StatusOr<StoredJob> stored = store_->LoadJob(num);
  if (!stored.ok() || !IsTerminal(stored->job.state())) return nullptr;
  ended_order_.push_back(num);
  return &jobs_.emplace(num, FromStore(*std::move(stored), clock_())).first->second;
}

Jobs::Entry Jobs::FromStore(StoredJob s, int64_t now) const {
  Entry e;
  e.job = std::move(s.job);
  e.events = std::move(s.events);
  e.not_before_ms = now;
  if (e.job.state() == rackrun::v1::RUNNING && e.job.attempts_size() > 0) {
    const Attempt& a = e.job.attempts(e.job.attempts_size() - 1);
    if (a.state() == rackrun::v1::RUNNING) {
      // Ranks that finished before the restart keep their result and are not awaited.
      for (const JobEvent& ev : e.events) {
        if (ev.has_rank_done() && ev.attempt() == a.number()) {
          e.results[ev.rank_done().rank()] = AttemptResult::SUCCEEDED;
        }
      }
      for (const auto& r : a.ranks()) {
        if (e.results.count(r.rank()) == 0) e.awaiting_reattach.insert(r.rank());
      }
      e.reattach_deadline_ms = now + options_.reattach_grace_ms;
    }
  }
  // Where a restart resumes: replayed from the events, as Checkpoint set it (the step of
  // the newest progress before the newest checkpoint event), so a restart after a
  // coordinator restart resumes at the last checkpoint rather than at step 0.
  int64_t progress_step = 0;
  for (const JobEvent& ev : e.events) {
    if (ev.has_progress()) progress_step = ev.progress().step();
    if (absl::StartsWith(ev.message(), kCheckpointEventPrefix)) e.checkpoint_step = progress_step;
  }
  e.progress_events = CountProgress(e.events);
  return e;
}

absl::Status Jobs::Initialize(std::vector<StoredJob> stored) {
  Lock lock(mu_);
  const int64_t now = clock_();
  std::vector<std::pair<int64_t, int64_t>> ended;  // (finished, number)
  for (StoredJob& s : stored) {
    Entry e = FromStore(std::move(s), now);
    // A history kept by an older coordinator (every progress report an event) is
    // trimmed once here, as Commit keeps it from now on.
    const std::vector<int64_t> drop =
        ProgressToDrop(e.events, {}, e.progress_events, MaxProgressEvents(e.job));
    if (!drop.empty()) {
      if (absl::Status st = store_->Commit(JobMutation{e.job, {}, drop}); !st.ok()) return st;
      DropEvents(e, drop);
    }
    const int64_t num = JobNumber(e.job.id());
    if (IsTerminal(e.job.state())) ended.emplace_back(e.job.finished_unix_ms(), num);
    jobs_.emplace(num, std::move(e));
  }
  std::sort(ended.begin(), ended.end());
  for (const auto& [finished, num] : ended) ended_order_.push_back(num);
  return absl::OkStatus();
}

void Jobs::ForgetEnded() {
  Lock lock(mu_);
  const size_t keep = static_cast<size_t>(std::max(0, options_.max_ended_in_memory));
  while (ended_order_.size() > keep) {
    jobs_.erase(ended_order_.front());
    ended_order_.pop_front();
  }
}

int Jobs::JobsInMemory() const {
  Lock lock(mu_);
  return static_cast<int>(jobs_.size());
}

absl::Status Jobs::Commit(Entry& e, Job next, std::vector<JobEvent> events) {
  const int64_t now = clock_();
  if (e.progress_pending.has_value() &&
      std::none_of(events.begin(), events.end(),
                   [](const JobEvent& ev) { return ev.has_progress(); })) {
    events.insert(events.begin(), *e.progress_pending);
  }
  int64_t seq = e.events.empty() ? 0 : e.events.back().seq();
  for (JobEvent& ev : events) {
    ev.set_seq(++seq);
    ev.set_job_id(next.id());
    ev.set_time_unix_ms(now);
  }
  const int added_progress = CountProgress(events);
  const bool ends = !IsTerminal(e.job.state()) && IsTerminal(next.state());
  JobMutation m{std::move(next), std::move(events), {}};
  m.dropped = ProgressToDrop(e.events, m.events, e.progress_events + added_progress,
                             MaxProgressEvents(m.job));
  if (absl::Status s = store_->Commit(m); !s.ok()) return s;
  e.job = std::move(m.job);
  DropEvents(e, m.dropped);
  for (JobEvent& ev : m.events) e.events.push_back(std::move(ev));
  e.progress_events += added_progress;
  if (added_progress > 0) {
    e.progress_pending.reset();
    e.progress_event_ms = now;
  }
  if (ends) ended_order_.push_back(JobNumber(e.job.id()));
  cv_.notify_all();
  return absl::OkStatus();
}

int Jobs::MaxProgressEvents(const Job& job) const {
  return IsTerminal(job.state()) ? options_.max_ended_progress_events
                                 : options_.max_progress_events;
}

void Jobs::DropEvents(Entry& e, const std::vector<int64_t>& seqs) {
  if (seqs.empty()) return;
  const std::set<int64_t> drop(seqs.begin(), seqs.end());
  std::erase_if(e.events, [&](const JobEvent& ev) { return drop.count(ev.seq()) > 0; });
  e.progress_events -= static_cast<int>(drop.size());
}

namespace {
JobEvent StateEvent(JobState state, int attempt) {
  JobEvent ev;
  ev.set_state(state);
  ev.set_attempt(attempt);
  return ev;
}
JobEvent MessageEvent(std::string message, int attempt) {
  JobEvent ev;
  ev.set_message(std::move(message));
  ev.set_attempt(attempt);
  return ev;
}
Attempt* Current(Job& job) {
  return job.attempts().empty() ? nullptr : job.mutable_attempts(job.attempts_size() - 1);
}
}  // namespace

absl::StatusOr<JobStore::InsertResult> Jobs::Submit(const JobSpec& spec,
                                                    const std::string& request_id) {
  Lock lock(mu_);
  if (shutdown_) return absl::UnavailableError("the coordinator is shutting down");
  const int64_t now = clock_();
  Job job;
  job.set_name(spec.name());
  job.set_state(rackrun::v1::QUEUED);
  *job.mutable_spec() = spec;
  job.set_request_id(request_id);
  job.set_created_unix_ms(now);
  job.set_message("queued");
  JobEvent first = StateEvent(rackrun::v1::QUEUED, 0);
  first.set_seq(1);
  first.set_time_unix_ms(now);
  absl::StatusOr<JobStore::InsertResult> r = store_->InsertJob(job, first);
  if (!r.ok()) return r.status();
  if (r->created) {
    Entry e;
    e.job = r->job;
    first.set_job_id(r->job.id());
    e.events.push_back(first);
    e.not_before_ms = now;
    jobs_.emplace(JobNumber(r->job.id()), std::move(e));
  } else if (const Entry* e = Find(r->job.id()); e != nullptr) {
    r->job = e->job;  // memory is at least as new as the store
  }
  return r;
}

absl::StatusOr<Job> Jobs::Get(const std::string& job_id) const {
  Lock lock(mu_);
  const Entry* e = Find(job_id);
  if (e == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  return e->job;
}

absl::StatusOr<rackrun::v1::ListJobsResponse> Jobs::List(
    const rackrun::v1::ListJobsRequest& req) const {
  int page = req.page_size() <= 0 ? 50 : std::min(req.page_size(), 1000);
  int64_t before = INT64_MAX;  // page token: list jobs with a number below it
  if (!req.page_token().empty() && (!absl::SimpleAtoi(req.page_token(), &before) || before <= 0)) {
    return absl::InvalidArgumentError(
        "page_token: not a token returned by List; omit it for the first page");
  }
  Lock lock(mu_);
  // The page's jobs from the store (it has every job; memory only the live ones and those
  // that ended last), each from memory where it is there (it may be newer: last_progress).
  absl::StatusOr<std::vector<int64_t>> nums = store_->ListJobNumbers(before, req.state(), page + 1);
  if (!nums.ok()) return nums.status();
  rackrun::v1::ListJobsResponse resp;
  for (const int64_t num : *nums) {
    if (resp.jobs_size() == page) {
      resp.set_next_page_token(absl::StrCat(JobNumber(resp.jobs(page - 1).id())));
      break;
    }
    Job* out = resp.add_jobs();
    if (auto it = jobs_.find(num); it != jobs_.end()) {
      *out = it->second.job;
    } else {
      absl::StatusOr<Job> stored = store_->LoadRecord(num);
      if (!stored.ok()) return stored.status();
      *out = *std::move(stored);
    }
    out->clear_spec();
    out->clear_attempts();
    // A 64-domain job's per-domain figures and a big model's per-expert sample are tens of
    // thousands of numbers each: a list of 1000 jobs leaves them to Get.
    if (out->has_last_progress()) {
      out->mutable_last_progress()->clear_domains();
      out->mutable_last_progress()->clear_expert_loads();
    }
  }
  return resp;
}

std::vector<RankRef> Jobs::Unreported(const Entry& e, const Attempt& a) const {
  std::vector<RankRef> out;
  for (const auto& r : a.ranks()) {
    if (e.results.count(r.rank()) > 0) continue;
    out.push_back({r.worker_id(), e.job.id(), a.number(), r.rank()});
  }
  return out;
}

absl::StatusOr<Jobs::Ended> Jobs::Cancel(const std::string& job_id, const std::string& reason) {
  Lock lock(mu_);
  if (shutdown_) return absl::UnavailableError("the coordinator is shutting down");
  Entry* e = Find(job_id);
  if (e == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  if (IsTerminal(e->job.state())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, " already ended (", rackrun::v1::JobState_Name(e->job.state()), ")"));
  }
  const int64_t now = clock_();
  Job next = e->job;
  Ended out;
  int attempt = 0;
  if (Attempt* a = Current(next); a != nullptr && a->state() == rackrun::v1::RUNNING) {
    a->set_state(rackrun::v1::CANCELLED);
    a->set_finished_unix_ms(now);
    attempt = a->number();
    out.to_cancel = Unreported(*e, *a);
  }
  next.set_state(rackrun::v1::CANCELLED);
  next.set_finished_unix_ms(now);
  next.set_message(reason.empty() ? "cancelled" : absl::StrCat("cancelled: ", reason));
  std::vector<JobEvent> events;
  events.push_back(MessageEvent(next.message(), attempt));
  events.push_back(StateEvent(rackrun::v1::CANCELLED, attempt));
  if (absl::Status s = Commit(*e, std::move(next), std::move(events)); !s.ok()) return s;
  e->awaiting_reattach.clear();
  out.job = e->job;
  return out;
}

std::vector<QueuedJob> Jobs::Queue() const {
  Lock lock(mu_);
  std::vector<QueuedJob> q;
  for (const auto& [num, e] : jobs_) {
    if (e.job.state() == rackrun::v1::QUEUED)
      q.push_back({e.job.id(), e.job.spec(), e.not_before_ms});
  }
  return q;
}

void Jobs::NoteUnplaced(const std::string& job_id, const std::string& reason) {
  Lock lock(mu_);
  if (shutdown_) return;
  Entry* e = Find(job_id);
  if (e == nullptr || e->job.state() != rackrun::v1::QUEUED || e->job.message() == reason) return;
  Job next = e->job;
  next.set_message(reason);
  const int attempt = next.attempts().empty() ? 0 : next.attempts().rbegin()->number();
  // A store that cannot write now is asked again on the next tick.
  (void)Commit(*e, std::move(next), {MessageEvent(reason, attempt)});
}

absl::StatusOr<Attempt> Jobs::StartAttempt(const std::string& job_id,
                                           const std::vector<rackrun::v1::RankPlacement>& ranks,
                                           const std::string& placement_note) {
  Lock lock(mu_);
  Entry* e = Find(job_id);
  if (e == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  if (e->job.state() != rackrun::v1::QUEUED) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " is not queued"));
  }
  const int64_t now = clock_();
  Job next = e->job;
  Attempt* a = next.add_attempts();
  a->set_number(next.attempts_size());
  a->set_state(rackrun::v1::RUNNING);
  for (const auto& r : ranks) *a->add_ranks() = r;
  a->set_start_step(a->number() > 1 ? e->checkpoint_step : 0);
  a->set_started_unix_ms(now);
  next.set_state(rackrun::v1::RUNNING);
  if (next.started_unix_ms() == 0) next.set_started_unix_ms(now);
  std::vector<std::string> where;
  for (const auto& r : ranks) where.push_back(absl::StrCat(r.worker_id(), "@", r.host()));
  next.set_message(
      absl::StrCat("attempt ", a->number(), " running on ", absl::StrJoin(where, ", ")));
  const Attempt started = *a;
  std::vector<JobEvent> events;
  events.push_back(MessageEvent(next.message(), started.number()));
  if (!placement_note.empty()) events.push_back(MessageEvent(placement_note, started.number()));
  events.push_back(StateEvent(rackrun::v1::RUNNING, started.number()));
  if (absl::Status s = Commit(*e, std::move(next), std::move(events)); !s.ok()) return s;
  e->results.clear();
  e->awaiting_reattach.clear();
  return started;
}

absl::StatusOr<Jobs::Ended> Jobs::FailLocked(Entry& e, int attempt, Failure failure) {
  Ended out;
  Job next = e.job;
  Attempt* a = Current(next);
  if (a == nullptr || a->number() != attempt || a->state() != rackrun::v1::RUNNING ||
      next.state() != rackrun::v1::RUNNING) {
    out.job = e.job;
    return out;
  }
  const int64_t now = clock_();
  if (failure.time_unix_ms() == 0) failure.set_time_unix_ms(now);
  a->set_state(rackrun::v1::FAILED);
  a->set_finished_unix_ms(now);
  *a->mutable_failure() = failure;
  if (!next.has_first_failure()) *next.mutable_first_failure() = failure;
  out.to_cancel = Unreported(e, *a);

  std::vector<JobEvent> events;
  JobEvent fe;
  fe.set_attempt(attempt);
  *fe.mutable_failure() = failure;
  events.push_back(fe);
  absl::StatusOr<jobspec::RestartPolicy> policy = jobspec::RestartPolicyOf(next.spec());
  const jobspec::RestartPolicy p = policy.ok() ? *policy : jobspec::RestartPolicy{};
  const std::string what = absl::StrCat("attempt ", attempt, " failed: ", DescribeFailure(failure));
  if (attempt < p.max_attempts && p.Restarts(failure.kind())) {
    const int64_t delay = p.BackoffMs(attempt + 1);
    next.set_state(rackrun::v1::QUEUED);
    next.set_restarts(next.restarts() + 1);
    next.set_message(absl::StrCat(what, "; restarting as attempt ", attempt + 1, " of ",
                                  p.max_attempts, " in ", delay / 1000.0, " s"));
    events.push_back(MessageEvent(next.message(), attempt));
    events.push_back(StateEvent(rackrun::v1::QUEUED, attempt));
    if (absl::Status s = Commit(e, std::move(next), std::move(events)); !s.ok()) return s;
    e.not_before_ms = now + delay;
  } else {
    next.set_state(rackrun::v1::FAILED);
    next.set_finished_unix_ms(now);
    next.set_message(what);
    events.push_back(StateEvent(rackrun::v1::FAILED, attempt));
    if (absl::Status s = Commit(e, std::move(next), std::move(events)); !s.ok()) return s;
  }
  e.awaiting_reattach.clear();
  out.job = e.job;
  return out;
}

absl::Status Jobs::ReplaceVerdictLocked(Entry& e, int attempt, Failure own) {
  const Failure& verdict = e.job.attempts(attempt - 1).failure();
  const int64_t now = clock_();
  if (e.job.attempts(attempt - 1).state() != rackrun::v1::FAILED ||
      verdict.kind() != rackrun::v1::HANG || verdict.rank() != own.rank() ||
      !verdict.replaced_verdict().empty() ||
      now - verdict.time_unix_ms() > options_.report_grace_ms) {
    return absl::OkStatus();
  }
  own.set_time_unix_ms(now);
  own.set_replaced_verdict(DescribeFailure(verdict));
  Job next = e.job;
  if (next.first_failure().SerializeAsString() == verdict.SerializeAsString()) {
    *next.mutable_first_failure() = own;
  }
  *next.mutable_attempts(attempt - 1)->mutable_failure() = own;
  const std::string what = absl::StrCat("attempt ", attempt, " failed: ", DescribeFailure(own));
  std::vector<JobEvent> events;
  JobEvent fe;
  fe.set_attempt(attempt);
  *fe.mutable_failure() = own;
  events.push_back(fe);
  events.push_back(MessageEvent(absl::StrCat("rank ", own.rank(), "'s own failure report arrived ",
                                             (now - verdict.time_unix_ms()) / 1000.0,
                                             " s after the hang verdict and replaces it"),
                                attempt));
  const bool last = attempt == next.attempts_size();
  absl::StatusOr<jobspec::RestartPolicy> policy = jobspec::RestartPolicyOf(next.spec());
  const jobspec::RestartPolicy p = policy.ok() ? *policy : jobspec::RestartPolicy{};
  if (last && next.state() == rackrun::v1::FAILED) {
    next.set_message(what);
  } else if (last && next.state() == rackrun::v1::QUEUED && !p.Restarts(own.kind())) {
    // The verdict restarted the job; the rank's own error is not a reason to.
    next.set_state(rackrun::v1::FAILED);
    next.set_finished_unix_ms(now);
    next.set_message(absl::StrCat(what, "; not restarted (restart.on does not include ",
                                  jobspec::FailureKindName(own.kind()), ")"));
    events.push_back(MessageEvent(next.message(), attempt));
    events.push_back(StateEvent(rackrun::v1::FAILED, attempt));
  }
  return Commit(e, std::move(next), std::move(events));
}

absl::StatusOr<Jobs::Ended> Jobs::FailAttempt(const std::string& job_id, int attempt,
                                              const Failure& failure) {
  Lock lock(mu_);
  Entry* e = Find(job_id);
  if (e == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  return FailLocked(*e, attempt, failure);
}

absl::StatusOr<Jobs::Ended> Jobs::RankResult(const std::string& job_id, int attempt, int rank,
                                             const AttemptResult& result) {
  Lock lock(mu_);
  Entry* e = Find(job_id);
  absl::StatusOr<const rackrun::v1::RankPlacement*> found = PlacementOf(e, job_id, attempt, rank);
  if (!found.ok()) return found.status();
  const rackrun::v1::RankPlacement* placement = *found;
  const Attempt& a = e->job.attempts(attempt - 1);
  Ended out;
  auto failure_of = [&](rackrun::v1::FailureKind kind) {
    Failure f;
    f.set_kind(kind);
    f.set_rank(rank);
    f.set_worker_id(placement->worker_id());
    f.set_host(placement->host());
    f.set_pid(placement->pid());
    f.set_phase(result.phase());
    f.set_step(result.step());
    f.set_message(result.message());
    return f;
  };
  const bool current = attempt == e->job.attempts_size() && a.state() == rackrun::v1::RUNNING &&
                       e->job.state() == rackrun::v1::RUNNING;
  if (!current) {
    if (result.outcome() == AttemptResult::FAILED) {
      if (absl::Status s = ReplaceVerdictLocked(*e, attempt, failure_of(rackrun::v1::ERROR));
          !s.ok())
        return s;
    }
    out.job = e->job;
    return out;
  }
  const bool repeated = e->results.count(rank) > 0;  // a retry whose answer was lost
  e->results[rank] = result.outcome();
  // Its result says it lives (and has ended): after a coordinator restart it is not awaited,
  // whether or not it registered again first.
  const bool was_awaited = e->awaiting_reattach.erase(rank) > 0;
  switch (result.outcome()) {
    case AttemptResult::FAILED:
      return FailLocked(*e, attempt, failure_of(rackrun::v1::ERROR));
    case AttemptResult::DRAINED:
    case AttemptResult::CANCELLED: {
      Failure f = failure_of(rackrun::v1::WORKER_CANCELLED);
      if (f.message().empty()) f.set_message("the worker stopped the job (shut down)");
      return FailLocked(*e, attempt, f);
    }
    case AttemptResult::SUCCEEDED:
      break;
    default:
      return absl::InvalidArgumentError(
          "result.outcome: set SUCCEEDED, FAILED, CANCELLED or DRAINED");
  }
  JobEvent done;
  done.set_attempt(attempt);
  done.mutable_rank_done()->set_rank(rank);
  done.mutable_rank_done()->set_step(result.step());
  done.mutable_rank_done()->set_worker_id(placement->worker_id());
  const bool all_succeeded = static_cast<int>(e->results.size()) == a.ranks_size() &&
                             std::all_of(e->results.begin(), e->results.end(), [](const auto& r) {
                               return r.second == AttemptResult::SUCCEEDED;
                             });
  if (!all_succeeded) {
    if (!repeated) {
      if (absl::Status s = Commit(*e, e->job, {std::move(done)}); !s.ok()) {
        // Not stored: as if it had not come (the worker sends it again).
        e->results.erase(rank);
        if (was_awaited) e->awaiting_reattach.insert(rank);
        return s;
      }
    }
    out.job = e->job;
    return out;
  }
  const int64_t now = clock_();
  Job next = e->job;
  Attempt& na = *next.mutable_attempts(next.attempts_size() - 1);
  na.set_state(rackrun::v1::SUCCEEDED);
  na.set_finished_unix_ms(now);
  next.set_state(rackrun::v1::SUCCEEDED);
  next.set_finished_unix_ms(now);
  next.set_message(result.message().empty()
                       ? absl::StrCat("succeeded at step ", result.step())
                       : absl::StrCat("succeeded at step ", result.step(), ": ", result.message()));
  std::vector<JobEvent> events;
  events.push_back(std::move(done));
  events.push_back(MessageEvent(next.message(), attempt));
  events.push_back(StateEvent(rackrun::v1::SUCCEEDED, attempt));
  if (absl::Status s = Commit(*e, std::move(next), std::move(events)); !s.ok()) return s;
  out.job = e->job;
  return out;
}

absl::Status Jobs::Progress(const std::string& job_id, int attempt,
                            const rackrun::v1::StepProgress& p) {
  Lock lock(mu_);
  Entry* e = Find(job_id);
  if (e == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  const Attempt* a =
      e->job.attempts().empty() ? nullptr : &e->job.attempts(e->job.attempts_size() - 1);
  if (a == nullptr || a->number() != attempt || a->state() != rackrun::v1::RUNNING) {
    return absl::OkStatus();
  }
  Job next = e->job;
  *next.mutable_last_progress() = p;
  JobEvent ev;
  ev.set_attempt(attempt);
  *ev.mutable_progress() = p;
  if (clock_() - e->progress_event_ms < options_.progress_event_interval_ms) {
    // Kept back: the job shows it at once, an event carries it later (Commit).
    e->job = std::move(next);
    e->progress_pending = std::move(ev);
    return absl::OkStatus();
  }
  return Commit(*e, std::move(next), {ev});
}

absl::Status Jobs::Checkpoint(const std::string& job_id, int attempt, const std::string& path) {
  Lock lock(mu_);
  Entry* e = Find(job_id);
  if (e == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  e->checkpoint_step = e->job.last_progress().step();
  return Commit(*e, e->job, {MessageEvent(absl::StrCat(kCheckpointEventPrefix, path), attempt)});
}

bool Jobs::AttemptRunning(const std::string& job_id, int attempt) const {
  Lock lock(mu_);
  const Entry* e = Find(job_id);
  if (e == nullptr || e->job.attempts().empty() || e->job.state() != rackrun::v1::RUNNING)
    return false;
  const Attempt& a = e->job.attempts(e->job.attempts_size() - 1);
  return a.number() == attempt && a.state() == rackrun::v1::RUNNING;
}

absl::StatusOr<const rackrun::v1::RankPlacement*> Jobs::PlacementOf(const Entry* e,
                                                                    const std::string& job_id,
                                                                    int attempt, int rank) {
  if (e == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  if (attempt < 1 || attempt > e->job.attempts_size()) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " has no attempt ", attempt));
  }
  for (const auto& r : e->job.attempts(attempt - 1).ranks()) {
    if (r.rank() == rank) return &r;
  }
  return absl::NotFoundError(
      absl::StrCat("attempt ", attempt, " of job ", job_id, " has no rank ", rank));
}

absl::Status Jobs::CheckReporter(const std::string& job_id, int attempt, int rank,
                                 const std::string& worker_id) const {
  Lock lock(mu_);
  absl::StatusOr<const rackrun::v1::RankPlacement*> placement =
      PlacementOf(Find(job_id), job_id, attempt, rank);
  if (!placement.ok()) return placement.status();
  if ((*placement)->worker_id() == worker_id) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "rank ", rank, " of attempt ", attempt, " of job ", job_id, " runs on worker ",
      (*placement)->worker_id(), ", not on '", worker_id,
      "': its report is refused (a job kept from a job store this coordinator no longer "
      "has, whose number came back as another job's?)"));
}

absl::Status Jobs::Reattach(const std::string& job_id, int attempt, int rank,
                            const rackrun::v1::RankPlacement& placement) {
  Lock lock(mu_);
  Entry* e = Find(job_id);
  if (e == nullptr || e->job.attempts().empty() || e->job.state() != rackrun::v1::RUNNING) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " is not running"));
  }
  const Attempt& a = e->job.attempts(e->job.attempts_size() - 1);
  if (a.number() != attempt || a.state() != rackrun::v1::RUNNING) {
    return absl::FailedPreconditionError(
        absl::StrCat("attempt ", attempt, " of job ", job_id, " is no longer running"));
  }
  int index = -1;
  for (int i = 0; i < a.ranks_size(); ++i) {
    if (a.ranks(i).rank() == rank) index = i;
  }
  if (index < 0 || e->results.count(rank) > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " is not running attempt ", attempt));
  }
  const auto& old = a.ranks(index);
  if (old.worker_id() != placement.worker_id()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " of attempt ", attempt, " of job ", job_id, " runs on worker ",
                     old.worker_id(), ", not on ", placement.worker_id()));
  }
  e->awaiting_reattach.erase(rank);
  if (old.host() == placement.host() && old.pid() == placement.pid()) {
    return absl::OkStatus();
  }
  Job next = e->job;
  rackrun::v1::RankPlacement* moved =
      next.mutable_attempts(next.attempts_size() - 1)->mutable_ranks(index);
  const int domain = moved->domain();  // the rank's domain stays; its worker changed
  *moved = placement;
  moved->set_domain(domain);
  return Commit(
      *e, std::move(next),
      {MessageEvent(absl::StrCat("rank ", rank, " re-attached as ", placement.worker_id()),
                    attempt)});
}

std::vector<Jobs::Ended> Jobs::ExpireReattach() {
  Lock lock(mu_);
  const int64_t now = clock_();
  std::vector<Ended> out;
  for (auto& [num, e] : jobs_) {
    if (e.awaiting_reattach.empty() || now < e.reattach_deadline_ms) continue;
    const Attempt& a = e.job.attempts(e.job.attempts_size() - 1);
    const int first = *e.awaiting_reattach.begin();
    Failure f;
    f.set_kind(rackrun::v1::WORKER_LOST);
    f.set_rank(first);
    for (const auto& r : a.ranks()) {
      if (r.rank() == first) {
        f.set_worker_id(r.worker_id());
        f.set_host(r.host());
        f.set_pid(r.pid());
      }
    }
    f.set_step(e.job.last_progress().step());
    f.set_message(absl::StrCat("rank(s) ", absl::StrJoin(e.awaiting_reattach, ", "),
                               " did not re-attach within ", options_.reattach_grace_ms / 1000.0,
                               " s after the coordinator restarted"));
    absl::StatusOr<Ended> ended = FailLocked(e, a.number(), f);
    e.awaiting_reattach.clear();
    if (ended.ok()) out.push_back(*std::move(ended));
  }
  return out;
}

absl::Status Jobs::WaitEvents(const std::string& job_id, int64_t after_seq, absl::Duration max_wait,
                              std::vector<JobEvent>* out, bool* done) const {
  Lock lock(mu_);
  const Entry* e = Find(job_id);
  if (e == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  const absl::Time deadline = absl::Now() + max_wait;
  while (!shutdown_ && (e->events.empty() || e->events.back().seq() <= after_seq) &&
         !IsTerminal(e->job.state())) {
    const bool timed_out = WaitUntil(cv_, lock, deadline);
    // Looked up again: while the lock was free the job may have ended and been forgotten
    // from memory (ForgetEnded); Find reads it back.
    e = Find(job_id);
    if (e == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
    if (timed_out) break;
  }
  *done = false;
  for (const JobEvent& ev : e->events) {
    if (ev.seq() <= after_seq) {
      if (ev.has_state() && IsTerminal(ev.state())) *done = true;
      continue;
    }
    out->push_back(ev);
    if (ev.has_state() && IsTerminal(ev.state())) *done = true;
  }
  if (shutdown_ && !*done && out->empty())
    return absl::UnavailableError("the coordinator is shutting down");
  return absl::OkStatus();
}

void Jobs::Shutdown() {
  Lock lock(mu_);
  shutdown_ = true;
  cv_.notify_all();
}

}  // namespace rackrun::coordinator
