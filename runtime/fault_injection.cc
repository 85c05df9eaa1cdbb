#include "runtime/fault_injection.h"

#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace rackrun::runtime {

absl::StatusOr<FaultInjection> FaultInjection::Parse(std::string_view value) {
  const absl::string_view v(value.data(), value.size());
  const auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat(kVariable, "='", v,
                     "' is malformed; use KIND:rank=R,layer=L,microbatch=M with KIND plan_hash, "
                     "stall or exit"));
  };
  const std::pair<absl::string_view, absl::string_view> kind_args =
      absl::StrSplit(v, absl::MaxSplits(':', 1));
  FaultInjection f;
  if (kind_args.first == "plan_hash") {
    f.kind_ = FaultKind::kPlanHash;
  } else if (kind_args.first == "stall") {
    f.kind_ = FaultKind::kStall;
  } else if (kind_args.first == "exit") {
    f.kind_ = FaultKind::kExit;
  } else {
    return bad();
  }
  bool rank = false, layer = false, microbatch = false;
  for (absl::string_view kv : absl::StrSplit(kind_args.second, ',')) {
    const std::pair<absl::string_view, absl::string_view> p =
        absl::StrSplit(kv, absl::MaxSplits('=', 1));
    int64_t n = 0;
    if (!absl::SimpleAtoi(p.second, &n) || n < 0) return bad();
    if (p.first == "rank" && !rank) {
      f.rank_ = static_cast<int>(n);
      rank = true;
    } else if (p.first == "layer" && !layer) {
      f.layer_ = static_cast<int>(n);
      layer = true;
    } else if (p.first == "microbatch" && !microbatch) {
      f.microbatch_ = n;
      microbatch = true;
    } else {
      return bad();
    }
  }
  if (!rank || !layer || !microbatch) return bad();
  return f;
}

absl::StatusOr<std::optional<FaultInjection>> FaultInjection::FromEnvironment() {
  const char* value = std::getenv(kVariable);
  if (value == nullptr) return std::optional<FaultInjection>();
  absl::StatusOr<FaultInjection> f = Parse(value);
  if (!f.ok()) return f.status();
  return std::optional<FaultInjection>(*f);
}

namespace {

std::mutex& ProcessFaultMutex() {
  static std::mutex mu;
  return mu;
}

std::optional<FaultInjection>& ProcessFault() {  // guarded by ProcessFaultMutex()
  static std::optional<FaultInjection> fault;
  return fault;
}

}  // namespace

std::optional<FaultInjection> ProcessFaultInjection() {
  std::lock_guard<std::mutex> lock(ProcessFaultMutex());
  return ProcessFault();
}

void SetProcessFaultInjection(std::optional<FaultInjection> fault) {
  std::lock_guard<std::mutex> lock(ProcessFaultMutex());
  ProcessFault() = std::move(fault);
}

absl::Status InstallFaultInjectionFromEnvironment() {
  absl::StatusOr<std::optional<FaultInjection>> fault = FaultInjection::FromEnvironment();
  if (!fault.ok()) return fault.status();
  SetProcessFaultInjection(*std::move(fault));
  return absl::OkStatus();
}

}  // namespace rackrun::runtime
