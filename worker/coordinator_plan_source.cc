#include "worker/coordinator_plan_source.h"

#include <chrono>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "rpc/plan_codec.h"

namespace rackrun::worker {

CoordinatorPlanSource::~CoordinatorPlanSource() {
  if (stream_ != nullptr) {
    stream_->WritesDone();
    rackrun::v1::PlanReply rest;
    while (stream_->Read(&rest)) {
    }
    (void)stream_->Finish();
  }
}

void CoordinatorPlanSource::OpenStream() {
  if (stream_ != nullptr) return;
  // One stream per (job, attempt, rank) for the whole attempt; its deadline only bounds
  // a coordinator that stops answering for a day.
  context_ = connection_.NewContext(std::chrono::hours(24));
  stub_ = connection_.stub();  // the stream's channel lives as long as the stream
  stream_ = stub_->Plans(context_.get());
  first_ = true;
}

rackrun::v1::LoadRow CoordinatorPlanSource::NewRow() {
  rackrun::v1::LoadRow row;
  if (first_) {
    row.set_job_id(job_id_);
    row.set_attempt(attempt_);
    row.set_rank(rank_);
    row.set_domain(domain_);
    first_ = false;
  }
  return row;
}

absl::Status CoordinatorPlanSource::Broken(const std::string& what) {
  grpc::Status s = stream_->Finish();
  stream_.reset();
  return absl::UnavailableError(
      absl::StrCat("coordinator plan stream ", what, ": ",
                   s.ok() ? std::string("closed by the coordinator") : s.error_message(),
                   "; the coordinator at ", connection_.address(), " is gone or restarted"));
}

absl::StatusOr<std::string> CoordinatorPlanSource::SaveState() {
  OpenStream();
  rackrun::v1::LoadRow row = NewRow();
  row.set_state_request(true);
  if (!stream_->Write(row)) return Broken("write failed");
  std::string state;
  while (true) {
    rackrun::v1::PlanReply reply;
    if (!stream_->Read(&reply)) return Broken("ended");
    if (!reply.error().empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the coordinator could not send the planner state: ", reply.error()));
    }
    if (reply.has_plan() || (reply.planner_state().empty() && !reply.planner_state_last())) {
      return absl::InternalError(
          "the coordinator answered a planner state request with something else");
    }
    if (reply.domain() != domain_) {
      return absl::InternalError(absl::StrCat("the coordinator sent the planner state of domain ",
                                              reply.domain(), " to a rank of domain ", domain_));
    }
    state.append(reply.planner_state());
    if (reply.planner_state_last()) return state;
  }
}

absl::Status CoordinatorPlanSource::RestoreState(std::string_view state) {
  OpenStream();
  const std::vector<std::string_view> chunks = rpc::PlannerStateChunks(state);
  for (size_t i = 0; i < chunks.size(); ++i) {
    rackrun::v1::LoadRow row = NewRow();
    row.set_restore_state(chunks[i].data(), chunks[i].size());
    row.set_restore_state_last(i + 1 == chunks.size());
    if (!stream_->Write(row)) return Broken("write failed");
  }
  rackrun::v1::PlanReply reply;
  if (!stream_->Read(&reply)) return Broken("ended");
  if (!reply.error().empty()) {
    const auto code = static_cast<absl::StatusCode>(reply.error_code());
    return absl::Status(code == absl::StatusCode::kOk ? absl::StatusCode::kUnknown : code,
                        absl::StrCat("the coordinator: ", reply.error()));
  }
  if (!reply.state_restored()) {
    return absl::InternalError(
        "the coordinator answered a planner state to restore with something else");
  }
  return absl::OkStatus();
}

absl::Status CoordinatorPlanSource::Solve(const Request& request, planner::LoadMatrix* loads,
                                          planner::Plan* plan) {
  const base::Stopwatch clock;
  OpenStream();
  rackrun::v1::LoadRow row = NewRow();
  row.set_microbatch(request.microbatch);
  row.set_layer(request.layer);
  row.set_training(request.training);
  for (const int64_t l : request.local_loads) row.add_loads(l);
  const base::Stopwatch exchange;
  if (!stream_->Write(row)) return Broken("write failed");
  rackrun::v1::PlanReply reply;
  if (!stream_->Read(&reply)) return Broken("ended");
  last_exchange_s_ = exchange.Seconds();
  if (!reply.error().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the coordinator could not plan: ", reply.error()));
  }
  if (reply.microbatch() != request.microbatch || reply.layer() != request.layer ||
      reply.domain() != domain_) {
    return absl::InternalError(absl::StrCat(
        "the coordinator answered for microbatch ", reply.microbatch(), " layer ", reply.layer(),
        " domain ", reply.domain(), " when microbatch ", request.microbatch, " layer ",
        request.layer, " domain ", domain_, " was asked"));
  }
  if (absl::Status s = rpc::PlanFromMessage(reply.plan(), plan, loads); !s.ok()) {
    return absl::DataLossError(absl::StrCat("the coordinator's plan: ", s.message()));
  }
  if (planner::PlanFingerprint(*plan) != reply.fingerprint()) {
    return absl::DataLossError(
        "the coordinator's plan does not match its fingerprint (damaged in transit)");
  }
  // The plan must have been solved from this rank's own row (its row in the domain).
  for (size_t e = 0; e < request.local_loads.size(); ++e) {
    if (domain_rank_ >= loads->ranks || static_cast<int>(e) >= loads->experts ||
        loads->at(domain_rank_, static_cast<int>(e)) != request.local_loads[e]) {
      return absl::DataLossError(absl::StrCat("the coordinator's plan for microbatch ",
                                              request.microbatch, " layer ", request.layer,
                                              " was not solved from rank ", rank_, "'s loads"));
    }
  }
  ++round_trips_;
  const double seconds = clock.Seconds();
  round_trip_s_ += seconds;
  if (on_round_trip_) on_round_trip_(seconds);
  return absl::OkStatus();
}

}  // namespace rackrun::worker
