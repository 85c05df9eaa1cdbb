// The coordinator's per-attempt rendezvous store (RackControl.StoreSet/StoreGet) seen as
// a comm::RendezvousStore, so the data channels (Gloo's TCP bootstrap, NCCL's unique id)
// bootstrap through the coordinator the way torchrun's processes do through its store.
//
// Every call goes out in slices no longer than the heartbeat deadline (rpc/liveness.h),
// each over the connection's channel of the moment: a slice that missed its deadline
// (keys not there yet, or a connection stalled by a short cut of the link) is sent again,
// over the new connection once the heartbeats have renewed it, so a rendezvous resumes
// within about two deadlines of the link's return instead of after TCP's retransmission
// backoff. A slice that missed its deadline may still arrive later: Set must be called
// with one value per key (the bootstraps publish each key once).
#ifndef RACKRUN_WORKER_RENDEZVOUS_CLIENT_H_
#define RACKRUN_WORKER_RENDEZVOUS_CLIENT_H_

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "comm/rendezvous_store.h"
#include "worker/connection.h"

namespace rackrun::worker {

class RendezvousClient final : public comm::RendezvousStore {
 public:
  // Keys are scoped by the coordinator to (job_id, attempt) of the job store `store_id`
  // (RunJob.store_id; a coordinator with another store answers NOT_FOUND). The connection
  // must outlive this object.
  RendezvousClient(Connection& connection, std::string job_id, int attempt, uint64_t store_id)
      : connection_(connection),
        job_id_(std::move(job_id)),
        attempt_(attempt),
        store_id_(store_id) {}

  // Unavailable or DeadlineExceeded when the coordinator did not take it within 10 s.
  absl::Status Set(const std::string& key, const std::string& value) override;
  // DeadlineExceeded naming the missing keys when they are not all set within `timeout`
  // (zero: now; the coordinator answers at once, without waiting for them).
  absl::StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                               absl::Duration timeout) override;

 private:
  // `call` in slices (see above) until it succeeds, fails otherwise than by a deadline or
  // unavailability, or `total` has passed; its last status.
  grpc::Status Sliced(
      std::chrono::milliseconds total,
      const std::function<grpc::Status(Connection::Stub&, grpc::ClientContext*)>& call);

  Connection& connection_;
  std::string job_id_;
  int attempt_;
  uint64_t store_id_;
  std::chrono::milliseconds set_timeout_{10000};
};

}  // namespace rackrun::worker

#endif  // RACKRUN_WORKER_RENDEZVOUS_CLIENT_H_
