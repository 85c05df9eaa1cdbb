// The coordinator's per-attempt rendezvous store (RackControl.StoreSet/StoreGet) seen as
// a comm::RendezvousStore, so the data channels (Gloo's TCP bootstrap, NCCL's unique id)
// bootstrap through the coordinator the way torchrun's processes do through its store.
#ifndef RACKRUN_WORKER_RENDEZVOUS_CLIENT_H_
#define RACKRUN_WORKER_RENDEZVOUS_CLIENT_H_

#include <string>
#include <vector>

#include "comm/rendezvous_store.h"
#include "worker/connection.h"

namespace rackrun::worker {

class RendezvousClient final : public comm::RendezvousStore {
 public:
  // Keys are scoped by the coordinator to (job_id, attempt). The connection must outlive
  // this object.
  RendezvousClient(Connection& connection, std::string job_id, int attempt)
      : connection_(connection), job_id_(std::move(job_id)), attempt_(attempt) {}

  absl::Status Set(const std::string& key, const std::string& value) override;
  // DeadlineExceeded naming the missing keys when they are not all set within `timeout`.
  absl::StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                               absl::Duration timeout) override;

 private:
  Connection& connection_;
  std::string job_id_;
  int attempt_;
};

}  // namespace rackrun::worker

#endif  // RACKRUN_WORKER_RENDEZVOUS_CLIENT_H_
