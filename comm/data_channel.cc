#include "comm/data_channel.h"

#include <cerrno>
#include <cstdlib>
#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/progress.h"

namespace rackrun::comm {

size_t DataTypeSize(DataType type) {
  switch (type) {
    case DataType::kByte:
      return 1;
    case DataType::kInt32:
    case DataType::kFloat32:
      return 4;
    case DataType::kInt64:
    case DataType::kFloat64:
      return 8;
  }
  return 1;
}

absl::string_view DataTypeName(DataType type) {
  switch (type) {
    case DataType::kByte:
      return "byte";
    case DataType::kInt32:
      return "int32";
    case DataType::kInt64:
      return "int64";
    case DataType::kFloat32:
      return "float32";
    case DataType::kFloat64:
      return "float64";
  }
  return "unknown";
}

absl::StatusOr<ChannelOptions> ChannelOptions::FromEnv() {
  ChannelOptions options;
  if (const char* value = std::getenv("RACKRUN_COMM_TIMEOUT_S"); value != nullptr) {
    double seconds = 0;
    if (!absl::SimpleAtod(value, &seconds) || !(seconds > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("RACKRUN_COMM_TIMEOUT_S='", value,
                       "' is not a positive number of seconds; unset it or set e.g. 60"));
    }
    options.timeout = absl::Seconds(seconds);
  }
  return options;
}

absl::Status Request::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  ProgressBackoff backoff(completion_event());
  while (true) {
    backoff.StartPass();
    absl::StatusOr<bool> done = Test();
    if (!done.ok()) return done.status();
    if (*done) return absl::OkStatus();
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          info_.send ? "Send" : "Recv", " (tag ", info_.tag, ", ", info_.bytes, " bytes) on rank ",
          info_.rank, " of ", info_.size, " timed out after ", absl::FormatDuration(timeout),
          " waiting for rank ", info_.peer, info_.send ? " to receive" : " to send",
          "; that rank is dead, stuck, or not posting the matching ",
          info_.send ? "receive" : "send"));
    }
    backoff.Idle(deadline);
  }
}

absl::Status WaitAll(std::span<const std::unique_ptr<Request>> requests, absl::Time deadline,
                     absl::string_view operation) {
  const absl::Time start = absl::Now();
  std::vector<bool> done(requests.size(), false);
  size_t remaining = 0;
  // Block on the transport's completion event when every request has the same one.
  const CompletionEvent* event = nullptr;
  bool shared_event = true;
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests[i] == nullptr) {
      done[i] = true;
      continue;
    }
    const CompletionEvent* own = requests[i]->completion_event();
    if (remaining == 0) {
      event = own;
    } else if (own != event) {
      shared_event = false;
    }
    ++remaining;
  }
  ProgressBackoff backoff(shared_event ? event : nullptr);
  while (remaining > 0) {
    backoff.StartPass();
    bool progressed = false;
    for (size_t i = 0; i < requests.size(); ++i) {
      if (done[i]) continue;
      absl::StatusOr<bool> complete = requests[i]->Test();
      if (!complete.ok()) {
        return absl::Status(complete.status().code(),
                            absl::StrCat(operation, ": ", complete.status().message()));
      }
      if (*complete) {
        done[i] = true;
        --remaining;
        progressed = true;
      }
    }
    if (remaining == 0) break;
    if (absl::Now() >= deadline) {
      // One line: who is this, what was it doing, whom is it still waiting for.
      std::map<int, std::string> waiting;  // peer -> "send", "recv" or "send+recv"
      int rank = -1;
      int size = 0;
      for (size_t i = 0; i < requests.size(); ++i) {
        if (done[i]) continue;
        const RequestInfo& info = requests[i]->info();
        rank = info.rank;
        size = info.size;
        std::string& what = waiting[info.peer];
        const char* dir = info.send ? "send" : "recv";
        if (what.empty()) {
          what = dir;
        } else if (what != dir) {
          what = "send+recv";
        }
      }
      std::vector<std::string> peers;
      for (const auto& [peer, what] : waiting) peers.push_back(absl::StrCat(peer, " (", what, ")"));
      return absl::DeadlineExceededError(absl::StrCat(
          operation, " on rank ", rank, " of ", size, " timed out after ",
          absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1))),
          " waiting for rank", peers.size() > 1 ? "s " : " ", absl::StrJoin(peers, ", "),
          "; that rank is dead, stuck, or not calling ", operation));
    }
    if (progressed) {
      backoff.Progress();
    } else {
      backoff.Idle(deadline);
    }
  }
  return absl::OkStatus();
}

absl::Status DataChannel::CheckPeer(absl::string_view operation, int peer) const {
  if (peer < 0 || peer >= size()) {
    return absl::InvalidArgumentError(absl::StrCat(operation, " on rank ", rank(), ": peer ", peer,
                                                   " is outside [0, ", size(),
                                                   "); pass a rank of this channel"));
  }
  return absl::OkStatus();
}

absl::Status DataChannel::CheckTag(absl::string_view operation, int tag) const {
  if (tag < 0 || tag >= kMaxUserTag) {
    return absl::InvalidArgumentError(absl::StrCat(operation, " on rank ", rank(), ": tag ", tag,
                                                   " is outside [0, ", kMaxUserTag,
                                                   "); higher tags are reserved for collectives"));
  }
  return absl::OkStatus();
}

absl::Status DataChannel::CheckCount(absl::string_view operation, int64_t count) const {
  if (count < 0) {
    return absl::InvalidArgumentError(absl::StrCat(operation, " on rank ", rank(), ": count ",
                                                   count, " is negative; pass 0 or more elements"));
  }
  return absl::OkStatus();
}

absl::Status DataChannel::CheckCountsAndDispls(absl::string_view operation,
                                               std::span<const int64_t> counts,
                                               std::span<const int64_t> displs,
                                               absl::string_view which) const {
  const size_t n = static_cast<size_t>(size());
  if (counts.size() != n || displs.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        operation, " on rank ", rank(), ": ", which, "_counts has ", counts.size(), " and ", which,
        "_displs ", displs.size(), " entries; both need one per rank (", n, ")"));
  }
  for (size_t i = 0; i < n; ++i) {
    if (counts[i] < 0 || displs[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(operation, " on rank ", rank(), ": ", which, "_counts[", i, "]=", counts[i],
                       " or ", which, "_displs[", i, "]=", displs[i], " is negative"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DataChannel>> DataChannel::Split(int /*color*/, int /*key*/) {
  return absl::UnimplementedError(
      absl::StrCat("Split on rank ", rank(), ": this ", backend(),
                   " data channel has no sub-groups; run expert-parallel domains "
                   "(parallelism.expert_parallel) on a backend's own channel"));
}

}  // namespace rackrun::comm
