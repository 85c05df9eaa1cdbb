#include "comm/rendezvous_store.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rackrun::comm {

absl::Status InMemoryRendezvousStore::Set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    values_[key] = value;
  }
  changed_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> InMemoryRendezvousStore::Get(
    const std::vector<std::string>& keys, absl::Duration timeout) {
  const auto deadline = std::chrono::steady_clock::now() +
                        absl::ToChronoNanoseconds(std::max(timeout, absl::ZeroDuration()));
  std::unique_lock<std::mutex> lock(mu_);
  auto all_set = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const std::string& key : keys) {
      if (!values_.contains(key)) return false;
    }
    return true;
  };
  if (!changed_.wait_until(lock, deadline, all_set)) {
    std::vector<std::string> missing;
    for (const std::string& key : keys) {
      if (!values_.contains(key)) missing.push_back(absl::StrCat("'", key, "'"));
    }
    return absl::DeadlineExceededError(
        absl::StrCat("rendezvous store: key", missing.size() > 1 ? "s " : " ",
                     absl::StrJoin(missing, ", "), " not set within ",
                     absl::FormatDuration(timeout)));
  }
  std::vector<std::string> values;
  values.reserve(keys.size());
  for (const std::string& key : keys) values.push_back(values_.find(key)->second);
  return values;
}

}  // namespace rackrun::comm
