// The gRPC edge: JobService (users) and RackControl (workers) as thin adapters onto Rack.
// Every handler first checks the caller's token and its role (auth.h: UNAUTHENTICATED or
// PERMISSION_DENIED naming the role needed, nothing changed) and
// that the coordinator is serving (UNAVAILABLE while it replays its state or shuts down),
// then translates the request, calls Rack, and maps absl::Status to grpc::Status.
// Streams (Watch, Assignments, Plans) poll for cancellation every `poll` (100 ms unless
// given), so a closed client connection or a shutdown ends them promptly.
#ifndef RACKRUN_COORDINATOR_SERVICES_H_
#define RACKRUN_COORDINATOR_SERVICES_H_

#include <atomic>
#include <optional>
#include <utility>

#include "absl/time/time.h"
#include "coordinator/auth.h"
#include "coordinator/rack.h"
#include "rackrun/v1/job_service.grpc.pb.h"
#include "rackrun/v1/rack_control.grpc.pb.h"

namespace rackrun::coordinator {

grpc::Status ToGrpc(const absl::Status& s);

// How often a stream handler looks for cancellation and shutdown.
inline constexpr absl::Duration kStreamPoll = absl::Milliseconds(100);

// Whether handlers may run: false while replaying and after shutdown began.
class ServingGate {
 public:
  void Open() { serving_ = true; }
  void Close() { serving_ = false; }
  bool serving() const { return serving_; }

 private:
  std::atomic<bool> serving_{false};
};

// How many calls that hold a server thread while they wait may be open at once (the
// server is synchronous: each such call is a thread). Beyond a limit a call is refused at
// once with RESOURCE_EXHAUSTED naming the flag, so a client that opens calls without end
// cannot starve the heartbeats and reports of threads (20,000 open watches made every
// other call miss a 5 s deadline before the limit).
struct CallLimits {
  int watch_streams = 1024;  // JobService.Watch (--max-watch-streams)
  int rack_waits = 4096;     // RackControl.StoreGet waits and Plans streams (--max-rack-waits)
};

// A count of open calls of one kind, at most `max`. TryEnter gives a Pass that counts one
// call until it is destroyed, or nothing when `max` are open.
class CallCounter {
 public:
  explicit CallCounter(int max) : max_(max) {}
  class Pass {
   public:
    explicit Pass(std::atomic<int>* open) : open_(open) {}
    Pass(Pass&& o) noexcept : open_(std::exchange(o.open_, nullptr)) {}
    Pass(const Pass&) = delete;
    Pass& operator=(const Pass&) = delete;
    Pass& operator=(Pass&&) = delete;
    ~Pass() {
      if (open_ != nullptr) open_->fetch_sub(1);
    }

   private:
    std::atomic<int>* open_;
  };
  std::optional<Pass> TryEnter();
  int max() const { return max_; }
  int open() const { return open_.load(); }

 private:
  const int max_;
  std::atomic<int> open_{0};
};

// What both services hold: the rack, the token check, the serving gate and the poll
// interval of their streams. Admit (token and role, then gate) is the first step of every
// call; `method` names the call in a PERMISSION_DENIED message.
class ServiceBase {
 protected:
  ServiceBase(Rack* rack, const TokenAuth* auth, const ServingGate* gate, absl::Duration poll)
      : rack_(rack), auth_(auth), gate_(gate), poll_(poll) {}
  grpc::Status Admit(const grpc::ServerContext& ctx, Access access, std::string_view method) const;

  Rack* const rack_;
  const TokenAuth* const auth_;
  const ServingGate* const gate_;
  const absl::Duration poll_;
};

class JobServiceImpl final : public rackrun::v1::JobService::Service, private ServiceBase {
 public:
  JobServiceImpl(Rack* rack, const TokenAuth* auth, const ServingGate* gate,
                 absl::Duration poll = kStreamPoll, CallLimits limits = {})
      : ServiceBase(rack, auth, gate, poll), watches_(limits.watch_streams) {}

  grpc::Status Submit(grpc::ServerContext* ctx, const rackrun::v1::SubmitRequest* req,
                      rackrun::v1::SubmitResponse* resp) override;
  grpc::Status Get(grpc::ServerContext* ctx, const rackrun::v1::GetJobRequest* req,
                   rackrun::v1::Job* resp) override;
  grpc::Status List(grpc::ServerContext* ctx, const rackrun::v1::ListJobsRequest* req,
                    rackrun::v1::ListJobsResponse* resp) override;
  grpc::Status Cancel(grpc::ServerContext* ctx, const rackrun::v1::CancelJobRequest* req,
                      rackrun::v1::Job* resp) override;
  grpc::Status Watch(grpc::ServerContext* ctx, const rackrun::v1::WatchJobRequest* req,
                     grpc::ServerWriter<rackrun::v1::JobEvent>* writer) override;
  grpc::Status ListWorkers(grpc::ServerContext* ctx, const rackrun::v1::ListWorkersRequest* req,
                           rackrun::v1::ListWorkersResponse* resp) override;

 private:
  CallCounter watches_;
};

class RackControlImpl final : public rackrun::v1::RackControl::Service, private ServiceBase {
 public:
  RackControlImpl(Rack* rack, const TokenAuth* auth, const ServingGate* gate,
                  absl::Duration poll = kStreamPoll, CallLimits limits = {})
      : ServiceBase(rack, auth, gate, poll), waits_(limits.rack_waits) {}

  grpc::Status Register(grpc::ServerContext* ctx, const rackrun::v1::RegisterRequest* req,
                        rackrun::v1::RegisterResponse* resp) override;
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const rackrun::v1::HeartbeatRequest* req,
                         rackrun::v1::HeartbeatResponse* resp) override;
  grpc::Status Assignments(grpc::ServerContext* ctx, const rackrun::v1::AssignmentsRequest* req,
                           grpc::ServerWriter<rackrun::v1::Assignment>* writer) override;
  grpc::Status Report(grpc::ServerContext* ctx, const rackrun::v1::ReportRequest* req,
                      rackrun::v1::ReportResponse* resp) override;
  grpc::Status Deregister(grpc::ServerContext* ctx, const rackrun::v1::DeregisterRequest* req,
                          rackrun::v1::DeregisterResponse* resp) override;
  grpc::Status StoreSet(grpc::ServerContext* ctx, const rackrun::v1::StoreSetRequest* req,
                        rackrun::v1::StoreSetResponse* resp) override;
  grpc::Status StoreGet(grpc::ServerContext* ctx, const rackrun::v1::StoreGetRequest* req,
                        rackrun::v1::StoreGetResponse* resp) override;
  grpc::Status Plans(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<rackrun::v1::PlanReply, rackrun::v1::LoadRow>* stream) override;

 private:
  CallCounter waits_;  // StoreGet waits and Plans streams
};

// Submit's checks of a spec that has been defaulted: ValidateJobSpec, the restart policy,
// and absolute data.train / checkpoint.dir. InvalidArgument naming the field otherwise.
absl::Status CheckSubmittedSpec(const rackrun::v1::JobSpec& spec);

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_SERVICES_H_
