#include "coordinator/services.h"

#include <new>
#include <thread>

#include "absl/strings/str_cat.h"
#include "jobspec/balancer.h"
#include "jobspec/restart_policy.h"
#include "jobspec/spec.h"

namespace rackrun::coordinator {

namespace {

grpc::Status Unavailable() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      "the coordinator is replaying its state or shutting down; retry shortly");
}

// The refusal of a call beyond its CallCounter's limit.
grpc::Status TooMany(absl::string_view method, const CallCounter& counter, absl::string_view what,
                     absl::string_view flag, absl::string_view fix) {
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      absl::StrCat(method, ": ", counter.max(), " ", what,
                                   " are open on this coordinator, its limit (", flag, " ",
                                   counter.max(), "); ", fix));
}
}  // namespace

std::optional<CallCounter::Pass> CallCounter::TryEnter() {
  int n = open_.load();
  do {
    if (n >= max_) return std::nullopt;
  } while (!open_.compare_exchange_weak(n, n + 1));
  return Pass(&open_);
}

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

absl::Status CheckSubmittedSpec(const rackrun::v1::JobSpec& spec) {
  if (absl::Status s = jobspec::ValidateJobSpec(spec); !s.ok()) return s;
  if (absl::StatusOr<jobspec::RestartPolicy> p = jobspec::RestartPolicyOf(spec); !p.ok()) {
    return p.status();
  }
  // Workers resolve a relative path against their own working directory; rackrun submit
  // sends them absolute, a raw gRPC client must too.
  if (absl::Status s = jobspec::CheckSpecPathsAbsolute(spec); !s.ok()) return s;
  if (jobspec::PlannedByCoordinator(spec)) {
    if (absl::StatusOr<jobspec::BalancerSetup> s =
            jobspec::BalancerSetupOf(spec, std::max(1, spec.resources().ranks()));
        !s.ok()) {
      return s.status();
    }
  }
  return absl::OkStatus();
}

// ---- JobService ----

grpc::Status ServiceBase::Admit(const grpc::ServerContext& ctx, Access access,
                                std::string_view method) const {
  if (grpc::Status s = auth_->Check(ctx, access, method); !s.ok()) return s;
  if (!gate_->serving()) return Unavailable();
  return grpc::Status::OK;
}

// A function-try-block: a submission whose handling runs out of memory is answered
// RESOURCE_EXHAUSTED with a message (gRPC would say only "Unexpected error in RPC handling").
grpc::Status JobServiceImpl::Submit(grpc::ServerContext* ctx, const rackrun::v1::SubmitRequest* req,
                                    rackrun::v1::SubmitResponse* resp) try {
  if (grpc::Status s = Admit(*ctx, Access::kJobs, "JobService.Submit"); !s.ok()) return s;
  if (req->request_id().empty()) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        "request_id: required; send a fresh unique id (e.g. a UUID) and reuse it on retries");
  }
  if (!req->has_spec()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "spec: required");
  rackrun::v1::JobSpec spec = req->spec();
  jobspec::ApplySpecDefaults(spec);
  if (absl::Status s = CheckSubmittedSpec(spec); !s.ok()) return ToGrpc(s);
  absl::StatusOr<JobStore::InsertResult> r = rack_->jobs().Submit(spec, req->request_id());
  if (!r.ok()) return ToGrpc(r.status());
  *resp->mutable_job() = r->job;
  resp->set_created(r->created);
  return grpc::Status::OK;
} catch (const std::bad_alloc&) {
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      "the coordinator ran out of memory handling this submission; retry later "
                      "or submit a smaller spec");
}

grpc::Status JobServiceImpl::Get(grpc::ServerContext* ctx, const rackrun::v1::GetJobRequest* req,
                                 rackrun::v1::Job* resp) {
  if (grpc::Status s = Admit(*ctx, Access::kRead, "JobService.Get"); !s.ok()) return s;
  absl::StatusOr<rackrun::v1::Job> j = rack_->jobs().Get(req->job_id());
  if (!j.ok()) return ToGrpc(j.status());
  *resp = *std::move(j);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::List(grpc::ServerContext* ctx, const rackrun::v1::ListJobsRequest* req,
                                  rackrun::v1::ListJobsResponse* resp) {
  if (grpc::Status s = Admit(*ctx, Access::kRead, "JobService.List"); !s.ok()) return s;
  absl::StatusOr<rackrun::v1::ListJobsResponse> r = rack_->jobs().List(*req);
  if (!r.ok()) return ToGrpc(r.status());
  *resp = *std::move(r);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::Cancel(grpc::ServerContext* ctx,
                                    const rackrun::v1::CancelJobRequest* req,
                                    rackrun::v1::Job* resp) {
  if (grpc::Status s = Admit(*ctx, Access::kJobs, "JobService.Cancel"); !s.ok()) return s;
  absl::StatusOr<rackrun::v1::Job> j = rack_->Cancel(req->job_id(), req->reason());
  if (!j.ok()) return ToGrpc(j.status());
  *resp = *std::move(j);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::Watch(grpc::ServerContext* ctx,
                                   const rackrun::v1::WatchJobRequest* req,
                                   grpc::ServerWriter<rackrun::v1::JobEvent>* writer) {
  if (grpc::Status s = Admit(*ctx, Access::kRead, "JobService.Watch"); !s.ok()) return s;
  const std::optional<CallCounter::Pass> pass = watches_.TryEnter();
  if (!pass.has_value()) {
    return TooMany("JobService.Watch", watches_, "watch streams", "--max-watch-streams",
                   "close some (rackrun watch, rackrun submit --watch) or raise the limit");
  }
  int64_t after = std::max<int64_t>(0, req->from_seq());
  while (!ctx->IsCancelled()) {
    if (!gate_->serving()) return Unavailable();
    std::vector<rackrun::v1::JobEvent> events;
    bool done = false;
    absl::Status s = rack_->jobs().WaitEvents(req->job_id(), after, poll_, &events, &done);
    if (!s.ok()) return ToGrpc(s);
    for (const rackrun::v1::JobEvent& e : events) {
      if (!writer->Write(e))
        return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
      after = e.seq();
    }
    if (done) return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
}

grpc::Status JobServiceImpl::ListWorkers(grpc::ServerContext* ctx,
                                         const rackrun::v1::ListWorkersRequest* req,
                                         rackrun::v1::ListWorkersResponse* resp) {
  if (grpc::Status s = Admit(*ctx, Access::kRead, "JobService.ListWorkers"); !s.ok()) return s;
  *resp = rack_->workers().List(req->include_gone());
  return grpc::Status::OK;
}

// ---- RackControl ----

grpc::Status RackControlImpl::Register(grpc::ServerContext* ctx,
                                       const rackrun::v1::RegisterRequest* req,
                                       rackrun::v1::RegisterResponse* resp) {
  if (grpc::Status s = Admit(*ctx, Access::kRack, "RackControl.Register"); !s.ok()) return s;
  absl::StatusOr<rackrun::v1::RegisterResponse> r = rack_->Register(*req);
  if (!r.ok()) return ToGrpc(r.status());
  *resp = *std::move(r);
  return grpc::Status::OK;
}

grpc::Status RackControlImpl::Heartbeat(grpc::ServerContext* ctx,
                                        const rackrun::v1::HeartbeatRequest* req,
                                        rackrun::v1::HeartbeatResponse* resp) {
  if (grpc::Status s = Admit(*ctx, Access::kRack, "RackControl.Heartbeat"); !s.ok()) return s;
  if (absl::Status s = rack_->CheckWorkerStore(req->store_id(), req->worker_id()); !s.ok())
    return ToGrpc(s);
  return ToGrpc(rack_->workers().Heartbeat(*req, resp));
}

grpc::Status RackControlImpl::Assignments(grpc::ServerContext* ctx,
                                          const rackrun::v1::AssignmentsRequest* req,
                                          grpc::ServerWriter<rackrun::v1::Assignment>* writer) {
  if (grpc::Status s = Admit(*ctx, Access::kRack, "RackControl.Assignments"); !s.ok()) return s;
  if (absl::Status s = rack_->CheckWorkerStore(req->store_id(), req->worker_id()); !s.ok())
    return ToGrpc(s);
  absl::StatusOr<int64_t> gen = rack_->workers().OpenStream(req->worker_id());
  if (!gen.ok()) return ToGrpc(gen.status());
  // Send the initial metadata now, so the worker knows the stream is open.
  writer->SendInitialMetadata();
  while (true) {
    if (ctx->IsCancelled()) {
      rack_->workers().CloseStream(req->worker_id(), *gen);
      return grpc::Status(grpc::StatusCode::CANCELLED, "the worker went away");
    }
    if (!gate_->serving()) return Unavailable();
    absl::StatusOr<std::optional<rackrun::v1::Assignment>> a =
        rack_->workers().NextAssignment(req->worker_id(), *gen, poll_);
    if (!a.ok()) {
      if (a.status().code() == absl::StatusCode::kUnavailable) return Unavailable();
      return ToGrpc(a.status());
    }
    if (a->has_value() && !writer->Write(**a)) {
      rack_->workers().CloseStream(req->worker_id(), *gen);
      return grpc::Status(grpc::StatusCode::CANCELLED, "the worker went away");
    }
  }
}

grpc::Status RackControlImpl::Report(grpc::ServerContext* ctx,
                                     const rackrun::v1::ReportRequest* req,
                                     rackrun::v1::ReportResponse* resp) {
  if (grpc::Status s = Admit(*ctx, Access::kRack, "RackControl.Report"); !s.ok()) return s;
  absl::StatusOr<rackrun::v1::ReportResponse> r = rack_->Report(*req);
  if (!r.ok()) return ToGrpc(r.status());
  *resp = *std::move(r);
  return grpc::Status::OK;
}

grpc::Status RackControlImpl::Deregister(grpc::ServerContext* ctx,
                                         const rackrun::v1::DeregisterRequest* req,
                                         rackrun::v1::DeregisterResponse*) {
  if (grpc::Status s = Admit(*ctx, Access::kRack, "RackControl.Deregister"); !s.ok()) return s;
  if (absl::Status s = rack_->CheckWorkerStore(req->store_id(), req->worker_id()); !s.ok())
    return ToGrpc(s);
  return ToGrpc(rack_->workers().Deregister(req->worker_id()));
}

grpc::Status RackControlImpl::StoreSet(grpc::ServerContext* ctx,
                                       const rackrun::v1::StoreSetRequest* req,
                                       rackrun::v1::StoreSetResponse*) {
  if (grpc::Status s = Admit(*ctx, Access::kRack, "RackControl.StoreSet"); !s.ok()) return s;
  if (req->key().empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "key: required");
  if (absl::Status s = rack_->CheckRunStore(req->store_id(), req->job_id(), req->attempt());
      !s.ok())
    return ToGrpc(s);
  if (!rack_->jobs().AttemptRunning(req->job_id(), req->attempt())) {
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        absl::StrCat("attempt ", req->attempt(), " of job '", req->job_id(), "' is not running"));
  }
  rack_->rendezvous().Set(req->job_id(), req->attempt(), req->key(), req->value());
  return grpc::Status::OK;
}

grpc::Status RackControlImpl::StoreGet(grpc::ServerContext* ctx,
                                       const rackrun::v1::StoreGetRequest* req,
                                       rackrun::v1::StoreGetResponse* resp) {
  if (grpc::Status s = Admit(*ctx, Access::kRack, "RackControl.StoreGet"); !s.ok()) return s;
  if (absl::Status s = rack_->CheckRunStore(req->store_id(), req->job_id(), req->attempt());
      !s.ok())
    return ToGrpc(s);
  if (!rack_->jobs().AttemptRunning(req->job_id(), req->attempt())) {
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        absl::StrCat("attempt ", req->attempt(), " of job '", req->job_id(), "' is not running"));
  }
  std::vector<std::string> keys(req->keys().begin(), req->keys().end());
  if (req->no_wait()) {
    absl::StatusOr<std::vector<std::string>> v =
        rack_->rendezvous().Get(req->job_id(), req->attempt(), keys, absl::Now());
    if (!v.ok()) {
      return v.status().code() == absl::StatusCode::kDeadlineExceeded
                 ? grpc::Status(grpc::StatusCode::NOT_FOUND, std::string(v.status().message()))
                 : ToGrpc(v.status());
    }
    for (std::string& x : *v) resp->add_values(std::move(x));
    return grpc::Status::OK;
  }
  const std::optional<CallCounter::Pass> pass = waits_.TryEnter();
  if (!pass.has_value()) {
    return TooMany("RackControl.StoreGet", waits_, "rendezvous waits and plan streams",
                   "--max-rack-waits", "raise the limit for racks of that many ranks");
  }
  // Bounded by the call's deadline and by the channel timeout.
  absl::Time deadline = absl::Now() + absl::Milliseconds(rack_->options().channel_timeout_ms);
  deadline = std::min(deadline, absl::FromChrono(ctx->deadline()));
  // Wait in slices so a client that goes away frees the thread.
  while (true) {
    const absl::Time slice = std::min(deadline, absl::Now() + poll_);
    absl::StatusOr<std::vector<std::string>> v =
        rack_->rendezvous().Get(req->job_id(), req->attempt(), keys, slice);
    if (v.ok()) {
      for (std::string& x : *v) resp->add_values(std::move(x));
      return grpc::Status::OK;
    }
    if (v.status().code() != absl::StatusCode::kDeadlineExceeded || slice >= deadline)
      return ToGrpc(v.status());
    if (ctx->IsCancelled())
      return grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
  }
}

grpc::Status RackControlImpl::Plans(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<rackrun::v1::PlanReply, rackrun::v1::LoadRow>* stream) {
  if (grpc::Status s = Admit(*ctx, Access::kRack, "RackControl.Plans"); !s.ok()) return s;
  const std::optional<CallCounter::Pass> pass = waits_.TryEnter();
  if (!pass.has_value()) {
    return TooMany("RackControl.Plans", waits_, "rendezvous waits and plan streams",
                   "--max-rack-waits", "raise the limit for racks of that many ranks");
  }
  rackrun::v1::LoadRow first;
  if (!stream->Read(&first)) return grpc::Status::OK;
  if (first.job_id().empty() || first.attempt() < 1) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        "the first LoadRow of a Plans stream must name job_id, attempt, rank and domain");
  }
  const std::string job_id = first.job_id();
  const int attempt = first.attempt();
  const int rank = first.rank();
  const int domain = first.domain();
  if (absl::Status s = rack_->planning().AddRow(first); !s.ok()) return ToGrpc(s);

  std::mutex mu;
  bool reader_done = false;
  absl::Status reader_error;
  std::thread reader([&] {
    rackrun::v1::LoadRow row;
    absl::Status err;
    while (stream->Read(&row)) {
      if (row.job_id().empty()) row.set_job_id(job_id);
      if (row.attempt() == 0) row.set_attempt(attempt);
      if (row.job_id() != job_id || row.attempt() != attempt) {
        err = absl::InvalidArgumentError(
            "a Plans stream serves one (job, attempt); open another stream");
        break;
      }
      row.set_rank(rank);
      row.set_domain(domain);
      if (err = rack_->planning().AddRow(row); !err.ok()) break;
    }
    Lock lock(mu);
    reader_done = true;
    reader_error = err;
  });
  grpc::Status result = grpc::Status::OK;
  while (true) {
    bool done;
    {
      Lock lock(mu);
      done = reader_done;
      if (done && !reader_error.ok()) {
        result = ToGrpc(reader_error);
        break;
      }
    }
    if (ctx->IsCancelled()) {
      result = grpc::Status(grpc::StatusCode::CANCELLED, "the worker went away");
      break;
    }
    if (!gate_->serving()) {
      result = Unavailable();
      break;
    }
    absl::StatusOr<std::optional<rackrun::v1::PlanReply>> r =
        rack_->planning().NextReply(job_id, attempt, rank, done ? absl::ZeroDuration() : poll_);
    if (!r.ok()) {
      result = ToGrpc(r.status());
      break;
    }
    if (r->has_value()) {
      if (!stream->Write(**r)) break;
    } else if (done) {
      break;  // the rank closed its side and every reply for it was sent
    }
  }
  bool reader_finished;
  {
    Lock lock(mu);
    reader_finished = reader_done;
  }
  if (!reader_finished) ctx->TryCancel();  // unblocks the reader when we end first
  reader.join();
  return result;
}

}  // namespace rackrun::coordinator
