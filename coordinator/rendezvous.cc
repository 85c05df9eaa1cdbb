#include "coordinator/rendezvous.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rackrun::coordinator {

void Rendezvous::Set(const std::string& job_id, int attempt, const std::string& key,
                     std::string value) {
  Lock lock(mu_);
  kv_[{job_id, attempt}][key] = std::move(value);
  cv_.notify_all();
}

absl::StatusOr<std::vector<std::string>> Rendezvous::Get(const std::string& job_id, int attempt,
                                                         const std::vector<std::string>& keys,
                                                         absl::Time deadline) {
  Lock lock(mu_);
  const Scope scope{job_id, attempt};
  const int drops = drops_[scope];
  while (true) {
    if (shutdown_) return absl::CancelledError("the coordinator is shutting down");
    if (drops_[scope] != drops) {
      return absl::CancelledError(absl::StrCat("attempt ", attempt, " of job ", job_id, " ended"));
    }
    std::vector<std::string> missing;
    std::vector<std::string> values;
    auto it = kv_.find(scope);
    for (const std::string& k : keys) {
      if (it == kv_.end() || it->second.count(k) == 0) {
        missing.push_back(k);
      } else {
        values.push_back(it->second.at(k));
      }
    }
    if (missing.empty()) return values;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("rendezvous of job ", job_id, " attempt ", attempt,
                       ": keys never set: ", absl::StrJoin(missing, ", ")));
    }
    WaitUntil(cv_, lock, deadline);
  }
}

void Rendezvous::Drop(const std::string& job_id, int attempt) {
  Lock lock(mu_);
  kv_.erase({job_id, attempt});
  ++drops_[{job_id, attempt}];
  cv_.notify_all();
}

void Rendezvous::Shutdown() {
  Lock lock(mu_);
  shutdown_ = true;
  cv_.notify_all();
}

}  // namespace rackrun::coordinator
