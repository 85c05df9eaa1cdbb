// Rendezvous: the key-value store of each attempt's data-channel bootstrap (Gloo's TCP
// store, NCCL's unique id), behind RackControl.StoreSet/StoreGet. Keys are scoped to
// (job, attempt); Drop removes an attempt's keys when it ends.
//
// Thread safety: all methods are thread-safe; Get blocks (bounded by its deadline).
#ifndef RACKRUN_COORDINATOR_RENDEZVOUS_H_
#define RACKRUN_COORDINATOR_RENDEZVOUS_H_

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/sync.h"

namespace rackrun::coordinator {

class Rendezvous {
 public:
  // Sets (or overwrites) one key of the attempt.
  void Set(const std::string& job_id, int attempt, const std::string& key, std::string value);

  // The values of `keys` in order, once every key exists. DeadlineExceeded naming the
  // missing keys when `deadline` passes first; Cancelled when the attempt was dropped
  // while waiting or Shutdown was called.
  absl::StatusOr<std::vector<std::string>> Get(const std::string& job_id, int attempt,
                                               const std::vector<std::string>& keys,
                                               absl::Time deadline);

  // Forgets the attempt's keys and wakes its waiters.
  void Drop(const std::string& job_id, int attempt);

  void Shutdown();

 private:
  using Scope = std::pair<std::string, int>;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Scope, std::map<std::string, std::string>> kv_ ABSL_GUARDED_BY(mu_);
  std::map<Scope, int> drops_ ABSL_GUARDED_BY(mu_);  // how often each scope was dropped
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_RENDEZVOUS_H_
