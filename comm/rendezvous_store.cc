#include "comm/rendezvous_store.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/file.h"

namespace rackrun::comm {

absl::Status InMemoryRendezvousStore::Set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    values_[key] = value;
  }
  changed_.notify_all();
  return absl::OkStatus();
}

namespace {

// "rendezvous store: keys 'a', 'b' not set within 20ms" (both stores say it alike).
absl::Status KeysMissing(const std::vector<std::string>& missing, absl::Duration timeout,
                         const std::string& where) {
  std::vector<std::string> quoted;
  quoted.reserve(missing.size());
  for (const std::string& key : missing) quoted.push_back(absl::StrCat("'", key, "'"));
  return absl::DeadlineExceededError(
      absl::StrCat("rendezvous store", where, ": key", missing.size() > 1 ? "s " : " ",
                   absl::StrJoin(quoted, ", "), " not set within ", absl::FormatDuration(timeout)));
}

}  // namespace

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
      if (!values_.contains(key)) missing.push_back(key);
    }
    return KeysMissing(missing, timeout, "");
  }
  std::vector<std::string> values;
  values.reserve(keys.size());
  for (const std::string& key : keys) values.push_back(values_.find(key)->second);
  return values;
}

DirectoryRendezvousStore::DirectoryRendezvousStore(std::string dir, absl::Duration poll)
    : dir_(std::move(dir)), poll_(std::max(poll, absl::Microseconds(100))) {}

std::string DirectoryRendezvousStore::PathOf(const std::string& key) const {
  // "" and names starting with '.' ("." and "..": the folder itself, its parent) escaped
  // too; no other key's escaped name starts with "%00" or "%2E".
  if (key.empty()) return absl::StrCat(dir_, "/%00");
  std::string name;
  name.reserve(key.size());
  for (const char c : key) {
    if (c == '.' && name.empty()) {
      name += "%2E";
    } else if (c == '%') {
      name += "%25";
    } else if (c == '/') {
      name += "%2F";
    } else {
      name += c;
    }
  }
  return absl::StrCat(dir_, "/", name);
}

absl::Status DirectoryRendezvousStore::Set(const std::string& key, const std::string& value) {
  // WriteFileAtomically's temporary is named by the process: one Set at a time per store.
  std::lock_guard<std::mutex> lock(set_mu_);
  absl::Status s = base::WriteFileAtomically(PathOf(key), value);
  if (s.ok()) return s;
  return absl::UnavailableError(absl::StrCat("rendezvous store: ", s.message(),
                                             "; check that the folder exists and is writable"));
}

absl::StatusOr<std::vector<std::string>> DirectoryRendezvousStore::Get(
    const std::vector<std::string>& keys, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + std::max(timeout, absl::ZeroDuration());
  std::vector<std::string> values(keys.size());
  std::vector<bool> found(keys.size(), false);
  while (true) {
    std::vector<std::string> missing;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (found[i]) continue;  // a value once read stays (a later Set may replace it)
      absl::StatusOr<std::string> value = base::ReadWholeFile(PathOf(keys[i]));
      if (absl::IsNotFound(value.status())) {
        missing.push_back(keys[i]);
        continue;
      }
      if (!value.ok()) return value.status();
      values[i] = *std::move(value);
      found[i] = true;
    }
    if (missing.empty()) return values;
    if (absl::Now() >= deadline) return KeysMissing(missing, timeout, absl::StrCat(" ", dir_));
    absl::SleepFor(std::min(poll_, deadline - absl::Now()));
  }
}

}  // namespace rackrun::comm
