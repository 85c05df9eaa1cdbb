#include "coordinator/rack.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "coordinator/scheduler.h"
#include "jobspec/balancer.h"
#include "rpc/phase.h"

namespace rackrun::coordinator {

Rack::Rack(JobStore* store, Clock clock, Options options)
    : store_(store),
      clock_(clock),
      options_(options),
      jobs_(store, clock, options.jobs),
      workers_(clock, options.workers, [store] { return store->NextWorkerNumber(); }) {}

absl::Status Rack::Initialize() {
  absl::StatusOr<std::vector<StoredJob>> stored =
      store_->LoadAll(std::max(0, options_.jobs.max_ended_in_memory));
  if (!stored.ok()) return stored.status();
  return jobs_.Initialize(*std::move(stored));
}

void Rack::EndAttempt(const Jobs::Ended& ended, const std::string& job_id, int attempt,
                      const std::string& reason) {
  for (const RankRef& r : ended.to_cancel) {
    rackrun::v1::Assignment a;
    a.mutable_cancel()->set_job_id(r.job_id);
    a.mutable_cancel()->set_attempt(r.attempt);
    a.mutable_cancel()->set_reason(reason);
    workers_.Push(r.worker_id, a);
  }
  if (!jobs_.AttemptRunning(job_id, attempt)) {
    rendezvous_.Drop(job_id, attempt);
    planning_.Close(job_id, attempt);
  }
}

absl::StatusOr<rackrun::v1::Job> Rack::Cancel(const std::string& job_id,
                                              const std::string& reason) {
  Lock lock(mu_);
  absl::StatusOr<Jobs::Ended> ended = jobs_.Cancel(job_id, reason);
  if (!ended.ok()) return ended.status();
  const int attempt = ended->job.attempts().empty() ? 0 : ended->job.attempts().rbegin()->number();
  EndAttempt(*ended, job_id, attempt,
             reason.empty() ? "job cancelled" : absl::StrCat("job cancelled: ", reason));
  return ended->job;
}

bool Rack::OtherStore(uint64_t store_id) const {
  return store_id != 0 && store_id != store_->store_id();
}

namespace {
constexpr const char* kOtherStore =
    " is from another job store (this coordinator's was lost or replaced, and it numbers "
    "workers and jobs from 1 again); ";
}  // namespace

absl::Status Rack::CheckWorkerStore(uint64_t store_id, const std::string& id) const {
  if (!OtherStore(store_id)) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat("worker id '", id, "'", kOtherStore,
                                          "register again: this coordinator gives it a new id"));
}

absl::Status Rack::CheckRunStore(uint64_t store_id, const std::string& job_id, int attempt) const {
  if (!OtherStore(store_id)) return absl::OkStatus();
  return absl::NotFoundError(
      absl::StrCat("job ", job_id, " attempt ", attempt, kOtherStore,
                   "this coordinator does not run it, whatever job has that number here"));
}

absl::StatusOr<rackrun::v1::RegisterResponse> Rack::Register(
    const rackrun::v1::RegisterRequest& request) {
  Lock lock(mu_);
  const rackrun::v1::RegisterRequest* in = &request;
  rackrun::v1::RegisterRequest fresh;
  if (OtherStore(request.store_id()) && !request.worker_id().empty()) {
    // Its id (and any job it names) is another store's: a new id here, so that it neither
    // takes the registration of a worker this store numbered alike nor a job's rank.
    fresh = request;
    fresh.clear_worker_id();
    in = &fresh;
  }
  const rackrun::v1::RegisterRequest& req = *in;
  // The attempt it was busy with before registering again (see below).
  const std::optional<rackrun::v1::RunJob> had =
      req.worker_id().empty() ? std::nullopt : workers_.BusyRun(req.worker_id());
  absl::StatusOr<std::string> id = workers_.Register(req);
  if (!id.ok()) return id.status();
  rackrun::v1::RegisterResponse resp;
  resp.set_worker_id(*id);
  resp.set_store_id(store_->store_id());
  if (in != &request) {
    std::fprintf(stderr,
                 "rackrun-coordinator: worker %s (host %s) registered with an id from another "
                 "job store: it is %s here\n",
                 request.worker_id().c_str(), request.host().c_str(), id->c_str());
  }
  resp.set_heartbeat_interval_ms(options_.workers.heartbeat_interval_ms);
  resp.set_heartbeat_timeout_ms(options_.workers.heartbeat_timeout_ms);
  if (!req.job_id().empty()) {
    absl::StatusOr<rackrun::v1::RankPlacement> p = workers_.Placement(*id);
    if (p.ok()) {
      p->set_rank(req.rank());
      if (jobs_.Reattach(req.job_id(), req.attempt(), req.rank(), *p).ok()) {
        workers_.SetBusy(*id, req.job_id(), req.attempt(), req.rank());
        resp.set_job_attached(true);
        absl::StatusOr<rackrun::v1::Job> job = jobs_.Get(req.job_id());
        if (job.ok() && jobspec::PlannedByCoordinator(job->spec())) {
          (void)planning_.Open(req.job_id(), req.attempt(), job->spec(), RanksOf(job->spec()));
        }
      }
    }
  } else if (had.has_value() && jobs_.AttemptRunning(had->job_id(), had->attempt())) {
    // Busy with a running attempt it does not name: the run died with its old stream (the
    // connection was gone before the run reached the worker) or waits in its queue. It is
    // sent again on the new stream; a worker ignores a run it already has.
    workers_.SetBusy(*id, had->job_id(), had->attempt(), had->rank());
    rackrun::v1::Assignment a;
    *a.mutable_run() = *had;
    workers_.Push(*id, a);
    std::fprintf(stderr,
                 "rackrun-coordinator: %s registered again without job %s attempt %d (its "
                 "stream closed before the run reached it?): sending the run again\n",
                 id->c_str(), had->job_id().c_str(), had->attempt());
  }
  return resp;
}

absl::StatusOr<rackrun::v1::ReportResponse> Rack::Report(const rackrun::v1::ReportRequest& req) {
  Lock lock(mu_);
  if (req.job_id().empty()) return absl::InvalidArgumentError("job_id: required");
  if (req.attempt() < 1) return absl::InvalidArgumentError("attempt: required (1-based)");
  if (absl::Status s = CheckRunStore(req.store_id(), req.job_id(), req.attempt()); !s.ok())
    return s;
  if (absl::Status s =
          jobs_.CheckReporter(req.job_id(), req.attempt(), req.rank(), req.worker_id());
      !s.ok())
    return s;
  switch (req.report_case()) {
    case rackrun::v1::ReportRequest::kProgress:
      if (req.rank() == 0) {
        if (absl::Status s = jobs_.Progress(req.job_id(), req.attempt(), req.progress()); !s.ok())
          return s;
      }
      break;
    case rackrun::v1::ReportRequest::kCheckpoint:
      if (absl::Status s = jobs_.Checkpoint(req.job_id(), req.attempt(), req.checkpoint()); !s.ok())
        return s;
      break;
    case rackrun::v1::ReportRequest::kResult: {
      absl::StatusOr<Jobs::Ended> ended =
          jobs_.RankResult(req.job_id(), req.attempt(), req.rank(), req.result());
      if (!ended.ok()) return ended.status();
      // A worker that drained shuts down: DRAINING until it deregisters, so the restart
      // this report may trigger is never placed on it.
      if (req.result().outcome() == rackrun::v1::AttemptResult::DRAINED) {
        workers_.SetDraining(req.worker_id(), req.job_id());
      } else {
        workers_.SetIdle(req.worker_id(), req.job_id());
      }
      EndAttempt(*ended, req.job_id(), req.attempt(),
                 absl::StrCat("attempt ", req.attempt(), " ended: ", ended->job.message()));
      StartJobs();
      break;
    }
    default:
      return absl::InvalidArgumentError("report: set progress, result or checkpoint");
  }
  rackrun::v1::ReportResponse resp;
  resp.set_stop(!jobs_.AttemptRunning(req.job_id(), req.attempt()));
  return resp;
}

void Rack::StartJobs() {
  Unplaced unplaced;
  const std::vector<Placement> placements =
      Schedule(jobs_.Queue(), workers_.Idle(), clock_(), &unplaced, workers_.BusyGpuWorkers());
  if (!unplaced.job_id.empty()) jobs_.NoteUnplaced(unplaced.job_id, unplaced.reason);
  for (const Placement& p : placements) {
    std::vector<rackrun::v1::RankPlacement> ranks;
    for (size_t r = 0; r < p.ranks.size(); ++r) {
      rackrun::v1::RankPlacement rp;
      rp.set_rank(static_cast<int>(r));
      rp.set_worker_id(p.ranks[r].worker_id);
      rp.set_host(p.ranks[r].host);
      rp.set_pid(p.ranks[r].pid);
      rp.set_rack(p.ranks[r].rack);
      rp.set_domain(static_cast<int>(r) / p.expert_parallel);
      ranks.push_back(rp);
    }
    absl::StatusOr<rackrun::v1::Attempt> attempt = jobs_.StartAttempt(p.job_id, ranks, p.note);
    if (!attempt.ok()) continue;
    if (!p.note.empty()) {
      std::fprintf(stderr, "rackrun-coordinator: job %s attempt %d: %s\n", p.job_id.c_str(),
                   attempt->number(), p.note.c_str());
    }
    absl::StatusOr<rackrun::v1::Job> job = jobs_.Get(p.job_id);
    if (!job.ok()) continue;
    const rackrun::v1::JobSpec& spec = job->spec();
    for (size_t r = 0; r < p.ranks.size(); ++r) {
      workers_.SetBusy(p.ranks[r].worker_id, p.job_id, attempt->number(), static_cast<int>(r));
    }
    if (jobspec::PlannedByCoordinator(spec)) {
      if (absl::Status s = planning_.Open(p.job_id, attempt->number(), spec, RanksOf(spec));
          !s.ok()) {
        rackrun::v1::Failure f;
        f.set_kind(rackrun::v1::ERROR);
        f.set_rank(-1);
        f.set_phase(rpc::PhaseName(rpc::Phase::kStarting));
        f.set_message(absl::StrCat("coordinator-mode planning: ", s.message()));
        (void)jobs_.FailAttempt(p.job_id, attempt->number(), f);
        for (const IdleWorker& w : p.ranks) workers_.SetIdle(w.worker_id, p.job_id);
        continue;
      }
    }
    // Ranks that share a host share its memory: each worker checks the job against it.
    std::map<std::string, int> ranks_on_host;
    for (const IdleWorker& w : p.ranks) ++ranks_on_host[w.host];
    for (size_t r = 0; r < p.ranks.size(); ++r) {
      rackrun::v1::Assignment a;
      rackrun::v1::RunJob* run = a.mutable_run();
      run->set_job_id(p.job_id);
      run->set_attempt(attempt->number());
      run->set_rank(static_cast<int>(r));
      run->set_ranks(static_cast<int>(p.ranks.size()));
      *run->mutable_spec() = spec;
      run->set_resume(attempt->number() > 1);
      run->set_ranks_on_host(ranks_on_host[p.ranks[r].host]);
      run->set_store_id(store_->store_id());
      rackrun::v1::Bootstrap* b = run->mutable_bootstrap();
      b->set_channel(ChannelOf(spec));
      b->set_store_prefix(absl::StrCat("jobs/", p.job_id, "/", attempt->number(), "/"));
      b->set_address(p.ranks[r].data_address.empty() ? p.ranks[r].host : p.ranks[r].data_address);
      b->set_timeout_ms(options_.channel_timeout_ms);
      workers_.Push(p.ranks[r].worker_id, a);
    }
  }
}

void Rack::Tick() {
  Lock lock(mu_);
  for (const Finding& f : workers_.Detect()) {
    absl::StatusOr<Jobs::Ended> ended = jobs_.FailAttempt(f.job_id, f.attempt, f.failure);
    if (!ended.ok()) continue;
    EndAttempt(*ended, f.job_id, f.attempt,
               absl::StrCat("attempt ", f.attempt, " failed: ", DescribeFailure(f.failure)));
  }
  for (const Jobs::Ended& ended : jobs_.ExpireReattach()) {
    const rackrun::v1::Attempt& a = *ended.job.attempts().rbegin();
    EndAttempt(ended, ended.job.id(), a.number(),
               absl::StrCat("attempt ", a.number(), " failed: ", DescribeFailure(a.failure())));
  }
  jobs_.ForgetEnded();
  StartJobs();
}

void Rack::Shutdown() {
  jobs_.Shutdown();
  workers_.Shutdown();
  rendezvous_.Shutdown();
  planning_.Shutdown();
}

}  // namespace rackrun::coordinator
