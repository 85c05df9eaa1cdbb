#include "base/process_limits.h"

#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace rackrun::base {

absl::StatusOr<int64_t> RaiseOpenFileLimit(int64_t cap) {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::InternalError(absl::StrCat("getrlimit(RLIMIT_NOFILE): ", std::strerror(errno)));
  }
  const rlim_t want = limit.rlim_max == RLIM_INFINITY
                          ? static_cast<rlim_t>(cap)
                          : std::min(limit.rlim_max, static_cast<rlim_t>(cap));
  if (limit.rlim_cur != RLIM_INFINITY && limit.rlim_cur < want) {
    limit.rlim_cur = want;
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) {
      return absl::InternalError(
          absl::StrCat("setrlimit(RLIMIT_NOFILE, ", want, "): ", std::strerror(errno)));
    }
  }
  return limit.rlim_cur == RLIM_INFINITY ? cap : static_cast<int64_t>(limit.rlim_cur);
}

}  // namespace rackrun::base
