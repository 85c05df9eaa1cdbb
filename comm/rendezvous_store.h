// The rendezvous store: a key-value store that the ranks of one job share to find each
// other before they have a data channel (torchrun's store, NCCL's unique-id exchange).
// The coordinator serves one over gRPC (RackControl.StoreSet/StoreGet); the worker adapts
// that onto this interface, so comm/ knows nothing of gRPC. InMemoryRendezvousStore is
// the store for threads of one process (tests, single-process runs);
// DirectoryRendezvousStore is the store for processes of one host that share a folder
// (tests and benchmarks that start ranks as processes without a coordinator).
//
// Contract of every implementation:
// - Set(key, value) stores `value` under `key`, replacing an earlier value. OK once the
//   value is visible to every later Get on any rank.
// - Get(keys, timeout) waits until every key exists, then returns their values in the
//   order of `keys`. DeadlineExceeded after `timeout` names the keys still missing (a
//   timeout of zero checks once). Other errors (the store unreachable) as the store's own
//   status. An empty `keys` returns at once.
// - Keys are flat strings; callers prefix them with the job (and purpose) so that jobs
//   sharing a store do not collide. Values are arbitrary bytes.
// - Thread-safe: many threads (ranks) may Set and Get concurrently.
#ifndef RACKRUN_COMM_RENDEZVOUS_STORE_H_
#define RACKRUN_COMM_RENDEZVOUS_STORE_H_

#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace rackrun::comm {

class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;

  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  virtual absl::StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                                       absl::Duration timeout) = 0;
};

// A map behind a mutex; Get blocks on a condition variable until its keys are all set.
class InMemoryRendezvousStore final : public RendezvousStore {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                               absl::Duration timeout) override;

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::string, std::string, std::less<>> values_ ABSL_GUARDED_BY(mu_);
};

// One file per key in an existing folder that every rank can read and write (one host, or
// a shared file system); a value is written atomically (base::WriteFileAtomically), so a
// reader sees it whole or not at all. Key names are escaped ('%' and '/' as %25 and %2F, a
// leading '.' as %2E, the empty key as %00), so distinct keys are distinct files. Get polls
// the folder every `poll` until its keys exist; Set and Get report file errors with the
// path and errno's text. Two store objects of one process must not Set the same key at the
// same moment (one temporary per process).
class DirectoryRendezvousStore final : public RendezvousStore {
 public:
  explicit DirectoryRendezvousStore(std::string dir, absl::Duration poll = absl::Milliseconds(2));

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                               absl::Duration timeout) override;

  // The file that holds `key`'s value.
  std::string PathOf(const std::string& key) const;

 private:
  std::string dir_;
  absl::Duration poll_;
  std::mutex set_mu_;
};

}  // namespace rackrun::comm

#endif  // RACKRUN_COMM_RENDEZVOUS_STORE_H_
